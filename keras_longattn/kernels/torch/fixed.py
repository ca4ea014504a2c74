"""The Sparse Transformer's fixed pattern on PyTorch's CPU kernels.

Heads ``[0, block_heads)`` attend their own block of ``l`` positions
(pattern A), the other heads the *summary* cells, the last ``c`` positions
of every block (pattern B); causal calls keep keys ``j <= i``.

* Pattern A is one attention per block: the blocks are a ``(B * m, l, h,
  d)`` view of the inputs, given to the compiled band kernel
  (:mod:`keras_longattn.kernels.torch.native`) as sequences of ``l`` with a
  band of ``l - 1`` keys, or, where it does not build, to the flash kernel
  with its own causal mode.
* Pattern B gathers the ``m * c`` summary keys and values (a small copy).
  Where the compiled kernel builds, every query is given its exact interval
  of summaries (causal: those of the earlier blocks and the summary cells
  of its own block up to itself; bidirectional: all), so no masked pair is
  computed beyond the ends of a tile's 16-query halves. Otherwise the
  queries go to the flash kernel in groups of whole blocks, each group
  against the summaries up to its own last block (the grouping of
  ``keras_longattn.ops.sparse``: about 56 % of all query-summary pairs
  with causal attention, most of them allowed), with one additive bias per
  group for the blocks inside it.

Both parts read the inputs through views and write one output and one
gradient per input, so no head slice, scaled copy or concatenation (nor
their backward) is made. A query that sees no key (causal pattern B: the
first ``l - c`` positions) gets zeros, and no gradient flows through it.

Shape legend: B batch, T sequence length, H heads, d head size, l block
length, c summary width, m = T / l blocks, h heads of pattern A.
"""

import torch

from keras_longattn.kernels.torch import band, native

_flash = band._flash
_flash_backward = band._flash_backward

#: Query groups of pattern B with causal attention (as ``ops.sparse``).
GROUPS = 8


def fixed_attention(query, key, value, block_length, summary_width, causal, block_heads,
                    scale):
    """Fixed sparse attention of ``(B, T, H, d)`` float32 heads, ``T`` a
    multiple of ``block_length``, no padding: heads ``[0, block_heads)``
    see the keys of their own block, the others the last ``summary_width``
    positions of every block (and only ``j <= i`` when ``causal``).
    Returns ``(B, T, H, d)``."""
    reason = band.supported(query, key, value)
    if reason is not None:
        raise ValueError(f"fixed_attention cannot run this call: {reason}.")
    T, H = query.shape[1], query.shape[2]
    l, c, h = int(block_length), int(summary_width), int(block_heads)
    if l < 2 or T % l:
        raise ValueError(
            "fixed_attention needs a block_length >= 2 that divides the sequence "
            f"length. Received: block_length={l}, sequence length {T}"
        )
    if not 1 <= c < l:
        raise ValueError(
            f"`summary_width` must be in [1, block_length). Received: summary_width={c}, "
            f"block_length={l}"
        )
    if not 0 <= h <= H:
        raise ValueError(f"`block_heads` must be in [0, {H}]. Received: block_heads={h}")
    query, key, value = (t if _viewable(t) else t.contiguous() for t in (query, key, value))
    return _Fixed.apply(query, key, value, _Plan(T, l, c, bool(causal)), h, float(scale))


@torch.compiler.disable
def fixed_attention_eager(query, key, value, block_length, summary_width, causal, block_heads,
                          scale):
    """:func:`fixed_attention`, run eagerly inside a compiled model."""
    return fixed_attention(query, key, value, block_length, summary_width, causal,
                           block_heads, scale)


