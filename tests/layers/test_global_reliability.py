"""Reliability of the layers with global rows and random blocks (issue 36,
items 3 and 5): LongformerAttention's global rows, BigBirdAttention's seed,
NystromAttention's padding.

* A NaN or inf at a query position padded only through ``value_mask`` (its
  query is a real query, so the call does not zero it) reaches that
  position's own output only: never another output, the global tokens'
  included, on every implementation that runs on the backend, in self- and
  cross-attention. Longformer's global rows are gathered and written back
  by index (a product with a one-hot matrix would carry ``0 * NaN``).
* BigBird's seed drawn for ``seed=None`` follows
  ``keras.utils.set_random_seed``, and the config and ``.keras`` files keep
  it.
* Nystrom: with ``query_mask`` (and ``value_mask``) padding is inert; with
  ``value_mask`` alone a padded position is a real query whose landmarks
  move the real outputs (docs/guides/nystrom_attention.md).

Small shapes (n = 12 or 16, batch 2): JAX compiles every new shape.
"""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import NystromAttention

F = 16
N = 12


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _padding(n=N):
    """Example 0 padded at its last three positions, example 1 at its
    first position (a leading global token) and its last two."""
    keep = np.ones((2, n), bool)
    keep[0, -3:] = False
    keep[1, 0] = False
    keep[1, -2:] = False
    return keep


def _poison(x, keep):
    """``x`` with NaN, inf and -inf at the padded positions."""
    x = x.copy()
    values = np.array([np.nan, np.inf, -np.inf], "float32")
    for i, (b, t) in enumerate(zip(*np.nonzero(~keep))):
        x[b, t] = values[i % 3]
    return x


def _layer_or_skip(cls, implementation, **kwargs):
    """The layer on ``implementation``; the test is skipped where the path
    refuses a call of length ``N`` on this backend."""
    layer = cls(num_heads=2, key_dim=8, implementation=implementation, **kwargs)
    try:
        layer.select_implementation(query_length=N, key_length=N)
    except ValueError as error:
        pytest.skip(f"{implementation} does not run here: {error}")
    return layer


def _assert_same_real_rows(out, clean, keep):
    out, clean = to_np(out), to_np(clean)
    assert np.isfinite(out[keep]).all(), "a non-finite padded input reached a real output"
    np.testing.assert_allclose(out[keep], clean[keep], rtol=1e-5, atol=1e-6)


# ------------------------------------------------- Longformer's global rows
LONGFORMER_PATHS = ("reference",) + LongformerAttention.implementations

#: case -> (constructor arguments, cross-attention, global positions of
#: the call's global_mask or None, whether a global slot is padded).
LONGFORMER_CASES = {
    # Global positions 0, 5 and 10: 10 is padded in both examples.
    "self-global_mask": ({}, False, (0, 5, 10), True),
    # Rotary positions: the global queries are gathered after the rotation.
    "self-global_tokens-rotary": (
        {"global_tokens": 1, "rotary_max_wavelength": 100.0}, False, None, False),
    # Global tokens 0 and 1: token 0 of example 1 is padded.
    "cross-global_tokens": ({"global_tokens": 2}, True, None, True),
}


@pytest.mark.parametrize("case", list(LONGFORMER_CASES))
@pytest.mark.parametrize("implementation", LONGFORMER_PATHS)
def test_longformer_nonfinite_value_mask_padding_stays_put(implementation, case):
    """NaN/inf in the query (and key/value) inputs at positions padded only
    through ``value_mask``: every real output, the global tokens' included,
    is finite and equal to the call with zeros there."""
    kwargs, cross, global_positions, _ = LONGFORMER_CASES[case]
    layer = _layer_or_skip(LongformerAttention, implementation, window=4, **kwargs)
    keep = _padding()
    query = _x((2, N, F), 0)
    value = _x((2, N, F), 1) if cross else query
    extra = {}
    if global_positions is not None:
        mask = np.zeros((2, N), bool)
        mask[:, list(global_positions)] = True
        extra["global_mask"] = mask
    zeroed = [np.where(keep[..., None], x, 0.0).astype("float32") for x in (query, value)]
    poisoned = [_poison(x, keep) for x in (query, value)]
    clean = layer(zeroed[0], zeroed[1], value_mask=keep, **extra)
    out = layer(poisoned[0], poisoned[1], value_mask=keep, **extra)
    _assert_same_real_rows(out, clean, keep)


@pytest.mark.parametrize("implementation", LONGFORMER_PATHS)
def test_longformer_attend_nonfinite_padded_query_heads(implementation):
    """``attend`` on projected heads (no global projections: the global
    queries are gathered inside the op): NaN/inf query heads at positions
    padded through ``query_mask`` reach no real output."""
    layer = _layer_or_skip(LongformerAttention, implementation, window=4, global_tokens=2)
    layer.build((2, N, F), (2, N, F))
    keep = _padding()
    q, k, v = (_x((2, N, 2, 8), s) for s in (0, 1, 2))
    # attend() takes backend tensors (the band kernel reads torch tensors).
    k, v = keras.ops.convert_to_tensor(k), keras.ops.convert_to_tensor(v)
    zeroed = keras.ops.convert_to_tensor(np.where(keep[..., None, None], q, 0.0).astype("float32"))
    poisoned = keras.ops.convert_to_tensor(_poison(q, keep))
    clean = layer.attend(zeroed, k, v, query_mask=keep)
    out = layer.attend(poisoned, k, v, query_mask=keep)
    _assert_same_real_rows(out, clean, keep)


