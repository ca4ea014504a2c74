"""The attention-layer contract shared by every mechanism of keras_longattn."""

import dataclasses
import math
import numbers
import warnings

import keras
import numpy as np
from keras import ops

from keras_longattn._validation import non_negative_int as _non_negative_int
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn import ops as la_ops
from keras_longattn.layers import dispatch as la_dispatch
from keras_longattn.layers.conversion import ConversionMixin
from keras_longattn.layers.decoding import DecodingMixin
from keras_longattn.layers.dispatch import auto_preference as dispatch_auto_preference
from keras_longattn.layers.dispatch import collect_implementations
from keras_longattn.layers.masking import check_mask as _check_mask
from keras_longattn.layers.masking import set_keras_mask as _set_keras_mask

#: ``(layer class name, reasons)`` pairs already warned about.
_WARNED_FALLBACKS = set()


@dataclasses.dataclass
class AttentionContext:
    """Everything an attention path needs besides the projected tensors.

    Attributes:
        padding: a :class:`keras_longattn.ops.PaddingMask` (structural).
        causal: whether query ``i`` may only see keys ``j <= i``.
        attention_mask: optional dense boolean ``(B, T, S)`` mask.
        training: the Keras training flag.
        return_scores: whether dense weights were requested.
        query_length: T.
        key_length: S.
    """

    padding: la_ops.PaddingMask
    causal: bool
    attention_mask: object = None
    training: object = None
    return_scores: bool = False
    query_length: object = None
    key_length: object = None


