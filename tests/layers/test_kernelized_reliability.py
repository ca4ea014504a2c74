"""Reliability of the kernelized layers (LinearAttention, PerformerAttention,
AdaMRAAttention): bad constructor arguments refused at construction with a
ValueError naming the argument and the value, the config round trip of
valid values, low-precision policies against float32 on the same weights,
and every efficient path against the reference path.

Mixed precision. The attention of these layers keeps its features, its
sums (the causal prefix sums of ``phi(k) v^T`` and ``phi(k)``, the
normaliser) and the division in float32 under every dtype policy, and casts
the result to the compute dtype once. Two checks follow from that:

* the attention alone (``attend``), given the same low-precision heads as
  a float32 layer, differs from it by at most one rounding of the output:
  a relative error of at most the unit roundoff ``u`` of the compute dtype
  (2**-8 for bfloat16, 2**-11 for float16);
* the whole layer, whose inputs, projected heads, attention output and
  output projection are each rounded to the compute dtype, stays within a
  few ``u`` of float32: :data:`LAYER_RTOL` allows 5 ``u`` (measured at
  most 2.2 ``u`` for bfloat16 and 2.1 ``u`` for float16 on JAX, TensorFlow
  and PyTorch, n = 19, 256 and 2000, both modes, these configurations).
  Sums kept in the compute dtype instead give 2.6e-2 (PyTorch) and 3.9e-2
  (TensorFlow) for Performer causal at n = 2000 under ``mixed_bfloat16``;
  on JAX, whose CPU kernels round bfloat16 only at the end of each
  operation, the first check catches them.
"""

import json

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import AdaMRAAttention
from keras_longattn.layers import LinearAttention
from keras_longattn.layers import PerformerAttention
from keras_longattn.ops.paths import fused_kernelized
from keras_longattn.testing import rel_error

BACKEND = keras.backend.backend()
FUSED = fused_kernelized() is not None
NAN, INF = float("nan"), float("inf")

#: The configurations checked (the property suite's for Linear and
#: Performer: chunks of 5, 20 random features).
LAYERS = {
    "linear": (LinearAttention, {"num_heads": 2, "key_dim": 8, "chunk_size": 5}),
    "performer": (
        PerformerAttention,
        {"num_heads": 2, "key_dim": 8, "num_features": 20, "chunk_size": 5, "seed": 7},
    ),
    "adamra": (AdaMRAAttention, {"num_heads": 2, "key_dim": 8}),
}

#: Unit roundoff of each compute dtype.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
#: Relative error allowed between a whole layer under a low-precision
#: policy and float32 on the same weights (see the module docstring).
LAYER_RTOL = {dtype: 5 * u for dtype, u in UNIT_ROUNDOFF.items()}


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(0)


def _make(name, **overrides):
    cls, kwargs = LAYERS[name]
    return cls(**dict(kwargs, **overrides))


def _paths(name):
    """The efficient paths of each layer that run on this backend."""
    if name == "linear":
        return ("kernel",) + (("kernel_fused",) if FUSED else ())
    if name == "performer":
        return ("favor",) + (("favor_fused",) if FUSED else ())
    return ("kernel",)


def _modes(name):
    return (False,) if name == "adamra" else (True, False)


# ------------------------------------------------------ bad arguments
_EPSILONS = (INF, -INF, NAN, 0.0, -1e-6, "1e-6", True, None, 10**400)
_POSITIVE_INTS = (0, -1, 2.5, 4.0, "8", True, None, INF)

