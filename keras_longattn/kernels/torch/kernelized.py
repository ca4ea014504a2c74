"""Kernelized attention for PyTorch with hand-written gradients.

The portable functions of :mod:`keras_longattn.ops.kernelized` and
:mod:`keras_longattn.ops.performer` compute the same numbers with
``keras.ops``; under eager PyTorch autograd then records every
intermediate: a column of ones appended to the values (65-wide matrices
and strided slices), transposed copies, a flip and a cumsum per prefix
sum in the backward pass, and one tensor per step of the stabilised
``exp`` of FAVOR+. On a CPU those passes over memory, not the matrix
products, are most of the time. Here each piece is one
``torch.autograd.Function`` whose backward pass is written out:

* :func:`causal_kernel_attention`: causal chunked prefix sums (the maths of
  :func:`keras_longattn.ops.kernelized.causal_kernel_attention`): per
  chunk the lower triangle of ``phi(Q) phi(K)^T`` and an exclusive prefix
  sum of the chunks' ``phi(K)^T V`` (normalisers kept as separate
  ``(F,)`` sums, not as a column of ones). The backward pass forms the
  reverse prefix sums of the gradients. Each prefix sum starts from zero
  (an inclusive sum minus the entry would carry a rounding error relative
  to the whole sum).
* :func:`kernel_attention`: the bidirectional associative form.
* :func:`softmax_kernel_features`: the stabilised positive random features
  of FAVOR+ as one function whose gradient is
  ``d/dx = s ((g * phi) W - x' sum_r g_r phi_r)``.

Same arguments, shapes and semantics as the portable functions; everything
in float32. Tested against them (values and gradients) in
``tests/kernels/test_torch_kernelized.py``.

Shape legend: B batch, T query length, S key length, H heads, F features,
D value head size, C chunk size, N chunks, G = B * H * N.
"""

import torch
import torch.nn.functional as nnf

from keras_longattn.kernels.constants import DEFAULT_CHUNK_SIZE
from keras_longattn.kernels.constants import DEFAULT_EPSILON
from keras_longattn.kernels.constants import check_chunk_size
from keras_longattn.kernels.constants import check_epsilon


