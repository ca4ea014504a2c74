"""Token routing (causal sorted-chunk attention) for PyTorch on the CPU.

The portable form (:func:`keras_longattn.ops.sorted_chunk_attention`) lays
every bucket out in chunks of ``w`` slots holding queries *and* keys, and
gives each chunk to the fused kernel as ``w`` query rows against the ``2 w``
slots of its own and the previous chunk. With as many queries as keys about
half of the rows are keys and half of the columns are queries: three
quarters of the scores are masked. And autograd's gradient of its row
gathers is a scatter-add over every gathered row, per slice of chunks.

Here the same attention is computed from a *plan*, integers worked out once
per call without gradient (:func:`make_plan`):

* items sorted once by bucket and position; each chunk's queries compacted
  to the front, and its context keys (those of the previous chunk when it
  belongs to the same bucket, then its own, in order) likewise. A query
  then sees exactly a *prefix* of its chunk's context, so one number per
  query (the prefix length) gives the mask (the self rule of shared
  query/key included);
* chunks grouped by their compacted sizes rounded up to a granule, each
  group one batch of PyTorch's flash attention kernel
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward,
  called directly) with an additive mask;
* every query token fills one row, every key token one "own" row and at
  most one "previous" row: results and query gradients go back to the
  tokens by ``index_copy``, key and value gradients by ``index_add_`` (an
  own and a previous row of a token add onto it).

A query that sees no key gets zeros, as in the portable form. The result
equals :func:`~keras_longattn.ops.sorted_chunk_attention` (causal) up to
float rounding; ``tests/layers/test_routing_torch.py`` checks values and
gradients against it and against a dense loop over the chunk timeline.

Shape legend: B batch, T query length, S key length, H heads, d head size,
dv value head size, w window, M chunks (``B * H * G``), m chunks of a group.
"""

import math

import torch
import torch.nn.functional as F


#: Sizes of a chunk's compacted queries and context keys are rounded up to
#: a multiple of this (at most the window): fewer, larger batches for the
#: fused kernel against fewer masked scores.
GRANULE = 32

