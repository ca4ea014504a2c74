"""Issue #48, item 2: the ``"cudnn"`` path (cuDNN's sliding window through
``jax.nn.dot_product_attention``) for plain windows on JAX.

There is no cuDNN on a CPU, so:

* the refusals are checked as they are (the CPU says why), and with the
  device check simulated (``cudnn_window.device_refusal`` returning None)
  for what ``"auto"`` picks on an NVIDIA GPU with a proof: ``"cudnn"`` for
  plain causal windows, ``"pallas"`` for dilated, global, padded, float32
  and other patterns, each refusal naming its reason;
* the program lowers for a CUDA GPU on the CPU (``lowering_platforms=
  ("cuda",)``, JAX's cuDNN version checks stubbed, as no cuDNN is
  installed): the cuDNN custom calls, forward and backward, with the
  window, mask and scale the layer asks for;
* the argument mapping is checked numerically against the dense reference
  by running the same call with ``implementation=None`` (JAX's XLA
  attention, same ``local_window_size`` semantics): the test-only
  substitution ``cudnn_window.IMPLEMENTATION = None``.
"""

import re

import keras
import numpy as np
import pytest

from keras_longattn.kernels import proven
from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.layers import base_attention
from keras_longattn.layers import dispatch
from keras_longattn.ops import PaddingMask

ON_JAX = keras.backend.backend() == "jax"
jax_only = pytest.mark.skipif(not ON_JAX, reason="the cuDNN path is JAX's")


def _context(T, S=None, causal=True, key_mask=None):
    return base_attention.AttentionContext(
        padding=PaddingMask(None, key_mask), causal=causal, query_length=T,
        key_length=T if S is None else S)


def _reason(layer, context):
    return layer._implementation_table["cudnn"].refusal(layer, context)


# ------------------------------------------------------------ as it is
def test_the_cpu_refuses_and_says_why():
    layer = LocalAttention(num_heads=2, key_dim=8, window=4, dtype="bfloat16")
    assert "cudnn" not in layer.auto_order()
    assert layer.select_implementation(use_causal_mask=True, query_length=16,
                                       key_length=16) != "cudnn"
    reason = _reason(layer, _context(16))
    if ON_JAX:
        assert "no cuDNN there" in reason and "'cpu'" in reason
    else:
        assert "needs the JAX backend on an NVIDIA GPU" in reason
    named = LocalAttention(num_heads=2, key_dim=8, window=4, implementation="cudnn")
    x = np.zeros((1, 16, 16), "float32")
    with pytest.raises(ValueError, match="cudnn: "):
        named(x, x)


# ---------------------------------------------------- a simulated GPU
@pytest.fixture
def gpu(monkeypatch):
    """JAX as on an NVIDIA Hopper GPU with cuDNN, whose vendor has proofs
    of the "cudnn" and "pallas" paths on today's sources."""
    from keras_longattn.kernels.jax import cudnn_window

    monkeypatch.setattr(cudnn_window, "device_refusal", lambda: None)
    monkeypatch.setattr(cudnn_window, "max_head_dim", lambda: 256)
    monkeypatch.setattr(cudnn_window, "right_window_supported", lambda: False)
    monkeypatch.setattr(proven, "active_vendor", lambda backend: "nvidia")
    monkeypatch.setattr(proven, "_WARNED", set())
    monkeypatch.setattr(dispatch, "_FAILED", {})
    monkeypatch.delenv(proven.TRUST_VARIABLE, raising=False)
    monkeypatch.setitem(proven.PROVEN, ("jax", "nvidia"), {
        kind: {"sources": proven.source_hashes(kind)} for kind in ("cudnn", "pallas")})
    return cudnn_window


@jax_only
def test_auto_picks_cudnn_for_plain_windows(gpu):
    local = LocalAttention(num_heads=2, key_dim=64, window=16, dtype="bfloat16")
    assert local.auto_order()[:2] == ("cudnn", "pallas")
    assert local._select(_context(256)) == "cudnn"
    # Not causal, no keys ahead: the same pairs as a causal window.
    look_back = LocalAttention(num_heads=2, key_dim=64, look_back=7, look_ahead=0,
                               dtype="bfloat16")
    assert look_back._select(_context(256, causal=False)) == "cudnn"
    longformer = LongformerAttention(num_heads=2, key_dim=64, window=16, dtype="float16")
    assert longformer._select(_context(256)) == "cudnn"
    # Mixed precision computes in bfloat16.
    mixed = LocalAttention(num_heads=2, key_dim=64, window=16, dtype="mixed_bfloat16")
    assert mixed._select(_context(256)) == "cudnn"


