"""Sliding-window (band) attention on PyTorch's CPU flash-attention kernel.

Query ``p`` attends keys ``p - look_back .. p + look_ahead``. The sequence is
cut into blocks of ``b`` positions; each *interior* query block (one whose
key band lies inside the sequence) attends the ``C = (before + 1 + after) *
b`` keys around it, and those keys are an **overlapping strided view** of
the key tensor (``as_strided``), not a copy: the kernel reads through
strides. The band predicate is one additive ``(b, C)`` bias shared by every
interior block. The few queries near the ends (and a length that is not a
multiple of ``b``) are *edge* segments, each one kernel call with its own
``(queries, keys)`` bias. Every query belongs to exactly one call, so no
log-sum-exp merging is needed.

The autograd function keeps only the inputs, the output and the per-query
log-sum-exp; the backward pass calls the kernel's backward on the same
views and sums the band gradients of the keys and values back onto their
positions. Calls take groups of blocks so that no temporary exceeds
:data:`MAX_BAND_ELEMENTS` elements: the memory is O(n * d) besides that.

Why: the portable fused path builds band copies of the keys and values, a
``(n, b, C)`` boolean mask and the zero-row fix-up around the kernel; this
path runs the kernel alone on views.

**Compiled kernel.** Where :func:`keras_longattn.kernels.torch.native.band_ops`
builds (a C++ compiler; see that module), :func:`band_forward` and
:func:`band_backward` run ``csrc/band_attention.cpp`` instead of the flash
calls above: tiles of :data:`NATIVE_TILE` queries, each against exactly the
keys its rows see (no block rounding, no band-sized gradient buffers to
zero and fold). Same results to float rounding.

Shape legend: B batch, T sequence length, H heads, d head size, b block
size, C keys per block, G blocks per kernel call.
"""

import math

import torch

from keras_longattn.kernels.torch import native

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

#: Additive bias of a masked (query, key) pair: finite, so that a query with
#: no visible key gets a finite log-sum-exp (about this value) instead of NaN.
MASKED_BIAS = -1e30
#: A log-sum-exp below this marks a query that sees no key.
DEAD_LSE = -1e29
#: Most elements of a band-shaped temporary (the key gradients of the blocks
#: of one kernel call, ``G * C * H * d``): 4 Mi floats, 16 MiB.
MAX_BAND_ELEMENTS = 1 << 22
#: Queries per tile of the compiled kernel.
NATIVE_TILE = 32
#: Whether the compiled kernel copies a sequence's rows into a contiguous
#: buffer first: -1 where a view's rows lie a page or more apart and one
#: head's sequence is at most 64 Ki floats (the columns of the strided
#: pattern), 0 never, 1 always (the tests run both).
NATIVE_PACK = -1


