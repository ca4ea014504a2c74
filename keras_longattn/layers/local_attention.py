"""Exact sliding-window attention computed block by block."""


import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import positive_int
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.conversion import ConversionMixin
from keras_longattn.layers.dispatch import CONTEXT_PARALLEL
from keras_longattn.layers.dispatch import context_parallel_axes
from keras_longattn.layers.dispatch import context_parallel_devices
from keras_longattn.layers.dispatch import context_parallel_refusal
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import window_kernel_attention
from keras_longattn.layers.dispatch import window_kernel_refusal


@keras.saving.register_keras_serializable(package="keras_longattn")
class LocalAttention(BaseAttention):
    """Sliding-window (local) multi-head attention.

    An exact sliding window, not an approximation by blocks. Causal
    (``use_causal_mask=True``): query ``i`` attends keys
    ``i - window + 1 .. i``. Bidirectional: keys within ``window // 2`` on
    each side. ``look_back`` and ``look_ahead`` set the two extents
    separately (a causal call always uses ``look_ahead = 0``).

    The ``"blocked"`` path (and ``"blocked_fused"``, the same blocks through
    ``keras.ops.dot_product_attention``, preferred on PyTorch) cuts the sequence into blocks of ``block_size``
    positions and lets each query block look at the neighbouring key blocks
    that can hold a visible key, masking every pair exactly: O(n * w) time
    and memory, any sequence length (it pads internally and strips the
    padding), never a ``(T, S)`` tensor. ``"pallas"`` (JAX only) runs the
    same band in one block-sparse flash-attention kernel
    (``kernels/jax/pallas_attention.py``): chosen by ``"auto"`` on GPU/TPU,
    interpreted (slowly, for tests) on the CPU; no attention dropout.
    ``"cudnn"`` (JAX on NVIDIA GPUs) runs a plain window in cuDNN's fused
    flash attention (``jax.nn.dot_product_attention(local_window_size=)``):
    float16/bfloat16, equal query and key lengths, no key padding mask, a
    window with keys ahead only where JAX gives cuDNN a right window;
    ``"auto"`` tries it first, before ``"pallas"``, where a device run
    proved it. ``"flex"`` (PyTorch only, by name) runs the band in FlexAttention
    (``torch.nn.attention.flex_attention``), its block mask and mask from
    the same ``LocalPattern``; no attention dropout, and on the CPU forward
    only (see the fast paths guide). ``"context_parallel"`` (JAX, under a
    :class:`keras_longattn.parallel.ContextParallel` distribution, where
    ``"auto"`` picks it first) splits the sequence over the
    distribution's sequence axis and exchanges only the window's halo with
    the neighbouring devices
    (:func:`keras_longattn.parallel.halo_local_attention`); self-attention
    of a length that is a multiple of the devices, each device's share at
    least the window's extent; no attention dropout in training.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        window: window length (see above). Defaults to 128.
        look_back: keys visible before the query. Defaults to
            ``window - 1`` when causal and ``window // 2`` otherwise.
        look_ahead: keys visible after the query (bidirectional calls).
            Defaults to ``window // 2``.
        block_size: positions per block of the blocked paths. Defaults to
            half the larger extent, rounded up to a multiple of 8
            (:func:`keras_longattn.ops.default_block_size`).
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"blocked"``, ``"blocked_fused"``, ``"band_kernel"``,
            ``"pallas"`` (JAX, see the fast paths guide), ``"cudnn"`` (JAX
            on NVIDIA GPUs, see above), ``"flex"``
            (PyTorch's FlexAttention), ``"context_parallel"`` (see above) or
            ``"reference"``; ``"band_kernel"`` is the backend's own
            band kernel, PyTorch on the CPU only, float32, equal query and
            key lengths: the flash kernel on overlapping views of the keys,
            preferred by ``"auto"`` there).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``use_causal_mask``,
        ``return_attention_scores`` (dense ``(B, H, T, S)``, O(n^2)),
        ``training``. A dense ``attention_mask`` is only accepted with
        ``implementation="reference"``.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested).

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.LocalAttention(
    ...     num_heads=2, key_dim=8, window=4)
    >>> x = np.random.rand(1, 10, 16).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (1, 10, 16)

    Reference:
        Parmar et al., "Image Transformer", ICML 2018; Child et al.,
        "Generating Long Sequences with Sparse Transformers", 2019.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        window=128,
        look_back=None,
        look_ahead=None,
        block_size=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        if window is None and look_back is None:
            raise ValueError(
                "LocalAttention needs `window` or `look_back`. "
                "Received: window=None, look_back=None"
            )
        # Validates every combination now rather than at call time.
        la_ops.resolve_window(window, look_back, look_ahead, causal=True)
        la_ops.resolve_window(window, look_back, look_ahead, causal=False)
        self.window = window
        self.look_back = look_back
        self.look_ahead = look_ahead
        self.block_size = positive_int("block_size", block_size, allow_none=True)

    def extents(self, causal):
        """``(look_back, look_ahead)`` of a causal or bidirectional call."""
        return la_ops.resolve_window(
            self.window, self.look_back, self.look_ahead, causal
        )

    def attention_pattern(self, query_length, key_length, causal):
        return la_ops.LocalPattern(*self.extents(causal))

    @implementation("blocked")
    def _blocked(self, query, key, value, context):
        """Band attention over blocks, explicit einsums and softmax."""
        return self._band(query, key, value, context, fused=False)

    @implementation("band_kernel", kind="fused", dropout=False)
    def _band_kernel(self, query, key, value, context):
        """The backend's band-attention kernel (PyTorch on the CPU: the flash
        kernel on overlapping views of the keys, see
        ``keras_longattn/kernels/torch/band.py``)."""
        look_back, look_ahead = self.extents(context.causal)
        return la_ops.paths.band_attention(
            query,
            key,
            value,
            look_back,
            look_ahead,
            path="band_kernel",
            block_size=self.block_size,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_band_kernel.refuses
    def _band_kernel(self, context):
        return la_ops.paths.refusal(
            "band_kernel", self.compute_dtype, context.query_length, context.key_length,
            self.key_dim, self.value_dim or self.key_dim,
        )

    @_band_kernel.reports
    def _band_kernel(self, context):
        # "band_kernel:flash" where the compiled kernel did not run.
        return la_ops.paths.variant("band_kernel")

    @implementation("blocked_fused", kind="fused", dropout=False)
    def _blocked_fused(self, query, key, value, context):
        """The same blocks through ``keras.ops.dot_product_attention``."""
        return self._band(query, key, value, context, fused=True)

    @implementation("pallas", kind="pallas", dropout=False)
    def _pallas(self, query, key, value, context):
        """The band in the block-sparse Pallas kernel (JAX only; preferred
        by ``"auto"`` on GPU/TPU, interpreted on the CPU)."""
        look_back, look_ahead = self.extents(context.causal)
        return la_ops.paths.band_attention(
            query, key, value, look_back, look_ahead, path="block_sparse",
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_pallas.refuses
    def _pallas(self, context):
        return la_ops.paths.refusal("block_sparse")

    @implementation("flex", kind="flex", dropout=False)
    def _flex(self, query, key, value, context):
        """The band in PyTorch's FlexAttention (torch only, by name)."""
        T, S = context.query_length, context.key_length
        look_back, look_ahead = self.extents(context.causal)
        return la_ops.paths.band_attention(
            query, key, value, look_back, look_ahead, path="flex",
            pattern=self.attention_pattern(T, S, context.causal),
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_flex.refuses
    def _flex(self, context):
        return la_ops.paths.refusal("flex", self.compute_dtype, trainable=self.trainable)

    @implementation("cudnn", kind="cudnn", dropout=False)
    def _cudnn(self, query, key, value, context):
        """The plain window in cuDNN's fused flash attention (JAX on NVIDIA
        GPUs: ``jax.nn.dot_product_attention(implementation="cudnn",
        local_window_size=...)``, ``kernels/jax/cudnn_window.py``), tried
        first by ``"auto"`` where a device run proved it; no padding masks,
        no attention dropout."""
        look_back, look_ahead = self.extents(context.causal)
        return window_kernel_attention(query, key, value, look_back, look_ahead,
                                       context.causal, self._inverse_sqrt_key_dim)

    @_cudnn.refuses
    def _cudnn(self, context):
        look_back, look_ahead = self.extents(context.causal)
        return window_kernel_refusal(
            self.compute_dtype, context.query_length, context.key_length, self.key_dim,
            self.value_dim or self.key_dim, look_back, look_ahead, context.causal,
            context.padding.key_mask is not None)

    @implementation("context_parallel", kind=CONTEXT_PARALLEL, dropout=False)
    def _context_parallel(self, query, key, value, context):
        """The band with the sequence split over the devices of the
        :class:`~keras_longattn.parallel.ContextParallel` in scope, each
        device receiving the window's halo from its neighbours."""
        from keras_longattn.parallel.context import halo_local_attention

        look_back, look_ahead = self.extents(context.causal)
        return halo_local_attention(
            query, key, value, look_back=look_back, look_ahead=look_ahead,
            key_mask=context.padding.key_mask, scale=self._inverse_sqrt_key_dim,
            block_size=self.block_size, **context_parallel_axes(query.shape[0]),
        )

    @_context_parallel.refuses
    def _context_parallel(self, context):
        reason = context_parallel_refusal(context)
        if reason is not None:
            return reason
        devices = context_parallel_devices()
        shard = context.query_length // devices
        extent = max(self.extents(context.causal))
        if devices > 1 and extent > shard:
            return (f"each device holds {shard} positions, fewer than the window's extent "
                    f"{extent} (the halo would span more than one neighbour)")
        return None

    def _band(self, query, key, value, context, fused):
        look_back, look_ahead = self.extents(context.causal)
        return la_ops.local_attention(
            query,
            key,
            value,
            look_back,
            look_ahead,
            block_size=self.block_size,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
            dropout_fn=None if fused else self._dropout_fn(context.training),
            fused=fused,
        )

    # -------------------------------------------------------------- decoding
    cache_length_free = False

    def decode_refusal(self):
        return None

    def _ring_length(self):
        return max(1, self.extents(True)[0])

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, look_back, num_key_value_heads, key_dim)``: a ring of the
        keys (``[:, 0]``) and values (``[:, 1]``) of the last ``look_back``
        positions (of a causal call; at least 1), whatever ``max_length``:
        position ``p`` is in slot ``p mod look_back``."""
        return (batch_size, 2, self._ring_length(), self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        """The new queries against the ring (the ``W`` positions before
        ``index``, put in order) and the new keys: one new token attends
        ``W + 1`` keys directly (O(w) work); more run the blocked band over
        the ``W + T`` keys (O((W + T) * w)). The ring then keeps the last
        ``W`` of them."""
        look_back = self.extents(True)[0]
        W, T = cache.shape[2], query.shape[1]
        keys, values, k_pos, written = self._ring_keys(cache, key, value, index)
        if T == 1:
            q_pos = index + ops.arange(1, dtype="int32")
            visible = ops.logical_and(written[None, :], k_pos[None, :] >= q_pos[:, None] - look_back)
            out = la_ops.reference_attention(
                query, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
                mask=visible[None], scale=self._inverse_sqrt_key_dim,
                dropout_fn=self._dropout_fn(training))
        else:
            # The new queries are the last T of W + T positions in order.
            padded = ops.concatenate(
                [ops.zeros((ops.shape(query)[0], W) + tuple(query.shape[2:]), query.dtype),
                 query], axis=1)
            key_mask = ops.broadcast_to(written[None, :], (ops.shape(query)[0], W + T))
            out = la_ops.local_attention(
                padded, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
                look_back, 0, block_size=self.block_size,
                key_mask=key_mask, scale=self._inverse_sqrt_key_dim,
                dropout_fn=self._dropout_fn(training))[:, W:]
        return out, self._ring_after(keys, values, index, T)

    def full_attention_limit(self, sequence_length):
        n = int(sequence_length)
        return {"window": 2 * n, "look_back": None, "look_ahead": None}, 1e-5

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "window": self.window,
                "look_back": self.look_back,
                "look_ahead": self.look_ahead,
                "block_size": self.block_size,
            }
        )
        return config


# A Keras source layer with a sliding window converts to this layer.
ConversionMixin.sliding_window_class = LocalAttention
