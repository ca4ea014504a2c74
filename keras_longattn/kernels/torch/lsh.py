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
* chunks of a round grouped by their size rounded up to :data:`GRANULE`
  (``wq`` query rows) and whether they have a previous chunk: an additive
  mask per group, one ``(wq, P + wq)`` mask shared by all its chunks when
  they are full (causal: the keys before the query; bidirectional: every
  key but itself; alone: itself; padding rows and columns hidden), each
  group a few batches of the flash kernel;
* one round at a time (per-round buffers of ``N + 1`` token rows, ``2N +
  2`` for key gradients), the rounds combined by their log-sum-exps as in
  the portable form (a running log-sum-exp), the self rule over the union
  of the rounds included: ``O = sum_r w_r o_r`` with ``w_r =
  softmax_r(lse_r)`` over the rounds that show the token a key other than
  itself (all of them when none does);
* backward: with ``P^r_ij = w_r p^r_ij`` the probabilities of the union,
  ``dL/ds^r_ij = w_r p^r_ij (dO . v_j - dO . O)``. The flash backward of
  round ``r`` called with ``grad_out = w_r dO``, ``out = O`` (the combined
  output) and ``logsumexp = lse_r`` computes exactly that (its ``D`` is
  ``rowsum(grad_out * out) = w_r dO . O``): no gradient of ``lse`` is
  needed;
* results go back to the tokens by ``index_copy`` (every token is one
  query per round); gradients are added onto the tokens by ``index_add_``
  (one query, one own key and at most one previous key per round), with
  no per-round gradient buffers. The backward gathers each call's keys and
  values again instead of keeping them from the forward pass (the same
  time, measured interleaved at n = 16384, and ``4 R n d`` floats less
  memory: 243 MiB there): the kept state is the inputs, the output and
  the per-round log-sum-exps, O(R n) besides ``O(n d)``; nothing of size
  ``n^2``.

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

from keras_longattn.kernels.constants import MASKED_LOGIT

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

#: Most elements of the keys and values gathered for one call of the flash
#: kernel (``chunks x keys x 2D``): 16 MiB of float32, well under glibc's
#: largest mmap threshold (32 MiB), so that the allocator reuses memory
#: between calls instead of page-faulting fresh buffers (see
#: :data:`keras_longattn.kernels.torch.MAX_SCORES_PER_CALL`).
MAX_BLOCK_ELEMENTS = 1 << 22

#: A partial chunk's queries are rounded up to a multiple of this (at most
#: the window): a few groups per round instead of one per size.
GRANULE = 32


#: Threads for the plan, gathers, copies and the combination of rounds
#: (None: PyTorch's setting), and for the flash kernel calls and the
#: hashing products (:data:`KERNEL_THREADS`). Measured at n = 16K (forward
#: + backward of the layer, causal, 2 CPU cores): with both cores free,
#: 1.1-1.3 s with PyTorch's 2 threads everywhere against 1.6-2.0 s with
#: both set to 1; with one core busy with another job, about 6 s with 2
#: threads against 2.1-2.3 s with 1 (many short parallel regions, each
#: waiting for every thread of the pool to be scheduled). PyTorch's setting
#: by default; set both to 1 on a loaded machine.
SMALL_OP_THREADS = None

#: See :data:`SMALL_OP_THREADS`.
KERNEL_THREADS = None


class _Threads:
    """Context manager: PyTorch's intra-op threads set to ``n`` (None:
    unchanged) inside, restored after."""

    def __init__(self, n):
        self.n = n
        self.saved = None

    def __enter__(self):
        if self.n is not None:
            self.saved = torch.get_num_threads()
            if self.saved != self.n:
                torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self.n is not None and self.saved != self.n:
            torch.set_num_threads(self.saved)
        return False


def _small_ops():
    return _Threads(SMALL_OP_THREADS)


def _kernel_threads(count):
    """Inside :func:`_small_ops`: the flash kernel with
    :data:`KERNEL_THREADS` threads, or ``count`` (PyTorch's setting outside)
    when that is None."""
    return _Threads(KERNEL_THREADS if KERNEL_THREADS is not None else count)


