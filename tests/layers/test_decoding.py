"""Decoding with a cache (keras-hub's convention: ``cache`` and
``cache_update_index``, the layer returns ``(output, cache)``): a prompt
prefilled in one call, then the rest token by token or a few at a time,
gives the outputs of one causal forward pass over the whole sequence, on
every backend (also across the window edge and after Local's ring wraps,
with rotary positions, and under JAX's and TensorFlow's compilers)."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LinearAttention
from keras_longattn.layers import PerformerAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.layers import SynthesizerAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LSHAttention

B, N, DIM, H, D = 2, 13, 16, 2, 8
#: Largest absolute difference from the full forward pass (float32).
TOL = 2e-5
BACKEND = keras.backend.backend()


def _inputs(seed=0):
    return np.random.default_rng(seed).normal(size=(B, N, DIM)).astype("float32")


def _layer(kind, **kwargs):
    keras.utils.set_random_seed(0)
    if kind == "full":
        layer = FullAttention(num_heads=H, key_dim=D, **kwargs)
    elif kind == "performer":
        layer = PerformerAttention(num_heads=H, key_dim=D, num_features=16, chunk_size=4,
                                   seed=3, **kwargs)
    elif kind.startswith("sparse"):
        _, pattern, combination = kind.split("-")
        layer = SparseAttention(num_heads=H, key_dim=D, pattern=pattern, block_length=4,
                                combination=combination, **kwargs)
    elif kind == "bigbird":
        layer = BigBirdAttention(num_heads=H, key_dim=D, block_size=2, window_blocks=3,
                                 global_blocks=1, random_blocks=2, seed=4, **kwargs)
    elif kind.startswith("synthesizer"):
        layer = SynthesizerAttention(num_heads=H, key_dim=D, max_length=N + 3,
                                     kind=kind.split("-", 1)[1], **kwargs)
    elif kind == "linear":
        layer = LinearAttention(num_heads=H, key_dim=D, chunk_size=4, **kwargs)
    else:
        layer = LocalAttention(num_heads=H, key_dim=D, window=4, **kwargs)
    x = _inputs()
    layer(x, x, use_causal_mask=True)
    return layer


def _decode(layer, x, chunks):
    """Outputs of decoding ``x`` in chunks of the given sizes."""
    cache = layer.init_cache(B, N)
    outs, index = [], 0
    for size in chunks:
        part = x[:, index:index + size]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache,
                           cache_update_index=index)
        assert layer.last_implementation == "decode"
        assert tuple(cache.shape) == tuple(layer.cache_shape(B, N))
        outs.append(keras.ops.convert_to_numpy(out))
        index += size
    return np.concatenate(outs, axis=1)


SCHEDULES = {
    "prefill-then-steps": [5] + [1] * 8,
    "steps-only": [1] * N,
    "chunks-across-the-ring": [3, 2, 4, 1, 3],
    "one-call": [N],
}


KINDS = ["bigbird", "full", "linear", "local", "performer", "sparse-strided-multihead",
         "sparse-fixed-merged", "synthesizer-dense+random+vanilla",
         "synthesizer-factorized_dense+factorized_random+fixed_random"]
#: Every schedule for Local (its ring is where decoding can go wrong), the
#: two that cover prefill, steps and chunks for the others; rotary positions
#: on one layer of each cache kind.
CASES = (
    [("local", schedule, None) for schedule in sorted(SCHEDULES)]
    + [(kind, schedule, None) for kind in KINDS if kind != "local"
       for schedule in ("prefill-then-steps", "chunks-across-the-ring")]
    + [(kind, "chunks-across-the-ring", 100.0) for kind in ("full", "local", "linear")]
)


@pytest.mark.every_backend
@pytest.mark.parametrize("kind,schedule,rotary", CASES,
                         ids=[f"{k}-{s}-{'rotary' if r else 'plain'}" for k, s, r in CASES])
def test_decoding_gives_the_full_forward_pass(kind, schedule, rotary):
    layer = _layer(kind, rotary_max_wavelength=rotary)
    x = _inputs(1)
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    got = _decode(layer, x, SCHEDULES[schedule])
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def test_local_cache_is_a_ring_of_the_window():
    layer = _layer("local")
    full = _layer("full")
    assert layer.cache_shape(B, 32768) == (B, 2, 3, H, D)  # look_back = window - 1
    assert full.cache_shape(B, 32768) == (B, 2, 32768, H, D)
    linear = _layer("linear")
    assert linear.cache_shape(B, 32768) == (B, H, D, D + 1)  # the recurrent state
    assert keras.backend.standardize_dtype(linear.init_cache(B, 8).dtype) == "float32"


def compiled_decoding(layer, x, prefill=0):
    """Outputs of decoding ``x`` with one compiled step function (the index
    traced, the cache of fixed size; ``jax.jit`` or TensorFlow's XLA),
    after an eager prefill of the first ``prefill`` tokens."""
    batch, length = x.shape[:2]

    def step(token, cache, index):
        return layer(token, token, use_causal_mask=True, cache=cache, cache_update_index=index)

    if BACKEND == "jax":
        import jax

        compiled = jax.jit(step)
    else:
        import tensorflow as tf

        compiled = tf.function(step, jit_compile=True)
    cache = layer.init_cache(batch, length)
    outs = []
    if prefill:
        out, cache = step(x[:, :prefill], cache, 0)
        outs.append(keras.ops.convert_to_numpy(out))
    for i in range(prefill, length):
        out, cache = compiled(x[:, i:i + 1], cache, keras.ops.convert_to_tensor(i, "int32"))
        outs.append(keras.ops.convert_to_numpy(out))
    return np.concatenate(outs, axis=1)


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="JAX's and TensorFlow's compilers")
@pytest.mark.parametrize("kind", ["bigbird", "full", "linear", "local", "performer",
                                  "synthesizer-dense+random+vanilla"])
def test_compiled_step_with_a_traced_index(kind):
    """One compiled step function (the index traced, the cache of fixed
    size) serves every position."""
    layer = _layer(kind)
    x = _inputs(2)
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    np.testing.assert_allclose(compiled_decoding(layer, x), expected, atol=TOL, rtol=0)


def test_bad_decoding_calls_are_refused():
    layer = _layer("local")
    full = _layer("full")
    x = _inputs()[:, :1]
    cache = layer.init_cache(B, N)
    with pytest.raises(ValueError, match="cache_update_index"):
        layer(x, x, use_causal_mask=True, cache=cache, cache_update_index=-1)
    with pytest.raises(ValueError, match=r"cache_update_index.*at most 12"):
        full(x, x, use_causal_mask=True, cache=full.init_cache(B, N), cache_update_index=13)
    with pytest.raises(ValueError, match="cache_update_index"):
        layer(x, x, use_causal_mask=True, cache=cache, cache_update_index=1.5)
    with pytest.raises(ValueError, match="Received: cache.shape"):
        layer(x, x, use_causal_mask=True, cache=full.init_cache(B, N), cache_update_index=0)
    with pytest.raises(ValueError, match="use_causal_mask"):
        layer(x, x, cache=cache, cache_update_index=0)
    with pytest.raises(ValueError, match="cache_update_index=None"):
        layer(x, x, use_causal_mask=True, cache=cache)
    with pytest.raises(ValueError, match="value_mask"):
        layer(x, x, use_causal_mask=True, cache=cache, cache_update_index=0,
              value_mask=np.ones((B, 1), bool))
    with pytest.raises(ValueError, match="value_dim"):
        other = FullAttention(num_heads=H, key_dim=D, value_dim=4)
        other(_inputs(), _inputs())
        other(x, x, use_causal_mask=True, cache=other.init_cache(B, N), cache_update_index=0)
    with pytest.raises(ValueError, match="block_length"):  # not fixed yet: no length seen
        SparseAttention(num_heads=H, key_dim=D).init_cache(B, N)
    lsh = LSHAttention(num_heads=H, key_dim=D, bucket_size=4)
    lsh(_inputs(), _inputs())
    with pytest.raises(ValueError, match="no decoding cache"):
        lsh.init_cache(B, N)
    with pytest.raises(ValueError, match="no decoding cache"):
        lsh(x, x, use_causal_mask=True, cache=cache, cache_update_index=0)


def test_synthesizer_cache_fits_its_tables():
    layer = _layer("synthesizer-random+vanilla")
    assert layer.cache_shape(B, N + 3) == (B, 2, N + 3, H, D)
    with pytest.raises(ValueError, match=r"max_length=16 positions.*max_length=17"):
        layer.init_cache(B, N + 4)
