"""Multi-round LSH attention (Reformer) for PyTorch on the CPU.

The portable form (:func:`keras_longattn.ops.lsh.lsh_attention`) lays every
round's buckets out in a chunk-aligned buffer (empty slots included) and
writes each chunk's ``(w, 2w)`` scores, masks and softmax explicitly, since
combining the rounds needs each round's log-sum-exp: elementwise passes
over ``R * H`` score tensors dominate its time.

Here every round runs in PyTorch's flash attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the
log-sum-exp too, and its backward, called directly), inside one
``torch.autograd.Function``, from a *plan* worked out once per call without
gradient (:func:`make_plan`):

* per round and head, tokens sorted by (bucket, position); bucket ``c``
  cut into ``ceil(n_c / w)`` chunks of consecutive sorted tokens, all full
  but the last. A chunk's queries are its ``s`` tokens; its keys the ``w``
  tokens of the previous chunk of its bucket (when there is one) followed
  by its own: contiguous in the sorted order, no empty slot;
* chunks grouped by (``s``, has a previous chunk): the mask of a group is
  one ``(s, P + s)`` additive mask shared by all its chunks (causal: the
  keys before the query; bidirectional: every key but itself; alone:
  itself), each group one batch of the flash kernel;
* the rounds combined by their log-sum-exps as in the portable form, the
  self rule over the union of the rounds included: ``O = sum_r w_r o_r``
  with ``w_r = softmax_r(lse_r)`` over the rounds that show the token a key
  other than itself (all of them when none does);
* backward: with ``P^r_ij = w_r p^r_ij`` the probabilities of the union,
  ``dL/ds^r_ij = w_r p^r_ij (dO . v_j - dO . O)``. The flash backward of
  round ``r`` called with ``grad_out = w_r dO``, ``out = O`` (the combined
  output) and ``logsumexp = lse_r`` computes exactly that (its ``D`` is
  ``rowsum(grad_out * out) = w_r dO . O``): no gradient of ``lse`` is
  needed;
* results and gradients go back to the tokens by ``index_copy`` (every
  token is one query and one own key per round, and at most one previous
  key: that gradient goes to a second buffer), then a sum over rounds:
  no scatter-add. Memory O(R * n * (w + d)), nothing of size ``n^2``.

The result equals :func:`~keras_longattn.ops.lsh.lsh_attention` up to float
rounding; ``tests/layers/test_lsh_torch.py`` checks values and gradients
against it.

Shape legend: B batch, n length, H heads, d head size, dv value head size,
R rounds, w window (bucket_size), k buckets, s queries of a chunk, P keys
of its previous chunk (0 or w).
"""

import math

import torch
import torch.nn.functional as F

from keras_longattn.ops.reference import MASKED_LOGIT

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

#: Most chunks of one group per call of the flash kernel (bounds the
#: gathered blocks and the kernel's temporaries).
MAX_CHUNKS_PER_CALL = 512


class _Group:
    """Chunks of ``s`` queries with ``P`` previous keys: ``q_index``
    ``(m * s,)`` round-token rows of the queries (``r * N + token``, ``N =
    B * n * H``; also their own-key rows), ``k_tokens`` ``(m * (P + s),)``
    token rows of the keys, ``prev_index`` ``(m * P,)`` round-token rows of
    the previous keys, and the additive mask ``(1, 1, s, P + s)``."""

    def __init__(self, s, P, q_index, k_tokens, prev_index, mask, num_tokens):
        self.s, self.P = s, P
        self.m = q_index.numel() // s
        self.q_index = q_index
        self.q_tokens = q_index % num_tokens
        self.k_tokens = k_tokens
        self.prev_index = prev_index
        self.mask = mask

    def slices(self):
        step = MAX_CHUNKS_PER_CALL
        return [(i, min(i + step, self.m)) for i in range(0, self.m, step)]


class _Plan:
    def __init__(self, groups, num_rounds, num_tokens, other):
        self.groups = groups
        self.num_rounds = num_rounds
        self.num_tokens = num_tokens  # N = B * n * H
        self.other = other  # bool (R, N): the round shows a key but itself


def _chunk_mask(s, P, causal):
    """Additive ``(1, 1, s, P + s)`` mask of a chunk: query ``i`` is column
    ``P + i``; causal: the keys before it; bidirectional: every key but
    itself; itself only when it sees nothing else."""
    cols = torch.arange(P + s)
    rows = torch.arange(s)[:, None]
    if causal:
        allowed = cols < torch.clamp(P + rows, min=1)
    elif P + s > 1:
        allowed = cols != P + rows
    else:
        allowed = torch.ones((1, 1), dtype=torch.bool)
    mask = torch.zeros((1, 1, s, P + s), dtype=torch.float32)
    mask[0, 0].masked_fill_(~allowed, -math.inf)
    return mask