@jax_only
@pytest.mark.parametrize("make, context, reason", [
    (lambda: LocalAttention(num_heads=2, key_dim=64, window=16, dtype="bfloat16"),
     _context(256, causal=False), "left window only"),
    (lambda: LocalAttention(num_heads=2, key_dim=64, window=16),
     _context(256), "float16 or bfloat16 only"),
    (lambda: LocalAttention(num_heads=2, key_dim=64, window=16, dtype="bfloat16"),
     _context(256, key_mask=np.ones((1, 256), bool)), "key padding mask"),
    (lambda: LocalAttention(num_heads=2, key_dim=64, window=16, dtype="bfloat16"),
     _context(256, 128), "lengths differ"),
    (lambda: LocalAttention(num_heads=2, key_dim=60, window=16, dtype="bfloat16"),
     _context(256), "multiple of 8"),
    (lambda: LocalAttention(num_heads=2, key_dim=512, window=16, dtype="bfloat16"),
     _context(256), "at most 256"),
    (lambda: LocalAttention(num_heads=2, key_dim=64, value_dim=32, window=16,
                            dtype="bfloat16"),
     _context(256), "needs them equal"),
    (lambda: LongformerAttention(num_heads=2, key_dim=64, window=16, dilation=[1, 2],
                                 dtype="bfloat16"),
     _context(256), "dilated"),
    (lambda: LongformerAttention(num_heads=2, key_dim=64, window=16, global_tokens=2,
                                 dtype="bfloat16"),
     _context(256), "global tokens"),
    (lambda: LongformerAttention(num_heads=2, key_dim=64, window=16, dtype="bfloat16"),
     _context(256, causal=False), "left window only"),
], ids=["symmetric", "float32", "padding", "cross-lengths", "head-60", "head-512",
        "value-heads", "dilated", "global", "longformer-symmetric"])
def test_what_cudnn_cannot_express_goes_to_pallas_with_the_reason(gpu, make, context,
                                                                  reason):
    layer = make()
    assert reason in _reason(layer, context)
    assert layer._select(context) == "pallas"


@jax_only
def test_other_patterns_never_take_cudnn(gpu):
    for layer in (SparseAttention(num_heads=2, key_dim=64, pattern="strided",
                                  block_length=16, dtype="bfloat16"),
                  BigBirdAttention(num_heads=2, key_dim=64, block_size=16,
                                   dtype="bfloat16")):
        assert "cudnn" not in layer._implementation_table
        assert layer._select(_context(256)) == "pallas"


@jax_only
def test_cudnn_needs_its_own_proof(gpu, monkeypatch):
    """Without a proof of "cudnn" (or with a stale one) "auto" takes Pallas."""
    layer = LocalAttention(num_heads=2, key_dim=64, window=16, dtype="bfloat16")
    monkeypatch.setitem(proven.PROVEN, ("jax", "nvidia"),
                        {"pallas": {"sources": proven.source_hashes("pallas")}})
    assert layer._select(_context(256)) == "pallas"
    stale = {"keras_longattn/kernels/jax/cudnn_window.py": "0" * 64}
    monkeypatch.setitem(proven.PROVEN, ("jax", "nvidia"), {
        "pallas": {"sources": proven.source_hashes("pallas")}, "cudnn": {"sources": stale}})
    with pytest.warns(UserWarning, match="cudnn_window.py: changed"):
        assert layer._select(_context(256)) == "pallas"


def test_window_arguments():
    from keras_longattn.kernels.jax import cudnn_window

    assert cudnn_window.window_arguments(511, 0, True) == (True, (511, 0))
    assert cudnn_window.window_arguments(7, 0, False) == (True, (7, 0))
    assert cudnn_window.window_arguments(8, 8, False) == (False, (8, 8))



# ------------------------------------------------ lowering for a GPU
@jax_only
@pytest.mark.parametrize("layer_cls, kwargs, look_back", [
    (LocalAttention, {"window": 8}, 7), (LongformerAttention, {"window": 8}, 8)])
