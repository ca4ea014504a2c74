"""Block-sparse flash attention written with Pallas (JAX only).

One kernel serves every block-sparse layer: a query block visits only the
key blocks its *layout* lists, and inside each visited block an
element-level predicate on token positions decides which pairs count. The
layout is coarse (blocks that may hold an allowed pair); the predicate is
exact. Nothing of size ``(T, S)`` or ``(T, w)`` is ever written to memory:
the mask of a tile is computed in registers from two position vectors.

Forward: for each query block, an online softmax over its key blocks
(FlashAttention), float32 accumulation, returning the output and the
log-sum-exp of each row (so that parts computed over disjoint key sets
merge exactly, :func:`keras_longattn.ops.merge_attention_parts`).
Backward (``jax.custom_vjp``): the flash backward from the saved
log-sum-exp, in two passes: ``dq`` over each query block's key blocks, and
``dk``/``dv`` over each key block's query blocks (the transposed layout,
computed outside the kernels). The cotangent of the returned log-sum-exp is
honoured (``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O) -
dlse``), so a merge by log-sum-exp differentiates correctly.

Positions: every token carries an int32 position (``q_pos``, ``k_pos``).
They default to ``0 .. T-1`` and ``0 .. S-1``; a layer that reorders tokens
(columns of a strided pattern, summary keys, routing clusters) passes the
original positions, so the predicate keeps meaning what it means in the
dense reference. ``k_valid`` marks real keys (padding is False). Rows that
see no key return zeros, a log-sum-exp of ``MASKED_LOGIT`` and zero,
finite gradients.

On a CPU the kernels run in Pallas interpret mode (``interpret=True``), which
is how the tests check them; on GPU/TPU they are compiled. Block sizes
should be multiples of 16 (128 is the default of the layers) for compiled
use; head sizes are zero-padded to a power of two of at least 16.

Shape legend: B batch, T query length, S key length, H heads, d query/key
head size, dv value head size, bq / bk query / key block size, nq / nk
number of query / key blocks, M width of a layout row.
"""

import contextlib
import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from keras_longattn.kernels.constants import MASKED_LOGIT  # noqa: F401 (re-exported)


# ----------------------------------------------------------------- layouts
class Layout(typing.NamedTuple):
    """A block layout as the kernels take it: ``rows`` int32 ``(L, nq, M)``
    (per query block ``[count, key blocks...]``), ``cols`` the transpose,
    and the two block sizes (built by :mod:`keras_longattn.ops.layouts`,
    whose ``BlockLayout`` has the same four fields and documents them)."""

    rows: object
    cols: object
    block_q: int
    block_k: int


