"""Nyström attention (Nyströmformer, Xiong et al. 2021): the softmax
matrix approximated from segment-mean landmarks and an iterative
pseudo-inverse, linear in the length."""

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn.layers._head_kernel import HeadKernel
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.ops import nystrom as nystrom_ops


@keras.saving.register_keras_serializable(package="keras_longattn")
class NystromAttention(BaseAttention):
    """Nyström attention (Nyströmformer): softmax attention approximated
    from ``num_landmarks`` landmarks; linear in the sequence length.

    The ``(T, S)`` softmax matrix is replaced by ``F A^+ B`` with
    ``F = softmax(Q K~^T / sqrt(d))`` ``(T, m)``,
    ``A = softmax(Q~ K~^T / sqrt(d))`` ``(m, m)`` and
    ``B = softmax(Q~ K^T / sqrt(d))`` ``(m, S)``, where the landmarks
    ``Q~`` and ``K~`` are the means of ``m`` consecutive segments of the
    queries and of the keys, and ``A^+`` is the Moore-Penrose pseudo-inverse
    of ``A`` computed by ``pinv_iterations`` steps of the iteration of
    Razavi et al. (2014), initialised as in the paper with
    ``A^T / (||A||_1 ||A||_inf)`` (per matrix). The output is
    ``F (A^+ (B V))``, computed in float32 whatever the dtype policy.

    **Landmarks of any length.** The paper cuts ``n`` tokens into ``m``
    segments of ``n / m`` (``n`` a multiple of ``m``). Here the real tokens
    of each example (padding excluded, wherever it is) are cut into segments
    of ``ceil(n_real / m)`` consecutive tokens; the last one may be shorter,
    and slots past it are empty and take no part in any softmax. An
    example's output therefore does not depend on the padding of its
    batch, and a sequence shorter than ``m`` uses one landmark per token
    (with enough iterations, exact attention: :meth:`full_attention_limit`).

    **Convolution on the values** (the authors' code; off by default):
    with ``conv_kernel_size=k`` (odd) a depthwise convolution along the
    sequence, one learned filter of ``k`` taps per head (the ``conv``
    weight, ``(k, num_heads)``), applied to the values (padding zeroed) is
    added to the output. Self-attention lengths only (``T == S``).

    **Bidirectional only**: every landmark is a mean over a whole segment,
    so query ``i`` would see keys after ``i`` through ``F`` and through
    ``A^+ B``; ``use_causal_mask=True`` is refused. There is no attention
    dropout (nothing forms attention weights over the keys): ``dropout > 0``
    is refused.

    **Cost**: the ``"landmarks"`` path forms the ``(T, m)``, ``(m, m)`` and
    ``(m, S)`` kernels and multiplies right to left: time
    O(n * m * d + m^3 * pinv_iterations), memory O(n * m) per head, never an
    ``n x n`` tensor. ``"reference"`` is the explicit quadratic form of the
    same approximation: landmarks by the explicit ``(m, n)`` averaging
    matrix, the ``(T, S)`` matrix ``F A^+ B`` (plus the convolution's band
    matrix) materialised and applied to ``V``; with a dense
    ``attention_mask``, each query's key landmarks are cut from the keys it
    may see. ``return_attention_scores=True`` returns that ``(T, S)``
    matrix (not a probability matrix: its entries may be negative).

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        num_landmarks: m, landmarks per head. Defaults to 64 (the paper's
            setting for its LRA and BERT models).
        pinv_iterations: iterations of the pseudo-inverse. Defaults to 6
            (the paper's).
        conv_kernel_size: odd number of taps of the depthwise convolution
            on the values, or None (no convolution). Defaults to None.
        **kwargs: the arguments of :class:`BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"landmarks"`` or ``"reference"``). The kernel
            initializer, regularizer and constraint also apply to the
            convolution's filters.

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``
        (padded queries take no part in the query landmarks; pass it for
        padded inputs: every query moves the query landmarks, so with
        ``value_mask`` alone a padded position, a real query, moves the
        real outputs),
        ``value_mask``/``key_mask`` ``(B, S)``, ``training``,
        ``return_attention_scores``. ``use_causal_mask=True`` is refused; a
        dense ``attention_mask`` only with ``implementation="reference"``.

    Returns:
        ``(B, T, output_dim)``, and the ``(B, H, T, S)`` matrix when
        ``return_attention_scores=True``.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.NystromAttention(
    ...     num_heads=2, key_dim=8, num_landmarks=16)
    >>> x = np.random.rand(2, 100, 16).astype("float32")
    >>> mask = np.arange(100)[None, :] < np.array([[100], [60]])
    >>> tuple(layer(x, x, query_mask=mask, value_mask=mask).shape)
    (2, 100, 16)
    >>> layer.last_implementation
    'landmarks'

    Reference:
        Xiong, Zeng, Chakraborty, Tan, Fung, Li and Singh, "Nyströmformer:
        A Nyström-Based Algorithm for Approximating Self-Attention", AAAI
        2021 (arXiv:2102.03902).
    """

    is_exact = False
    supports_causal = False
    supports_scores = True
    supports_attention_mask = False
    reference_tolerance = 1e-4

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        num_landmarks=64,
        pinv_iterations=nystrom_ops.DEFAULT_PINV_ITERATIONS,
        conv_kernel_size=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.num_landmarks = _positive_int("num_landmarks", num_landmarks)
        self.pinv_iterations = _positive_int("pinv_iterations", pinv_iterations)
        conv = _positive_int("conv_kernel_size", conv_kernel_size, allow_none=True)
        if conv is not None and conv % 2 == 0:
            raise ValueError(
                "`conv_kernel_size` must be odd (a 'same' convolution centred "
                f"on each position). Received: conv_kernel_size={conv_kernel_size!r}"
            )
        self.conv_kernel_size = conv
        if self.dropout > 0.0:
            raise ValueError(
                "NystromAttention forms no attention weights over the keys "
                "(only the factors F, A^+ and B), so there is nothing for "
                "attention dropout to drop: use dropout=0. "
                f"Received: dropout={self.dropout!r}"
            )
        self._conv = None

    # ---------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        if self.conv_kernel_size is None:
            return
        self._conv = HeadKernel(
            self.conv_kernel_size,
            self.num_heads,
            initializer=self._sublayer_kwargs()["kernel_initializer"],
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            dtype=self.dtype_policy,
            name="conv",
        )
        self._conv.build()

    def set_weights(self, weights):
        """Sets the weights; a list without the convolution's kernel (e.g.
        ``MultiHeadAttention.get_weights()``) sets the projections and keeps
        the kernel."""
        weights = list(weights)
        if self._conv is not None and len(weights) == len(self.weights) - 1:
            weights.append(ops.convert_to_numpy(self._conv.kernel))
        super().set_weights(weights)

    # -------------------------------------------------------------- checks
    def _select(self, context):
        if context.causal:
            raise ValueError(
                "NystromAttention has no causal mode: each landmark is the "
                "mean of a whole segment of keys (and of queries), so query i "
                "would see keys after i through softmax(Q K~^T) and through "
                "A^+ softmax(Q~ K^T). Use another layer for causal attention. "
                "Received: use_causal_mask=True"
            )
        return super()._select(context)

    def _dispatch(self, q, k, v, context):
        if self.conv_kernel_size is not None:
            T, S = context.query_length, context.key_length
            if la_ops.shapes.is_static(T, S) and T != S:
                raise ValueError(
                    "The convolution on the values (conv_kernel_size="
                    f"{self.conv_kernel_size}) adds a value per query "
                    "position, so it needs as many keys as queries. Received: "
                    f"query length {T}, key length {S}"
                )
        return super()._dispatch(q, k, v, context)

    # -------------------------------------------------------- efficient path
    @implementation("landmarks", dropout=False)
    def _landmarks(self, query, key, value, context):
        """``F (A^+ (B V))``, right to left (no ``(T, S)`` tensor)."""
        padding = context.padding
        out = nystrom_ops.nystrom_attention(
            query,
            key,
            value,
            self.num_landmarks,
            self.pinv_iterations,
            query_mask=padding.query_mask,
            key_mask=padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )
        if self._conv is not None:
            v = value
            if padding.key_mask is not None:
                keep = ops.cast(padding.key_mask, "bool")[:, :, None, None]
                v = ops.where(keep, v, ops.zeros_like(v))
            conv = nystrom_ops.depthwise_sequence_conv(v, self._conv.kernel)
            out = ops.cast(ops.cast(out, "float32") + conv, out.dtype)
        return out

    # ------------------------------------------------------------ reference
    def _attention_reference(self, query, key, value, context):
        """The explicit ``(T, S)`` matrix ``F A^+ B`` (+ the convolution's
        band matrix), applied to ``V``."""
        T, S = context.query_length, context.key_length
        rows = la_ops.combine_dense_masks(
            context.padding.dense_mask(T, S), context.attention_mask
        )  # (B, 1 or T, S) or None
        key_rows = None
        if context.attention_mask is not None:
            key_rows = ops.cast(
                ops.broadcast_to(rows, ops.shape(context.attention_mask)), "bool"
            )
        elif context.padding.key_mask is not None:
            key_rows = ops.cast(context.padding.key_mask, "bool")
        weights = nystrom_ops.nystrom_weights(
            query,
            key,
            self.num_landmarks,
            self.pinv_iterations,
            query_mask=context.padding.query_mask,
            key_mask=key_rows,
            scale=self._inverse_sqrt_key_dim,
        )  # (B, H, T, S)
        if self._conv is not None:
            band = nystrom_ops.conv_matrix(self._conv.kernel, S)[None]  # (1, H, S, S)
            if rows is not None:
                band = ops.where(ops.cast(rows, "bool")[:, None], band, 0.0)
            weights = weights + band
        v = ops.cast(value, "float32")
        if context.padding.key_mask is not None:
            keep = ops.cast(context.padding.key_mask, "bool")[:, :, None, None]
            v = ops.where(keep, v, 0.0)
        out = ops.cast(ops.einsum("bhts,bshd->bthd", weights, v), value.dtype)
        if context.return_scores:
            return out, ops.cast(weights, value.dtype)
        return out

    # ----------------------------------------------------------------- limit
    def full_attention_limit(self, sequence_length):
        """One landmark per token (``num_landmarks = n``): then ``Q~ = Q``,
        ``K~ = K``, the three kernels are the softmax matrix ``P`` and
        ``F A^+ B = P P^+ P = P``, exact attention once the pseudo-inverse
        has converged. ``FULL_LIMIT_ITERATIONS`` (20) iterations instead of
        6: measured at n = 37 and 64 over 8 seeds on torch, 6 iterations
        leave a relative error of 2e-2 to 4e-2, 15 to 20 reach 2e-5 to
        1.2e-4, and more let float32 rounding grow again in the directions
        of the smallest singular values of ``P`` (up to 1.6e-3 at 60)."""
        n = int(sequence_length)
        return {
            "num_landmarks": n,
            "pinv_iterations": FULL_LIMIT_ITERATIONS,
            "conv_kernel_size": None,
        }, FULL_LIMIT_TOLERANCE

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_landmarks": self.num_landmarks,
                "pinv_iterations": self.pinv_iterations,
                "conv_kernel_size": self.conv_kernel_size,
            }
        )
        return config


#: Pseudo-inverse iterations of :meth:`NystromAttention.full_attention_limit`.
FULL_LIMIT_ITERATIONS = 20
#: Relative error allowed against FullAttention in that limit.
FULL_LIMIT_TOLERANCE = 1e-3