class _Group:
    """Chunks of one round with ``wq`` query rows (``s <= wq`` real ones)
    and ``P`` previous keys: token rows ``q_tok`` ``(m, wq)`` and ``k_tok``
    ``(m, P + wq)`` (``N``: a padding row, a dump row for results), their
    gather rows ``q_src``/``k_src`` (padding read from row 0, hidden by the
    mask) and the additive mask, ``(1, 1, wq, P + wq)`` when every chunk is
    full, else ``(m, 1, wq, P + wq)``."""

    def __init__(self, wq, P, q_tok, k_tok, mask, num_tokens):
        self.wq, self.P = wq, P
        self.wk = P + wq
        self.m = q_tok.shape[0]
        self.q_tok = q_tok
        self.k_tok = k_tok
        self.q_src = torch.where(q_tok == num_tokens, 0, q_tok)
        self.k_src = torch.where(k_tok == num_tokens, 0, k_tok)
        self.mask = mask

    def slices(self, width):
        """``(i0, i1, mask)`` per kernel call of chunks ``i0 .. i1 - 1``, so
        that their gathered keys and values of head size ``width`` stay
        within :data:`MAX_BLOCK_ELEMENTS`."""
        step = max(1, MAX_BLOCK_ELEMENTS // (self.wk * 2 * width))
        for i0 in range(0, self.m, step):
            i1 = min(i0 + step, self.m)
            mask = self.mask if self.mask.shape[0] == 1 else self.mask[i0:i1]
            yield i0, i1, mask


class _Plan:
    def __init__(self, rounds, num_tokens, other, same_tokens):
        self.rounds = rounds  # R lists of groups
        self.num_rounds = len(rounds)
        self.num_tokens = num_tokens  # N = B * n * H
        self.other = other  # bool (R, N): the round shows a key but itself
        # Every round places the same tokens (padding is padding in every
        # round): per-round buffers need no zeroing between rounds.
        self.same_tokens = same_tokens


def _group_mask(sizes, wq, P, causal):
    """Additive mask of chunks of ``sizes`` ``(m,)`` real queries in ``wq``
    rows: query ``i`` is column ``P + i``; causal: the keys before it;
    bidirectional: every key of the chunk but itself; itself only when it
    sees nothing else. Padding rows see column 0 (finite, dropped)."""
    if bool((sizes == wq).all()):
        sizes = sizes[:1]
    s = sizes.view(-1, 1, 1)
    cols = torch.arange(P + wq).view(1, 1, -1)
    rows = torch.arange(wq).view(1, -1, 1)
    if causal:
        allowed = cols < torch.clamp(P + rows, min=1)
    else:
        allowed = (cols < P + s) & ((cols != P + rows) | (P + s == 1))
    allowed = torch.where(rows < s, allowed, cols == 0)
    mask = torch.where(allowed, 0.0, -math.inf)
    return mask.unsqueeze(1)


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
    chunk_round = (chunk_stream % RH) // H

    # Token row of every sorted position, (b * n + t) * H + h; N: none.
    b_of = stream // RH
    h_of = stream % H
    tok = (b_of[:, None] * n + order) * H + h_of[:, None]  # (S, n)
    r_of = (stream % RH) // H
    tok_pad = torch.cat([tok.reshape(-1), tok.new_full((1,), N)])
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
    other[(r_of[:, None] * N + tok).reshape(-1)] = other_sorted.reshape(-1)

    granule = min(GRANULE, w)
    padded = torch.clamp((size + granule - 1) // granule * granule, max=w)
    key = (chunk_round * 2 + has_prev.to(torch.int64)) * (w + 1) + padded
    # Rows of every chunk at its widest (w queries, 2w keys), then each
    # group takes its chunks' leading columns.
    base = pos[:, None]
    lead = has_prev.to(torch.int64)[:, None] * w  # P of each chunk
    i = torch.arange(w)
    q_tok = tok_pad[torch.where(i < size[:, None], base + i, S * n)]  # (C, w)
    j = torch.arange(2 * w)
    k_tok = tok_pad[torch.where(j < lead + size[:, None], base - lead + j, S * n)]
    key_sorted, chunk_order = torch.sort(key, stable=True)
    values, counts_g = torch.unique_consecutive(key_sorted, return_counts=True)
    rounds = [[] for _ in range(R)]
    offset = 0
    for value, m in zip(values.tolist(), counts_g.tolist()):
        chunks = chunk_order[offset:offset + m]
        offset += m
        r, rest = divmod(value, 2 * (w + 1))
        P = w if rest > w else 0
        wq = rest - (w + 1 if P else 0)
        rounds[r].append(_Group(
            wq, P, q_tok[chunks, :wq], k_tok[chunks, :P + wq],
            _group_mask(size[chunks], wq, P, causal), N,
        ))
    placed = (buckets < k).reshape(B, R, H, n)
    same_tokens = bool((placed == placed[:, :1]).all())
    return _Plan(rounds, N, other.view(R, N), same_tokens)


class _LSHAttention(torch.autograd.Function):
    """Inputs are 2-D float32 token rows ``(N, D)`` (``N = B * n * H``) of
    one head size ``D``; the output ``(N, D)``. One round at a time: every
    temporary is at most ``(N + 1, D)``."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        ctx.threads = torch.get_num_threads()
        with _small_ops():
            return _LSHAttention._forward(ctx, q, k, v, plan, scale)

    @staticmethod
    def backward(ctx, grad):
        with _small_ops():
            return _LSHAttention._backward(ctx, grad)

    @staticmethod
    def _forward(ctx, q, k, v, plan, scale):
        R, N = plan.num_rounds, plan.num_tokens
        D = q.shape[1]
        other = plan.other
        keep = other | ~other.any(0, keepdim=True)
        acc = q.new_zeros((N, D))
        total = q.new_full((N,), -math.inf)
        out_r = q.new_zeros((N + 1, D))
        lse_r = q.new_full((N + 1,), MASKED_LOGIT)
        logits = q.new_empty((R, N))  # each round's log-sum-exp (kept rounds)
        group_lse = []
        for r, groups in enumerate(plan.rounds):
            if r and not plan.same_tokens:
                out_r.zero_()
                lse_r.fill_(MASKED_LOGIT)
            saved = []
            for gr in groups:
                parts = []
                for i0, i1, mask in gr.slices(D):
                    m = i1 - i0
                    qg = q.index_select(0, gr.q_src[i0:i1].reshape(-1)).view(m, 1, gr.wq, D)
                    kidx = gr.k_src[i0:i1].reshape(-1)
                    kg = k.index_select(0, kidx).view(m, 1, gr.wk, D)
                    vg = v.index_select(0, kidx).view(m, 1, gr.wk, D)
                    with _kernel_threads(ctx.threads):
                        out, lse = _flash(qg, kg, vg, 0.0, False, attn_mask=mask,
                                          scale=scale)
                    qidx = gr.q_tok[i0:i1].reshape(-1)
                    out_r.index_copy_(0, qidx, out.view(-1, D))
                    lse_r.index_copy_(0, qidx, lse.reshape(-1))
                    parts.append(lse)
                saved.append(parts)
            group_lse.append(saved)
            # One softmax over the kept rounds, accumulated round by round.
            lr = torch.where(keep[r], lse_r[:N], MASKED_LOGIT)
            logits[r] = lr
            new_total = torch.logaddexp(total, lr)
            acc.mul_(torch.exp(total - new_total)[:, None])
            acc.addcmul_(out_r[:N], torch.exp(lr - new_total)[:, None])
            total = new_total
        ctx.save_for_backward(q, k, v, acc, total, logits)
        ctx.plan, ctx.scale, ctx.group_lse = plan, scale, group_lse
        return acc

    @staticmethod
    def _backward(ctx, grad):
        q, k, v, out, total, logits = ctx.saved_tensors
        plan, scale, group_lse = ctx.plan, ctx.scale, ctx.group_lse
        ctx.group_lse = None
        N = plan.num_tokens
        D = q.shape[1]
        grad = grad.contiguous()
        # Row N of each: the dump of padding rows (dropped at the end).
        # Every round adds its gradients onto the tokens with index_add_
        # (a token is one query and one own key per round, and at most one
        # previous key): no per-round buffers to zero and sum.
        dq, dk, dv = (q.new_zeros((N + 1, D)) for _ in range(3))
        go = q.new_zeros((N + 1, D))  # row N: padding rows get no gradient
        for r, groups in enumerate(plan.rounds):
            # grad_out of round r: w_r dO; out: the combined O; logsumexp:
            # the round's own (see the module docstring). A round left out
            # by the self rule has w_r = 0: no gradient.
            torch.mul(grad, torch.exp(logits[r] - total)[:, None], out=go[:N])
            for gr, parts in zip(groups, group_lse[r]):
                for (i0, i1, mask), lse in zip(gr.slices(D), parts):
                    m = i1 - i0
                    kidx = gr.k_src[i0:i1].reshape(-1)
                    kg = k.index_select(0, kidx).view(m, 1, gr.wk, D)
                    vg = v.index_select(0, kidx).view(m, 1, gr.wk, D)
                    qsrc = gr.q_src[i0:i1].reshape(-1)
                    qg = q.index_select(0, qsrc).view(m, 1, gr.wq, D)
                    og = out.index_select(0, qsrc).view(m, 1, gr.wq, D)
                    qtok = gr.q_tok[i0:i1].reshape(-1)
                    gog = go.index_select(0, qtok).view(m, 1, gr.wq, D)
                    with _kernel_threads(ctx.threads):
                        gq, gk, gv = _flash_backward(
                            gog, qg, kg, vg, og, lse, 0.0, False, attn_mask=mask,
                            scale=scale,
                        )
                    dq.index_add_(0, qtok, gq.view(-1, D))
                    ktok = gr.k_tok[i0:i1].reshape(-1)
                    dk.index_add_(0, ktok, gk.view(-1, D))
                    dv.index_add_(0, ktok, gv.view(-1, D))
        return dq[:N], dk[:N], dv[:N], None, None


#: Most elements of one hashing projection ``(B, heads, n, c)``: 16 MiB.
MAX_PROJECTION = 1 << 22


@torch.compiler.disable
@torch.no_grad()
def hash_buckets(x, rotations, valid=None):
    """:func:`keras_longattn.ops.lsh.hash_buckets` with fewer passes and
    every projection under :data:`MAX_PROJECTION` elements (a few heads at
    a time): the same products, the same argmax (the first of equal
    ``|x Rot|``), the same buckets.

    Args:
        x: ``(B, n, H, d)`` torch tensor.
        rotations: float32 ``(R, c, H, d)``.
        valid: optional boolean ``(B, n)``; False: bucket ``2c``.

    Returns:
        int32 ``(B, R * H, n)``.
    """
    x = x.detach().to(torch.float32)
    rotations = rotations.to(torch.float32)
    B, n, H, _ = x.shape
    c = rotations.shape[1]
    step = max(1, MAX_PROJECTION // max(1, B * n * c))
    threads = torch.get_num_threads()
    with _small_ops():
        return _hash_rounds(x, rotations, valid, step, threads)


def _hash_rounds(x, rotations, valid, step, threads):
    B, n, H, _ = x.shape
    R, c = rotations.shape[0], rotations.shape[1]
    rounds = []
    for r in range(R):
        heads = []
        for h0 in range(0, H, step):
            h1 = min(H, h0 + step)
            with _kernel_threads(threads):
                proj = torch.einsum("bnhd,chd->bhnc", x[:, :, h0:h1], rotations[r, :, h0:h1])
            negative = proj < 0
            j = torch.argmax(proj.abs_(), dim=-1, keepdim=True)
            heads.append((j + c * torch.gather(negative, -1, j))[..., 0])
        rounds.append(torch.cat(heads, 1) if len(heads) > 1 else heads[0])
    buckets = torch.cat(rounds, 1) if R > 1 else rounds[0]
    if valid is not None:
        buckets = torch.where(valid.to(torch.bool)[:, None, :], buckets, 2 * c)
    return buckets.to(torch.int32)


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
    with _small_ops():
        plan = make_plan(buckets, num_buckets, window, H, causal)
    D = max(d, dv)

    def rows(x):
        x = x.to(torch.float32).reshape(-1, x.shape[-1])
        return F.pad(x, (0, D - x.shape[-1])) if x.shape[-1] < D else x

    out = _LSHAttention.apply(rows(query), rows(keys), rows(value), plan, float(scale))
    return out[:, :dv].reshape(B, n, H, dv).to(dtype)
