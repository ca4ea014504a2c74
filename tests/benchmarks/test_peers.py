"""The benchmark's peer-comparison mode (keras_longattn.benchmarks.peers).

The peers (lucidrains ``local-attention`` and ``routing-transformer``) are
not dependencies: these tests pass without them. The adapter is tested with
a fake peer module doing dense attention (so the layer must equal
FullAttention on the same weights), the real peers only when importable.
"""

import importlib.machinery
import sys
import types

import keras
import numpy as np
import pytest

from keras_longattn.benchmarks import peers
from keras_longattn.benchmarks import run_benchmark
from keras_longattn.benchmarks.command import build_parser

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

BACKEND = keras.backend.backend()
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the peers run on torch only")


def test_peer_specs_and_names():
    specs = peers.peer_specs()
    assert [s["config"]["name"] for s in specs] == peers.peer_names()
    assert peers.peer_names() == ["peer-local-attention", "peer-routing-transformer"]
    one = peers.peer_specs("peer-routing-transformer,routing-transformer")
    assert len(one) == 1 and one[0]["config"]["peer"] == "routing-transformer"
    assert one[0]["config"]["num_clusters"] == "${max(1, round(sqrt(seq_len)))}"
    with pytest.raises(ValueError, match="unknown peer 'nope'.*Received: peers='nope'"):
        peers.peer_specs("nope")


def test_peers_are_not_registered_short_names():
    """``lra --layers all`` and the like never pick a peer up."""
    from keras_longattn.benchmarks import available_layers

    assert not any(name.startswith("peer") for name in available_layers())


def test_cli_flag():
    parser = build_parser()
    assert parser.parse_args(["--peers"]).peers == "all"
    assert parser.parse_args(["--peers", "local-attention"]).peers == "local-attention"
    assert parser.parse_args([]).peers is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--peers", "nope"])


def test_skip_reasons(monkeypatch):
    spec = peers.peer_specs("routing-transformer")[0]
    assert peers.skip_reason({"layer_spec": {"class_name": "FullAttention"},
                              "backend": "jax"}) is None
    reason = peers.skip_reason({"layer_spec": spec, "backend": "jax"})
    assert "torch backend only" in reason
    monkeypatch.setitem(
        peers.PEERS, "routing-transformer",
        peers.Peer("routing-transformer", "no_such_module_for_tests", "routing-transformer==1.6.*",
                   {}, ""))
    reason = peers.skip_reason({"layer_spec": spec, "backend": "torch"})
    assert "not importable" in reason and "pip install" in reason
    assert "routing-transformer==1.6.*" in reason


def test_missing_peer_is_reported_as_skipped_without_a_worker(monkeypatch, tmp_path):
    monkeypatch.setitem(
        peers.PEERS, "local-attention",
        peers.Peer("local-attention", "no_such_module_for_tests", "local-attention==1.11.*",
                   {"window": "${window}"}, ""))
    results = run_benchmark(layers=peers.peer_specs("local-attention"), lengths=[64],
                            backends=[BACKEND], modes=["fwd"], baseline=None,
                            num_heads=2, head_dim=8, output_dir=str(tmp_path),
                            progress=None)
    rows = list(results)
    assert [r["status"] for r in rows] == ["skipped"]
    assert rows[0]["layer"] == "peer-local-attention"
    assert "not importable" in rows[0]["message"] or "torch backend only" in rows[0]["message"]


def test_peer_layer_validates_arguments():
    from keras_longattn.benchmarks.peer_layer import PeerAttention

    with pytest.raises(ValueError, match="`peer` must be one of .*Received: peer='x'"):
        PeerAttention(2, 8, peer="x")
    with pytest.raises(ValueError, match="Received: window=0"):
        PeerAttention(2, 8, peer="local-attention", window=0)
    with pytest.raises(ValueError, match="Received: num_clusters=1.5"):
        PeerAttention(2, 8, peer="routing-transformer", num_clusters=1.5)


def _fake_local_attention_module():
    """A stand-in for ``local_attention``: dense softmax attention on
    ``(b, h, n, d)``, causal when asked."""
    import torch

    class LocalAttention(torch.nn.Module):
        def __init__(self, window_size, causal=False, autopad=False, **kwargs):
            super().__init__()
            self.causal = causal

        def forward(self, q, k, v):
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            if self.causal:
                n = q.shape[-2]
                future = torch.ones(n, n, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            return scores.softmax(-1) @ v

    module = types.ModuleType("local_attention")
    module.LocalAttention = LocalAttention
    module.__spec__ = importlib.machinery.ModuleSpec("local_attention", None)
    return module


@torch_only
@pytest.mark.parametrize("causal", [False, True])
def test_adapter_with_a_fake_peer_equals_full_attention(monkeypatch, causal):
    """Projections in, heads laid out as (b, h, n, d) for the peer, merged
    and projected out: with a peer doing dense attention, the layer is
    FullAttention on the same weights, values and input gradients."""
    from keras_longattn.benchmarks.peer_layer import PeerAttention
    from keras_longattn.layers import FullAttention
    from keras_longattn.testing.gradients import input_gradient

    monkeypatch.setitem(sys.modules, "local_attention", _fake_local_attention_module())
    x = np.random.default_rng(0).standard_normal((2, 12, 16)).astype("float32")
    layer = PeerAttention(3, 4, peer="local-attention")
    full = FullAttention(num_heads=3, key_dim=4)
    layer(x, x)
    full(x, x)
    # Dense kernels (dim, H*d) and biases (H*d,) from the EinsumDense ones
    # (dim, H, d) and (H, d); the output kernel (H, d, dim) as (H*d, dim).
    fw = full.get_weights()
    assert len(fw) == 8
    weights = [fw[0].reshape(16, -1), fw[1].reshape(-1), fw[2].reshape(16, -1),
               fw[3].reshape(-1), fw[4].reshape(16, -1), fw[5].reshape(-1),
               fw[6].reshape(-1, 16), fw[7]]
    layer.set_weights(weights)
    out = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=causal))
    want = keras.ops.convert_to_numpy(full(x, x, use_causal_mask=causal))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    got = input_gradient(lambda v: layer(v, v, use_causal_mask=causal), x)
    expected = input_gradient(lambda v: full(v, v, use_causal_mask=causal), x)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    heads = keras.ops.convert_to_tensor(x.reshape(2, 12, 4, 4)[:, :, :3])
    attended = layer.attend(heads, heads, heads, use_causal_mask=causal)
    assert tuple(attended.shape) == (2, 12, 3, 4)


@torch_only
@pytest.mark.parametrize("name", list(peers.PEERS))
@pytest.mark.parametrize("scope", ["layer", "attention"])
def test_real_peers_when_importable(name, scope):
    if peers.unavailable_reason(name, BACKEND):
        pytest.skip(peers.unavailable_reason(name, BACKEND))
    from keras_longattn.benchmarks import worker

    spec = peers.peer_specs(name)[0]
    result = worker.run_config({"backend": BACKEND, "layer": spec["config"]["name"],
                                "layer_spec": spec, "mode": "fwdbwd", "seq_len": 256,
                                "num_heads": 2, "head_dim": 8, "repeats": 1,
                                "scope": scope, "window": 32, "options": {}})
    assert result["status"] == "ok", result.get("traceback")
    assert result["layer_class"].endswith("PeerAttention")