BAD_ARGUMENTS = (
    [("linear", "epsilon", v) for v in _EPSILONS]
    + [("linear", "chunk_size", v) for v in _POSITIVE_INTS]
    + [("linear", "key_dim", 0), ("linear", "value_dim", 0)]
    + [("performer", "epsilon", v) for v in _EPSILONS]
    + [("performer", "chunk_size", v) for v in _POSITIVE_INTS]
    + [("performer", "num_features", v) for v in _POSITIVE_INTS]
    + [("performer", "feature_redraw_interval", v) for v in (0, -2, 1.5, "3", True, INF)]
    + [("performer", "seed", v) for v in (-1, 1.7, 1.0, "a", True, NAN, 2**31, 2**40)]
    + [("performer", "key_dim", 0), ("performer", "value_dim", 0)]
    + [("adamra", "epsilon", v) for v in _EPSILONS]
    + [("adamra", "num_subheads", v) for v in _POSITIVE_INTS]
    + [("adamra", "seed", v) for v in (-1, 1.7, 1.0, "a", True)]
    + [
        ("adamra", "compression_rates", v)
        for v in ((NAN, 0.5), (INF, 0.5), (0.5, -INF), (1e-9, 0.5), (True, 0.5), (0.5, "1"))
    ]
    + [("adamra", "key_dim", 0), ("adamra", "value_dim", 0)]
)


@pytest.mark.parametrize(
    "name, argument, value",
    BAD_ARGUMENTS,
    ids=[f"{n}-{a}={v!r:.14}" for n, a, v in BAD_ARGUMENTS],
)
def test_bad_argument_refused_at_construction(name, argument, value):
    """Refused by the constructor (no call needed), with a ValueError that
    names the argument and shows the value received."""
    with pytest.raises(ValueError) as error:
        _make(name, **{argument: value})
    message = str(error.value)
    assert f"`{argument}`" in message, message
    assert f"{argument}={value!r}" in message, message


# ------------------------------------------------------- config round trip
VALID = {
    "linear": {"epsilon": np.float32(1e-3), "chunk_size": np.int64(7),
               "feature_map": "relu"},
    "performer": {"epsilon": 2.5e-4, "chunk_size": np.int32(3), "num_features": np.int64(12),
                  "feature_redraw_interval": np.int64(4), "seed": np.int64(2**31 - 1)},
    "adamra": {"epsilon": 1, "num_subheads": np.int64(2), "seed": np.int64(0),
               "compression_rates": np.array([1.0, 1e-4])},
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_arguments_round_trip_through_the_config(name):
    """Valid values of other numeric types (NumPy scalars, an int epsilon)
    are stored as Python numbers: the config is JSON, and from_config gives
    the same config and the same outputs."""
    layer = _make(name, **VALID[name])
    config = layer.get_config()
    json.dumps(config)  # plain Python values only
    for argument, value in VALID[name].items():
        stored = config[argument]
        if argument == "compression_rates":
            assert stored == tuple(float(c) for c in value)
            assert all(type(c) is float for c in stored)
        elif isinstance(value, str):
            assert stored == value
        else:
            assert stored == value and type(stored) in (int, float), (argument, stored)
    assert type(config["epsilon"]) is float
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    x = np.random.default_rng(0).standard_normal((2, 11, 16)).astype("float32")
    y = to_np(layer(x, x))
    clone(x, x)
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(to_np(clone(x, x)), y)


# ---------------------------------------------------------- mixed precision
def _inputs(n, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, n, 16)).astype("float32")
    mask = np.ones((2, n), bool)
    mask[0, n - 5:] = False
    return x, mask


def _layer_error(name, policy, n, causal, **overrides):
    """Relative error of the layer under ``policy`` against float32 on the
    same weights (real queries; the second example padded at the end)."""
    x, mask = _inputs(n)
    full = _make(name, **overrides)
    kwargs = {"use_causal_mask": causal, "query_mask": mask, "value_mask": mask}
    expected = to_np(full(x, x, **kwargs))
    low = _make(name, dtype=policy, **overrides)
    low.build(x.shape, x.shape)
    low.set_weights(full.get_weights())
    y = low(x, x, **kwargs)
    assert keras.backend.standardize_dtype(y.dtype) == policy.split("_")[-1]
    y = to_np(keras.ops.cast(y, "float32"))
    assert np.all(np.isfinite(y))
    return rel_error(y[mask], expected[mask])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_performer_causal_long_input_close_to_float32(policy):
    """Performer, causal, n = 2000 (400 chunks of 5 in the prefix sums):
    within :data:`LAYER_RTOL` of float32 on the same weights."""
    err = _layer_error("performer", policy, 2000, causal=True)
    assert err <= LAYER_RTOL[policy.split("_")[-1]], err


