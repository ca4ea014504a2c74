"""Properties of decoding with a cache, for every layer that has one.

A mixin of :class:`keras_longattn.testing.properties.AttentionLayerProperties`
(so a new layer with a cache inherits them; a layer without one skips them):

* ``test_prop_decode_cache_arguments``: ``init_cache`` refuses a
  ``batch_size`` / ``max_length`` that is not a positive int and a non-float
  ``dtype``; a concrete ``cache_update_index`` outside the cache is refused;
  a call with no new token returns ``(B, 0, features)`` and the cache
  unchanged; the returned cache keeps the dtype it was given (a bfloat16
  cache of a float32 layer stays bfloat16, so a compiled loop can carry it);
* ``test_prop_decode_unwritten_slots_inert``: NaN in every slot not written
  yet changes no output (a full-length or ring cache; a recurrent state has
  no such slots);
* ``test_prop_decode_traced_index_refused``: a traced ``cache_update_index``
  outside the cache stops the compiled program with the argument's name
  (``jax.jit``; a TensorFlow graph), and under XLA on TensorFlow, which
  cannot raise while running, gives NaN outputs and the cache unchanged —
  never a clamped write. On torch the index is concrete (eager): the first
  property covers it.
"""

import keras
import numpy as np
import pytest

#: Bad values of init_cache's sizes (each must be refused by name).
BAD_SIZES = (0, -3, 2.5, True, "4", None)


def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")))


class DecodingProperties:
    """Decoding properties (see the module docstring). Uses the host
    class's ``make_layer``, ``features``, ``batch_size`` and
    ``fixed_length`` (the cache's ``max_length``)."""

    #: Tokens of the prefill call before the steps.
    decode_prefill = 3

    def _decoder(self):
        layer = self.make_layer()
        if not getattr(self, "supports_causal", True):
            pytest.skip("no causal mode: no decoding cache")
        n = self.fixed_length
        x = np.zeros((self.batch_size, n, self.features), "float32")
        layer(x, x, use_causal_mask=True)
        if layer.decode_refusal() is not None:
            pytest.skip(f"no decoding cache: {layer.decode_refusal()}")
        return layer, n

    def _inputs(self, n, seed=5):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((self.batch_size, n, self.features)).astype("float32")

    @staticmethod
    def _step(layer, x, cache, index):
        return layer(x, x, use_causal_mask=True, cache=cache, cache_update_index=index)

    def _run(self, layer, x, cache, schedule):
        outs, index = [], 0
        for size in schedule:
            out, cache = self._step(layer, x[:, index:index + size], cache, index)
            outs.append(_np(out))
            index += size
        return np.concatenate(outs, axis=1), cache

    # ------------------------------------------------------ cache arguments
    def test_prop_decode_cache_arguments(self):
        layer, n = self._decoder()
        B, F = self.batch_size, self.features
        problems = []
        for name in ("batch_size", "max_length"):
            for value in BAD_SIZES:
                args = {"batch_size": B, "max_length": n, name: value}
                try:
                    layer.init_cache(**args)
                except ValueError as error:
                    if name not in str(error) or repr(value) not in str(error):
                        problems.append(f"{name}={value!r}: message {str(error)[:160]}")
                except Exception as error:
                    problems.append(f"{name}={value!r}: {type(error).__name__}: {error}")
                else:
                    problems.append(f"{name}={value!r}: accepted")
        with pytest.raises(ValueError, match="dtype"):
            layer.init_cache(B, n, dtype="int32")
        x = self._inputs(n)
        cache = layer.init_cache(B, n)
        bad = [-1] + ([n - self.decode_prefill + 1] if layer.cache_length_free else [])
        for index in bad:
            with pytest.raises(ValueError, match="cache_update_index"):
                self._step(layer, x[:, :self.decode_prefill], cache, index)
        # No new token: an empty output, the cache untouched.
        _, filled = self._step(layer, x[:, :self.decode_prefill], cache, 0)
        for index in (0, self.decode_prefill):
            start = filled if index else cache
            out, after = self._step(layer, x[:, :0], start, index)
            if tuple(out.shape) != (B, 0, F):
                problems.append(f"empty call at {index}: output shape {tuple(out.shape)}")
            if not np.array_equal(_np(after), _np(start), equal_nan=True):
                problems.append(f"empty call at {index}: the cache changed")
        # The cache keeps its dtype across a prefill and a step.
        low = layer.init_cache(B, n, dtype="bfloat16")
        for size, index in ((self.decode_prefill, 0), (1, self.decode_prefill)):
            _, low = self._step(layer, x[:, index:index + size], low, index)
            got = keras.backend.standardize_dtype(low.dtype)
            if got != "bfloat16":
                problems.append(f"a bfloat16 cache came back {got} (call at {index})")
        assert not problems, "\n".join(problems)

    # ------------------------------------------------------ unwritten slots
    def test_prop_decode_unwritten_slots_inert(self):
        layer, n = self._decoder()
        if not layer.cache_stacks_key_value:
            pytest.skip("a recurrent state: every entry is read, none is unwritten")
        B = self.batch_size
        x = self._inputs(n)
        schedule = [self.decode_prefill, 1, 1, 2]
        clean = layer.init_cache(B, n)
        poisoned = keras.ops.full(tuple(clean.shape), float("nan"), dtype=clean.dtype)
        want, _ = self._run(layer, x, clean, schedule)
        steps, _ = self._run(layer, x, poisoned, [1] * sum(schedule))
        got, _ = self._run(layer, x, poisoned, schedule)
        for name, out in (("prefill then steps", got), ("steps only", steps)):
            assert np.isfinite(out).all(), f"{name}: NaN in unwritten slots reached an output"
            np.testing.assert_allclose(out, want, atol=2e-5, rtol=0, err_msg=name)

    # --------------------------------------------------------- traced index
    def test_prop_decode_traced_index_refused(self):
        backend = keras.backend.backend()
        if backend not in ("jax", "tensorflow"):
            pytest.skip("eager backend: the index is concrete (test_prop_decode_cache_arguments)")
        layer, n = self._decoder()
        B = self.batch_size
        x = self._inputs(n)
        _, cache = self._step(layer, x[:, :self.decode_prefill], layer.init_cache(B, n), 0)
        token = x[:, self.decode_prefill:self.decode_prefill + 1]
        good = self.decode_prefill
        bads = [-1] + ([n] if layer.cache_length_free else [])

        def step(t, c, i):
            return self._step(layer, t, c, i)

        if backend == "jax":
            import jax

            compiled = [(jax.jit(step), True)]
        else:
            import tensorflow as tf

            compiled = [(tf.function(step), True), (tf.function(step, jit_compile=True), False)]
        for fn, raises in compiled:
            index = keras.ops.convert_to_tensor(good, "int32")
            out, _ = fn(token, cache, index)
            assert np.isfinite(_np(out)).all(), "a valid traced index gave non-finite outputs"
            for bad in bads:
                index = keras.ops.convert_to_tensor(bad, "int32")
                if raises:
                    with pytest.raises(Exception, match="cache_update_index"):
                        out, after = fn(token, cache, index)
                        _np(out), _np(after)
                else:
                    out, after = fn(token, cache, index)
                    assert np.isnan(_np(out)).all(), f"index {bad}: outputs not marked NaN"
                    assert np.array_equal(_np(after), _np(cache)), f"index {bad}: cache written"
