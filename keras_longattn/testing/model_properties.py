"""Decoding properties that every causal model with a cache runs.

:class:`CausalModelDecodingProperties` is a pytest mixin for models that
decode incrementally with keras-hub's convention (``init_caches``,
``call_with_cache(token_ids, cache, cache_update_index)``, ``generate``):
:class:`keras_longattn.models.CausalLanguageModel` and the keras-hub tasks
of :mod:`keras_longattn.hub` (``LongGPT2CausalLM`` ...). Subclass it in a
pytest module (the class name must start with ``Test``) and give it a
``make_model()``::

    from keras_longattn.models import build_causal_language_model
    from keras_longattn.testing.model_properties import (
        CausalModelDecodingProperties)

    class TestLocalLanguageModelDecoding(CausalModelDecodingProperties):
        vocab_size = 32
        position_table = 16  # learned positions; None for rotary

        def make_model(self):
            return build_causal_language_model(
                vocab_size=32, sequence_length=16, dim=16, num_layers=1,
                num_heads=2, attention={"class_name": "LocalAttention",
                                        "config": {"window": 4}})

What is checked (every test name starts with ``test_model_decode_``):

* ``call_with_cache`` refuses concrete token ids (NumPy and the backend's
  eager tensors) outside ``[0, vocab_size)``, negative ones included, with
  a ValueError naming ``token_ids``, the vocabulary size and the offending
  id; float and bool ids with a ValueError naming ``token_ids`` and the
  dtype;
* traced ids are refused when the program runs: under ``jax.jit`` (JAX)
  and a ``tf.function`` without XLA (TensorFlow), with the same message,
  while valid traced ids give the eager logits (on torch, eager ids are
  concrete: skipped); under XLA on TensorFlow, which cannot stop a
  program, a refused call returns NaN logits and hidden states and the
  caches it was given;
* ``init_caches`` refuses a ``batch_size`` or ``max_length`` of 2.5, -3, 0
  or True with a ValueError naming the argument;
* with a learned position table (``position_table`` rows), ``generate``
  and ``init_caches`` with ``max_length`` past it are refused before
  anything runs (a ValueError naming ``max_length`` and the table size),
  and so is a ``call_with_cache`` at positions past it (concrete: at the
  call; traced: when the program runs).

Hooks a subclass may override: :meth:`init_caches`,
:meth:`call_with_cache` and :meth:`generate` (how the model is driven),
and the class attributes below.
"""

import keras
import numpy as np
import pytest
from keras import ops

BAD_SIZES = (2.5, -3, 0, True)


def _numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def _backend():
    return keras.config.backend()


