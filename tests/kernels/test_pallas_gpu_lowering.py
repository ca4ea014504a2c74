"""Every ``implementation="pallas"`` path lowers for a CUDA GPU through
Triton, checked on the CPU.

``pallas_attention.building_for("gpu")`` makes the kernels build as on a
GPU (compiled, Triton launch parameters); ``lower(lowering_platforms=
("cuda",))`` then runs Pallas' Triton lowering of each kernel, forward and
backward, without a GPU. What this cannot check (Triton's compilation to
PTX, speed, values) is the device check's (``scripts/device_check.sh``).
"""

import keras
import numpy as np
import pytest

from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import RoutingAttention
from keras_longattn.layers import SparseAttention

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the Pallas kernel is JAX only")

CASES = [
    (LocalAttention, {"window": 64}, True),
    (SparseAttention, {"pattern": "strided", "block_length": 32}, True),
    (SparseAttention, {"pattern": "fixed", "block_length": 32, "summary_width": 4,
                       "combination": "merged"}, False),
    (BigBirdAttention, {"block_size": 32, "window_blocks": 3, "global_blocks": 1,
                        "random_blocks": 1, "seed": 3}, False),
    (LongformerAttention, {"window": 32, "dilation": (1, 2), "max_global": 2}, False),
    (RoutingAttention, {"num_clusters": 4, "local_heads": 1, "causal_routing": "balanced"},
     True),
]


def _lowered_text(layer, x, mask, causal, extra):
    import jax
    import jax.numpy as jnp

    def loss(x):
        out = layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal, **extra)
        return jnp.sum(out.astype("float32"))

    fn = jax.jit(jax.value_and_grad(loss))
    return fn.trace(jnp.asarray(x)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("layer_cls, kwargs, causal", CASES,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_pallas_path_lowers_through_triton(layer_cls, kwargs, causal):
    from keras_longattn.kernels.jax import pallas_attention as pa

    n, F = 256, 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, n, F)).astype("float32")
    mask = np.ones((2, n), bool)
    mask[1, n - 40:] = False
    heads = 3 if layer_cls is RoutingAttention else 2
    layer = layer_cls(num_heads=heads, key_dim=16, implementation="pallas", **kwargs)
    layer(x[:, :64], x[:, :64])  # built eagerly (interpreted) before lowering
    extra = {}
    if layer_cls is LongformerAttention:
        global_mask = np.zeros((2, n), bool)
        global_mask[:, [3, 100]] = True
        extra["global_mask"] = global_mask
    with pa.building_for("gpu"):
        text = _lowered_text(layer, x, mask, causal, extra)
    # Forward (1) and backward (2) kernels per call, all through Triton.
    assert text.count("xla.gpu.triton") >= 3
    assert "mosaic" not in text.lower()


def test_gpu_lowering_refuses_an_unknown_platform():
    from keras_longattn.kernels.jax import pallas_attention as pa

    with pytest.raises(ValueError, match="platform"):
        with pa.building_for("metal"):
            pass


def test_gpu_tiles_hold_sixteen_rows():
    """Splits are lowered where a layout block is small, so that every tile
    of a compiled kernel has the 16 rows Triton's products need; a short
    sequence (kernel blocks of 16) lowers too."""
    from keras_longattn.kernels.jax import pallas_attention as pa

    for d in (16, 64, 128, 256):
        tiling = pa.default_tiling(d, "gpu")
        for block in (16, 32, 64, 128):
            t = tiling.fitted(block, block, pa.MIN_TILE)
            for split in (t.q_split, t.k_split, t.bwd_q_split, t.bwd_k_split):
                assert block % split == 0 and block // split >= pa.MIN_TILE
    assert pa.default_tiling(64, "cpu") == pa.Tiling()
    layer = LocalAttention(num_heads=2, key_dim=16, window=8, implementation="pallas")
    x = np.zeros((1, 40, 32), "float32")
    layer(x, x)
    with pa.building_for("gpu"):
        text = _lowered_text(layer, x, np.ones((1, 40), bool), True, {})
    assert text.count("xla.gpu.triton") >= 3