@torch.no_grad()
def make_plan(buckets, num_buckets, window, num_heads, causal):
    """The plan of multi-round LSH attention for int ``buckets``
    ``(B, R * H, n)`` in ``[0, num_buckets]`` (``num_buckets``: padding, no
    part), round-major (round ``r``, head ``h`` is row ``r * H + h``)."""
    k = int(num_buckets)
    w = int(window)
    B, RH, n = buckets.shape
    H = int(num_heads)
    R = RH // H
    N = B * n * H
    S = B * RH  # streams, ordered (b, r, h)
    bk = buckets.to(torch.int64).reshape(S, n)
    sorted_b, order = torch.sort(bk, dim=-1, stable=True)  # (S, n)
    stream = torch.arange(S)
    counts = torch.bincount(
        (stream[:, None] * (k + 1) + bk).reshape(-1), minlength=S * (k + 1)
    ).view(S, k + 1)[:, :k]
    start = torch.cumsum(counts, 1) - counts  # (S, k) sorted position
    n_chunks = (counts + (w - 1)) // w
    flat_chunks = n_chunks.reshape(-1)
    total = int(flat_chunks.sum())
    owner = torch.repeat_interleave(torch.arange(S * k), flat_chunks)  # (C,)
    first = torch.cumsum(flat_chunks, 0) - flat_chunks
    g = torch.arange(total) - first[owner]
    own_start = start.reshape(-1)[owner] + g * w  # sorted position in its stream
    size = torch.clamp(counts.reshape(-1)[owner] - g * w, max=w)
    has_prev = g > 0
    chunk_stream = owner // k

    # Round-token rows of every sorted position: r * N + (b * n + t) * H + h.
    b_of = stream // RH
    r_of = (stream % RH) // H
    h_of = stream % H
    tok = (b_of[:, None] * n + order) * H + h_of[:, None]  # (S, n) token rows
    rtok = (r_of[:, None] * N + tok).reshape(-1)
    tok = tok.reshape(-1)
    pos = chunk_stream * n + own_start  # flat sorted position of each chunk

    # Whether a round shows a token a key other than itself.
    safe = torch.clamp(sorted_b, max=k - 1)
    rank = torch.arange(n)[None, :] - torch.gather(start, 1, safe)  # in its bucket
    if causal:
        other_sorted = rank > 0  # a key before it (previous chunk included)
    else:
        # A previous chunk, or another member of its own chunk.
        chunk_size = torch.clamp(torch.gather(counts, 1, safe) - rank // w * w, max=w)
        other_sorted = (rank >= w) | (chunk_size > 1)
    other_sorted &= sorted_b < k
    other = torch.zeros(R * N, dtype=torch.bool)
    other[rtok] = other_sorted.reshape(-1)

    key = has_prev.to(torch.int64) * (w + 1) + size
    groups = []
    for value in torch.unique(key).tolist():
        P = w if value > w else 0
        s = value - (w + 1 if P else 0)
        chunks = torch.nonzero(key == value)[:, 0]
        base = pos[chunks]
        q_pos = (base[:, None] + torch.arange(s)).reshape(-1)
        k_pos = (base[:, None] - P + torch.arange(P + s)).reshape(-1)
        prev_pos = (base[:, None] - P + torch.arange(P)).reshape(-1)
        groups.append(_Group(
            s, P, rtok[q_pos], tok[k_pos], rtok[prev_pos], _chunk_mask(s, P, causal), N,
        ))
    return _Plan(groups, R, N, other.view(R, N))


def _run(fn, group, *tensors, **kwargs):
    results = []
    for i0, i1 in group.slices():
        args = [t[i0:i1] for t in tensors]
        results.append(fn(*args, 0.0, False, attn_mask=group.mask, **kwargs))
    if len(results) == 1:
        return results[0]
    return tuple(torch.cat(parts) for parts in zip(*results))


def _blocks(x, index, m, width):
    return x.index_select(0, index).view(m, 1, width, x.shape[-1])


class _LSHAttention(torch.autograd.Function):
    """Inputs are 2-D float32 token rows ``(N, D)`` (``N = B * n * H``) of
    one head size ``D``; the output ``(N, D)``."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        R, N = plan.num_rounds, plan.num_tokens
        D = q.shape[1]
        outs = q.new_zeros((R * N, D))
        lses = q.new_full((R * N,), MASKED_LOGIT)
        for gr in plan.groups:
            qg = _blocks(q, gr.q_tokens, gr.m, gr.s)
            kg = _blocks(k, gr.k_tokens, gr.m, gr.P + gr.s)
            vg = _blocks(v, gr.k_tokens, gr.m, gr.P + gr.s)
            out, lse = _run(_flash, gr, qg, kg, vg, scale=scale)
            outs.index_copy_(0, gr.q_index, out.reshape(-1, D))
            lses.index_copy_(0, gr.q_index, lse.reshape(-1))
        outs = outs.view(R, N, D)
        lses = lses.view(R, N)
        # The self rule over the union of the rounds, then one softmax.
        other = plan.other
        keep = other | ~other.any(0, keepdim=True)
        weights = torch.softmax(torch.where(keep, lses, MASKED_LOGIT), dim=0)  # (R, N)
        out = torch.einsum("rn,rnd->nd", weights, outs)
        ctx.save_for_backward(q, k, v, out, weights, lses)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, weights, lses = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        R, N = plan.num_rounds, plan.num_tokens
        D = q.shape[1]
        grad = grad.contiguous()
        # grad_out of round r: w_r dO; out: the combined O; logsumexp: the
        # round's own (see the module docstring). A round left out by the
        # self rule has w_r = 0: no gradient.
        grad_rounds = (weights[:, :, None] * grad[None]).view(R * N, D)
        lses = lses.reshape(-1)
        dq = q.new_zeros((R * N, D))
        dk = q.new_zeros((R * N, D))
        dk_prev = q.new_zeros((R * N, D))
        dv = q.new_zeros((R * N, D))
        dv_prev = q.new_zeros((R * N, D))
        for gr in plan.groups:
            m, s, P = gr.m, gr.s, gr.P
            qg = _blocks(q, gr.q_tokens, m, s)
            kg = _blocks(k, gr.k_tokens, m, P + s)
            vg = _blocks(v, gr.k_tokens, m, P + s)
            go = _blocks(grad_rounds, gr.q_index, m, s)
            og = _blocks(out, gr.q_tokens, m, s)
            lg = lses.index_select(0, gr.q_index).view(m, 1, s)
            gq, gk, gv = _run(_flash_backward, gr, go, qg, kg, vg, og, lg, scale=scale)
            dq.index_copy_(0, gr.q_index, gq.reshape(-1, D))
            gk = gk.view(m, P + s, D)
            gv = gv.view(m, P + s, D)
            dk.index_copy_(0, gr.q_index, gk[:, P:].reshape(-1, D))
            dv.index_copy_(0, gr.q_index, gv[:, P:].reshape(-1, D))
            if P:
                dk_prev.index_copy_(0, gr.prev_index, gk[:, :P].reshape(-1, D))
                dv_prev.index_copy_(0, gr.prev_index, gv[:, :P].reshape(-1, D))
        dq = dq.view(R, N, D).sum(0)
        dk = dk.add_(dk_prev).view(R, N, D).sum(0)
        dv = dv.add_(dv_prev).view(R, N, D).sum(0)
        return dq, dk, dv, None, None


@torch.compiler.disable
def lsh_attention(query, keys, value, buckets, num_buckets, window, causal=False,
                  scale=None):
    """Multi-round LSH attention, equal to
    :func:`keras_longattn.ops.lsh.lsh_attention` (without dropout).

    Args:
        query: ``(B, n, H, d)`` torch tensor.
        keys: ``(B, n, H, d)``: the shared keys (normalised queries).
        value: ``(B, n, H, dv)``.
        buckets: int ``(B, R * H, n)`` in ``[0, num_buckets]``
            (``num_buckets``: a token that takes no part; zero output).
        num_buckets: the static bucket count ``2c``.
        window: chunk size w.
        causal: a token sees no key after it.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.

    Returns:
        ``(B, n, H, dv)`` in the dtype of ``value``.
    """
    B, n, H, d = query.shape
    dv = value.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(float(d))
    dtype = value.dtype
    plan = make_plan(buckets, num_buckets, window, H, causal)
    D = max(d, dv)

    def rows(x):
        x = x.to(torch.float32).reshape(-1, x.shape[-1])
        return F.pad(x, (0, D - x.shape[-1])) if x.shape[-1] < D else x

    out = _LSHAttention.apply(rows(query), rows(keys), rows(value), plan, float(scale))
    return out[:, :dv].reshape(B, n, H, dv).to(dtype)