class CausalModelDecodingProperties:
    """Mixin of the ``test_model_decode_*`` properties (see the module
    docstring)."""

    #: The model's vocabulary size (token ids ``[0, vocab_size)``).
    vocab_size = None
    #: The rows of the model's learned position table; None without one
    #: (rotary or no positions): the table properties are skipped.
    position_table = None
    #: The ``max_length`` of the caches the probes decode with (at most the
    #: position table).
    max_length = 8
    #: The seed set before ``make_model()``.
    seed = 0

    # ------------------------------------------------------------- hooks
    def make_model(self):
        """The model under test (built once per test class)."""
        raise NotImplementedError("Subclasses define make_model()")

    def init_caches(self, model, batch_size, max_length):
        return model.init_caches(batch_size=batch_size, max_length=max_length)

    def call_with_cache(self, model, token_ids, caches, cache_update_index):
        return model.call_with_cache(token_ids, caches, cache_update_index)

    def generate(self, model, prompt, max_length):
        """Generates after ``prompt`` (int ``(B, P)``) up to ``max_length``
        tokens in all."""
        return model.generate(prompt, max_length=max_length)

    # ----------------------------------------------------------- helpers
    def model(self):
        cls = type(self)
        if "_decoding_model" not in cls.__dict__:
            keras.utils.set_random_seed(self.seed)
            cls._decoding_model = self.make_model()
        return cls._decoding_model

    def _vocab(self):
        if self.vocab_size is None:
            raise NotImplementedError("Subclasses set vocab_size")
        return int(self.vocab_size)

    def _ids(self, batch=2, length=3, seed=0):
        rng = np.random.default_rng(seed)
        return rng.integers(0, self._vocab(), (batch, length)).astype("int32")

    def _traced(self, function):
        """``function`` compiled as the backend's traced function: jax.jit,
        or a tf.function without XLA."""
        if _backend() == "jax":
            import jax

            return jax.jit(function)
        if _backend() == "tensorflow":
            import tensorflow as tf

            return tf.function(function, jit_compile=False)
        pytest.skip("torch eager: ids and positions are concrete when the call is made")

    def _id_message(self, value=None):
        vocab = self._vocab()
        pattern = rf"`token_ids` must be token ids in \[0, {vocab}\)"
        if value is not None:
            pattern += rf"[^\d]*vocabulary size is {vocab}\)?[\s\S]*token id[^\d-]*{value}(?!\d)"
        return pattern

    # ------------------------------------------------------------- ids
    @pytest.mark.parametrize("kind", ["numpy", "tensor"])
    @pytest.mark.parametrize("where", ["vocab_size", "far", "negative"])
    def test_model_decode_refuses_out_of_range_token_ids(self, where, kind):
        model = self.model()
        vocab = self._vocab()
        value = {"vocab_size": vocab, "far": vocab + 7, "negative": -1}[where]
        caches = self.init_caches(model, 2, self.max_length)
        ids = self._ids()
        ids[1, 2] = value
        if kind == "tensor":
            ids = ops.convert_to_tensor(ids)
        with pytest.raises(ValueError, match=self._id_message(value)):
            self.call_with_cache(model, ids, caches, 0)

    @pytest.mark.parametrize("dtype", ["float32", "bool"])
    def test_model_decode_refuses_non_integer_token_ids(self, dtype):
        model = self.model()
        caches = self.init_caches(model, 2, self.max_length)
        ids = ops.convert_to_tensor(self._ids().astype(dtype))
        with pytest.raises(ValueError, match=rf"`token_ids`.*dtype {dtype}"):
            self.call_with_cache(model, ids, caches, 0)

    @pytest.mark.parametrize("where", ["far", "negative"])
    def test_model_decode_refuses_traced_bad_token_ids(self, where):
        """Refused when the program runs (the message carries the id);
        valid traced ids give the eager logits."""
        model = self.model()
        vocab = self._vocab()
        caches = self.init_caches(model, 2, self.max_length)
        run = self._traced(lambda ids: self.call_with_cache(model, ids, caches, 0)[0])
        good = self._ids()
        expected = _numpy(self.call_with_cache(model, good, caches, 0)[0])
        np.testing.assert_allclose(_numpy(run(good)), expected, rtol=1e-4, atol=1e-5)
        value = vocab + 3 if where == "far" else -2
        bad = good.copy()
        bad[0, 1] = value
        with pytest.raises(Exception, match=self._id_message()) as raised:
            _numpy(run(bad))
        assert str(value) in str(raised.value)

    def test_model_decode_xla_refusal_gives_nan_and_keeps_the_caches(self):
        """XLA on TensorFlow cannot stop a program: a refused call is
        unusable by construction (NaN logits and hidden states, the caches
        it was given)."""
        if _backend() != "tensorflow":
            pytest.skip("XLA without run-time errors: TensorFlow's jit_compile=True")
        import tensorflow as tf

        model = self.model()
        caches = self.init_caches(model, 2, self.max_length)
        _, _, caches = self.call_with_cache(model, self._ids(seed=1), caches, 0)
        run = tf.function(
            lambda ids: self.call_with_cache(model, ids, caches, 3), jit_compile=True
        )
        good = self._ids(length=1)
        logits, hidden, _ = run(good)
        expected = _numpy(self.call_with_cache(model, good, caches, 3)[0])
        np.testing.assert_allclose(_numpy(logits), expected, rtol=1e-4, atol=1e-5)
        bad = good.copy()
        bad[1, 0] = self._vocab() + 5
        logits, hidden, new_caches = run(bad)
        assert np.isnan(_numpy(logits)).all() and np.isnan(_numpy(hidden)).all()
        old, new = keras.tree.flatten(caches), keras.tree.flatten(new_caches)
        assert len(old) == len(new)
        for a, b in zip(old, new):
            np.testing.assert_array_equal(_numpy(b), _numpy(a))

    # ---------------------------------------------------------- caches
    @pytest.mark.parametrize("value", BAD_SIZES, ids=[repr(v) for v in BAD_SIZES])
    @pytest.mark.parametrize("argument", ["batch_size", "max_length"])
    def test_model_decode_init_caches_refuses_bad_sizes(self, argument, value):
        model = self.model()
        sizes = {"batch_size": 2, "max_length": self.max_length}
        sizes[argument] = value
        with pytest.raises(ValueError, match=f"`{argument}`"):
            self.init_caches(model, **sizes)

    # --------------------------------------------------- position table
    def _table(self):
        if self.position_table is None:
            pytest.skip("no learned position table (rotary or no positions)")
        return int(self.position_table)

    def test_model_decode_generate_beyond_the_position_table_is_refused(self):
        table = self._table()
        model = self.model()
        with pytest.raises(
            ValueError, match=rf"`max_length`.*position table \({table}\b.*max_length={table + 1}"
        ):
            self.generate(model, self._ids(), table + 1)

    def test_model_decode_init_caches_beyond_the_position_table_is_refused(self):
        table = self._table()
        with pytest.raises(
            ValueError, match=rf"`max_length`.*position table \({table}\b.*max_length={table + 1}"
        ):
            self.init_caches(self.model(), 2, table + 1)

    def test_model_decode_call_with_cache_beyond_the_position_table_is_refused(self):
        table = self._table()
        model = self.model()
        caches = self.init_caches(model, 2, table)
        message = rf"position table \({table} rows"
        with pytest.raises(ValueError, match=message + rf".*= {table + 1}"):
            self.call_with_cache(model, self._ids(length=1), caches, table)
        with pytest.raises(ValueError, match=message + rf".*= {table + 1}"):
            self.call_with_cache(model, self._ids(length=3), caches, table - 2)
        # The last position is still open.
        logits, _, _ = self.call_with_cache(model, self._ids(length=1), caches, table - 1)
        assert np.all(np.isfinite(_numpy(logits)))

    def test_model_decode_traced_position_beyond_the_table_is_refused(self):
        table = self._table()
        model = self.model()
        caches = self.init_caches(model, 2, table)
        run = self._traced(
            lambda ids, index: self.call_with_cache(model, ids, caches, index)[0]
        )
        ids = self._ids(length=1)
        assert np.all(np.isfinite(_numpy(run(ids, np.int32(table - 1)))))
        with pytest.raises(Exception, match=rf"position table \({table} rows") as raised:
            _numpy(run(ids, np.int32(table)))
        assert str(table + 1) in str(raised.value)
