"""The Sparse Transformer's strided pattern on PyTorch's CPU flash kernel.

Heads ``[0, window_heads)`` attend a sliding window of ``stride`` keys
(pattern A: :func:`keras_longattn.kernels.torch.band.band_forward`), the
other heads every ``stride``-th key (pattern B: each *column* of the
sequence seen as ``(T / stride rows, stride columns)`` attends within
itself). Both parts read the inputs through strided views and write into
one output, and the backward pass into one gradient per input, so that no
head slice, transposed copy or concatenation (nor their backward) is made:
in the portable fused path these copies cost more than the kernel calls.
The autograd function keeps the inputs, the output and the log-sum-exp.

Where the compiled band kernel builds (:mod:`keras_longattn.kernels.torch.native`),
it runs both parts: pattern A as the band, pattern B as a band of
``T / stride`` keys over each column (the columns are one more strided
view), instead of the flash calls.

Shape legend: B batch, T sequence length, H heads, d head size, l stride,
m = T / l rows, h heads of pattern A.
"""

import torch

from keras_longattn.kernels.torch import band, native

_flash = band._flash
_flash_backward = band._flash_backward


def strided_attention(query, key, value, stride, causal, window_heads, scale):
    """Strided sparse attention of ``(B, T, H, d)`` float32 heads, ``T`` a
    multiple of ``stride``, no padding: heads ``[0, window_heads)`` see keys
    ``i - stride < j <= i`` (bidirectional ``|i - j| < stride``), the others
    keys with ``(i - j) mod stride == 0`` (and ``j <= i`` when causal).
    Returns ``(B, T, H, d)``."""
    reason = band.supported(query, key, value)
    if reason is not None:
        raise ValueError(f"strided_attention cannot run this call: {reason}.")
    T, H = query.shape[1], query.shape[2]
    stride, window_heads = int(stride), int(window_heads)
    if stride < 1 or T % stride:
        raise ValueError(
            "strided_attention needs a stride >= 1 that divides the sequence "
            f"length. Received: stride={stride}, sequence length {T}"
        )
    if not 0 <= window_heads <= H:
        raise ValueError(
            f"`window_heads` must be in [0, {H}]. Received: window_heads={window_heads}"
        )
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous()
                         for t in (query, key, value))
    look_ahead = 0 if causal else stride - 1
    # The band's blocks are a tiling only: the kernel's default size, not
    # the stride (blocks of 64 against 128 at stride 128: 0.84x the time).
    plan = band._Plan(T, band.default_block_size(stride - 1, look_ahead), stride - 1,
                      look_ahead, window_heads * query.shape[3]) if window_heads else None
    return _Strided.apply(query, key, value, plan, stride, bool(causal), window_heads,
                          float(scale))


@torch.compiler.disable
def strided_attention_eager(query, key, value, stride, causal, window_heads, scale):
    """:func:`strided_attention`, run eagerly inside a compiled model."""
    return strided_attention(query, key, value, stride, causal, window_heads, scale)


def _column_rows(x, stride):
    """``x`` ``(T, H, d)`` as ``(l, m, H, d)``: column ``c``, row ``r`` is
    position ``r * l + c`` (a view: the compiled kernel's layout)."""
    T, H, d = x.shape
    return x.as_strided((stride, T // stride, H, d), (x.stride(0), stride * x.stride(0))
                        + x.stride()[1:], x.storage_offset())


def _columns(x, stride):
    """``x`` ``(T, H, d)`` as ``(l, H, m, d)``: column ``c``, row ``r`` is
    position ``r * l + c`` (a view)."""
    T, H, d = x.shape
    rows = x.as_strided((T // stride, stride, H, d), (stride * x.stride(0),) + x.stride(),
                        x.storage_offset())
    return rows.permute(1, 2, 0, 3)


class _Strided(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, plan, stride, causal, h, scale):
        B, T, H, d = query.shape
        out = torch.empty((B, T, H, d), dtype=query.dtype)
        lse_a = torch.empty((B, T, h), dtype=torch.float32)
        lse_b = torch.empty((B, stride, H - h, T // stride), dtype=torch.float32)
        kernel = native.band_ops()  # compiled kernel, or None: flash calls
        if h:
            band.band_forward(plan, query[:, :, :h], key[:, :, :h], value[:, :, :h], None,
                              scale, out[:, :, :h], lse_a)
        if h < H and kernel is not None:
            m = T // stride
            for e in range(B):
                q, k, v, o = (_column_rows(t[e, :, h:], stride) for t in (query, key, value, out))
                kernel.forward(q, k, v, None, m - 1, 0 if causal else m - 1, band.NATIVE_TILE,
                               scale, o, lse_b[e].transpose(1, 2), band.NATIVE_PACK)
        elif h < H:
            for e in range(B):
                q, k, v = (_columns(t[e, :, h:], stride) for t in (query, key, value))
                o, l = _flash(q, k, v, 0.0, causal, scale=scale)
                _columns(out[e, :, h:], stride).copy_(o)
                lse_b[e] = l
        ctx.save_for_backward(query, key, value, out, lse_a, lse_b)
        ctx.kernel = kernel
        ctx.plan, ctx.stride, ctx.causal, ctx.h, ctx.scale = plan, stride, causal, h, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse_a, lse_b = ctx.saved_tensors
        plan, stride, causal, h, scale = ctx.plan, ctx.stride, ctx.causal, ctx.h, ctx.scale
        H = query.shape[2]
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(out)
        dk = torch.empty_like(out)
        dv = torch.empty_like(out)
        if h:
            band.band_backward(plan, query[:, :, :h], key[:, :, :h], value[:, :, :h], None,
                               scale, out[:, :, :h], lse_a, grad_out[:, :, :h],
                               dq[:, :, :h], dk[:, :, :h], dv[:, :, :h])
        if h < H and ctx.kernel is not None:
            m = query.shape[1] // stride
            for e in range(query.shape[0]):
                q, k, v, o, go, gq, gk, gv = (
                    _column_rows(t[e, :, h:], stride)
                    for t in (query, key, value, out, grad_out, dq, dk, dv))
                ctx.kernel.backward(q, k, v, None, m - 1, 0 if causal else m - 1,
                                    band.NATIVE_TILE, scale, o, lse_b[e].transpose(1, 2),
                                    go, gq, gk, gv, band.NATIVE_PACK)
        elif h < H:
            for e in range(query.shape[0]):
                q, k, v = (_columns(t[e, :, h:], stride) for t in (query, key, value))
                go = _columns(grad_out[e, :, h:], stride)
                o = _columns(out[e, :, h:], stride)
                gq, gk, gv = _flash_backward(go, q, k, v, o, lse_b[e], 0.0, causal,
                                             scale=scale)
                _columns(dq[e, :, h:], stride).copy_(gq)
                _columns(dk[e, :, h:], stride).copy_(gk)
                _columns(dv[e, :, h:], stride).copy_(gv)
        return dq, dk, dv, None, None, None, None, None