def _to_chunks(x, padded, chunk, head_major=False):
    """``(B, L, H, X)`` (``(B, H, L, X)`` when ``head_major``) to
    head-major chunks ``(B * H * N, C, X)`` (zero rows appended up to
    ``padded``; a view when ``x`` is head-major and ``L = padded``)."""
    if not head_major:
        x = x.transpose(1, 2)
    B, H, L, X = x.shape
    if padded != L:
        x = nnf.pad(x, (0, 0, 0, padded - L))
    return x.reshape(B * H * (padded // chunk), chunk, X)


def _from_chunks(x, B, H, length, head_major=False):
    """Inverse of :func:`_to_chunks`: a view ``(B, length, H, X)`` (or
    ``(B, H, length, X)``)."""
    x = x.reshape(B, H, -1, x.shape[-1])[:, :, :length]
    return x if head_major else x.transpose(1, 2)


def _mask_keys(key_features, value, key_mask, head_major=False):
    """Masked keys get features and values of exact zeros (``where``: a NaN
    there must not leak)."""
    if key_mask is None:
        return key_features, value
    mask = key_mask.to(torch.bool)
    if mask.dim() == 2:  # (B, S)
        mask = mask[:, :, None]
    mask = mask[..., None]  # (B, S, H or 1, 1)
    zero = torch.zeros((), dtype=key_features.dtype, device=key_features.device)
    fmask = mask.transpose(1, 2) if head_major else mask
    return torch.where(fmask, key_features, zero), torch.where(mask, value, zero)


#: Most elements per addition of :func:`_exclusive_cumsum`: PyTorch's
#: grain size, below which an elementwise operation runs on one thread.
_SERIAL_ELEMENTS = 32768


def _exclusive_cumsum(x, reverse=False):
    """Sums over axis 1 of the entries strictly before each one (after
    each one when ``reverse``), each summed from zero (not as an
    inclusive sum minus the entry, whose rounding error is relative to
    the whole sum).

    In-place additions, one per chunk and per slice of at most
    :data:`_SERIAL_ELEMENTS` elements: ``torch.cumsum`` along a non-last
    axis runs a strided loop on a CPU, and slices small enough to run on
    one thread keep hundreds of short parallel regions from waiting on
    each other's threads.
    """
    rows, steps = x.shape[0], x.shape[1]
    flat = x.reshape(rows, steps, -1)
    out = torch.empty_like(flat)
    width = flat.shape[-1]
    step = max(1, _SERIAL_ELEMENTS // max(rows, 1))
    pieces = [slice(a, min(width, a + step)) for a in range(0, width, step)]
    order = range(steps - 2, -1, -1) if reverse else range(1, steps)
    out[:, steps - 1 if reverse else 0].zero_()
    for c in order:
        prev = c + 1 if reverse else c - 1
        for p in pieces:
            torch.add(out[:, prev, p], flat[:, prev, p], out=out[:, c, p])
    return out.view(x.shape)


class _CausalKernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qf, kf, v, chunk, epsilon, head_major):
        B, S, H, D = v.shape
        T = qf.shape[2 if head_major else 1]
        F = qf.shape[-1]
        L = max(T, S)
        C = max(1, min(chunk, L))
        N = -(-L // C)
        padded = N * C
        q = _to_chunks(qf, padded, C, head_major)  # (G, C, F)
        k = _to_chunks(kf, padded, C, head_major)
        val = _to_chunks(v, padded, C)  # (G, C, D)
        G = q.shape[0]
        BH = G // N
        # Inside each chunk: lower triangle of q k^T.
        weights = torch.bmm(q, k.transpose(1, 2)).tril_()  # (G, C, C)
        num = torch.bmm(weights, val)  # (G, C, D)
        den = weights.sum(-1)  # (G, C)
        # Earlier chunks: exclusive prefix sums of k^T v and of k.
        kv = torch.bmm(k.transpose(1, 2), val).view(BH, N, F, D)
        ks = k.sum(1).view(BH, N, F)
        past = _exclusive_cumsum(kv).view(G, F, D)
        past_ks = _exclusive_cumsum(ks).view(G, F)
        num.baddbmm_(q, past)
        den.add_(torch.bmm(q, past_ks.unsqueeze(-1)).squeeze(-1))
        safe = den.clamp_min(epsilon)
        out = num.div_(safe.unsqueeze(-1))
        ctx.save_for_backward(q, k, val, weights, past, past_ks, den, safe, out)
        ctx.dims = (B, T, S, H, N, epsilon, head_major)
        return _from_chunks(out, B, H, T)

    @staticmethod
    def backward(ctx, grad):
        q, k, val, weights, past, past_ks, den, safe, out = ctx.saved_tensors
        B, T, S, H, N, epsilon, head_major = ctx.dims
        G, C, F = q.shape
        D = val.shape[-1]
        BH = G // N
        g = _to_chunks(grad.to(out.dtype), N * C, C)  # (G, C, D)
        g_num = g / safe.unsqueeze(-1)
        # d out / d den = -out / den, where den > epsilon (else clamped).
        g_den = (g_num * out).sum(-1).neg_()
        g_den = torch.where(den > epsilon, g_den, torch.zeros_like(g_den))
        # Inside the chunks.
        g_w = torch.bmm(g_num, val.transpose(1, 2)).add_(g_den.unsqueeze(-1)).tril_()
        g_q = torch.bmm(g_w, k)
        g_k = torch.bmm(g_w.transpose(1, 2), q)
        g_v = torch.bmm(weights.transpose(1, 2), g_num)
        # Through the exclusive prefix sums.
        g_q.baddbmm_(g_num, past.transpose(1, 2))
        g_q.addcmul_(g_den.unsqueeze(-1), past_ks.unsqueeze(1))
        qt = q.transpose(1, 2)
        g_past = torch.bmm(qt, g_num).view(BH, N, F, D)
        g_past_ks = torch.bmm(qt, g_den.unsqueeze(-1)).view(BH, N, F)
        # Chunk c feeds the prefix of every later chunk: a reverse
        # exclusive sum.
        g_kv = _exclusive_cumsum(g_past, reverse=True).view(G, F, D)
        g_ks = _exclusive_cumsum(g_past_ks, reverse=True).view(G, 1, F)
        g_k.baddbmm_(val, g_kv.transpose(1, 2)).add_(g_ks)
        g_v.baddbmm_(k, g_kv)
        return (
            _from_chunks(g_q, B, H, T, head_major),
            _from_chunks(g_k, B, H, S, head_major),
            _from_chunks(g_v, B, H, S),
            None,
            None,
            None,
        )


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qf, kf, v, epsilon, head_major):
        # Head-major: (BH, T, F), (BH, S, F), (BH, S, D).
        B, S, H, D = v.shape
        F = qf.shape[-1]
        if not head_major:
            qf, kf = qf.transpose(1, 2), kf.transpose(1, 2)
        T = qf.shape[2]
        q = qf.reshape(B * H, T, F)
        k = kf.reshape(B * H, S, F)
        val = v.transpose(1, 2).reshape(B * H, S, D)
        kv = torch.bmm(k.transpose(1, 2), val)  # (BH, F, D)
        ks = k.sum(1)  # (BH, F)
        num = torch.bmm(q, kv)  # (BH, T, D)
        den = torch.bmm(q, ks.unsqueeze(-1)).squeeze(-1)  # (BH, T)
        safe = den.clamp_min(epsilon)
        out = num.div_(safe.unsqueeze(-1))
        ctx.save_for_backward(q, k, val, kv, ks, den, safe, out)
        ctx.dims = (B, H, epsilon, head_major)
        return out.view(B, H, T, -1).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        q, k, val, kv, ks, den, safe, out = ctx.saved_tensors
        B, H, epsilon, head_major = ctx.dims
        BH, T, F = q.shape
        S, D = k.shape[1], val.shape[-1]
        g = grad.to(out.dtype).transpose(1, 2).reshape(BH, T, D)
        g_num = g / safe.unsqueeze(-1)
        g_den = (g_num * out).sum(-1).neg_()
        g_den = torch.where(den > epsilon, g_den, torch.zeros_like(g_den))
        g_q = torch.bmm(g_num, kv.transpose(1, 2))
        g_q.addcmul_(g_den.unsqueeze(-1), ks.unsqueeze(1))
        qt = q.transpose(1, 2)
        g_kv = torch.bmm(qt, g_num)  # (BH, F, D)
        g_ks = torch.bmm(qt, g_den.unsqueeze(-1)).view(BH, 1, F)
        g_k = torch.bmm(val, g_kv.transpose(1, 2)).add_(g_ks)
        g_v = torch.bmm(k, g_kv)

        def back(x, n, head_major=False):
            x = x.view(B, H, n, x.shape[-1])
            return x if head_major else x.transpose(1, 2)

        return (
            back(g_q, T, head_major), back(g_k, S, head_major), back(g_v, S),
            None, None,
        )


def _eager(fn):
    """Kept eager inside a ``torch.compile``-d model (the policy of
    :meth:`keras_longattn.kernels.torch.TorchOps.compile`)."""
    from keras_longattn.kernels.torch import OPS

    run = OPS.compile(fn)
    run.__doc__ = fn.__doc__
    run.__name__ = fn.__name__
    return run


@_eager
def causal_kernel_attention(
    query_features,
    key_features,
    value,
    key_mask=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
    epsilon=DEFAULT_EPSILON,
    head_major=False,
):
    """:func:`keras_longattn.ops.kernelized.causal_kernel_attention` with a
    written-out backward pass (same arguments; torch tensors). With
    ``head_major`` the features are ``(B, H, T, F)`` and ``(B, H, S, F)``
    (as :func:`softmax_kernel_features` gives them), which spares two
    transposed copies of ``F``-wide tensors.

    Returns:
        ``(B, T, H, D)`` in the dtype of ``value``.
    """
    chunk_size = check_chunk_size(chunk_size)
    epsilon = check_epsilon(epsilon)
    dtype = value.dtype
    qf = query_features.float()
    kf, v = _mask_keys(key_features.float(), value.float(), key_mask, head_major)
    out = _CausalKernelAttention.apply(
        qf, kf, v, chunk_size, epsilon, bool(head_major)
    )
    return out.to(dtype)


@_eager
def kernel_attention(
    query_features, key_features, value, key_mask=None, epsilon=DEFAULT_EPSILON,
    head_major=False,
):
    """:func:`keras_longattn.ops.kernelized.kernel_attention` with a
    written-out backward pass (same arguments; torch tensors; features
    ``(B, H, n, F)`` when ``head_major``)."""
    epsilon = check_epsilon(epsilon)
    dtype = value.dtype
    qf = query_features.float()
    kf, v = _mask_keys(key_features.float(), value.float(), key_mask, head_major)
    return _KernelAttention.apply(qf, kf, v, epsilon, bool(head_major)).to(dtype)


def associative_attention(
    query_features,
    key_features,
    value,
    causal=False,
    key_mask=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
    epsilon=DEFAULT_EPSILON,
    head_major=False,
):
    """:func:`keras_longattn.ops.kernelized.associative_attention`, either
    mode, with written-out backward passes (features ``(B, H, n, F)`` when
    ``head_major``)."""
    if causal:
        return causal_kernel_attention(
            query_features, key_features, value, key_mask=key_mask,
            chunk_size=chunk_size, epsilon=epsilon, head_major=head_major,
        )
    return kernel_attention(
        query_features, key_features, value, key_mask=key_mask, epsilon=epsilon,
        head_major=head_major,
    )


class _SoftmaxKernelFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, projection, is_query, causal, keep, head_major):
        B, n, H, d = x.shape
        m = projection.shape[0]
        scale = float(d) ** -0.25
        u = x * scale
        if head_major:  # rows (B, H, n): transpose the d-wide input only
            u = u.transpose(1, 2)
        u = u.reshape(-1, d)
        shape = (B, H, n, m) if head_major else (B, n, H, m)
        # z = u W^T - |u|^2 / 2, then shifted, exponentiated in place.
        z = torch.addmm(u.square().sum(-1, keepdim=True), u, projection.t(), beta=-0.5)
        half_bound = 0.25 * projection.square().sum(-1).max()
        if is_query:
            shift = z.amax(-1, keepdim=True)
            if causal:
                shift = shift - half_bound
            z.sub_(shift)
        elif causal:
            z.sub_(half_bound)
        else:
            rows = z.amax(-1).view(B, H, n) if head_major else z.amax(-1).view(B, n, H)
            if keep is not None:
                pad = ~keep[:, None, :] if head_major else ~keep[:, :, None]
                rows = rows.masked_fill(pad, float("-inf"))
            # One shift per example and head: (B, H, 1, 1) or (B, 1, H, 1).
            shift = rows.amax(2 if head_major else 1, keepdim=True).unsqueeze(-1)
            shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
            z.view(shape).sub_(shift)
        if keep is not None:
            pad = ~keep[:, None, :, None] if head_major else ~keep[:, :, None, None]
            z.view(shape).masked_fill_(pad, float("-inf"))
        phi = z.exp_().mul_(float(m) ** -0.5)
        ctx.save_for_backward(u, projection, phi)
        ctx.scale = scale
        ctx.head_major = head_major
        return phi.view(shape)

    @staticmethod
    def backward(ctx, grad):
        u, projection, phi = ctx.saved_tensors
        m, d = projection.shape
        g = grad.reshape(-1, m) * phi  # (B n H, m)
        g_x = None
        g_w = None
        if ctx.needs_input_grad[0]:
            g_u = torch.mm(g, projection)
            g_u.addcmul_(u, g.sum(-1, keepdim=True), value=-1.0)
            g_u.mul_(ctx.scale)
            if ctx.head_major:
                B, H, n, _ = grad.shape
                g_x = g_u.view(B, H, n, d).transpose(1, 2)
            else:
                g_x = g_u.view(grad.shape[:-1] + (d,))
        if ctx.needs_input_grad[1]:
            g_w = torch.mm(g.t(), u)
        return g_x, g_w, None, None, None, None


@_eager
def softmax_kernel_features(
    x, projection, is_query, causal=False, mask=None, head_major=False
):
    """:func:`keras_longattn.ops.performer.softmax_kernel_features` as one
    function with a written-out gradient (same arguments and stabilisers;
    the shifts are constants for the gradient, as there).

    Returns:
        float32 ``(B, n, H, m)``, or ``(B, H, n, m)`` when ``head_major``
        (the layout the attention functions take with ``head_major``).
    """
    keep = None if mask is None else mask.to(torch.bool)
    return _SoftmaxKernelFeatures.apply(
        x.float(), projection.float(), bool(is_query), bool(causal), keep,
        bool(head_major),
    )