def supported(query, key, value):
    """Why :func:`band_attention` cannot take these tensors (None: it can)."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return "inputs are not torch tensors"
    if any(t.device.type != "cpu" for t in (query, key, value)):
        return "the flash kernel used here runs on the CPU only"
    if any(t.dtype != torch.float32 for t in (query, key, value)):
        return "float32 inputs only"
    if query.shape[1] != key.shape[1]:
        return "query and key lengths differ"
    if query.shape[-1] != value.shape[-1]:
        return "value head size differs from the key head size"
    return None


def refusal(dtype, query_length, key_length, key_dim, value_dim):
    """Why a call of compute ``dtype``, these lengths (None: unknown) and
    head sizes cannot run here (None: it can), decided before any tensor
    exists."""
    from keras.src.backend.torch.core import get_device

    if str(get_device()).split(":")[0] != "cpu":
        return "the flash kernel used here runs on the CPU only"
    if str(dtype) != "float32":
        return f"float32 only (compute dtype {dtype})"
    if None not in (query_length, key_length) and query_length != key_length:
        return "query and key lengths differ"
    if key_dim != value_dim:
        return "the flash kernel needs value_dim == key_dim"
    return None


def default_block_size(look_back, look_ahead):
    """Block size of :func:`band_attention`: 64 positions (32 when both
    extents are below 32).

    The CPU flash kernel computes every (query, key) pair of a call, masked
    or not, and does not skip tiles at these sizes (a causal call on
    256 x 256 blocks took as long as a full one), so the useful share of
    the work is ``extent / C`` with ``C = (before + 1 + after) * b``: small
    blocks waste less, until the per-call overhead wins (64 for every
    extent from 32 up, by the band benchmark).
    """
    extent = max(int(look_back), int(look_ahead))
    return 32 if extent < 32 else 64


def band_attention(query, key, value, look_back, look_ahead, block_size=None,
                   key_mask=None, scale=None, extra_keys=None, extra_values=None,
                   extra_mask=None):
    """Exact sliding-window attention through the CPU flash kernel.

    Args:
        query: ``(B, T, H, d)`` float32.
        key: ``(B, T, H, d)``.
        value: ``(B, T, H, d)``.
        look_back: keys visible before the query (>= 0).
        look_ahead: keys visible after the query (>= 0).
        block_size: positions per block. Defaults to
            :func:`default_block_size`.
        key_mask: optional boolean ``(B, T)``; False marks padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        extra_keys: optional ``(B, G, H, d)``: a few keys (Longformer's
            global tokens) that every query may see besides its band, in
            the same softmax (the band and these keys merged by their
            log-sum-exps, see :class:`_BandWithKeys`).
        extra_values: ``(B, G, H, d)``, with ``extra_keys``.
        extra_mask: boolean ``(B, T, G)``, with ``extra_keys``: which extra
            keys each query sees.

    Returns:
        ``(B, T, H, d)``; a query that sees no key gets zeros.
    """
    reason = supported(query, key, value)
    if reason is not None:
        raise ValueError(f"band_attention cannot run this call: {reason}.")
    look_back, look_ahead = int(look_back), int(look_ahead)
    if look_back < 0 or look_ahead < 0:
        raise ValueError(
            "`look_back` and `look_ahead` must be >= 0. Received: "
            f"look_back={look_back}, look_ahead={look_ahead}"
        )
    b = int(block_size) if block_size else default_block_size(look_back, look_ahead)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if key_mask is not None:
        key_mask = torch.as_tensor(key_mask, device=query.device).to(torch.bool)
        key_mask = key_mask.expand(query.shape[0], query.shape[1]).contiguous()
    plan = _Plan(query.shape[1], b, look_back, look_ahead, query.shape[2] * query.shape[3])
    if extra_keys is None:
        return _BandAttention.apply(query, key, value, key_mask, plan, float(scale))
    if extra_values is None or extra_mask is None:
        raise ValueError("`extra_keys` needs `extra_values` and `extra_mask`.")
    B, T, H, d = query.shape
    G = extra_keys.shape[1]
    if tuple(extra_keys.shape) != (B, G, H, d) or tuple(extra_values.shape) != (B, G, H, d):
        raise ValueError(
            "`extra_keys` and `extra_values` must be (B, G, H, d) = "
            f"{(B, G, H, d)}. Received: extra_keys.shape={tuple(extra_keys.shape)}, "
            f"extra_values.shape={tuple(extra_values.shape)}"
        )
    extra_mask = torch.as_tensor(extra_mask).to(torch.bool).expand(B, T, G)
    bias = torch.zeros((B, T, 1, G), dtype=query.dtype).masked_fill(
        ~extra_mask[:, :, None, :], MASKED_BIAS)
    return _BandWithKeys.apply(query, key, value, key_mask, extra_keys.to(query.dtype),
                               extra_values.to(query.dtype), bias, plan, float(scale))


@torch.compiler.disable
def band_attention_eager(query, key, value, look_back, look_ahead, block_size=None,
                         key_mask=None, scale=None, extra_keys=None, extra_values=None,
                         extra_mask=None):
    """:func:`band_attention`, run eagerly inside a compiled model."""
    return band_attention(query, key, value, look_back, look_ahead,
                          block_size=block_size, key_mask=key_mask, scale=scale,
                          extra_keys=extra_keys, extra_values=extra_values,
                          extra_mask=extra_mask)


class _Plan:
    """The kernel calls of one sequence length: interior groups of blocks
    and edge segments."""

    def __init__(self, T, b, look_back, look_ahead, width):
        self.T, self.b = T, b
        self.look_back, self.look_ahead = look_back, look_ahead
        #: The compiled kernel's operators, or None (flash-kernel calls).
        self.native = native.band_ops()
        self.before = -(-look_back // b)
        self.after = -(-look_ahead // b)
        self.C = (self.before + 1 + self.after) * b
        n = T // b
        first, end = self.before, n - self.after  # interior query blocks
        group = max(1, MAX_BAND_ELEMENTS // (self.C * width))
        self.groups = []  # (first block, number of blocks)
        if end > first:
            for i in range(first, end, group):
                self.groups.append((i, min(group, end - i)))
            edges = [(0, first * b), (end * b, T)]
        else:
            edges = [(0, T)]
        # Edge segments (query start, query end), split to bound their bias.
        self.edges = []
        for start, stop in edges:
            step = max(b, MAX_BAND_ELEMENTS // max(1, b + look_back + look_ahead) // 8)
            for s in range(start, stop, step):
                self.edges.append((s, min(stop, s + step)))
        t = torch.arange(b)[:, None]
        j = torch.arange(self.C)[None, :] - self.before * b
        self.bias = _bias(j - t, look_back, look_ahead)[None, None]  # (1, 1, b, C)

    def edge_keys(self, start, stop):
        """Key range ``(first, end)`` of the edge segment ``[start, stop)``."""
        return max(0, start - self.look_back), min(self.T, stop + self.look_ahead)

    def edge_bias(self, start, stop):
        lo, hi = self.edge_keys(start, stop)
        rel = torch.arange(lo, hi)[None, :] - torch.arange(start, stop)[:, None]
        return _bias(rel, self.look_back, self.look_ahead)[None, None]  # (1, 1, E, K)


def _bias(rel, look_back, look_ahead):
    """Additive bias of the key offsets ``rel`` (key - query position)."""
    allowed = (rel >= -look_back) & (rel <= look_ahead)
    return torch.zeros(rel.shape).masked_fill(~allowed, MASKED_BIAS)


def _calls(plan, q, k, v, key_valid):
    """The kernel calls of one example: ``(kind, where, qv, kv, vv, bias)``.

    ``q``/``k``/``v`` ``(T, H, d)`` of one example (any strides, the last
    one 1); ``key_valid`` None or boolean ``(T,)``. Views only; the bias is
    shared unless keys are padded.
    """
    b, C = plan.b, plan.C
    for first, count in plan.groups:
        qv = _blocks(q, first, count, b).transpose(1, 2)
        start = (first - plan.before) * b
        kv = _overlapping(k, count, C, b, start)
        vv = _overlapping(v, count, C, b, start)
        bias = plan.bias
        if key_valid is not None:
            valid = key_valid.as_strided((count, C), (b, 1), key_valid.storage_offset() + start)
            pad = torch.zeros(valid.shape).masked_fill(~valid, MASKED_BIAS)
            bias = torch.maximum(bias + pad[:, None, None, :], torch.tensor(MASKED_BIAS))
        yield "group", (first, count), qv, kv.transpose(1, 2), vv.transpose(1, 2), bias
    for start, stop in plan.edges:
        if stop <= start:
            continue
        lo, hi = plan.edge_keys(start, stop)
        bias = plan.edge_bias(start, stop)
        if key_valid is not None:
            pad = torch.zeros(hi - lo).masked_fill(~key_valid[lo:hi], MASKED_BIAS)
            bias = torch.maximum(bias + pad, torch.tensor(MASKED_BIAS))
        yield ("edge", (start, stop, lo, hi), q[start:stop].transpose(0, 1)[None],
               k[lo:hi].transpose(0, 1)[None], v[lo:hi].transpose(0, 1)[None], bias)


def _blocks(x, first, count, b):
    """Blocks ``first .. first + count - 1`` of ``b`` positions of ``x``
    ``(T, ...)``: ``(count, b, ...)``, a view."""
    row = x.stride(0)
    return x.as_strided((count, b) + tuple(x.shape[1:]), (b * row,) + x.stride(),
                        x.storage_offset() + first * b * row)


def _overlapping(x, count, C, b, start):
    """``count`` windows of ``C`` positions of ``x`` ``(T, H, d)``, window
    ``g`` starting at position ``start + g * b``: ``(count, C, H, d)``, a
    view whose windows overlap."""
    row = x.stride(0)
    return x.as_strided((count, C) + tuple(x.shape[1:]), (b * row,) + x.stride(),
                        x.storage_offset() + start * row)


def _rows(plan, kind, where):
    """Query positions ``(start, stop)`` of a call."""
    if kind == "group":
        first, count = where
        return first * plan.b, (first + count) * plan.b
    return where[0], where[1]


def _call_view(x, plan, kind, where):
    """The rows of a call in ``x`` ``(T, H, ...)``, laid out as the kernel's
    ``(G, H, b, ...)``."""
    start, stop = _rows(plan, kind, where)
    if kind == "group":
        return _blocks(x, where[0], where[1], plan.b).transpose(1, 2)
    return x[start:stop].transpose(0, 1)[None]


def band_forward(plan, query, key, value, key_mask, scale, out, lse):
    """Writes the band attention of ``(B, T, H, d)`` views into ``out``
    ``(B, T, H, d)`` and its log-sum-exp into ``lse`` ``(B, T, H)``; returns
    the boolean ``(B, T, H)`` of the queries that see no key (their output
    is zeroed), or None when every query sees one."""
    if plan.native is not None:
        plan.native.forward(query, key, value, key_mask, plan.look_back, plan.look_ahead,
                            NATIVE_TILE, scale, out, lse, NATIVE_PACK)
    else:
        _flash_forward(plan, query, key, value, key_mask, scale, out, lse)
    if key_mask is None:
        return None
    dead = lse < DEAD_LSE
    if not bool(dead.any()):
        return None
    out.masked_fill_(dead[..., None], 0.0)
    return dead


def _flash_forward(plan, query, key, value, key_mask, scale, out, lse):
    for e in range(query.shape[0]):
        valid = None if key_mask is None else key_mask[e]
        for kind, where, qv, kv, vv, bias in _calls(plan, query[e], key[e], value[e], valid):
            o, l = _flash(qv, kv, vv, 0.0, False, attn_mask=bias, scale=scale)
            _call_view(out[e], plan, kind, where).copy_(o)
            _call_view(lse[e], plan, kind, where).copy_(l)


def band_backward(plan, query, key, value, key_mask, scale, out, lse, grad_out, dq, dk, dv):
    """Gradients of :func:`band_forward`: writes ``dq``, ``dk`` and ``dv``
    (all ``(B, T, H, d)`` views); ``grad_out`` must be zero where a query
    sees no key."""
    if plan.native is not None:
        plan.native.backward(query, key, value, key_mask, plan.look_back, plan.look_ahead,
                             NATIVE_TILE, scale, out, lse, grad_out, dq, dk, dv, NATIVE_PACK)
        return
    dk.zero_()
    dv.zero_()
    for e in range(query.shape[0]):
        valid = None if key_mask is None else key_mask[e]
        for kind, where, qv, kv, vv, bias in _calls(plan, query[e], key[e], value[e], valid):
            go = _call_view(grad_out[e], plan, kind, where)
            ov = _call_view(out[e], plan, kind, where)
            lv = _call_view(lse[e], plan, kind, where)
            gq, gk, gv = _flash_backward(go, qv, kv, vv, ov, lv, 0.0, False,
                                         attn_mask=bias, scale=scale)
            _call_view(dq[e], plan, kind, where).copy_(gq)
            if kind == "group":
                first, count = where
                _fold(dk[e], gk, first - plan.before, count, plan.b)
                _fold(dv[e], gv, first - plan.before, count, plan.b)
            else:
                lo, hi = where[2], where[3]
                dk[e, lo:hi] += gk[0].transpose(0, 1)
                dv[e, lo:hi] += gv[0].transpose(0, 1)


def _backward_buffers(grad_out, dead, query):
    """The output gradient (contiguous, zero for the ``dead`` queries,
    which see no key, as :func:`band_backward` requires) and the buffers
    of the input gradients (``dq``, ``dk``, ``dv``, written by
    :func:`band_backward`), shaped like ``query``."""
    grad_out = grad_out.contiguous()
    if dead is not None:
        grad_out = grad_out.masked_fill(dead[..., None], 0.0)
    return grad_out, torch.empty_like(query), torch.empty_like(query), torch.empty_like(query)


class _BandAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, key_mask, plan, scale):
        B, T, H, d = query.shape
        out = torch.empty((B, T, H, d), dtype=query.dtype)
        lse = torch.empty((B, T, H), dtype=torch.float32)
        dead = band_forward(plan, query, key, value, key_mask, scale, out, lse)
        ctx.save_for_backward(query, key, value, out, lse, key_mask)
        ctx.plan, ctx.scale, ctx.dead = plan, scale, dead
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, key_mask = ctx.saved_tensors
        grad_out, dq, dk, dv = _backward_buffers(grad_out, ctx.dead, query)
        band_backward(ctx.plan, query, key, value, key_mask, ctx.scale, out, lse, grad_out,
                      dq, dk, dv)
        return dq, dk, dv, None, None, None


class _BandWithKeys(torch.autograd.Function):
    """The band plus a few extra keys (``G``) in one softmax.

    Forward: the band through :func:`band_forward` gives ``o_b`` and its
    log-sum-exp ``l_b``; the extra keys' scores ``s`` ``(B, T, H, G)`` are
    explicit (``G`` is small). With ``L = logaddexp(l_b, logsumexp(s))``,
    ``a = exp(l_b - L)`` and ``P = exp(s - L)`` the result is
    ``O = a o_b + P v_extra``.

    Backward: the band's share of ``O`` is ``a p_b`` (``p_b`` its own
    softmax), so a band score's gradient is ``a p_b (dO . v - dO . O)``: the
    flash backward computes exactly that when given ``a dO`` as the output
    gradient and the *merged* ``O`` as the output (it forms ``D`` as the
    row sums of the two), with ``l_b``. The extra keys' part is the usual
    softmax gradient, ``P (dO . v_extra - dO . O)``, in explicit einsums.
    """

    @staticmethod
    def forward(ctx, query, key, value, key_mask, extra_keys, extra_values, bias, plan,
                scale):
        B, T, H, d = query.shape
        band_out = torch.empty((B, T, H, d), dtype=query.dtype)
        band_lse = torch.empty((B, T, H), dtype=torch.float32)
        band_forward(plan, query, key, value, key_mask, scale, band_out, band_lse)
        scores = torch.einsum("bthd,bghd->bthg", query, extra_keys) * scale + bias
        merged = torch.logaddexp(band_lse, torch.logsumexp(scores, dim=-1))
        share = torch.exp(band_lse - merged)  # (B, T, H)
        out = share[..., None] * band_out + torch.einsum(
            "bthg,bghd->bthd", torch.exp(scores - merged[..., None]), extra_values)
        dead = merged < DEAD_LSE
        if bool(dead.any()):
            out.masked_fill_(dead[..., None], 0.0)
            share = share.masked_fill(dead, 0.0)
        else:
            dead = None
        ctx.save_for_backward(query, key, value, key_mask, extra_keys, extra_values, bias,
                              out, band_lse, merged, share)
        ctx.plan, ctx.scale, ctx.dead = plan, scale, dead
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (query, key, value, key_mask, extra_keys, extra_values, bias, out, band_lse, merged,
         share) = ctx.saved_tensors
        scale = ctx.scale
        grad_out, dq, dk, dv = _backward_buffers(grad_out, ctx.dead, query)
        # ``share`` is 0 for a query that sees no band key: its band
        # gradient vanishes, as band_backward requires.
        band_backward(ctx.plan, query, key, value, key_mask, scale, out, band_lse,
                      (share[..., None] * grad_out).contiguous(), dq, dk, dv)
        scores = torch.einsum("bthd,bghd->bthg", query, extra_keys) * scale + bias
        probs = torch.exp(scores - merged[..., None])
        if ctx.dead is not None:
            probs = probs.masked_fill(ctx.dead[..., None], 0.0)
        row = (grad_out * out).sum(-1, keepdim=True)  # (B, T, H, 1)
        dscores = probs * (torch.einsum("bthd,bghd->bthg", grad_out, extra_values) - row)
        dq += scale * torch.einsum("bthg,bghd->bthd", dscores, extra_keys)
        d_extra_keys = scale * torch.einsum("bthg,bthd->bghd", dscores, query)
        d_extra_values = torch.einsum("bthg,bthd->bghd", probs, grad_out)
        return dq, dk, dv, None, d_extra_keys, d_extra_values, None, None, None


def _fold(target, band, first_block, count, b):
    """Adds the band gradients ``(G, H, C, d)`` of ``count`` consecutive
    blocks onto ``target`` ``(T, H, d)``: block ``g``'s ``C`` keys start at
    position ``(first_block + g) * b``."""
    for s in range(band.shape[2] // b):
        part = band[:, :, s * b:(s + 1) * b].transpose(1, 2)  # (G, b, H, d)
        _blocks(target, first_block + s, count, b).add_(part)