# --------------------------------------------------------- BigBird's seed
BIGBIRD = {"num_heads": 2, "key_dim": 8, "block_size": 2, "window_blocks": 1,
           "global_blocks": 1, "random_blocks": 2}


def _random_blocks(layer, n=32):
    return layer.attention_pattern(n, n, False).block_mask()


def test_bigbird_seed_follows_set_random_seed():
    """``seed=None`` after ``keras.utils.set_random_seed(s)``: the same
    ``s`` gives the same seed, random blocks and output; another ``s``
    other random blocks (and another output on the same weights)."""
    x = _x((2, 32, F), 0)
    layers, out = [], []
    for s in (7, 7, 8):
        keras.utils.set_random_seed(s)
        layers.append(BigBirdAttention(**BIGBIRD))
        out.append(to_np(layers[-1](x, x)))  # the weights are made here
    a, b, c = layers
    assert a.seed == b.seed
    assert a.seed != c.seed
    np.testing.assert_array_equal(_random_blocks(a), _random_blocks(b))
    assert not np.array_equal(_random_blocks(a), _random_blocks(c))
    np.testing.assert_array_equal(out[0], out[1])
    c.set_weights(a.get_weights())
    assert np.abs(to_np(c(x, x)) - out[0]).max() > 1e-4


def test_bigbird_drawn_seed_survives_config_and_keras_file(tmp_path):
    """The drawn seed is in the config: ``from_config`` and a ``.keras``
    round trip (made under another global seed) keep the random blocks and
    the outputs."""
    keras.utils.set_random_seed(7)
    layer = BigBirdAttention(**BIGBIRD)
    config = layer.get_config()
    assert config["seed"] == layer.seed
    x = _x((2, 32, F), 0)
    inputs = keras.Input((32, F))
    model = keras.Model(inputs, layer(inputs, inputs))
    expected = to_np(model(x))
    path = str(tmp_path / "bigbird.keras")
    model.save(path)

    keras.utils.set_random_seed(8)
    again = BigBirdAttention.from_config(config)
    assert again.seed == layer.seed
    np.testing.assert_array_equal(_random_blocks(again), _random_blocks(layer))
    again(x, x)
    again.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_np(again(x, x)), expected, rtol=1e-5, atol=1e-6)

    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded(x)), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- Nystrom's padding
NYSTROM_PATHS = ("reference",) + NystromAttention.implementations


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("implementation", NYSTROM_PATHS)
def test_nystrom_query_mask_makes_padding_inert(implementation, cross):
    """With ``query_mask`` and ``value_mask``, random values or NaN/inf at
    the padded positions leave the real outputs unchanged; with
    ``value_mask`` alone the padded positions are real queries: their
    landmarks move the real outputs."""
    layer = _layer_or_skip(NystromAttention, implementation, num_landmarks=4)
    keep = _padding()
    query = np.where(keep[..., None], _x((2, N, F), 0), 0.0).astype("float32")
    value = query
    if cross:
        value = np.where(keep[..., None], _x((2, N, F), 1), 0.0).astype("float32")
    noise = _x((2, N, F), 2)
    moved_query = np.where(keep[..., None], query, noise).astype("float32")
    moved_value = moved_query
    if cross:
        moved_value = np.where(keep[..., None], value, noise).astype("float32")
    masks = {"query_mask": keep, "value_mask": keep}
    clean = layer(query, value, **masks)
    _assert_same_real_rows(layer(moved_query, moved_value, **masks), clean, keep)
    _assert_same_real_rows(layer(_poison(query, keep), _poison(value, keep), **masks), clean,
                           keep)

    value_only = to_np(layer(query, value, value_mask=keep))
    moved = to_np(layer(moved_query, moved_value, value_mask=keep))
    assert np.abs(moved[keep] - value_only[keep]).max() > 1e-4


@pytest.mark.parametrize("implementation", NYSTROM_PATHS)
def test_nystrom_attend_nonfinite_padded_heads(implementation):
    """``attend`` on projected heads: NaN/inf query and key heads at
    positions padded through ``query_mask`` and ``key_mask`` take no part
    in any landmark and reach no real output."""
    layer = _layer_or_skip(NystromAttention, implementation, num_landmarks=4)
    layer.build((2, N, F), (2, N, F))
    keep = _padding()
    q, k, v = (_x((2, N, 2, 8), s) for s in (0, 1, 2))
    zero = [np.where(keep[..., None, None], t, 0.0).astype("float32") for t in (q, k, v)]
    bad = [_poison(t, keep) for t in (q, k, v)]
    clean = layer.attend(*zero, query_mask=keep, key_mask=keep)
    out = layer.attend(*bad, query_mask=keep, key_mask=keep)
    _assert_same_real_rows(out, clean, keep)
