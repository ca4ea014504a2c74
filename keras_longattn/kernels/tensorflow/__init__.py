"""TensorFlow entries of the backend table (see
:mod:`keras_longattn.kernels`): the portable ones. ``keras.ops.top_k`` on
TensorFlow already prefers the lower index among ties, and kernels run
inside the model's ``tf.function`` when it has one."""

from keras_longattn.kernels import BackendOps


class TensorFlowOps(BackendOps):
    name = "tensorflow"


OPS = TensorFlowOps()