class _Plan:
    """The summary intervals of pattern B's queries (compiled kernel), and
    its query groups and their additive biases (flash kernel)."""

    def __init__(self, T, l, c, causal):
        self.l, self.c, self.causal = l, c, causal
        m = T // l
        self.m = m
        # Query i sees summaries [0, last[i]) of the m * c: the c of every
        # earlier block, and (causal) its own block's cells up to i.
        pos = torch.arange(T)
        if causal:
            last = (pos // l) * c + (pos % l - (l - c) + 1).clamp(0, c)
        else:
            last = torch.full((T,), m * c)
        self.intervals = torch.stack([torch.zeros_like(last), last]).to(torch.int32).contiguous()
        self._groups = None

    @property
    def groups(self):
        """``(first query, end query, summaries read, bias or None)`` of each
        query group of the flash-kernel path (made on first use: the biases
        are as large as the pairs they mask)."""
        if self._groups is None:
            l, c, m, causal = self.l, self.c, self.m, self.causal
            if causal:
                count = min(GROUPS, m)
                bounds = [round(g * m / count) for g in range(count + 1)]
            else:
                bounds = [0, m]
            self._groups = []
            for first, end in zip(bounds[:-1], bounds[1:]):
                if end <= first:
                    continue
                read = end if causal else m
                bias = None
                if causal:
                    q_pos = torch.arange(first * l, end * l)[:, None]
                    k_pos = (torch.arange(read)[:, None] * l
                             + torch.arange(l - c, l)).reshape(1, -1)
                    bias = torch.zeros((q_pos.shape[0], k_pos.shape[1])).masked_fill(
                        k_pos > q_pos, band.MASKED_BIAS)[None, None]
                self._groups.append((first * l, end * l, read * c, bias))
        return self._groups


def _viewable(x):
    """Whether :func:`_blocks` can view ``x`` ``(B, T, H, e)``: last stride
    1, and the sequences of the batch one after another (any batch stride
    when ``B == 1``)."""
    return x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))