#: Most scores per call of the fused kernel: bounds each call's additive
#: mask (32 MiB) and temporaries.
MAX_SCORES_PER_CALL = 1 << 23

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _round_up(n, granule, cap):
    return torch.clamp((n + granule - 1) // granule * granule, max=cap)


def _dump_rows(rows, size):
    """``rows`` with ``-1`` (padding entries) sent to row ``size``: one
    extra row of a ``(size + 1, D)`` buffer, dropped afterwards."""
    return torch.where(rows < 0, size, rows)


def _scatter_rows(size, parts, rows, add=False):
    """A ``(size, D)`` tensor holding row ``i`` of ``parts[g]`` at row
    ``rows[g][i]`` (rows of ``size``: padding, dropped), zeros elsewhere:
    ``index_copy`` where every real row is written once (queries), and
    ``index_add_`` with ``add`` (a key token's own and previous-chunk rows
    add onto it)."""
    out = parts[0].new_zeros((size + 1, parts[0].shape[1]))
    for part, index in zip(parts, rows):
        if add:
            out.index_add_(0, index, part)
        else:
            out.index_copy_(0, index, part)
    return out[:size]


class _Group:
    """Chunks whose compacted queries fit ``wq`` rows and context ``wk``
    keys: flat token rows ``q_rows`` ``(m * wq,)``, ``k_rows``
    ``(m * wk,)`` (padding entries read row 0; the mask hides them: padded
    query rows see no key, padded key columns are seen by no query) and the
    additive mask ``(m, 1, wq, wk)``."""

    def __init__(self, q_rows, k_rows, mask, m, wq, wk):
        self.q_rows, self.k_rows, self.mask = q_rows, k_rows, mask
        self.m, self.wq, self.wk = m, wq, wk

    def slices(self):
        per = max(1, MAX_SCORES_PER_CALL // (self.wq * self.wk))
        return [(i, min(i + per, self.m)) for i in range(0, self.m, per)]


class _Plan:
    """Everything :class:`_TokenRoutingAttention` needs besides the tensors:
    the groups and the sizes of the token tensors."""

    def __init__(self, groups, num_queries, num_keys):
        self.groups = groups
        self.num_queries = num_queries  # B * T * H query rows
        self.num_keys = num_keys  # B * S * H key rows


@torch.no_grad()
def make_plan(query_buckets, key_buckets, num_buckets, window, query_length,
              key_length, shared, dtype=torch.float32):
    """The plan of causal token routing for these buckets (see the module
    docstring). ``query_buckets`` ``(B, H, T)``, ``key_buckets``
    ``(B, H, S)`` (ignored when ``shared``), in ``[0, num_buckets]``
    (``num_buckets``: padding).

    Items (queries and keys; with ``shared`` each token is one item, both)
    are sorted by bucket, then position, a key before the query of its
    position; bucket ``c`` fills ``ceil(n_c / w)`` whole chunks of ``w``
    consecutive items, as in
    :func:`keras_longattn.ops.chunked.sorted_chunk_layout`. A chunk's
    context is the keys of the previous chunk (same bucket only), then its
    own keys, in order: a query sees exactly a *prefix* of it, the previous
    chunk's keys and its own chunk's keys before it. So each query carries
    one number, the length of that prefix, and the mask of a group is one
    comparison.
    """
    k = int(num_buckets)
    w = int(window)
    T, S = int(query_length), int(key_length)
    qb = query_buckets.to(torch.int64)
    B, H = qb.shape[0], qb.shape[1]
    R = B * H
    if shared:
        items = qb.reshape(R, T)
        keys = items * T + torch.arange(T)
        is_query = is_key = torch.ones(T, dtype=torch.bool)
        token = (torch.arange(B).view(B, 1, 1) * T + torch.arange(T)) * H
        q_token = k_token = (token + torch.arange(H).view(1, H, 1)).reshape(R, T)
    else:
        kb = key_buckets.to(torch.int64)
        P = max(T, S)
        items = torch.cat([qb, kb], dim=-1).reshape(R, T + S)
        positions = torch.cat([torch.arange(T), torch.arange(S)])
        is_query = torch.cat([torch.ones(T, dtype=torch.bool), torch.zeros(S, dtype=torch.bool)])
        is_key = ~is_query
        # Bucket first, then position; a key before the query of its position.
        keys = items * (2 * P) + 2 * positions + is_query.to(torch.int64)
        b_idx = torch.arange(B).view(B, 1, 1)
        h_idx = torch.arange(H).view(1, H, 1)
        length = torch.where(is_query, T, S)
        q_token = k_token = ((b_idx * length + positions) * H + h_idx).reshape(R, T + S)
    N = items.shape[1]
    order = torch.argsort(keys, dim=-1)  # (R, N)
    sb = torch.gather(items, 1, order)
    counts = torch.zeros((R, k + 1), dtype=torch.int64)
    counts.scatter_add_(1, items, torch.ones_like(items))
    start = torch.cumsum(counts, 1) - counts
    n_chunks = (counts[:, :k] + (w - 1)) // w
    base = torch.cumsum(n_chunks, 1) - n_chunks
    G = max(int(n_chunks.sum(1).max()), 1)
    M = R * G
    placed = sb < k
    safe = torch.clamp(sb, max=k - 1)
    j = torch.arange(N)
    rank = j - torch.gather(start, 1, safe)
    chunk_start = j - rank % w  # sorted index where the item's chunk begins
    chunk = torch.arange(R).view(R, 1) * G + torch.gather(base, 1, safe) + rank // w
    chunk = torch.where(placed, chunk, M)  # M: a dump chunk, dropped
    sq = is_query[order] & placed
    sk = is_key[order] & placed
    q_before = torch.cumsum(sq, 1) - sq.to(torch.int64)
    k_before = torch.cumsum(sk, 1) - sk.to(torch.int64)
    q_index = q_before - torch.gather(q_before, 1, chunk_start)  # within the chunk
    k_index = k_before - torch.gather(k_before, 1, chunk_start)  # keys before it
    tok = torch.gather(q_token, 1, order)

    flat_chunk = chunk.reshape(-1)
    nq = torch.zeros(M + 1, dtype=torch.int64).scatter_add_(0, flat_chunk, sq.reshape(-1).long())
    nk_own = torch.zeros(M + 1, dtype=torch.int64).scatter_add_(0, flat_chunk, sk.reshape(-1).long())
    bucket = torch.full((M + 1,), -1, dtype=torch.int64).scatter_(0, flat_chunk, safe.reshape(-1))
    nq, nk_own, bucket = nq[:M], nk_own[:M], bucket[:M]
    bucket = torch.where(nq + nk_own > 0, bucket, -1)
    prev_bucket = torch.cat([bucket.new_full((1,), -1), bucket[:-1]])
    same_prev = (prev_bucket == bucket) & (bucket >= 0) & (torch.arange(M) % G > 0)
    nk_prev = torch.where(same_prev, torch.cat([nk_own.new_zeros(1), nk_own[:-1]]), 0)
    nk = nk_prev + nk_own

    def scatter_rows(size, width, where, index, values, fill):
        flat = torch.full(((size + 1) * width,), fill, dtype=values.dtype)
        target = torch.where(where, chunk * width + index, (size + 1) * width - 1)
        flat.scatter_(0, target.reshape(-1), values.reshape(-1))
        return flat[: size * width].view(size, width)

    own_col = torch.gather(torch.cat([nk_prev, nk_prev.new_zeros(1)]), 0, flat_chunk).view(R, N)
    q_rows = scatter_rows(M, w, sq, q_index, tok, -1)
    prefix = own_col + k_index  # keys of the context the query sees
    if shared:
        prefix = torch.clamp(prefix, min=1)  # nothing else: itself
    prefix_rows = scatter_rows(M, w, sq, q_index, prefix, 0)
    k_rows_own = scatter_rows(M, 2 * w, sk, own_col + k_index, tok, -1)
    # As the previous chunk of the next chunk (when that one shares the bucket).
    nxt = torch.cat([same_prev, same_prev.new_zeros(1)])
    chunk_next = torch.where(placed, chunk + 1, M)
    as_prev = sk & torch.gather(nxt, 0, torch.clamp(chunk_next, max=M).reshape(-1)).view(R, N)
    flat = torch.full(((M + 1) * 2 * w,), -1, dtype=torch.int64)
    target = torch.where(as_prev, chunk_next * 2 * w + k_index, (M + 1) * 2 * w - 1)
    flat.scatter_(0, target.reshape(-1), tok.reshape(-1))
    k_rows_prev = flat[: M * 2 * w].view(M, 2 * w)
    k_rows = torch.where(k_rows_prev >= 0, k_rows_prev, k_rows_own)

    granule = min(GRANULE, w)
    kept = (nq > 0) & (nk > 0)  # a chunk whose queries see no key: zeros
    sizes = torch.where(
        kept, _round_up(nq, granule, w) * (2 * w + 1) + _round_up(nk, granule, 2 * w), -1
    )
    groups = []
    for size in torch.unique(sizes[kept]).tolist():
        wq, wk = divmod(int(size), 2 * w + 1)
        chunks = torch.nonzero(sizes == size)[:, 0]
        m = chunks.numel()
        gq_rows = q_rows.index_select(0, chunks)[:, :wq]
        gk_rows = k_rows.index_select(0, chunks)[:, :wk]
        seen = prefix_rows.index_select(0, chunks)[:, :wq]  # 0 for padding rows
        allowed = torch.arange(wk) < seen[:, :, None]
        mask = torch.zeros((m, 1, wq, wk), dtype=dtype)
        mask[:, 0].masked_fill_(~allowed, -math.inf)
        group = _Group(gq_rows.clamp(min=0).reshape(-1),
                       gk_rows.clamp(min=0).reshape(-1), mask, m, wq, wk)
        # Where each entry's result goes back: its query row, its key row
        # as an own key, or as a previous-chunk key (the dump row else).
        n_keys = B * (T if shared else S) * H
        group.q_back = _dump_rows(gq_rows.reshape(-1), B * T * H)
        group.k_back = _dump_rows(gk_rows.reshape(-1), n_keys)
        groups.append(group)
    return _Plan(groups, B * T * H, B * (T if shared else S) * H)


def _flash_slices(group, *tensors, **kwargs):
    """Runs ``_flash`` (``backward=False``) or ``_flash_backward`` over the
    slices of a group; returns the outputs concatenated."""
    backward = kwargs.pop("backward", False)
    results = []
    for i0, i1 in group.slices():
        args = [t[i0:i1] for t in tensors]
        mask = group.mask[i0:i1]
        if backward:
            results.append(_flash_backward(*args, 0.0, False, attn_mask=mask, **kwargs))
        else:
            results.append(_flash(*args, 0.0, False, attn_mask=mask, **kwargs))
    if len(results) == 1:
        return results[0]
    return tuple(torch.cat(parts) for parts in zip(*results))


class _TokenRoutingAttention(torch.autograd.Function):
    """Forward and backward of the planned chunks (see the module
    docstring). Inputs are 2-D token rows ``(B*n*H, D)`` of one dtype and
    one head size ``D``."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        saved = []
        outs = []
        for group in plan.groups:
            qg = q.index_select(0, group.q_rows).view(group.m, 1, group.wq, -1)
            kg = k.index_select(0, group.k_rows).view(group.m, 1, group.wk, -1)
            vg = v.index_select(0, group.k_rows).view(group.m, 1, group.wk, -1)
            out, lse = _flash_slices(group, qg, kg, vg, scale=scale)
            saved.append((qg, kg, vg, out, lse))
            outs.append(out.view(-1, q.shape[1]))
        ctx.plan, ctx.scale, ctx.groups_saved = plan, scale, saved
        ctx.dims = (q.shape[1], k.shape[1])
        if not outs:
            return q.new_zeros(q.shape)
        return _scatter_rows(plan.num_queries, outs, [g.q_back for g in plan.groups])

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        d_q, d_k = ctx.dims
        grad = grad.contiguous()
        dqs, dks, dvs = [], [], []
        for group, (qg, kg, vg, out, lse) in zip(plan.groups, ctx.groups_saved):
            dout = grad.index_select(0, group.q_rows).view(group.m, 1, group.wq, -1)
            dq, dk, dv = _flash_slices(group, dout, qg, kg, vg, out, lse,
                                       scale=ctx.scale, backward=True)
            dqs.append(dq.view(-1, d_q))
            dks.append(dk.view(-1, d_k))
            dvs.append(dv.view(-1, d_k))
        ctx.groups_saved = None
        if not dqs:
            zeros = grad.new_zeros
            return (zeros((plan.num_queries, d_q)), zeros((plan.num_keys, d_k)),
                    zeros((plan.num_keys, d_k)), None, None)
        groups = plan.groups
        dq = _scatter_rows(plan.num_queries, dqs, [g.q_back for g in groups])
        back = [g.k_back for g in groups]
        dk = _scatter_rows(plan.num_keys, dks, back, add=True)
        dv = _scatter_rows(plan.num_keys, dvs, back, add=True)
        return dq, dk, dv, None, None


@torch.compiler.disable
def token_routing_attention(query, key, value, query_buckets, key_buckets,
                            num_buckets, window, shared=False, scale=None):
    """Causal token routing, equal to
    ``keras_longattn.ops.sorted_chunk_attention(..., causal=True)``.

    Args:
        query: ``(B, T, H, d)`` torch tensor.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        query_buckets: int ``(B, H, T)`` in ``[0, num_buckets]``
            (``num_buckets``: padding, which gets a zero output).
        key_buckets: int ``(B, H, S)`` (ignored when ``shared``).
        num_buckets: k.
        window: chunk size w.
        shared: queries and keys are the same tokens (``T == S``); a token
            sees itself only when it sees nothing else.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.

    Returns:
        ``(B, T, H, dv)`` in the dtype of ``query``.
    """
    B, T, H, d = query.shape
    S, dv = key.shape[1], value.shape[3]
    if shared and T != S:
        raise ValueError(
            "Shared query/key routing needs as many keys as queries. "
            f"Received: query length {T}, key length {S}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(float(d))
    dtype = query.dtype
    plan = make_plan(query_buckets, key_buckets, num_buckets, window, T, S, shared)
    D = max(d, dv)

    def rows(x, n):
        x = x.to(torch.float32).reshape(-1, x.shape[-1])
        return F.pad(x, (0, D - x.shape[-1])) if x.shape[-1] < D else x

    out = _TokenRoutingAttention.apply(
        rows(query, T), rows(key, S), rows(value, S), plan, float(scale)
    )
    return out[:, :dv].reshape(B, T, H, dv).to(dtype)
