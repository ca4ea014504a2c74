"""Longformer attention: sliding, dilated and global (Beltagy et al. 2020)."""

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import non_negative_int as _non_negative_int
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn.layers._longformer_decoding import LongformerDecoding
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.base_attention import _as_tensor
from keras_longattn.layers.base_attention import _zero_where_not
from keras_longattn.layers.dispatch import CONTEXT_PARALLEL
from keras_longattn.layers.dispatch import context_parallel_axes
from keras_longattn.layers.dispatch import context_parallel_devices
from keras_longattn.layers.dispatch import context_parallel_refusal
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import is_training
from keras_longattn.layers.dispatch import window_kernel_attention
from keras_longattn.layers.dispatch import window_kernel_refusal
from keras_longattn.ops import longformer as la_longformer

#: Names of the global projections, built after MultiHeadAttention's four.
GLOBAL_PROJECTIONS = ("query_global", "key_global", "value_global")


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongformerAttention(LongformerDecoding, BaseAttention):
    """Longformer attention: a (dilated) sliding window plus global tokens.

    Each query attends to a window of keys around it and to the global
    positions; a global query attends to every key. In detail, for query
    ``i``, key ``j``, window ``w`` (even) and head ``h`` with dilation
    ``r_h``:

    * window: ``j = i + r_h * t`` with ``-w/2 <= t <= w/2``; in causal mode
      (``use_causal_mask=True``) ``-w <= t <= 0``, the ``w`` previous
      steps. With ``r_h = 1`` that is ``w + 1`` consecutive keys; a
      dilation keeps the number of keys and multiplies the reach by ``r_h``.
    * global: if ``j`` is a global position every query sees it; if ``i``
      is global it sees every key. Global rows are computed with their own
      query, key and value projections (``query_global``, ``key_global``,
      ``value_global``), as in the paper: a global query ``Q_g x_i`` against
      the keys ``K_g x_j`` and values ``V_g x_j`` of every position it sees.
      The other rows use the ordinary projections throughout, for their
      window and for the global keys.
    * causal mode ANDs everything with ``j <= i``: a global key is seen
      only by the queries at or after it, and a global query sees only the
      keys up to itself (its row is then a causal full-attention row).
      Nothing of a later position can reach an earlier output.

    Global positions are given per call by ``global_mask`` (boolean
    ``(B, n)``, self-attention), or, without a mask, are the first
    ``global_tokens`` positions (the constructor option; e.g. a
    classification token). Array shapes must be static while the number of
    global positions varies by example, so a call with ``global_mask`` has
    ``max_global`` global slots: the first ``max_global`` global positions of
    each example (in position order) are global, any further ones are
    treated as ordinary positions (the ``"reference"`` path applies the
    same rule). Raise ``max_global`` when examples can have more.

    Cost: the ``"blocked"`` path computes the window band block by block
    (a dilated window on the sequence seen as ``r`` interleaved columns, so
    a dilation costs nothing extra; heads with the same dilation share one
    layout), every query against the ``g`` global keys, the two merged into
    one softmax by their log-sum-exps, and the ``g`` global rows against
    every key: O(n * (w + g)) time and memory for ``g`` global slots, never
    a ``(T, S)`` tensor. ``"blocked_fused"`` (preferred by ``"auto"`` on
    PyTorch; no attention dropout in training) gives the same layouts to
    ``keras.ops.dot_product_attention``, with the global keys appended to
    the keys of every window block so that one softmax covers both.
    ``"pallas"`` (JAX only; preferred by ``"auto"`` on GPU/TPU, interpreted
    on the CPU; no attention dropout) runs the three parts in the
    block-sparse Pallas kernel, the window on tokens sorted by residue.
    ``"cudnn"`` (JAX on NVIDIA GPUs) runs a plain window (no global tokens,
    dilation 1) in cuDNN's fused flash attention: float16/bfloat16, no key
    padding mask, and (JAX giving cuDNN a left window only) causal calls;
    ``"auto"`` tries it first where a device run proved it.
    ``"flex"`` (PyTorch only, by name; no attention dropout, and on the
    CPU forward only) runs them in FlexAttention
    (``torch.nn.attention.flex_attention``): per dilation the window on
    tokens sorted by residue with the global keys appended (one softmax),
    then the global rows, block masks and masks from the same patterns.
    ``"context_parallel"`` (JAX, under a
    :class:`keras_longattn.parallel.ContextParallel` distribution, where
    ``"auto"`` picks it first) splits the sequence over the
    distribution's sequence axis: each device receives the dilated
    window's halo from its neighbours, the global tokens' keys and values,
    and merges the global rows' partial sums
    (:func:`keras_longattn.parallel.halo_longformer_attention`);
    self-attention whose length is a multiple of the devices, each
    device's share at least the dilated window's reach and the
    ``global_tokens``; global positions from ``global_tokens`` only (not
    a call's ``global_mask``); no attention dropout in training.
    ``"reference"`` is dense attention under the same pattern and
    projections, O(n^2).

    Weights: ``query``, ``key``, ``value`` and ``attention_output`` come
    first, named and shaped as ``keras.layers.MultiHeadAttention``'s, then
    the three global projections. ``set_weights`` with a list of
    MultiHeadAttention's length (and :meth:`from_multi_head_attention`)
    loads the local projections and copies the query, key and value
    projections into the global ones (the usual initialisation of
    Longformer from a pretrained model). :meth:`attend` takes projected
    heads only, so its global rows use the local projections.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        window: ``w``, a positive even number: ``w / 2`` window steps on
            each side, or ``w`` previous steps when causal. Defaults to 512
            (the paper's, and its reference implementation's, default).
        dilation: the dilation of the window, one int for every head or a
            list of ``num_heads`` ints (e.g. ``[1, 1, 2, 4]``: the paper
            dilates some heads only). Defaults to 1.
        global_tokens: without ``global_mask``, the number of leading
            positions that are global. Defaults to 0 (no global position
            unless a mask is passed).
        max_global: the number of global slots of a call with
            ``global_mask`` (see above). Defaults to 32.
        block_size: positions per block of the window band (along each
            column when dilated). Defaults to half the window side
            (``"blocked"``, :func:`keras_longattn.ops.default_block_size`)
            or the window side (``"blocked_fused"``: fewer, larger kernel
            calls), rounded up to a multiple of 8. Not used by ``"pallas"``
            (its kernel blocks are powers of two up to 128).
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"blocked"``, ``"band_kernel"``, ``"blocked_fused"``,
            ``"pallas"``, ``"cudnn"``, ``"flex"``, ``"context_parallel"`` or
            ``"reference"``; ``"band_kernel"`` is the backend's band kernel with the global keys in the same softmax,
            PyTorch on the CPU only, float32, dilation 1, equal query and
            key lengths, preferred by ``"auto"`` there).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``use_causal_mask``,
        ``return_attention_scores`` (dense ``(B, H, T, S)``, from the
        reference path: O(n^2)), ``training``; and
        ``global_mask``: optional boolean (or 0/1 integer) ``(B, T)``, True
        at global positions (self-attention: ``T == S``). In a functional
        model pass a ``keras.Input((T,), dtype="bool")``. Overrides
        ``global_tokens`` for the call. A dense ``attention_mask`` is only
        accepted with ``implementation="reference"``. ``cache`` and
        ``cache_update_index``: causal decoding with a cache
        (:meth:`init_cache`; the ring of the widest dilated window, the
        first ``global_tokens`` positions and their global projections; no
        ``global_mask``), returning ``(output, cache)``.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested). Queries that
        see no key get a zero attention output.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.LongformerAttention(
    ...     num_heads=2, key_dim=8, window=4, dilation=[1, 2])
    >>> x = np.random.rand(2, 12, 16).astype("float32")
    >>> global_mask = np.zeros((2, 12), bool)
    >>> global_mask[:, 0] = True  # e.g. a classification token
    >>> tuple(layer(x, x, global_mask=global_mask).shape)
    (2, 12, 16)
    >>> layer.last_implementation in ("blocked", "blocked_fused")  # dilated: no band kernel
    True

    Reference:
        Beltagy, Peters, Cohan, "Longformer: The Long-Document
        Transformer", arXiv:2004.05150, 2020.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        window=512,
        dilation=1,
        global_tokens=0,
        max_global=32,
        block_size=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.window = la_longformer.check_window(window)
        dilations = la_longformer.check_dilation(dilation, self.num_heads)
        self.dilation = (
            dilations[0] if not isinstance(dilation, (list, tuple)) else list(dilations)
        )
        self.global_tokens = _non_negative_int("global_tokens", global_tokens)
        self.max_global = _positive_int("max_global", max_global)
        self.block_size = _positive_int("block_size", block_size, allow_none=True)
        # The inputs of the call under way, for the global projections
        # (in a plain holder: Keras does not track what it contains).
        self._call_state = _CallState()

    @property
    def dilations(self):
        """The dilation of each head, a tuple of ``num_heads`` ints."""
        return la_longformer.check_dilation(self.dilation, self.num_heads)

    # ----------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        H = self.num_heads
        dense = {}
        for name, dim, shape in (
            ("query_global", self.key_dim, query_shape),
            ("key_global", self.key_dim, key_shape),
            ("value_global", self.value_dim, value_shape),
        ):
            layer = keras.layers.EinsumDense(
                "abc,cde->abde",
                output_shape=(None, H, dim),
                bias_axes="de" if self.use_bias else None,
                name=name,
                **self._sublayer_kwargs(),
            )
            layer.build(shape)
            dense[name] = layer
        self._query_global_dense = dense["query_global"]
        self._key_global_dense = dense["key_global"]
        self._value_global_dense = dense["value_global"]

    def _local_weight_count(self):
        return 8 if self.use_bias else 4

    def set_weights(self, weights):
        """Sets the weights; a list as long as MultiHeadAttention's (the
        local projections only) also copies the query, key and value
        projections into the global ones."""
        weights = list(weights)
        n = self._local_weight_count()
        if len(weights) == n and len(self.weights) == n + n * 3 // 4:
            per = 2 if self.use_bias else 1
            weights = weights + weights[: 3 * per]
        super().set_weights(weights)

    # -------------------------------------------------------------- patterns
    def head_patterns(self, query_length, key_length, causal):
        """The pattern of each head (the constructor's global tokens
        included; a call's ``global_mask`` adds its own positions)."""
        return la_longformer.longformer_head_patterns(
            self.window, self.dilations, causal,
            tuple(range(self.global_tokens)),
        )

    def attention_pattern(self, query_length, key_length, causal):
        """The keys any head sees (the union of :meth:`head_patterns`)."""
        distinct = []
        for p in self.head_patterns(query_length, key_length, causal):
            if p not in distinct:
                distinct.append(p)
        return distinct[0] if len(distinct) == 1 else la_ops.Union(*distinct)

    def reference_mask(self, context):
        """Dense ``(B or 1, H, T, S)``: each head's window, OR the call's
        global queries and keys, AND causality, key padding and
        ``attention_mask``."""
        T, S = context.query_length, context.key_length
        look_back, look_ahead = la_longformer.window_extents(self.window, context.causal)
        masks = {}
        for r in self.dilations:
            if r not in masks:
                masks[r] = la_ops.DilatedPattern(look_back, look_ahead, r).dense_mask(T, S)
        mask = ops.stack([masks[r] for r in self.dilations])[None]  # (1, H, T, S)
        # A context made outside a call (e.g. by hand) has no global slots.
        gq, gk = la_longformer.global_flags(getattr(context, "global_slots", None), T, S)
        if gq is not None:
            mask = ops.logical_or(mask, gq[:, None, :, None])
            mask = ops.logical_or(mask, gk[:, None, None, :])
        if context.causal:
            mask = ops.logical_and(mask, la_ops.CausalPattern().dense_mask(T, S)[None, None])
        padding = context.padding.dense_mask(T, S)  # (B, 1, S) or None
        if padding is not None:
            padding = ops.expand_dims(padding, 1)
        dense = context.attention_mask
        if dense is not None:
            dense = ops.expand_dims(ops.cast(dense, "bool"), 1)
        return la_ops.combine_dense_masks(mask, padding, dense)

    # ------------------------------------------------------------------ call
    def call(self, query, value, key=None, query_mask=None, value_mask=None,
             key_mask=None, attention_mask=None, return_attention_scores=False,
             training=None, use_causal_mask=False, global_mask=None, cache=None,
             cache_update_index=None):
        global_mask = _as_tensor(global_mask)
        decoding = cache is not None or cache_update_index is not None
        if global_mask is not None and decoding:
            raise ValueError(
                "A decoding call takes no `global_mask`: the global positions of a "
                "cache are the first `global_tokens`. Received: global_mask of shape "
                f"{tuple(global_mask.shape)}")
        if global_mask is not None:
            self._check_global_mask(global_mask, query, value if key is None else key)
        self._call_state.pending = (query, value if key is None else key, value, global_mask)
        try:
            return super().call(
                query, value, key=key, query_mask=query_mask,
                value_mask=value_mask, key_mask=key_mask,
                attention_mask=attention_mask,
                return_attention_scores=return_attention_scores,
                training=training, use_causal_mask=use_causal_mask,
                cache=cache, cache_update_index=cache_update_index,
            )
        finally:
            self._call_state.pending = None

    def compute_output_spec(self, query, value, key=None, query_mask=None,
                            value_mask=None, key_mask=None, attention_mask=None,
                            return_attention_scores=False, training=None,
                            use_causal_mask=False, global_mask=None):
        if global_mask is not None:
            self._check_global_mask(global_mask, query, value if key is None else key)
        return super().compute_output_spec(
            query, value, key=key,
            return_attention_scores=return_attention_scores,
        )

    def _check_global_mask(self, mask, query, key):
        B, T = query.shape[0], query.shape[1]
        S = key.shape[1]
        shape = tuple(mask.shape)
        if len(shape) != 2 or any(
            e is not None and s is not None and e != s for s, e in zip(shape, (B, T))
        ):
            raise ValueError(
                "`global_mask` must have shape (batch, query length) = "
                f"{(B, T)}. Received: global_mask.shape={shape}"
            )
        if T is not None and S is not None and T != S:
            raise ValueError(
                "`global_mask` marks positions of a self-attention call: the "
                f"query and key lengths must be equal. Received: query length "
                f"{T}, key length {S}"
            )
        dtype = keras.backend.standardize_dtype(mask.dtype)
        if dtype != "bool" and "int" not in dtype:
            raise ValueError(
                "`global_mask` must be boolean (True = global) or integer 0/1. "
                f"Received: global_mask.dtype={dtype}"
            )

    def _dispatch(self, q, k, v, context):
        pending = self._call_state.pending
        self._call_state.pending = None
        T, S = context.query_length, context.key_length
        global_mask = None if pending is None else pending[3]
        context.global_from_mask = global_mask is not None
        context.global_slots = la_longformer.global_slots(
            T, S, global_mask, self.global_tokens, self.max_global
        )
        context.global_inputs = None
        if pending is not None and context.global_slots is not None:
            query, key, value = pending[:3]
            # Padded positions enter the projections as zeros (see
            # BaseAttention.call).
            if context.padding.key_mask is not None:
                keep = ops.expand_dims(context.padding.key_mask, -1)
                same = key is value
                value = _zero_where_not(keep, value)
                key = value if same else _zero_where_not(keep, key)
            if context.padding.query_mask is not None:
                query = _zero_where_not(ops.expand_dims(context.padding.query_mask, -1), query)
            context.global_inputs = (query, key, value)
        return super()._dispatch(q, k, v, context)

    def _global_projections(self, context, rows_only):
        """``(qg, kg, vg)`` of the call (None each without global inputs).
        ``qg`` is ``(B, G, H, d)`` for the slots when ``rows_only``, else
        ``(B, T, H, d)`` for every position."""
        if getattr(context, "global_inputs", None) is None:
            return None, None, None
        query, key, value = context.global_inputs
        kg = self._key_global_dense(key)
        vg = self._value_global_dense(value)
        rotary = self.rotary_max_wavelength
        if rotary is not None:
            kg = la_ops.apply_rotary(kg, rotary)
        if not rows_only or rotary is not None:
            qg = self._query_global_dense(query)
            if rotary is not None:
                qg = la_ops.apply_rotary(qg, rotary)
            if rows_only:
                qg = self._slot_rows(context, qg)
            return qg, kg, vg
        # (B, G, dim): the inputs of the global rows.
        return self._query_global_dense(self._slot_rows(context, query)), kg, vg

    def _slot_rows(self, context, x):
        """The rows of ``x`` ``(B, T, ...)`` at the call's global query
        slots, ``(B, G, ...)`` (zeros for invalid slots), by an indexed
        gather: a NaN or inf at another position (a query padded through
        ``value_mask`` only) does not reach them."""
        slots = context.global_slots
        return la_longformer.gather_slots(x, slots.positions, slots.query_valid)

    # ---------------------------------------------------------- computation
    def _attention_reference(self, query, key, value, context):
        """Dense attention under the pattern; global rows with the global
        projections."""
        mask = self.reference_mask(context)
        dropout_fn = self._dropout_fn(context.training)
        scale = self._inverse_sqrt_key_dim
        result = la_ops.reference_attention(
            query, key, value, mask=mask, scale=scale, dropout_fn=dropout_fn,
            return_scores=context.return_scores,
        )
        if getattr(context, "global_slots", None) is None:
            return result
        gq, _ = la_longformer.global_flags(
            context.global_slots, context.query_length, context.key_length
        )
        qg, kg, vg = self._global_projections(context, rows_only=False)
        if qg is None:  # attend(): the local projections throughout
            return result
        rows = la_ops.reference_attention(
            qg, kg, vg, mask=mask, scale=scale, dropout_fn=dropout_fn,
            return_scores=context.return_scores,
        )
        if context.return_scores:
            (out, weights), (g_out, g_weights) = result, rows
        else:
            out, g_out = result, rows
        out = ops.where(gq[:, :, None, None], g_out, out)
        if context.return_scores:
            weights = ops.where(gq[:, None, :, None], g_weights, weights)
            return out, weights
        return out

    @implementation("blocked")
    def _blocked(self, query, key, value, context):
        """Band + global keys merged by log-sum-exp, plus the global rows,
        with explicit einsums and softmax."""
        # Outside training dropout is the identity: no dropout_fn, so that
        # JAX runs the compiled program.
        dropout_fn = (
            self._dropout_fn(context.training) if is_training(context.training) else None
        )
        return self._longformer(query, key, value, context, dropout_fn=dropout_fn)

    @implementation("band_kernel", kind="fused", dropout=False)
    def _band_kernel(self, query, key, value, context):
        """The window and the global keys in one call of the backend's band
        kernel (PyTorch on the CPU: ``keras_longattn/kernels/torch/band.py``,
        the global keys merged by log-sum-exp inside its autograd
        function), then the global rows as in ``"blocked_fused"``."""
        return self._longformer(query, key, value, context,
                                band_kernel=la_ops.paths.band_kernel_attention)

    @_band_kernel.refuses
    def _band_kernel(self, context):
        if any(r != 1 for r in self.dilations):
            return f"dilated windows (dilation={list(self.dilations)}) are not in the band kernel"
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
        """The same layouts through ``keras.ops.dot_product_attention``,
        the global keys appended to every window block (one softmax, no
        merge)."""
        return self._longformer(query, key, value, context, fused=True)

    @implementation("pallas", kind="pallas", dropout=False)
    def _pallas(self, query, key, value, context):
        """Every part in the block-sparse Pallas kernel (JAX only): the
        window per dilation (tokens sorted by residue), the global keys
        (merged by log-sum-exp) and the global rows."""
        qg, kg, vg = self._global_projections(context, rows_only=True)
        return la_ops.block_sparse.longformer_attention(
            query, key, value, self.window, self.dilations,
            causal=context.causal,
            slots=context.global_slots,
            global_query=qg, global_key=kg, global_value=vg,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_pallas.refuses
    def _pallas(self, context):
        return la_ops.paths.refusal("block_sparse")

    @implementation("flex", kind="flex", dropout=False)
    def _flex(self, query, key, value, context):
        """Every part in PyTorch's FlexAttention (torch only, by name): the
        window per dilation (tokens sorted by residue) with the global keys
        appended, and the global rows."""
        look_back, look_ahead = la_longformer.window_extents(self.window, context.causal)
        windows = {r: la_ops.DilatedPattern(look_back, look_ahead, r)
                   for r in set(self.dilations)}
        slots = context.global_slots
        qg, kg, vg = self._global_projections(context, rows_only=True)
        return la_ops.paths.flex_attention(
            "longformer", query, key, value, tuple(windows[r] for r in self.dilations), self.dilations,
            global_pattern=la_ops.CausalPattern() if context.causal else la_ops.FullPattern(),
            global_positions=None if slots is None else slots.positions,
            global_query_valid=None if slots is None else slots.query_valid,
            global_key_valid=None if slots is None else slots.key_valid,
            global_query=qg, global_key=kg, global_value=vg,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_flex.refuses
    def _flex(self, context):
        return la_ops.paths.refusal("flex", self.compute_dtype, trainable=self.trainable)

    @implementation("cudnn", kind="cudnn", dropout=False)
    def _cudnn(self, query, key, value, context):
        """A plain window (no global tokens, dilation 1) in cuDNN's fused
        flash attention (JAX on NVIDIA GPUs, ``kernels/jax/cudnn_window.py``),
        tried first by ``"auto"`` where a device run proved it."""
        look_back, look_ahead = la_longformer.window_extents(self.window, context.causal)
        return window_kernel_attention(query, key, value, look_back, look_ahead,
                                       context.causal, self._inverse_sqrt_key_dim)

    @_cudnn.refuses
    def _cudnn(self, context):
        if any(r != 1 for r in self.dilations):
            return (f"dilated windows (dilation={list(self.dilations)}) are not a plain "
                    "window")
        if self.global_tokens or getattr(context, "global_slots", None) is not None:
            return "global tokens are not in a plain window"
        look_back, look_ahead = la_longformer.window_extents(self.window, context.causal)
        return window_kernel_refusal(
            self.compute_dtype, context.query_length, context.key_length, self.key_dim,
            self.value_dim or self.key_dim, look_back, look_ahead, context.causal,
            context.padding.key_mask is not None)

    @implementation("context_parallel", kind=CONTEXT_PARALLEL, dropout=False)
    def _context_parallel(self, query, key, value, context):
        """The window, global keys and global rows with the sequence split
        over the devices of the
        :class:`~keras_longattn.parallel.ContextParallel` in scope: the
        dilated window's halo from the neighbours, the global tokens (on
        the first device) shared with every device."""
        from keras_longattn.parallel.context import halo_longformer_attention

        g = 0 if getattr(context, "global_slots", None) is None else self.global_tokens
        qg, kg, vg = (None, None, None) if not g else self._global_projections(
            context, rows_only=True)
        return halo_longformer_attention(
            query, key, value, window=self.window, dilation=list(self.dilations),
            causal=context.causal, global_tokens=g,
            global_query=qg, global_key=kg, global_value=vg,
            key_mask=context.padding.key_mask, scale=self._inverse_sqrt_key_dim,
            block_size=self.block_size, **context_parallel_axes(query.shape[0]),
        )

    @_context_parallel.refuses
    def _context_parallel(self, context):
        reason = context_parallel_refusal(context)
        if reason is not None:
            return reason
        if getattr(context, "global_from_mask", False):
            return ("global positions from a call's global_mask (only the constructor's "
                    "global_tokens, which lie on the first device)")
        devices = context_parallel_devices()
        shard = context.query_length // devices
        look_back, look_ahead = la_longformer.window_extents(self.window, context.causal)
        reach = max(self.dilations) * max(look_back, look_ahead)
        if devices > 1 and reach > shard:
            return (f"each device holds {shard} positions, fewer than the dilated window's "
                    f"reach {reach} (the halo would span more than one neighbour)")
        if self.global_tokens > shard:
            return (f"global_tokens={self.global_tokens} do not fit on the first device, "
                    f"which holds {shard} positions")
        return None

    def _input_space_projections(self, context):
        """``(key_input, value_input, key_kernel, value_kernel, value_bias,
        key_bias)`` for :func:`keras_longattn.ops.longformer.input_space_attention`, or
        None where the global rows must project every key (rotary
        positions, quantized projections, no global inputs)."""
        if getattr(context, "global_inputs", None) is None:
            return None
        if self.rotary_max_wavelength is not None:
            return None
        dense = (self._key_global_dense, self._value_global_dense)
        if any(getattr(layer, "quantization_mode", None) for layer in dense):
            return None
        _, key, value = context.global_inputs
        # Tensors, not variables: the ops may run under jax.jit.
        tensor = ops.convert_to_tensor
        kernels = [tensor(layer.kernel) for layer in dense]
        if self.use_bias:
            value_bias, key_bias = tensor(dense[1].bias), tensor(dense[0].bias)
        else:
            value_bias = key_bias = None
        return (key, value, kernels[0], kernels[1], value_bias, key_bias)

    def _longformer(self, query, key, value, context, **path):
        projections = self._input_space_projections(context)
        if projections is not None:
            # The global rows in input space: two fewer full projections.
            rows = self._slot_rows(context, context.global_inputs[0])
            qg, kg, vg = self._query_global_dense(rows), None, None
        else:
            qg, kg, vg = self._global_projections(context, rows_only=True)
        return la_longformer.longformer_attention(
            query, key, value, self.window, self.dilations,
            causal=context.causal,
            slots=context.global_slots,
            global_query=qg, global_key=kg, global_value=vg,
            global_projections=projections,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
            block_size=(la_longformer.fused_block_size(self.window)
                        if path.get("band_kernel") is not None and self.block_size is None
                        else self.block_size),
            **path,
        )

    def full_attention_limit(self, sequence_length):
        n = int(sequence_length)
        return {"window": 2 * n, "dilation": 1, "global_tokens": 0}, 1e-5

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "window": self.window,
                "dilation": (
                    list(self.dilation) if isinstance(self.dilation, list) else self.dilation
                ),
                "global_tokens": self.global_tokens,
                "max_global": self.max_global,
                "block_size": self.block_size,
            }
        )
        return config


class _CallState:
    """What a call hands to its attention paths besides projected heads."""

    pending = None
    #: The new tokens' inputs of a decoding call (their global projections).
    decode_inputs = None
