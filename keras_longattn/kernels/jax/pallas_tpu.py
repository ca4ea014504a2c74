"""Block-sparse flash attention for TPUs: the layout table is prefetched.

The kernels of :mod:`keras_longattn.kernels.jax.pallas_attention` (forward,
``dq``, ``dk``/``dv``), written for Mosaic, the TPU lowering of Pallas, where
a program's block is what its VMEM holds. The layout table is a scalar
prefetch (in SMEM, flattened to one dimension); the grid is ``(B, H, n,
W)`` with ``n`` query blocks (key blocks for ``dk``/``dv``) and ``W = M -
1`` the entries of a layout row. The index maps of the K/V blocks (the
Q/dO/lse/delta blocks for ``dk``/``dv``) read the table, so each grid step
brings the one block its entry lists: VMEM holds blocks, never a whole
sequence, and the pipeline fetches the next listed block while the current
one is computed. The online-softmax state (``m``, ``l``, ``acc``) and the
gradient accumulators live in VMEM scratch: set at entry 0, written to the
output at the last entry (the last axis has "arbitrary" semantics; the
others are "parallel"). Entries at or beyond a row's count are skipped;
their table slots repeat the last listed block, so they issue no new copy.

The element predicate, positions, ``k_valid``, scale, base-2 exponentials,
log-sum-exp conventions, float32 accumulation and empty rows (zeros, a
log-sum-exp of ``MASKED_LOGIT``, zero gradients) are those of the other
kernels; the predicate is called on ``(bq, bk)`` position tiles.

TPU layout: q/k/v are transposed to ``(B, H, length, d)`` so that a block's
last two dimensions are ``(block, d)``. Per-query vectors (query positions,
log-sum-exp, ``delta``) are broadcast along 128 lanes, ``(..., T, 128)``,
and per-key vectors (key positions, ``k_valid``) along 8 sublanes per key
block, ``(..., S / bk, 8, bk)``, as in JAX's TPU flash attention: every
block is then a whole trailing tile, ``(bq, d)``, ``(bq, 128)`` or ``(8,
bk)``, for any block size that is a multiple of 16 (128 fills the lanes of
a ``(bq, bk)`` tile). The prefetched table, ``L * n * M`` int32, must fit
in SMEM (1 MiB on a TPU v5e core); a layout made in the graph has rows of
width ``next_power_of_2(nk + 1)``, so its table grows with ``nq * nk``.

Shape legend as in :mod:`~keras_longattn.kernels.jax.pallas_attention`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from keras_longattn.kernels.jax import pallas_attention as pa

#: Lanes of a TPU vector register (the minor dimension of a tile).
NUM_LANES = 128
#: Sublanes of a TPU vector register (the second-minor dimension).
NUM_SUBLANES = 8


def _widen(x, width):
    """``(r, 128)`` rows whose columns are all equal, as ``(r, width)``."""
    w = x.shape[1]
    if width == w:
        return x
    if width < w:
        return x[:, :width]
    if width % w == 0:
        return jnp.tile(x, (1, width // w))
    return jnp.tile(x, (1, -(-width // w)))[:, :width]


def _heads_major(x):
    """``(B, T, H, d) <-> (B, H, T, d)``."""
    return jnp.transpose(x, (0, 2, 1, 3))


def _column(x):
    """``(..., n) -> (..., n, 128)``: each entry along the lanes."""
    return jnp.broadcast_to(x[..., None], x.shape + (NUM_LANES,))


def _row(x, block):
    """``(..., n) -> (..., n // block, 8, block)``: each block of entries
    along the sublanes (a block's tile is then a whole trailing
    ``(8, block)``, which Mosaic takes for any block size)."""
    lead, n = x.shape[:-1], x.shape[-1]
    x = jnp.reshape(x, lead + (n // block, 1, block))
    return jnp.broadcast_to(x, lead + (n // block, NUM_SUBLANES, block))


def _walk(table, n):
    """How programs walk a layout table ``(L, n, M)`` (flattened): the
    start of row ``i`` of batch entry ``b``, the block listed at entry
    ``j`` (an index map's view), and the grid width ``max(M - 1, 1)``."""
    L, _, M = table.shape
    lb = pa._pick(L)

    def start(b, i):
        return (lb(b) * n + i) * M

    if M > 1:
        def entry(b, i, j, t):
            return t[start(b, i) + 1 + j]
    else:  # no row lists a block: one step that visits nothing
        def entry(b, i, j, t):
            return 0
    return start, entry, max(M - 1, 1)


def _block_spec(x, block, entry=None):
    """BlockSpec on the grid ``(B, H, n, W)`` of a ``(B or 1, H or 1, length,
    minor)`` array (blocks of ``block`` along the length) or of
    :func:`_row`'s ``(B or 1, H or 1, blocks, 8, block)``: the program's
    own block (``entry`` None) or the block its layout entry lists."""
    pb, ph = pa._pick(x.shape[0]), pa._pick(x.shape[1])
    if entry is None:
        def which(b, i, j, t):
            return i
    else:
        which = entry
    if x.ndim == 5:
        return pl.BlockSpec((None, None, None, NUM_SUBLANES, block),
                            lambda b, h, i, j, t: (pb(b), ph(h), which(b, i, j, t), 0, 0))
    return pl.BlockSpec((None, None, block, x.shape[3]),
                        lambda b, h, i, j, t: (pb(b), ph(h), which(b, i, j, t), 0))


def _compiler_params():
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _tile_mask(config, qpos_ref, kpos_ref, kvalid_ref, shape):
    """The element mask of a ``(bq, bk)`` tile from a ``(bq, NUM_LANES)``
    query-position tile and ``(8, bk)`` key-position and validity tiles."""
    bk = shape[1]
    ok = kvalid_ref[:1, :] != 0
    if config.predicate is None:
        return jnp.broadcast_to(ok, shape)
    q_pos = _widen(qpos_ref[...], bk)
    k_pos = jnp.broadcast_to(kpos_ref[:1, :], shape)
    allowed = jnp.asarray(config.predicate.allowed(q_pos, k_pos))
    return jnp.logical_and(allowed, ok)


def _probs(config, q, k, mask, lse_ref):
    """Recomputed probabilities of a tile from the saved log-sum-exp
    (``(bq, NUM_LANES)`` tile, natural log)."""
    s = pa._dot_t(q, k) * (config.scale * pa.LOG2E)
    lse2 = _widen(lse_ref[...] * pa.LOG2E, k.shape[0])
    return jnp.where(mask, jnp.exp2(s - lse2), 0.0)


# ------------------------------------------------------------- the kernels
def _forward_kernel(rows_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kvalid_ref,
                    o_ref, lse_ref, m_ref, l_ref, acc_ref, *, config, start):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    count = rows_ref[start(b, i)]
    dv = acc_ref.shape[1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j < count)
    def _visit():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        shape = (q.shape[0], k.shape[0])
        # Base-2 logits: exp2(s * log2 e) == exp(s).
        s = pa._dot_t(q, k) * (config.scale * pa.LOG2E)
        s = jnp.where(_tile_mask(config, qpos_ref, kpos_ref, kvalid_ref, shape), s, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row that has seen nothing yet keeps m = -inf: shift by 0.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_prev - shift)
        p = jnp.exp2(s - _widen(shift, shape[1]))
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = _widen(alpha, dv) * acc_ref[...] + pa._dot(p.astype(v.dtype), v)
        m_ref[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[...]
        seen = l > 0.0
        l_safe = jnp.where(seen, l, 1.0)
        o_ref[...] = (acc_ref[...] / _widen(l_safe, dv)).astype(o_ref.dtype)
        # Natural-log log-sum-exp: (m + log2 l) / log2 e.
        lse = (m_ref[...] + jnp.log2(l_safe)) * (1.0 / pa.LOG2E)
        lse_ref[...] = jnp.where(seen, lse, pa.MASKED_LOGIT)


def _dq_kernel(rows_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kvalid_ref, do_ref,
               lse_ref, delta_ref, dq_ref, dq_acc, *, config, start):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    count = rows_ref[start(b, i)]

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(j < count)
    def _visit():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        shape = (q.shape[0], k.shape[0])
        mask = _tile_mask(config, qpos_ref, kpos_ref, kvalid_ref, shape)
        p = _probs(config, q, k, mask, lse_ref)
        dp = pa._dot_t(do, v)
        ds = p * (dp - _widen(delta_ref[...], shape[1]))
        dq_acc[...] += pa._dot(ds.astype(k.dtype), k)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_acc[...] * config.scale).astype(dq_ref.dtype)


def _dkv_kernel(cols_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kvalid_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, config, start):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    count = cols_ref[start(b, i)]

    @pl.when(j == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(j < count)
    def _visit():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        shape = (q.shape[0], k.shape[0])
        mask = _tile_mask(config, qpos_ref, kpos_ref, kvalid_ref, shape)
        p = _probs(config, q, k, mask, lse_ref)
        dv_acc[...] += pa._dot(p.T.astype(do.dtype), do)
        dp = pa._dot_t(do, v)
        ds = p * (dp - _widen(delta_ref[...], shape[1]))
        dk_acc[...] += pa._dot(ds.T.astype(q.dtype), q)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * config.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


# ------------------------------------------------------------------ calls
def forward(config, q, k, v, q_pos, k_pos, k_valid, rows):
    """The forward kernel; arguments and results as
    ``pallas_attention._forward``: ``q (B, T, H, d)``, ``k (B, S, H, d)``,
    ``v (B, S, H, dv)`` with ``T``, ``S`` multiples of the blocks, int32
    ``(B or 1, H or 1, length)`` positions and validity, the layout rows
    ``(L, nq, M)``; returns ``out (B, T, H, dv)`` and the float32 ``lse
    (B, H, T)``."""
    B, T, H, d = q.shape
    dv = v.shape[3]
    bq, bk = config.block_q, config.block_k
    nq = T // bq
    start, entry, width = _walk(rows, nq)
    q, k, v = (_heads_major(x) for x in (q, k, v))
    q_cols = _column(q_pos)
    k_rows, valid_rows = _row(k_pos, bk), _row(k_valid, bk)
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, config=config, start=start),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, H, nq, width),
            in_specs=[
                _block_spec(q, bq),
                _block_spec(k, bk, entry),
                _block_spec(v, bk, entry),
                _block_spec(q_cols, bq),
                _block_spec(k_rows, bk, entry),
                _block_spec(valid_rows, bk, entry),
            ],
            out_specs=[
                pl.BlockSpec((None, None, bq, dv), lambda b, h, i, j, t: (b, h, i, 0)),
                pl.BlockSpec((None, None, bq, NUM_LANES), lambda b, h, i, j, t: (b, h, i, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                pltpu.VMEM((bq, dv), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, H, T, dv), q.dtype),
            jax.ShapeDtypeStruct((B, H, T, NUM_LANES), jnp.float32),
        ],
        interpret=config.interpret,
        compiler_params=_compiler_params(),
        name="block_sparse_attention_forward_tpu",
    )(jnp.reshape(rows, (-1,)), q, k, v, q_cols, k_rows, valid_rows)
    return _heads_major(out), lse[..., 0]


def backward(config, q, k, v, q_pos, k_pos, k_valid, rows, cols, out, lse, dout, dlse):
    """The ``dq`` and ``dk``/``dv`` kernels; arguments and results as
    ``pallas_attention._backward`` (``cols``: the transposed layout
    ``(L, nk, M')``, ``dlse`` the cotangent of ``lse (B, H, T)``)."""
    B, T, H, d = q.shape
    S, dv = k.shape[1], v.shape[3]
    bq, bk = config.block_q, config.block_k
    nq, nk = T // bq, S // bk
    # delta = rowsum(dO * O) - dlse: (B, H, T), float32.
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse
    q, k, v, dout = (_heads_major(x) for x in (q, k, v, dout))
    q_cols = _column(q_pos)
    lse_cols, delta_cols = _column(lse), _column(delta)
    k_rows, valid_rows = _row(k_pos, bk), _row(k_valid, bk)
    args = (q, k, v, q_cols, k_rows, valid_rows, dout, lse_cols, delta_cols)

    start, entry, width = _walk(rows, nq)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, config=config, start=start),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, H, nq, width),
            in_specs=[
                _block_spec(q, bq),
                _block_spec(k, bk, entry),
                _block_spec(v, bk, entry),
                _block_spec(q_cols, bq),
                _block_spec(k_rows, bk, entry),
                _block_spec(valid_rows, bk, entry),
                _block_spec(dout, bq),
                _block_spec(lse_cols, bq),
                _block_spec(delta_cols, bq),
            ],
            out_specs=pl.BlockSpec((None, None, bq, d), lambda b, h, i, j, t: (b, h, i, 0)),
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, H, T, d), q.dtype),
        interpret=config.interpret,
        compiler_params=_compiler_params(),
        name="block_sparse_attention_dq_tpu",
    )(jnp.reshape(rows, (-1,)), *args)

    start, entry, width = _walk(cols, nk)
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, config=config, start=start),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, H, nk, width),
            in_specs=[
                _block_spec(q, bq, entry),
                _block_spec(k, bk),
                _block_spec(v, bk),
                _block_spec(q_cols, bq, entry),
                _block_spec(k_rows, bk),
                _block_spec(valid_rows, bk),
                _block_spec(dout, bq, entry),
                _block_spec(lse_cols, bq, entry),
                _block_spec(delta_cols, bq, entry),
            ],
            out_specs=[
                pl.BlockSpec((None, None, bk, d), lambda b, h, i, j, t: (b, h, i, 0)),
                pl.BlockSpec((None, None, bk, dv), lambda b, h, i, j, t: (b, h, i, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((bk, d), jnp.float32),
                pltpu.VMEM((bk, dv), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, H, S, d), k.dtype),
            jax.ShapeDtypeStruct((B, H, S, dv), v.dtype),
        ],
        interpret=config.interpret,
        compiler_params=_compiler_params(),
        name="block_sparse_attention_dkv_tpu",
    )(jnp.reshape(cols, (-1,)), *args)
    return _heads_major(dq), _heads_major(dk), _heads_major(dv_)