def _blocks(x, l):
    """``x`` ``(B, T, h, e)`` (a head slice of a :func:`_viewable` tensor)
    as ``(B * m, l, h, e)`` blocks of ``l`` positions: a view."""
    B, T = x.shape[0], x.shape[1]
    if not _viewable(x):
        raise ValueError("fixed_attention: the batch axis must be laid out as whole sequences")
    return x.as_strided((B * (T // l), l) + tuple(x.shape[2:]),
                        (l * x.stride(1),) + x.stride()[1:], x.storage_offset())


def _summaries(x, l, c):
    """``x`` ``(B, T, h, e)`` as ``(B, m, c, h, e)``: the last ``c``
    positions of every block (a view)."""
    B, T = x.shape[0], x.shape[1]
    s = x.stride()
    return x.as_strided((B, T // l, c) + tuple(x.shape[2:]),
                        (s[0], l * s[1]) + s[1:], x.storage_offset() + (l - c) * s[1])


def _heads_first(x):
    """``(B, T, h, e)`` -> ``(B, h, T, e)`` (a view)."""
    return x.transpose(1, 2)


class _Fixed(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, plan, h, scale):
        B, T, H, d = query.shape
        l, c = plan.l, plan.c
        out = torch.empty_like(query)
        kernel = native.band_ops()
        lse_a = lse_b = dead = None
        if h:
            qa, ka, va, oa = (_blocks(t[:, :, :h], l) for t in (query, key, value, out))
            if kernel is not None:
                lse_a = torch.empty((B * plan.m, l, h), dtype=torch.float32)
                kernel.forward(qa, ka, va, None, l - 1, 0 if plan.causal else l - 1,
                               band.NATIVE_TILE, scale, oa, lse_a, band.NATIVE_PACK)
            else:
                o, lse_a = _flash(*(_heads_first(t) for t in (qa, ka, va)), 0.0, plan.causal,
                                  scale=scale)
                _heads_first(oa).copy_(o)
        if h < H:
            ks, vs = (_summaries(t[:, :, h:], l, c).reshape(B, plan.m * c, H - h, d)
                      for t in (key, value))
            ctx.summaries = (ks, vs)
        if h < H and kernel is not None:
            # Queries that see no summary get zeros and no gradient there.
            lse_b = torch.empty((B, T, H - h), dtype=torch.float32)
            kernel.forward(query[:, :, h:], ks, vs, None, 0, 0, band.NATIVE_TILE, scale,
                           out[:, :, h:], lse_b, band.NATIVE_PACK, plan.intervals)
        elif h < H:
            lse_b = torch.empty((B, H - h, T), dtype=torch.float32)
            for start, stop, read, bias in plan.groups:
                q = _heads_first(query[:, start:stop, h:])
                o, lse = _flash(q, _heads_first(ks[:, :read]), _heads_first(vs[:, :read]), 0.0,
                                False, attn_mask=bias, scale=scale)
                _heads_first(out[:, start:stop, h:]).copy_(o)
                lse_b[:, :, start:stop] = lse
            if plan.causal:
                dead = lse_b < band.DEAD_LSE  # (B, H - h, T): sees no summary
                if bool(dead.any()):
                    _heads_first(out[:, :, h:]).masked_fill_(dead[..., None], 0.0)
                else:
                    dead = None
        ctx.save_for_backward(query, key, value, out)
        ctx.lse = (lse_a, lse_b)
        ctx.plan, ctx.h, ctx.scale, ctx.kernel, ctx.dead = plan, h, scale, kernel, dead
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out = ctx.saved_tensors
        plan, h, scale, kernel = ctx.plan, ctx.h, ctx.scale, ctx.kernel
        lse_a, lse_b = ctx.lse
        B, T, H, d = query.shape
        l, c = plan.l, plan.c
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        if h:
            qa, ka, va, oa, ga, dqa, dka, dva = (
                _blocks(t[:, :, :h], l)
                for t in (query, key, value, out, grad_out, dq, dk, dv))
            if kernel is not None:
                kernel.backward(qa, ka, va, None, l - 1, 0 if plan.causal else l - 1,
                                band.NATIVE_TILE, scale, oa, lse_a, ga, dqa, dka, dva,
                                band.NATIVE_PACK)
            else:
                gq, gk, gv = _flash_backward(*(_heads_first(t) for t in (ga, qa, ka, va, oa)),
                                             lse_a, 0.0, plan.causal, scale=scale)
                for target, part in ((dqa, gq), (dka, gk), (dva, gv)):
                    _heads_first(target).copy_(part)
        if h < H:
            ks, vs = ctx.summaries
        if h < H and kernel is not None:
            gks, gvs = torch.empty_like(ks), torch.empty_like(vs)
            kernel.backward(query[:, :, h:], ks, vs, None, 0, 0, band.NATIVE_TILE, scale,
                            out[:, :, h:], lse_b, grad_out[:, :, h:], dq[:, :, h:], gks, gvs,
                            band.NATIVE_PACK, plan.intervals)
        elif h < H:
            gks = torch.zeros_like(ks)
            gvs = torch.zeros_like(vs)
            go_b = grad_out[:, :, h:]
            if ctx.dead is not None:
                go_b = go_b.masked_fill(ctx.dead.transpose(1, 2)[..., None], 0.0)
            for start, stop, read, bias in plan.groups:
                gq, gk, gv = _flash_backward(
                    _heads_first(go_b[:, start:stop]), _heads_first(query[:, start:stop, h:]),
                    _heads_first(ks[:, :read]), _heads_first(vs[:, :read]),
                    _heads_first(out[:, start:stop, h:]), lse_b[:, :, start:stop], 0.0, False,
                    attn_mask=bias, scale=scale)
                _heads_first(dq[:, start:stop, h:]).copy_(gq)
                _heads_first(gks[:, :read]).add_(gk)
                _heads_first(gvs[:, :read]).add_(gv)
        if h < H:
            for target, part in ((dk, gks), (dv, gvs)):
                target[:, :, h:].zero_()
                _summaries(target[:, :, h:], l, c).copy_(part.view(B, plan.m, c, H - h, d))
        ctx.summaries = None
        return dq, dk, dv, None, None, None