def test_the_cudnn_path_lowers_for_a_cuda_gpu(gpu, monkeypatch, layer_cls, kwargs, look_back):
    import jax
    import jax.numpy as jnp

    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    for name, stub in (("check_cudnn_version", lambda: 91000),
                       ("check_compute_capability", lambda capability: True),
                       ("is_cuda_compute_capability_equal", lambda capability: False)):
        if not hasattr(fused, name):
            pytest.skip(f"this JAX has no {name} to stand in for cuDNN")
        monkeypatch.setattr(fused, name, stub)
    layer = layer_cls(num_heads=2, key_dim=64, implementation="cudnn", dtype="bfloat16",
                      **kwargs)
    layer.build((1, 64, 32), (1, 64, 32))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 32)), jnp.bfloat16)

    def loss(x):
        return jnp.sum(layer(x, x, use_causal_mask=True).astype("float32"))

    text = jax.jit(jax.value_and_grad(loss)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = set(re.findall(r"custom_call @([\w$]+)", text))
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls
    # JAX gives cuDNN the window as look_back + 1 keys ending at the query.
    assert set(re.findall(r"sliding_window_length\\22: (\d+)", text)) == {str(look_back + 1)}
    assert set(re.findall(r"mask_type\\22: \\22(\w+)\\22", text)) == {"CAUSAL"}
    assert set(re.findall(r"fmha_scale\\22: ([\d.]+)", text)) == {"0.125"}


# ----------------------------------- the mapping, numerically, via XLA
@pytest.fixture
def via_xla(gpu, monkeypatch):
    """The "cudnn" path with JAX's XLA attention in place of cuDNN (and
    float32 allowed, to compare closely)."""
    monkeypatch.setattr(gpu, "IMPLEMENTATION", None)
    monkeypatch.setattr(gpu, "DTYPES", gpu.DTYPES + ("float32",))
    return gpu


def _output_and_grad(layer, x, causal):
    import jax
    import jax.numpy as jnp

    def loss(x):
        out = layer(x, x, use_causal_mask=causal).astype("float32")
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    (_, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(x, layer.compute_dtype))
    return np.asarray(out, "float32"), np.asarray(grad, "float32")


@jax_only
@pytest.mark.parametrize("layer_cls, kwargs, causal", [
    (LocalAttention, {"window": 6}, True),
    (LocalAttention, {"look_back": 5, "look_ahead": 0}, False),
    (LocalAttention, {"window": 6, "look_back": 2, "look_ahead": 4}, False),
    (LongformerAttention, {"window": 6}, True),
], ids=["local-causal", "local-look-back", "local-asymmetric", "longformer-causal"])
def test_the_mapping_equals_the_reference(via_xla, monkeypatch, layer_cls, kwargs, causal):
    if not causal and kwargs.get("look_ahead"):
        # A JAX that gives cuDNN a right window: the mapping of such windows.
        monkeypatch.setattr(via_xla, "right_window_supported", lambda: True)
    x = np.random.default_rng(0).standard_normal((2, 40, 16)).astype("float32")
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        ours = layer_cls(num_heads=2, key_dim=8, implementation="cudnn", dtype=dtype, **kwargs)
        ours.build(x.shape, x.shape)
        ref = layer_cls(num_heads=2, key_dim=8, implementation="reference", **kwargs)
        ref.build(x.shape, x.shape)
        ref.set_weights(ours.get_weights())
        got = _output_and_grad(ours, x, causal)
        assert ours.last_implementation == "cudnn"
        want = _output_and_grad(ref, x, causal)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@jax_only
def test_auto_runs_the_cudnn_path_and_falls_back_when_it_fails(via_xla, monkeypatch):
    """On the simulated GPU "auto" runs "cudnn"; a cuDNN that fails to
    launch (here: raising) falls back to Pallas with one warning."""
    x = np.random.default_rng(2).standard_normal((1, 32, 16)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=8, window=4, dtype="bfloat16")
    layer(x, x, use_causal_mask=True)
    assert layer.last_implementation == "cudnn"

    def broken(*args, **kwargs):
        raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED (planted)")

    monkeypatch.setattr(via_xla, "window_attention", broken)
    with pytest.warns(UserWarning, match="CUDNN_STATUS_NOT_SUPPORTED") as record:
        layer(x, x, use_causal_mask=True)
    assert len(record) == 1
    assert layer.last_implementation == "pallas"