@pytest.mark.parametrize("causal", [True, False])
def test_linear_long_input_close_to_float32(causal):
    err = _layer_error("linear", "mixed_bfloat16", 2000, causal=causal)
    assert err <= LAYER_RTOL["bfloat16"], err


def test_adamra_long_input_close_to_float32():
    """elu + 1 features and every head for every query: ReLU features and
    the router's argmax are discontinuous (a coordinate or a router logit
    near a tie can land on the other side after rounding the projections
    to bfloat16: the output then moves by O(1)), so the closeness claimed
    is that of the continuous configuration."""
    err = _layer_error("adamra", "mixed_bfloat16", 2000, causal=False,
                       feature_map="elu+1", routing="all")
    assert err <= LAYER_RTOL["bfloat16"], err


def _core_case(name, path, policy, n):
    """A float32 layer and a ``policy`` layer (same weights, ``path``), the
    same heads rounded to the compute dtype (float32 copies for the first),
    and a padding mask."""
    dtype = policy.split("_")[-1]
    x, mask = _inputs(n)
    rng = np.random.default_rng(1)
    heads = [rng.standard_normal((2, n, 2, 8)).astype("float32") for _ in range(3)]
    low_heads = [keras.ops.cast(h, dtype) for h in heads]
    full_heads = [keras.ops.cast(h, "float32") for h in low_heads]
    full = _make(name, implementation=path)
    full.build(x.shape, x.shape)
    low = _make(name, implementation=path, dtype=policy)
    low.build(x.shape, x.shape)
    low.set_weights(full.get_weights())
    return full, low, full_heads, low_heads, mask


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_attention_in_float32_under_low_precision(name, policy):
    """Every path (the efficient ones and the reference), both modes,
    n = 2000: the attention of a low-precision layer equals that of a
    float32 layer on the same (rounded) heads up to one rounding of the
    output to the compute dtype, i.e. within the unit roundoff. Features,
    sums, normaliser and division are float32; any of them kept in the
    compute dtype adds roundings."""
    dtype = policy.split("_")[-1]
    tolerance = 1.02 * UNIT_ROUNDOFF[dtype]
    errors = {}
    for path in _paths(name) + ("reference",):
        full, low, full_heads, low_heads, mask = _core_case(name, path, policy, 2000)
        for causal in _modes(name):
            kwargs = {"query_mask": mask, "key_mask": mask, "use_causal_mask": causal}
            expected = to_np(full.attend(*full_heads, **kwargs))
            y = low.attend(*low_heads, **kwargs)
            assert keras.backend.standardize_dtype(y.dtype) == dtype
            y = to_np(keras.ops.cast(y, "float32"))
            errors[path, causal] = rel_error(y[mask], expected[mask])
    bad = {key: err for key, err in errors.items() if not err <= tolerance}
    assert not bad, f"{policy}: {bad} > {tolerance:.3g}"


# ----------------------------------------------- efficient paths = reference
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_efficient_paths_equal_reference(name):
    """float32, padding on both sides, 37 positions (chunks of 5 do not
    divide it), both modes: each efficient path within the layer's
    ``reference_tolerance`` of the reference path, on the same weights."""
    x, _ = _inputs(37)
    mask = np.ones((2, 37), bool)
    mask[0, 30:] = False
    mask[1, :4] = False
    reference = _make(name, implementation="reference")
    reference.build(x.shape, x.shape)
    for path in _paths(name):
        layer = _make(name, implementation=path)
        layer.build(x.shape, x.shape)
        layer.set_weights(reference.get_weights())
        for causal in _modes(name):
            kwargs = {"use_causal_mask": causal, "query_mask": mask, "value_mask": mask}
            expected = to_np(reference(x, x, **kwargs))
            y = to_np(layer(x, x, **kwargs))
            assert layer.last_implementation == path
            err = rel_error(y[mask], expected[mask])
            assert err <= layer.reference_tolerance, (path, causal, err)
