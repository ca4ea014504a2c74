"""TensorFlow entries of the backend table (see
:mod:`keras_longattn.kernels`): the portable ones. ``keras.ops.top_k`` on
TensorFlow already prefers the lower index among ties, and kernels run
inside the model's ``tf.function`` when it has one."""

from keras_longattn.kernels import BackendOps


class TensorFlowOps(BackendOps):
    name = "tensorflow"

    def as_tensor(self, x):
        """``keras.ops.convert_to_tensor`` returns a ``tf.Variable`` (or
        ``keras.Variable``) as it is; such a variable lacks parts of the
        tensor API that ``keras.ops`` relies on (``ndim`` in ``moveaxis``):
        it is read into a tensor."""
        import keras
        import tensorflow as tf

        x = super().as_tensor(x)
        if isinstance(x, (tf.Variable, keras.Variable)):
            x = tf.convert_to_tensor(x)
        return x

    def refuse_at_run_time(self, bad, value, message):
        """``tf.debugging.Assert`` in a graph; XLA (``jit_compile=True``)
        compiles asserts to nothing, so there it cannot. The value returned
        depends on the assert, so that nothing computed from it runs first
        (a slice at a bad index would fail with its own error)."""
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            return value, False
        head, _, tail = message.partition("{value}")
        check = tf.debugging.Assert(tf.logical_not(bad), [head, value, tail], summarize=1)
        with tf.control_dependencies([check]):
            return tf.identity(value), True


OPS = TensorFlowOps()