# ------------------------------------------------------------- the kernel
#: Fewest rows of a tile in a compiled kernel (Triton's matrix products).
MIN_TILE = 16
#: log2(e): logits are scaled by it so that the kernels use ``exp2``.
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernels cut a layout's blocks into the tiles one program
    holds, and Triton's launch parameters on a GPU.

    A program of the forward and ``dq`` kernels holds ``block_q //
    q_split`` query rows and walks its layout row's key blocks in chunks of
    ``block_k // k_split`` keys; a program of the ``dk``/``dv`` kernel
    holds ``block_k // bwd_k_split`` keys and walks its column's query
    blocks in chunks of ``block_q // bwd_q_split`` rows. A split tile uses
    its block's layout row, so the visited pairs stay a superset of the
    allowed ones (the predicate is exact). Splits of 1 run whole blocks.

    ``skip_full_tiles``: a tile whose keys are all real and whose pairs
    the predicate allows without exception (known from the tile's bounds:
    ``AttentionPattern.tile_all_allowed``, for tokens at their own indices)
    skips the element mask; the others evaluate it on every pair.
    """

    q_split: int = 1
    k_split: int = 1
    bwd_q_split: int = 1
    bwd_k_split: int = 1
    num_warps: int = 4
    num_stages: int = 2
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    skip_full_tiles: bool = True

    def __post_init__(self):
        for name in ("q_split", "k_split", "bwd_q_split", "bwd_k_split", "num_warps",
                     "num_stages", "bwd_num_warps", "bwd_num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
        if not isinstance(self.skip_full_tiles, bool):
            raise ValueError("`skip_full_tiles` must be True or False. "
                             f"Received: skip_full_tiles={self.skip_full_tiles!r}")

    def fitted(self, block_q, block_k, min_tile):
        """This tiling with each split lowered until its tiles hold at least
        ``min_tile`` rows (Triton's matrix products need 16), where the
        blocks allow."""

        def fit(split, block):
            while split > 1 and block // split < min_tile:
                split //= 2
            return split

        return dataclasses.replace(
            self, q_split=fit(self.q_split, block_q), k_split=fit(self.k_split, block_k),
            bwd_q_split=fit(self.bwd_q_split, block_q),
            bwd_k_split=fit(self.bwd_k_split, block_k))


@dataclasses.dataclass(frozen=True)
class _Config:
    predicate: object
    scale: float
    block_q: int
    block_k: int
    interpret: bool
    tiling: Tiling = Tiling()
    #: Queries and keys sit at their own indices (no positions passed), so
    #: a tile's position bounds follow from its place in the grid.
    contiguous: bool = False

    def compiler_params(self, backward=False):
        """Triton's launch parameters where the kernel is compiled for a GPU
        (they also select the Triton lowering over Mosaic GPU, which would
        copy each program's whole-sequence blocks into shared memory)."""
        if self.interpret or target_platform() == "tpu":
            return None
        from jax.experimental.pallas import triton as pl_triton

        t = self.tiling
        if backward:
            return pl_triton.CompilerParams(num_warps=t.bwd_num_warps,
                                            num_stages=t.bwd_num_stages)
        return pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def _tile(block, split, name):
    size, rest = divmod(int(block), int(split))
    if rest or size < 1:
        raise ValueError(
            f"`{name}` must divide the layout's block of {block}. Received: {name}={split}")
    return size


def _allowed(config, q_pos, k_pos, k_valid):
    """The element mask of a tile: ``(bq, 1)`` and ``(1, bk)`` positions."""
    ok = k_valid != 0
    if config.predicate is None:
        return jnp.broadcast_to(ok, (q_pos.shape[0], k_pos.shape[1]))
    allowed = jnp.asarray(config.predicate.allowed(q_pos, k_pos))
    return jnp.logical_and(allowed, ok)


def _tile_full(config, q_first, tq, k_first, tk, k_valid):
    """Whether the tile of ``tq`` queries from index ``q_first`` and ``tk``
    keys from ``k_first`` needs no element mask (a traced boolean), or None
    when it must always be masked."""
    if not config.tiling.skip_full_tiles:
        return None
    if config.predicate is None:
        pairs = True
    elif not config.contiguous:
        return None
    else:
        pairs = config.predicate.tile_all_allowed(
            q_first, q_first + (tq - 1), k_first, k_first + (tk - 1))
        if pairs is None or pairs is False:
            return None
    real = jnp.min(k_valid) > 0
    return real if pairs is True else jnp.logical_and(pairs, real)


def _masked_logits(config, s, full, q_pos, k_pos, k_valid):
    """``s`` with the disallowed pairs at ``-inf`` (unchanged where
    ``full``)."""

    def masked(s):
        return jnp.where(_allowed(config, q_pos, k_pos, k_valid), s, -jnp.inf)

    if full is None:
        return masked(s)
    return lax.cond(full, lambda s: s, masked, s)


def _dot_t(a, b):
    """``a @ b.T`` in float32: ``(m, k) x (n, k) -> (m, n)``."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _t_dot(a, b):
    """``a.T @ b`` in float32: ``(k, m) x (k, n) -> (m, n)``."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _chunk_start(table_ref, t, split, block, chunk):
    """Start of chunk ``t`` of a layout row walked in ``split`` chunks of
    ``chunk`` tokens per visited block of ``block``."""
    if split == 1:
        return pl.multiple_of(table_ref[t + 1] * block, block)
    # lax.div / lax.rem: ``t`` is never negative, and Triton lowers them
    # directly (jnp's floor division and modulo add sign corrections).
    split = jnp.int32(split)
    entry = table_ref[lax.div(t, split) + 1]
    return pl.multiple_of(entry * block + lax.rem(t, split) * chunk, chunk)


def _forward_kernel(rows_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kvalid_ref,
                    o_ref, lse_ref, *, config):
    split = config.tiling.k_split
    tk = config.block_k // split
    tq = q_ref.shape[0]
    dv = v_ref.shape[-1]
    q = q_ref[...]
    q_pos = qpos_ref[...][:, None]
    count = rows_ref[0] * split
    # Base-2 logits: exp2(s * log2 e) == exp(s).
    scale = config.scale * LOG2E
    q_first = pl.program_id(2) * tq

    def body(t, carry):
        m, l, acc = carry
        start = _chunk_start(rows_ref, t, split, config.block_k, tk)
        sl = pl.ds(start, tk)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        k_valid = kvalid_ref[sl]
        full = _tile_full(config, q_first, tq, start, tk, k_valid)
        s = _dot_t(q, k) * scale
        s = _masked_logits(config, s, full, q_pos, kpos_ref[sl][None, :], k_valid[None, :])
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row that has seen nothing yet keeps m = -inf: shift by 0.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - shift)
        p = jnp.exp2(s - shift[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return m_new, l, acc

    init = (
        jnp.full((tq,), -jnp.inf, jnp.float32),
        jnp.zeros((tq,), jnp.float32),
        jnp.zeros((tq, dv), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, count, body, init)
    seen = l > 0.0
    out = acc / jnp.where(seen, l, 1.0)[:, None]
    o_ref[...] = out.astype(o_ref.dtype)
    # Natural-log log-sum-exp: (m + log2 l) / log2 e.
    lse = (m + jnp.log2(jnp.where(seen, l, 1.0))) * (1.0 / LOG2E)
    lse_ref[...] = jnp.where(seen, lse, MASKED_LOGIT)


def _probs(config, q, k, q_pos, k_pos, k_valid, lse2, full=None):
    """Recomputed probabilities of a tile from the saved log-sum-exp (in
    base 2: ``lse2 = lse * log2 e``); the mask is skipped where ``full``."""
    s = _dot_t(q, k) * (config.scale * LOG2E)

    def masked(s):
        allowed = _allowed(config, q_pos, k_pos, k_valid)
        return jnp.where(allowed, jnp.exp2(s - lse2[:, None]), 0.0)

    if full is None:
        return masked(s)
    return lax.cond(full, lambda s: jnp.exp2(s - lse2[:, None]), masked, s)


def _dq_kernel(rows_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kvalid_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, config):
    split = config.tiling.k_split
    tk = config.block_k // split
    q = q_ref[...]
    do = do_ref[...]
    q_pos = qpos_ref[...][:, None]
    lse2 = lse_ref[...] * LOG2E
    delta = delta_ref[...]
    count = rows_ref[0] * split
    tq = q.shape[0]
    q_first = pl.program_id(2) * tq

    def body(t, dq):
        start = _chunk_start(rows_ref, t, split, config.block_k, tk)
        sl = pl.ds(start, tk)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        k_valid = kvalid_ref[sl]
        full = _tile_full(config, q_first, tq, start, tk, k_valid)
        p = _probs(config, q, k, q_pos, kpos_ref[sl][None, :], k_valid[None, :], lse2, full)
        dp = _dot_t(do, v)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, count, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * config.scale).astype(dq_ref.dtype)


def _dkv_kernel(cols_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kvalid_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, config):
    split = config.tiling.bwd_q_split
    tq = config.block_q // split
    k = k_ref[...]
    v = v_ref[...]
    k_pos = kpos_ref[...][None, :]
    k_valid = kvalid_ref[...][None, :]
    count = cols_ref[0] * split
    tk = k.shape[0]
    k_first = pl.program_id(2) * tk
    # Whether every key of this program is real (the same for every chunk).
    k_real = kvalid_ref[...]

    def body(t, carry):
        dk, dv = carry
        start = _chunk_start(cols_ref, t, split, config.block_q, tq)
        sl = pl.ds(start, tq)
        q = q_ref[sl, :]
        do = do_ref[sl, :]
        lse2 = lse_ref[sl] * LOG2E
        full = _tile_full(config, start, tq, k_first, tk, k_real)
        p = _probs(config, q, k, qpos_ref[sl][:, None], k_pos, k_valid, lse2, full)
        dv = dv + _t_dot(p.astype(do.dtype), do)
        dp = _dot_t(do, v)
        ds = p * (dp - delta_ref[sl][:, None])
        dk = dk + _t_dot(ds.astype(q.dtype), q)
        return dk, dv

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, count, body, init)
    dk_ref[...] = (dk * config.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _pick(size):
    """Index of a broadcast axis: 0 when the array has one entry there."""
    return (lambda i: i) if size > 1 else (lambda i: 0)


def _specs(q, k, v, q_pos, k_pos, k_valid, table, tile, split, by_query):
    """BlockSpecs of the inputs shared by the three kernels (table, q, k, v,
    q_pos, k_pos, k_valid), on the grid ``(B, H, n)``: ``n`` query tiles
    of ``tile`` rows, or key tiles when not ``by_query``; tile ``i`` reads
    row ``i // split`` of the layout ``table``."""
    T, d = q.shape[1], q.shape[3]
    S, dv = k.shape[1], v.shape[3]
    M = table.shape[2]
    lb = _pick(table.shape[0])
    if split == 1:
        table_spec = pl.BlockSpec((None, None, M), lambda b, h, i: (lb(b), i, 0))
    else:
        table_spec = pl.BlockSpec((None, None, M), lambda b, h, i: (lb(b), i // split, 0))

    def token_spec(x, length, blocked):
        pb, ph = _pick(x.shape[0]), _pick(x.shape[1])
        if blocked:
            return pl.BlockSpec((None, None, length), lambda b, h, i: (pb(b), ph(h), i))
        return pl.BlockSpec((None, None, length), lambda b, h, i: (pb(b), ph(h), 0))

    if by_query:
        q_spec = pl.BlockSpec((None, tile, None, d), lambda b, h, i: (b, i, h, 0))
        k_spec = pl.BlockSpec((None, S, None, d), lambda b, h, i: (b, 0, h, 0))
        v_spec = pl.BlockSpec((None, S, None, dv), lambda b, h, i: (b, 0, h, 0))
        pos_specs = (token_spec(q_pos, tile, True), token_spec(k_pos, S, False),
                     token_spec(k_valid, S, False))
    else:
        q_spec = pl.BlockSpec((None, T, None, d), lambda b, h, i: (b, 0, h, 0))
        k_spec = pl.BlockSpec((None, tile, None, d), lambda b, h, i: (b, i, h, 0))
        v_spec = pl.BlockSpec((None, tile, None, dv), lambda b, h, i: (b, i, h, 0))
        pos_specs = (token_spec(q_pos, T, False), token_spec(k_pos, tile, True),
                     token_spec(k_valid, tile, True))
    return [table_spec, q_spec, k_spec, v_spec, *pos_specs]


def _forward(config, q, k, v, q_pos, k_pos, k_valid, rows):
    B, T, H, _ = q.shape
    dv = v.shape[3]
    split = config.tiling.q_split
    tq = _tile(config.block_q, split, "q_split")
    _tile(config.block_k, config.tiling.k_split, "k_split")
    specs = _specs(q, k, v, q_pos, k_pos, k_valid, rows, tq, split, True)
    row_spec = pl.BlockSpec((None, None, tq), lambda b, h, i: (b, h, i))
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, config=config),
        grid=(B, H, T // tq),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, tq, None, dv), lambda b, h, i: (b, i, h, 0)),
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, dv), q.dtype),
            jax.ShapeDtypeStruct((B, H, T), jnp.float32),
        ],
        interpret=config.interpret,
        compiler_params=config.compiler_params(),
        name="block_sparse_attention_forward",
    )(rows, q, k, v, q_pos, k_pos, k_valid)
    return out, lse


def _backward(config, q, k, v, q_pos, k_pos, k_valid, rows, cols, out, lse, dout, dlse):
    B, T, H, d = q.shape
    S, dv = k.shape[1], v.shape[3]
    t = config.tiling
    tq = _tile(config.block_q, t.q_split, "q_split")
    tk = _tile(config.block_k, t.bwd_k_split, "bwd_k_split")
    _tile(config.block_q, t.bwd_q_split, "bwd_q_split")
    # delta = rowsum(dO * O) - dlse: (B, H, T), float32.
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse
    row_spec = pl.BlockSpec((None, None, tq), lambda b, h, i: (b, h, i))
    specs = _specs(q, k, v, q_pos, k_pos, k_valid, rows, tq, t.q_split, True)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, config=config),
        grid=(B, H, T // tq),
        in_specs=specs + [
            pl.BlockSpec((None, tq, None, dv), lambda b, h, i: (b, i, h, 0)),
            row_spec,
            row_spec,
        ],
        out_specs=pl.BlockSpec((None, tq, None, d), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=config.interpret,
        compiler_params=config.compiler_params(backward=True),
        name="block_sparse_attention_dq",
    )(rows, q, k, v, q_pos, k_pos, k_valid, dout, lse, delta)
    specs = _specs(q, k, v, q_pos, k_pos, k_valid, cols, tk, t.bwd_k_split, False)
    whole_rows = pl.BlockSpec((None, None, T), lambda b, h, i: (b, h, 0))
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, config=config),
        grid=(B, H, S // tk),
        in_specs=specs + [
            pl.BlockSpec((None, T, None, dv), lambda b, h, i: (b, 0, h, 0)),
            whole_rows,
            whole_rows,
        ],
        out_specs=[
            pl.BlockSpec((None, tk, None, d), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, tk, None, dv), lambda b, h, i: (b, i, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        interpret=config.interpret,
        compiler_params=config.compiler_params(backward=True),
        name="block_sparse_attention_dkv",
    )(cols, q, k, v, q_pos, k_pos, k_valid, dout, lse, delta)
    return dq, dk, dv_


@functools.lru_cache(maxsize=None)
def _attention_fn(config, variant="slice"):
    """The differentiable kernel call for one static configuration and
    kernel variant (``"slice"``: these kernels; ``"prefetch"``: those of
    :mod:`keras_longattn.kernels.jax.pallas_tpu`)."""
    if variant == "prefetch":
        from keras_longattn.kernels.jax import pallas_tpu

        forward, backward = pallas_tpu.forward, pallas_tpu.backward
    else:
        forward, backward = _forward, _backward

    @jax.custom_vjp
    def attend(q, k, v, q_pos, k_pos, k_valid, rows, cols):
        return forward(config, q, k, v, q_pos, k_pos, k_valid, rows)

    def fwd(q, k, v, q_pos, k_pos, k_valid, rows, cols):
        out, lse = forward(config, q, k, v, q_pos, k_pos, k_valid, rows)
        return (out, lse), (q, k, v, q_pos, k_pos, k_valid, rows, cols, out, lse)

    def bwd(res, cotangents):
        q, k, v, q_pos, k_pos, k_valid, rows, cols, out, lse = res
        dout, dlse = cotangents
        dq, dk, dv = backward(config, q, k, v, q_pos, k_pos, k_valid, rows, cols,
                              out, lse, dout, dlse)
        return dq, dk, dv, None, None, None, None, None

    attend.defvjp(fwd, bwd)
    # One compiled program per shapes (eager interpret mode would rebuild
    # the interpreter's loops at every call).
    return jax.jit(attend)


#: Tilings per device platform and head-size class (``"small"``: head size
#: of at most 64 after padding; ``"large"``: above). Entries not listed
#: use ``Tiling()``: whole blocks, 4 warps, 2 stages.
TILINGS = {
    ("gpu", "small"): Tiling(num_warps=4, num_stages=2, bwd_q_split=2, bwd_k_split=2,
                             bwd_num_warps=4, bwd_num_stages=2),
    # Read off the device check's sweep on an H200 (B=1, H=16, d=128, bf16,
    # n=65536, Local w=512): forward fastest with 8 warps, whole blocks,
    # 2 stages; backward with half-block tiles and 4 warps.
    ("gpu", "large"): Tiling(num_warps=8, num_stages=2, bwd_q_split=2, bwd_k_split=2,
                             bwd_num_warps=4, bwd_num_stages=2),
}


def default_tiling(head_dim, platform=None):
    """The :class:`Tiling` of :data:`TILINGS` for ``platform`` (default:
    JAX's default backend) and a head size of ``head_dim``."""
    platform = platform or target_platform()
    size = "small" if _head_width(head_dim) <= 64 else "large"
    return TILINGS.get((platform, size), Tiling())


_TARGET = []


def target_platform():
    """The platform the kernels are built for: JAX's default backend, or
    the one :func:`building_for` names."""
    return _TARGET[-1] if _TARGET else jax.default_backend()


@contextlib.contextmanager
def building_for(platform):
    """Within the block, kernels are built for ``platform`` (``"gpu"``,
    ``"tpu"`` or ``"cpu"``) whatever the default backend: lowering for
    another platform (``jax.jit(f).trace(...).lower(lowering_platforms=
    ("cuda",))``) checks on a CPU that Triton accepts a kernel."""
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(
            "`platform` must be 'cpu', 'gpu' or 'tpu'. "
            f"Received: platform={platform!r}")
    _TARGET.append(platform)
    try:
        yield
    finally:
        _TARGET.pop()


def default_interpret():
    """Interpret mode where Pallas cannot compile: on the CPU."""
    return target_platform() == "cpu"


def _positions(pos, batch, heads, length, padded):
    """int32 ``(B or 1, H or 1, padded)`` positions from None, ``(n,)``,
    ``(B, n)`` or ``(B, H, n)``."""
    if pos is None:
        # Padding rows continue the indices, so that a tile's positions
        # are its indices (``_Config.contiguous``).
        pos = jnp.arange(padded, dtype=jnp.int32)
        length = padded
    pos = jnp.asarray(pos).astype(jnp.int32)
    if pos.ndim == 1:
        pos = pos[None, None]
    elif pos.ndim == 2:
        pos = pos[:, None]
    if pos.shape[-1] != length:
        raise ValueError(
            f"positions must have {length} entries on their last axis. "
            f"Received: shape={tuple(pos.shape)}"
        )
    if padded > length:
        pos = jnp.pad(pos, [(0, 0), (0, 0), (0, padded - length)])
    return pos


def _pad_to(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _head_width(d):
    return max(16, int(pl.next_power_of_2(int(d))))


def block_sparse_attention(query, key, value, layout, *, predicate=None, q_pos=None,
                           k_pos=None, k_valid=None, scale=None, interpret=None,
                           tiling=None, variant=None):
    """Block-sparse flash attention, differentiable (``jax.custom_vjp``).

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        layout: the block layout, with ``rows``, ``cols``, ``block_q`` and
            ``block_k`` (a :class:`Layout`, or any object with those
            fields, e.g. :class:`keras_longattn.ops.layouts.BlockLayout`):
            ``ceil(T / block_q)`` query blocks and ``ceil(S / block_k)``
            key blocks.
        predicate: None (every key of a visited block), or an object with
            ``allowed(q_pos, k_pos)`` (an
            :class:`keras_longattn.ops.AttentionPattern`), evaluated inside
            the kernel on each tile, on ``(bq, 1)`` and ``(1, bk)`` int32
            positions. Hashable (it is part of the compiled kernel).
        q_pos: int32 positions of the queries, ``(T,)``, ``(B, T)`` or
            ``(B, H, T)``. Defaults to ``0 .. T-1``.
        k_pos: int32 positions of the keys, ``(S,)``, ``(B, S)`` or
            ``(B, H, S)``. Defaults to ``0 .. S-1``.
        k_valid: boolean ``(S,)``, ``(B, S)`` or ``(B, H, S)``, False for
            padded keys. Defaults to all True.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        interpret: run the Pallas interpreter. Defaults to True on the CPU.
        tiling: a :class:`Tiling` (how programs cut the layout's blocks, and
            Triton's launch parameters). Defaults to
            :func:`default_tiling` of the device and head size. The
            ``"prefetch"`` variant runs whole layout blocks and ignores it.
        variant: ``"slice"``: each program holds the whole-sequence keys
            and values (queries, for ``dk``/``dv``) and slices the blocks
            its layout row lists (a GPU block is a pointer into memory);
            ``"prefetch"``: the TPU kernels of
            :mod:`keras_longattn.kernels.jax.pallas_tpu`, where the layout
            is scalar-prefetched and each grid step brings one listed block
            into VMEM. Defaults to ``"prefetch"`` where the kernels are
            built for a TPU (:func:`target_platform`), else ``"slice"``.

    Returns:
        ``(out, lse)``: ``(B, T, H, dv)`` in the query's dtype and the
        float32 log-sum-exp ``(B, T, H)`` of each row's visible logits
        (``MASKED_LOGIT`` and a zero output where a row sees no key).
    """
    if variant is None:
        variant = "prefetch" if target_platform() == "tpu" else "slice"
    elif variant not in ("slice", "prefetch"):
        raise ValueError(
            f"`variant` must be None, 'slice' or 'prefetch'. Received: variant={variant!r}")
    B, T, H, d = query.shape
    S, dv = key.shape[1], value.shape[3]
    bq, bk = int(layout.block_q), int(layout.block_k)
    nq, nk = int(layout.rows.shape[1]), int(layout.cols.shape[1])
    if nq != -(-T // bq) or nk != -(-S // bk):
        raise ValueError(
            f"`layout` has {nq} query blocks of {bq} and {nk} key blocks of {bk}, "
            f"which does not cover T={T} and S={S}. Received: layout with "
            f"rows.shape={tuple(layout.rows.shape)}, cols.shape={tuple(layout.cols.shape)}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if interpret is None:
        interpret = default_interpret()
    dtype = query.dtype
    if interpret and dtype in (jnp.float16, jnp.bfloat16):
        # The CPU has no low-precision dot with a float32 result.
        query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
    Tp, Sp = nq * bq, nk * bk
    dp, dvp = _head_width(d), _head_width(dv)
    q = _pad_to(_pad_to(query, 1, Tp), 3, dp)
    k = _pad_to(_pad_to(key, 1, Sp), 3, dp)
    v = _pad_to(_pad_to(value, 1, Sp), 3, dvp)
    qp = _positions(q_pos, B, H, T, Tp)
    kp = _positions(k_pos, B, H, S, Sp)
    if k_valid is None:
        k_valid = jnp.ones((S,), bool)
    kv = _positions(jnp.asarray(k_valid).astype(jnp.int32), B, H, S, Sp)
    if tiling is None:
        tiling = default_tiling(max(d, dv))
    elif not isinstance(tiling, Tiling):
        raise ValueError(f"`tiling` must be a Tiling. Received: tiling={tiling!r}")
    if not interpret:
        tiling = tiling.fitted(bq, bk, MIN_TILE)
    config = _Config(predicate, float(scale), bq, bk, bool(interpret), tiling,
                     contiguous=q_pos is None and k_pos is None)
    rows = jnp.asarray(layout.rows, jnp.int32)
    cols = jnp.asarray(layout.cols, jnp.int32)
    out, lse = _attention_fn(config, variant)(q, k, v, qp, kp, kv, rows, cols)
    out = out[:, :T, :, :dv].astype(dtype)
    lse = jnp.transpose(lse[:, :, :T], (0, 2, 1))
    return out, lse