class BaseAttention(DecodingMixin, ConversionMixin, keras.layers.Layer):
    """Base class of every attention layer of keras_longattn.

    Constructor and call follow ``keras.layers.MultiHeadAttention``: the
    query/key/value/output projections are ``EinsumDense`` layers named,
    shaped and ordered exactly as MultiHeadAttention's, so the weights of a
    trained ``MultiHeadAttention`` load into any layer with the same
    projections (``layer.set_weights(mha.get_weights())`` or
    :meth:`from_multi_head_attention`). A subclass decides *what* each query
    attends to and *how* it is computed:

    * what: an exact layer (``is_exact = True``) returns its pattern from
      :meth:`attention_pattern` (an :class:`keras_longattn.ops.AttentionPattern`),
      and the ``"reference"`` implementation is dense attention under that
      pattern's mask; a content-dependent or approximate layer overrides
      :meth:`_attention_reference` with the explicit quadratic form of its
      own computation (what its fast paths must equal), and may name a
      configuration in which it equals :class:`FullAttention`
      (:meth:`full_attention_limit`);
    * how: each efficient path is an
      :class:`keras_longattn.layers.Implementation` declared with the
      :func:`keras_longattn.layers.implementation` decorator; it runs a call
      or refuses it with a reason before running. ``"auto"`` tries them by
      kind in the backend's order of preference
      (:attr:`keras_longattn.kernels.BackendOps.auto_preference`), then by
      declaration order, and falls back to ``"reference"`` only when all
      refuse; ``last_implementation`` names the path that ran.

    Masks stay structural: padding masks of shape ``(B, T)`` / ``(B, S)`` and a
    causal flag. Efficient paths never build a ``(B, T, S)`` tensor. A dense
    ``attention_mask`` is honoured by the reference path (and by layers whose
    efficient path can take it, such as ``FullAttention``); other layers
    refuse it with an error that points to the padding masks.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each attention head for query and key.
        value_dim: size of each attention head for value. Defaults to
            ``key_dim``.
        dropout: dropout rate on the attention weights. Defaults to 0.
        use_bias: whether the projections use a bias. Defaults to True.
        output_shape: the size of the output's last axis (int or tuple).
            Defaults to the query's feature size.
        kernel_initializer: initializer of the projection kernels. Defaults
            to ``"glorot_uniform"``.
        bias_initializer: initializer of the projection biases. Defaults to
            ``"zeros"``.
        kernel_regularizer: regularizer of the kernels. Defaults to None.
        bias_regularizer: regularizer of the biases. Defaults to None.
        activity_regularizer: regularizer of the output. Defaults to None.
        kernel_constraint: constraint of the kernels. Defaults to None.
        bias_constraint: constraint of the biases. Defaults to None.
        implementation: ``"auto"``, ``"reference"`` or the name of one of the
            layer's efficient paths (see :attr:`implementations`).
            ``"auto"`` takes the first efficient path that supports the call.
            Defaults to ``"auto"``.
        seed: seed of the attention dropout. Defaults to None.
        rotary_max_wavelength: when set, rotary position embeddings
            (Su et al. 2021) with this maximum wavelength are applied to the
            projected queries and keys (positions ``0..n-1``, or from
            ``cache_update_index`` when decoding). Defaults to None (no
            positions inside the layer).
        num_key_value_heads: grouped-query attention: the number of key and
            value heads (it must divide ``num_heads``; 1 is multi-query
            attention). Each serves ``num_heads / num_key_value_heads``
            consecutive query heads, as in
            ``keras.layers.GroupQueryAttention``; the attention is that of
            ``num_heads`` heads with the key and value heads repeated, and a
            decoding cache holds the ``num_key_value_heads`` heads only.
            Defaults to ``num_heads``.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        query: ``(B, T, dim)``.
        value: ``(B, S, dim)``.
        key: optional ``(B, S, dim)``; defaults to ``value``.
        query_mask: optional boolean ``(B, T)``; False marks padded queries.
            Taken from the query's Keras mask when not given.
        value_mask: optional boolean ``(B, S)``; False marks padded keys.
            Taken from the value's Keras mask when not given.
        key_mask: optional boolean ``(B, S)``, combined with ``value_mask``.
        attention_mask: optional dense boolean ``(B, T, S)`` mask, True where
            attention is allowed; O(T*S), only where the layer can honour it.
        return_attention_scores: also return the dense ``(B, H, T, S)``
            attention weights (computed by the reference path: O(T*S)
            memory, for inspection and plots).
        training: whether dropout is active.
        use_causal_mask: whether query ``i`` may only attend to keys
            ``j <= i``.

    Returns:
        ``(B, T, output_dim)``, and the ``(B, H, T, S)`` weights when
        ``return_attention_scores=True``. Queries that see no key (e.g.
        every key padded) get a zero attention output before the output
        projection.
    """

    #: Names of the layer's efficient implementations, in declaration
    #: order (set from the :class:`Implementation` attributes of the class).
    implementations = ()
    _implementation_table = {}
    #: Whether the efficient paths can honour a dense ``attention_mask``.
    supports_attention_mask = False
    #: True when the layer computes exact softmax attention under a pattern
    #: (:meth:`attention_pattern`); False for approximations (low-rank,
    #: kernel feature maps, synthesised weights), whose ``"reference"`` is
    #: the explicit quadratic form of the same approximation.
    is_exact = True
    #: Whether ``return_attention_scores=True`` is supported (dense weights
    #: from the reference path).
    supports_scores = True
    #: Whether ``use_causal_mask=True`` is supported (and leak-free).
    supports_causal = True
    #: Whether bidirectional calls are supported.
    supports_bidirectional = True
    #: Relative error allowed between an efficient path and ``"reference"``
    #: in float32 (max |a - b| / max |b|).
    reference_tolerance = 1e-5

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._implementation_table = collect_implementations(cls)
        cls.implementations = tuple(cls._implementation_table)

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        implementation="auto",
        seed=None,
        rotary_max_wavelength=None,
        num_key_value_heads=None,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.supports_masking = True
        self.num_heads = _positive_int("num_heads", num_heads)
        self.key_dim = _positive_int("key_dim", key_dim)
        self.value_dim = (
            self.key_dim if value_dim is None else _positive_int("value_dim", value_dim)
        )
        if num_key_value_heads is None:
            num_key_value_heads = self.num_heads
        num_key_value_heads = _positive_int("num_key_value_heads", num_key_value_heads)
        if self.num_heads % num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads` (each key/value head "
                f"serves num_heads / num_key_value_heads query heads). Received: "
                f"num_heads={self.num_heads}, num_key_value_heads={num_key_value_heads}")
        self.num_key_value_heads = num_key_value_heads
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, numbers.Real)
            or not 0.0 <= float(dropout) < 1.0
        ):
            raise ValueError(
                f"`dropout` must be a float in [0, 1). Received: dropout={dropout!r}"
            )
        self.dropout = float(dropout)
        self.use_bias = bool(use_bias)
        if output_shape is not None:
            output_shape = _check_output_shape(output_shape)
        self._output_shape = output_shape
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        allowed = ("auto", "reference") + tuple(self.implementations)
        if implementation not in allowed:
            raise ValueError(
                f"`implementation` must be one of {allowed} for "
                f"{type(self).__name__}. Received: implementation={implementation!r}"
            )
        self.implementation = implementation
        if seed is not None:
            seed = _non_negative_int("seed", seed)
        self.seed = seed
        if rotary_max_wavelength is not None:
            if (
                isinstance(rotary_max_wavelength, bool)
                or not isinstance(rotary_max_wavelength, numbers.Real)
                or not math.isfinite(rotary_max_wavelength)
                or rotary_max_wavelength <= 1
            ):
                raise ValueError(
                    "`rotary_max_wavelength` must be a finite number > 1 or None. "
                    f"Received: rotary_max_wavelength={rotary_max_wavelength!r}"
                )
            if self.key_dim % 2:
                raise ValueError(
                    "Rotary positions need an even `key_dim`. "
                    f"Received: key_dim={self.key_dim}"
                )
        self.rotary_max_wavelength = rotary_max_wavelength
        self._dropout_layer = keras.layers.Dropout(rate=self.dropout, seed=seed)
        self._inverse_sqrt_key_dim = 1.0 / float(self.key_dim) ** 0.5
        #: The implementation used by the most recent call (for inspection).
        self.last_implementation = None

    # ------------------------------------------------------------------ build
    @property
    def output_shape(self):
        return self._output_shape

    def build(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        for name, shape in (
            ("query", query_shape),
            ("value", value_shape),
            ("key", key_shape),
        ):
            if len(shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3 (batch, sequence, features). "
                    f"Received: {name}.shape={shape}"
                )
            if shape[-1] is None:
                raise ValueError(
                    f"The feature size (last axis) of `{name}` must be known. "
                    f"Received: {name}.shape={shape}"
                )
            if shape[-1] == 0:
                raise ValueError(
                    f"The feature size (last axis) of `{name}` must be at least 1 "
                    f"(the projections have nothing to read). Received: {name}.shape={shape}"
                )
        self._query_shape = query_shape
        self._value_shape = value_shape
        self._key_shape = key_shape
        H = self.num_heads
        self._query_dense = keras.layers.EinsumDense(
            "abc,cde->abde",
            output_shape=(None, H, self.key_dim),
            bias_axes="de" if self.use_bias else None,
            name="query",
            **self._sublayer_kwargs(),
        )
        self._query_dense.build(query_shape)
        H_kv = self.num_key_value_heads
        self._key_dense = keras.layers.EinsumDense(
            "abc,cde->abde",
            output_shape=(None, H_kv, self.key_dim),
            bias_axes="de" if self.use_bias else None,
            name="key",
            **self._sublayer_kwargs(),
        )
        self._key_dense.build(key_shape)
        self._value_dense = keras.layers.EinsumDense(
            "abc,cde->abde",
            output_shape=(None, H_kv, self.value_dim),
            bias_axes="de" if self.use_bias else None,
            name="value",
            **self._sublayer_kwargs(),
        )
        self._value_dense.build(value_shape)
        out_dims = self._output_shape or (query_shape[-1],)
        letters = "efghij"[: len(out_dims)]
        self._output_dense = keras.layers.EinsumDense(
            f"abcd,cd{letters}->ab{letters}",
            output_shape=(None,) + tuple(out_dims),
            bias_axes=letters if self.use_bias else None,
            name="attention_output",
            **self._sublayer_kwargs(),
        )
        self._output_dense.build((None, None, H, self.value_dim))
        self.build_extra(query_shape, value_shape, key_shape)
        self.built = True

    def build_extra(self, query_shape, value_shape, key_shape):
        """Hook for subclasses that own more state (centroids, projections)."""

    def _sublayer_kwargs(self):
        def clone(obj):
            if obj is None:
                return None
            return obj.__class__.from_config(obj.get_config())

        return dict(
            kernel_initializer=clone(self.kernel_initializer),
            bias_initializer=clone(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
        )

    # ------------------------------------------------------------- patterns
    def attention_pattern(self, query_length, key_length, causal):
        """The layer's attention pattern (an ``ops.AttentionPattern``).

        The reference implementation is dense attention under
        ``pattern.dense_mask(T, S)``. Content-dependent layers override
        :meth:`_attention_reference` instead.
        """
        return la_ops.CausalPattern() if causal else la_ops.FullPattern()

    # -------------------------------------------------------------- dispatch
    def select_implementation(
        self,
        use_causal_mask=False,
        attention_mask=False,
        return_attention_scores=False,
        training=False,
        query_length=None,
        key_length=None,
    ):
        """Returns the name of the implementation a call with these
        properties would run (without running anything)."""
        context = AttentionContext(
            padding=la_ops.PaddingMask(),
            causal=bool(use_causal_mask),
            attention_mask=True if attention_mask is not None and attention_mask is not False else None,
            training=training,
            return_scores=bool(return_attention_scores),
            query_length=query_length,
            key_length=key_length,
        )
        return self._select(context)

    def _select(self, context):
        if context.return_scores:
            if not self.supports_scores:
                raise ValueError(
                    f"{type(self).__name__} cannot return attention scores: it "
                    "never forms per-query weights over the keys. Received: "
                    "return_attention_scores=True"
                )
            return "reference"
        if context.causal and not self.supports_causal:
            raise ValueError(
                f"{type(self).__name__} has no causal mode. Received: "
                "use_causal_mask=True"
            )
        if not context.causal and not self.supports_bidirectional:
            raise ValueError(
                f"{type(self).__name__} only supports causal attention. "
                "Received: use_causal_mask=False"
            )
        requested = self.implementation
        if requested == "reference":
            return "reference"
        if context.attention_mask is not None and not self.supports_attention_mask:
            raise ValueError(
                f"{type(self).__name__} cannot honour a dense `attention_mask` "
                "without building a (B, T, S) tensor, which its efficient "
                "paths never do. Pass padding through `query_mask`, "
                "`value_mask` or `key_mask` (or Keras masks, e.g. "
                "`Embedding(mask_zero=True)`) and causality through "
                "`use_causal_mask=True`; or construct the layer with "
                "implementation='reference' to accept the dense mask at "
                "O(T*S) cost. Received: attention_mask with shape "
                f"{getattr(context.attention_mask, 'shape', '(dense)')}"
            )
        candidates = self.auto_order() if requested == "auto" else (requested,)
        reasons = []
        for name in candidates:
            # A path that failed to compile or launch here is not tried
            # again by "auto" (see layers/dispatch.py).
            reason = (la_dispatch.path_failure(self, name) if requested == "auto" else None)
            if reason is None:
                reason = self._implementation_table[name].refusal(self, context)
            if reason is None:
                return name
            reasons.append(f"{name}: {reason}")
        if requested == "auto":
            return "reference"
        raise ValueError(
            f"implementation={requested!r} of {type(self).__name__} cannot "
            f"run this call ({'; '.join(reasons)}). Use implementation='auto' "
            "or 'reference'."
        )

    #: Whether ``"auto"`` warns when it falls to the reference path (False
    #: where the reference costs what the efficient paths cost).
    warns_on_reference_fallback = True

    def _warn_reference_fallback(self, context):
        """Warns once per layer class and set of reasons that ``"auto"``
        runs the O(T*S) reference path because every efficient path refused
        the call."""
        if not self.warns_on_reference_fallback:
            return
        table = self._implementation_table
        order = self.auto_order()
        reasons = tuple(f"{name}: {table[name].refusal(self, context)}" for name in order)
        key = (type(self).__name__, reasons)
        if key in _WARNED_FALLBACKS:
            return
        _WARNED_FALLBACKS.add(key)
        why = "; ".join(reasons) if reasons else (
            f"no efficient path of {type(self).__name__} runs on this backend")
        warnings.warn(
            f"{type(self).__name__} with implementation='auto' runs the "
            f"O(T*S) reference path for this call: {why}. Name a path with "
            "`implementation=` to make this an error instead.",
            stacklevel=3,
        )

    def auto_order(self):
        """Efficient implementations in the order ``"auto"`` tries them on
        the active backend: by kind, in the backend's order of preference
        (:attr:`keras_longattn.kernels.BackendOps.auto_preference`: fused
        kernels first on PyTorch, explicit einsums first where XLA fuses
        them), then in declaration order."""
        preference = dispatch_auto_preference()
        table = self._implementation_table
        # A kind the backend does not list (e.g. "pallas" off JAX GPU/TPU)
        # only runs when named.
        names = [name for name in table if table[name].kind in preference]
        return tuple(
            sorted(names, key=lambda name: preference.index(table[name].kind))
        )

    def implementation_kind(self, name):
        """The kind (``"explicit"``, ``"fused"``, ``"pallas"``, ``"flex"``,
        ``"cudnn"`` or ``"context_parallel"``) of implementation ``name``;
        ``"reference"`` for the reference path."""
        if name == "reference":
            return "reference"
        return self._implementation_table[name].kind

    def full_attention_limit(self, sequence_length):
        """A configuration in which this layer equals :class:`FullAttention`.

        Returns ``(overrides, tolerance)``: constructor arguments that, put
        into this layer's config, make it compute full softmax attention on
        sequences of up to ``sequence_length`` positions (relative error at
        most ``tolerance`` against ``FullAttention`` on the same weights),
        or None when the mechanism has no such limit.
        """
        return None

    # ------------------------------------------------------------------ call
    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        # Keras fills `query_mask`, `value_mask` and `key_mask` from the
        # inputs' Keras masks (e.g. `Embedding(mask_zero=True)`) before
        # `call`, exactly as for MultiHeadAttention.
        if cache is not None or cache_update_index is not None:
            return self._call_with_cache(
                query, value, key, cache, cache_update_index,
                masks=(query_mask, value_mask, key_mask, attention_mask),
                return_attention_scores=return_attention_scores,
                training=training, use_causal_mask=use_causal_mask,
            )
        if key is None:
            key = value
        # The masks are consumed here (as MultiHeadAttention does), so that
        # the projections do not warn about dropping them.
        for t in (query, value, key):
            _set_keras_mask(t, None)
        query_mask, value_mask, key_mask, attention_mask = (
            _as_tensor(m) for m in (query_mask, value_mask, key_mask, attention_mask)
        )
        self._validate_call(
            query, value, key, query_mask, value_mask, key_mask, attention_mask
        )
        key_padding = la_ops.combine_dense_masks(value_mask, key_mask)
        query_padding = None if query_mask is None else ops.cast(query_mask, "bool")
        if attention_mask is not None:
            # A key that the dense mask hides from every query, and a query
            # that it lets see no key, are padding: they are zeroed below
            # like positions padded through the padding masks, so that a
            # NaN there cannot reach a real row through 0 * NaN.
            attention_mask = ops.cast(attention_mask, "bool")
            key_padding = la_ops.combine_dense_masks(
                key_padding, ops.any(attention_mask, axis=1)
            )
            query_padding = la_ops.combine_dense_masks(
                query_padding, ops.any(attention_mask, axis=2)
            )
        empty = _empty_call(query, value)
        if empty:
            return self._empty_result(query, value, return_attention_scores)
        # Padded positions never reach a real output or gradient, even when
        # their inputs are not finite: they enter the projections as zeros
        # (a masked key's weight is exactly 0, but 0 * NaN is NaN, in the
        # weighted sum and in the projections' weight gradients alike).
        if key_padding is not None:
            keep = ops.expand_dims(key_padding, -1)
            same = key is value
            value = _zero_where_not(keep, value)
            key = value if same else _zero_where_not(keep, key)
        if query_padding is not None:
            query = _zero_where_not(ops.expand_dims(query_padding, -1), query)
        q = self._query_dense(query)  # (B, T, H, d)
        k = self._key_dense(key)  # (B, S, H, d)
        v = self._value_dense(value)  # (B, S, H, dv)
        if self.rotary_max_wavelength is not None:
            q = la_ops.apply_rotary(q, self.rotary_max_wavelength)
            k = la_ops.apply_rotary(k, self.rotary_max_wavelength)
        k, v = self.expand_key_value_heads(k), self.expand_key_value_heads(v)
        context = AttentionContext(
            padding=la_ops.PaddingMask(query_padding, key_padding),
            causal=bool(use_causal_mask),
            attention_mask=attention_mask,
            training=training,
            return_scores=bool(return_attention_scores),
            query_length=la_ops.length(query, 1),
            key_length=la_ops.length(key, 1),
        )
        result = self._dispatch(q, k, v, context)
        if context.return_scores:
            out, scores = result
        else:
            out, scores = result, None
        out = self._output_dense(out)  # (B, T, output_dim)
        if return_attention_scores:
            return out, scores
        return out

    def _empty_result(self, query, value, return_attention_scores):
        """The result of a call with an empty batch or sequence, computed
        without any attention path (there is nothing to attend to or
        from): queries that see no key get a zero attention output, so
        the output is the output projection of zeros, shaped
        ``(B, T, output_dim)``; the scores are ``(B, H, T, S)`` zeros."""
        B, T = query.shape[0], query.shape[1]
        S = value.shape[1]
        H = self.num_heads
        if B == 0 or T == 0:
            # No rows (TensorFlow's einsum would not keep a 0 batch and a 0
            # length together).
            out = ops.zeros(
                self.compute_output_shape(query.shape, value.shape), dtype=self.compute_dtype
            )
        else:
            zeros = ops.zeros((B, T, H, self.value_dim), dtype=self.compute_dtype)
            out = self._output_dense(zeros)
        self.last_implementation = "empty"
        if return_attention_scores:
            return out, ops.zeros((B, H, T, S), dtype=self.compute_dtype)
        return out

    def _dispatch(self, q, k, v, context):
        while True:
            name = self._select(context)
            if name == "reference":
                if self.implementation == "auto" and not context.return_scores:
                    self._warn_reference_fallback(context)
                result = self._attention_reference(q, k, v, context)
                ran = name
                break
            path = self._implementation_table[name]
            if self.implementation == "auto" and la_dispatch.is_accelerator(path):
                # An accelerator path "auto" chose that fails to compile or
                # launch: one warning, then the next path "auto" takes.
                try:
                    result = la_dispatch.run_accelerated(self, path, q, k, v, context)
                except Exception as error:
                    la_dispatch.record_failure(self, path, error)
                    continue
            else:
                result = path.run(self, q, k, v, context)
            variant = path.variant(self, context)
            ran = name if variant is None else f"{name}:{variant}"
            break
        self.last_implementation = ran
        return result

    def attend(
        self,
        query,
        key,
        value,
        query_mask=None,
        key_mask=None,
        use_causal_mask=False,
        training=None,
    ):
        """The attention of the layer on already projected heads.

        ``call`` is the input projections, then this, then the output
        projection. Use it to put the layer's attention behind projections
        of one's own, or to measure the attention alone (the benchmark's
        ``--scope attention``). The layer must be built. Same
        implementations, masks and causality as ``call`` (no dense
        ``attention_mask``, no scores, no rotary positions).

        Args:
            query: ``(B, T, num_heads, key_dim)``.
            key: ``(B, S, num_key_value_heads, key_dim)`` (repeated to
                ``num_heads`` heads, see :meth:`expand_key_value_heads`).
            value: ``(B, S, num_key_value_heads, value_dim)``.
            query_mask: optional boolean ``(B, T)``, False for padding
                (padded query heads enter as zeros).
            key_mask: optional boolean ``(B, S)``, False for padding
                (padded key and value heads enter as zeros).
            use_causal_mask: causal attention (query ``i`` sees keys
                ``j <= i``).
            training: as in ``call`` (dropout; layers with state, such as
                :class:`RoutingAttention`'s centroids, update it).

        Returns:
            ``(B, T, num_heads, value_dim)``.
        """
        if not self.built:
            raise ValueError(
                f"{type(self).__name__}.attend needs a built layer: call the "
                "layer once or build it first"
            )
        query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
        H_kv = self.num_key_value_heads
        for name, x, dims in (
            ("query", query, (self.num_heads, self.key_dim)),
            ("key", key, (H_kv, self.key_dim)),
            ("value", value, (H_kv, self.value_dim)),
        ):
            if len(x.shape) != 4 or tuple(x.shape[2:]) != dims:
                raise ValueError(
                    f"`{name}` must have shape (batch, length, {dims[0]}, "
                    f"{dims[1]}). Received: {name}.shape={tuple(x.shape)}"
                )
        key, value = self.expand_key_value_heads(key), self.expand_key_value_heads(value)
        if _empty_call(query, key):
            # Nothing to attend to or from: (B, T, H, dv) zeros, no path.
            self.last_implementation = "empty"
            return ops.zeros(
                tuple(query.shape[:2]) + (self.num_heads, self.value_dim),
                dtype=value.dtype,
            )
        query_mask, key_mask = (
            None if m is None else ops.cast(_as_tensor(m), "bool") for m in (query_mask, key_mask)
        )
        # Padded heads enter as zeros, as padded inputs do in ``call``.
        if key_mask is not None:
            keep = ops.expand_dims(ops.expand_dims(key_mask, -1), -1)
            key = _zero_where_not(keep, key)
            value = _zero_where_not(keep, value)
        if query_mask is not None:
            keep = ops.expand_dims(ops.expand_dims(query_mask, -1), -1)
            query = _zero_where_not(keep, query)
        context = AttentionContext(
            padding=la_ops.PaddingMask(query_mask, key_mask),
            causal=bool(use_causal_mask),
            attention_mask=None,
            training=training,
            return_scores=False,
            query_length=la_ops.length(query, 1),
            key_length=la_ops.length(key, 1),
        )
        return self._dispatch(query, key, value, context)

    def _attention_reference(self, query, key, value, context):
        """Dense attention under the layer's pattern: the specification."""
        mask = self.reference_mask(context)
        return la_ops.reference_attention(
            query,
            key,
            value,
            mask=mask,
            scale=self._inverse_sqrt_key_dim,
            dropout_fn=self._dropout_fn(context.training),
            return_scores=context.return_scores,
        )

    def reference_mask(self, context):
        """The dense ``(B or 1, T, S)`` boolean mask of a call: the layer's
        pattern AND key padding AND ``attention_mask``. O(T*S)."""
        T, S = context.query_length, context.key_length
        pattern = self.attention_pattern(T, S, context.causal)
        mask = ops.expand_dims(pattern.dense_mask(T, S), 0)
        return la_ops.combine_dense_masks(
            mask,
            context.padding.dense_mask(T, S),
            context.attention_mask,
        )

    def _dropout_fn(self, training):
        if self.dropout <= 0.0:
            return None
        return lambda probs: self._dropout_layer(probs, training=training)

    def _weighted_values(self, weights, value, context):
        """Explicit ``(B, H, T, S)`` weights applied to ``(B, S, H, dv)``
        values, with attention dropout: the output ``(B, T, H, dv)``, and
        the weights (before dropout) too when the call asks for scores."""
        weights = ops.cast(weights, value.dtype)
        dropout_fn = self._dropout_fn(context.training)
        probs = weights if dropout_fn is None else dropout_fn(weights)
        out = ops.einsum("bhts,bshd->bthd", probs, value)
        if context.return_scores:
            return out, weights
        return out

    def expand_key_value_heads(self, x):
        """Projected key or value heads ``(B, S, num_key_value_heads, d)``
        repeated to ``(B, S, num_heads, d)`` (each key/value head serving
        its group of consecutive query heads); unchanged without grouping."""
        repeats = self.num_heads // self.num_key_value_heads
        return x if repeats == 1 else ops.repeat(x, repeats, axis=2)

    # ------------------------------------------------------------ validation
    def _validate_call(
        self, query, value, key, query_mask, value_mask, key_mask, attention_mask
    ):
        shapes = {}
        for name, t in (("query", query), ("value", value), ("key", key)):
            shape = tuple(t.shape)
            if len(shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3 (batch, sequence, features). "
                    f"Received: {name}.shape={shape}"
                )
            shapes[name] = shape
        built = {
            "query": self._query_shape,
            "value": self._value_shape,
            "key": self._key_shape,
        }
        for name, shape in shapes.items():
            if shape[-1] != built[name][-1]:
                raise ValueError(
                    f"`{name}` has {shape[-1]} features but the layer was built "
                    f"for {built[name][-1]}. Received: {name}.shape={shape}"
                )
        batches = {n: s[0] for n, s in shapes.items() if s[0] is not None}
        if len(set(batches.values())) > 1:
            raise ValueError(
                "`query`, `value` and `key` must have the same batch size. "
                f"Received: query.shape={shapes['query']}, "
                f"value.shape={shapes['value']}, key.shape={shapes['key']}"
            )
        sv, sk = shapes["value"][1], shapes["key"][1]
        if sv is not None and sk is not None and sv != sk:
            raise ValueError(
                "`key` and `value` must have the same sequence length. "
                f"Received: value.shape={shapes['value']}, key.shape={shapes['key']}"
            )
        B = next(iter(batches.values()), None)
        T, S = shapes["query"][1], shapes["value"][1]
        for name, m, expected, legend in (
            ("query_mask", query_mask, (B, T), "BT"),
            ("value_mask", value_mask, (B, S), "BS"),
            ("key_mask", key_mask, (B, S), "BS"),
            ("attention_mask", attention_mask, (B, T, S), "BTS"),
        ):
            if m is None:
                continue
            _check_mask(name, m, expected, legend)

    # ---------------------------------------------------------------- shapes
    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        if self._output_shape:
            return query_shape[:-1] + tuple(self._output_shape)
        return query_shape

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        out = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape),
            dtype=self.compute_dtype,
        )
        if return_attention_scores:
            scores = keras.KerasTensor(
                (query.shape[0], self.num_heads, query.shape[1], value.shape[1]),
                dtype=self.compute_dtype,
            )
            return out, scores
        if cache is not None:
            return out, keras.KerasTensor(tuple(cache.shape), dtype=cache.dtype)
        return out

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_shape": self._output_shape,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "implementation": self.implementation,
                "seed": self.seed,
                "rotary_max_wavelength": self.rotary_max_wavelength,
            }
        )
        if self.num_key_value_heads != self.num_heads:
            # Only when grouped: an ungrouped layer's config stays as it was.
            config["num_key_value_heads"] = self.num_key_value_heads
        return config

def _check_output_shape(output_shape):
    """``output_shape`` as a tuple of positive ints, or a ValueError naming
    it (strings, floats such as 2.7 and booleans are refused, never
    truncated)."""
    message = (
        "`output_shape` must be a positive int or a non-empty tuple of "
        f"positive ints. Received: output_shape={output_shape!r}"
    )

    def size(d):
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
            raise ValueError(message)
        return int(d)

    if isinstance(output_shape, (str, bytes)):
        raise ValueError(message)
    if isinstance(output_shape, numbers.Integral) or (
        hasattr(output_shape, "shape") and not getattr(output_shape, "shape", ())
    ):
        return (size(output_shape),)
    try:
        dims = tuple(output_shape)
    except TypeError:
        raise ValueError(message) from None
    if not dims:
        raise ValueError(message)
    return tuple(size(d) for d in dims)


def _as_tensor(mask):
    """Masks given as Python lists or NumPy arrays become tensors (as
    MultiHeadAttention accepts them)."""
    if mask is None or hasattr(mask, "shape"):
        return mask
    return ops.convert_to_tensor(np.asarray(mask))


def _empty_call(query, value):
    """Whether the batch, the query length or the key length is known to
    be 0 (a static size; TensorFlow graphs with unknown sizes run the
    attention paths)."""
    for size in (query.shape[0], query.shape[1], value.shape[1]):
        if isinstance(size, int) and size == 0:
            return True
    return False


def _zero_where_not(keep, x):
    """``x`` where ``keep`` (broadcast), exact zeros elsewhere."""
    return ops.where(keep, x, ops.zeros_like(x))
