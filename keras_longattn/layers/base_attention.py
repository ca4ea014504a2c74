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
from keras_longattn.ops import checks as la_checks
from keras_longattn.layers import dispatch as la_dispatch
from keras_longattn.layers.dispatch import auto_preference as dispatch_auto_preference
from keras_longattn.layers.dispatch import collect_implementations

#: ``(layer class name, reasons)`` pairs already warned about.
_WARNED_FALLBACKS = set()

try:  # Keras keeps this helper private; fall back to the attribute.
    from keras.src.backend.common.masking import set_keras_mask as _set_keras_mask
except ImportError:  # pragma: no cover

    def _set_keras_mask(x, mask):
        try:
            x._keras_mask = mask
        except AttributeError:
            pass

_MHA_CONFIG_KEYS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "dropout",
    "use_bias",
    "output_shape",
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "seed",
)


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


class BaseAttention(keras.layers.Layer):
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
    def __call__(self, *args, **kwargs):
        # Keras casts every float argument to the layer's input dtype before
        # `call`: a decoding cache must keep its own dtype (a bfloat16 cache
        # of a float32 layer stays bfloat16), so it passes held.
        if kwargs.get("cache") is not None:
            kwargs["cache"] = _Held(kwargs["cache"])
        return super().__call__(*args, **kwargs)

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
        if isinstance(cache, _Held):
            cache = cache.value
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

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        """Why the layer cannot decode with a cache (None when it can).

        A layer decodes incrementally when a new query's output depends on
        the earlier keys through a state of bounded size that one step can
        update (:meth:`cache_shape`, :meth:`_decode`)."""
        return (f"{type(self).__name__} has no decoding cache: every output "
                "depends on the whole sequence at once")

    def cache_shape(self, batch_size, max_length):
        """The shape of the decoding cache of ``batch_size`` sequences of up
        to ``max_length`` positions (:meth:`init_cache` makes one)."""
        reason = self.decode_refusal()
        if reason is not None:
            raise ValueError(reason)
        raise NotImplementedError

    def init_cache(self, batch_size, max_length, dtype=None):
        """An empty decoding cache: zeros of :meth:`cache_shape` in
        ``dtype`` (default: the layer's compute dtype; a float dtype).

        Raises:
            ValueError: ``batch_size`` or ``max_length`` not a positive int,
                or ``dtype`` not a float dtype (every cache, rings and
                recurrent states included, whose size ignores
                ``max_length``)."""
        for name, size in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ValueError(f"`{name}` of init_cache must be a positive int. "
                                 f"Received: {name}={size!r}")
        dtype = keras.backend.standardize_dtype(dtype or self.compute_dtype)
        if dtype not in _CACHE_DTYPES:
            raise ValueError(f"`dtype` of init_cache must be one of {_CACHE_DTYPES}. "
                             f"Received: dtype={dtype!r}")
        return ops.zeros(self.cache_shape(int(batch_size), int(max_length)), dtype=dtype)

    def _decode(self, query, key, value, cache, index, training):
        """One decoding call on projected heads: the ``T`` new queries, keys
        and values at positions ``index .. index + T - 1``, and the cache of
        the earlier ones. Returns ``(out (B, T, H, dv), new cache)``."""
        raise NotImplementedError

    def _check_cache(self, cache, batch_size):
        """The cache as a tensor, or a ValueError naming what differs from
        :meth:`cache_shape` (the sequence axis of a full-length cache is
        free: ``cache_length_free``)."""
        cache = ops.convert_to_tensor(cache)
        expected = tuple(self.cache_shape(batch_size, None if self.cache_length_free else 1))
        shape = tuple(cache.shape)
        same = len(shape) == len(expected) and all(
            e is None or s is None or s == e for s, e in zip(shape, expected))
        if not same:
            shown = tuple("max_length" if e is None else e for e in expected)
            raise ValueError(
                f"`cache` of {type(self).__name__} must have shape {shown} "
                f"(init_cache gives one). Received: cache.shape={shape}")
        if keras.backend.standardize_dtype(cache.dtype) not in _CACHE_DTYPES:
            raise ValueError(
                "`cache` must be a floating-point tensor. "
                f"Received: cache.dtype={keras.backend.standardize_dtype(cache.dtype)}")
        return cache

    #: Whether the cache stacks keys and values on its axis 1 (which needs
    #: ``value_dim == key_dim``).
    cache_stacks_key_value = True

    #: Whether the cache's sequence axis is the maximum length (a full
    #: cache) rather than a size the layer fixes (a ring of the window).
    cache_length_free = True

    def _call_with_cache(self, query, value, key, cache, index, masks,
                         return_attention_scores, training, use_causal_mask):
        """``call`` with ``cache`` and ``cache_update_index``: causal
        self-attention of the new tokens at positions ``index ..`` over the
        cached ones and themselves; returns ``(output, new cache)``."""
        name = type(self).__name__
        reason = self.decode_refusal()
        if reason is not None:
            raise ValueError(f"{reason}. Received: cache={'given' if cache is not None else None}")
        if cache is None or index is None:
            raise ValueError(
                "Decoding needs both `cache` and `cache_update_index`. Received: "
                f"cache={'given' if cache is not None else None}, "
                f"cache_update_index={index!r}")
        if not use_causal_mask:
            raise ValueError(
                f"{name} decodes causally only: pass use_causal_mask=True with a "
                "cache. Received: use_causal_mask=False")
        if return_attention_scores:
            raise ValueError(
                "A decoding call returns no attention scores. "
                "Received: return_attention_scores=True")
        given = [n for n, m in zip(("query_mask", "value_mask", "key_mask", "attention_mask"),
                                   masks) if m is not None]
        if given:
            raise ValueError(
                f"{name} decodes without padding masks (the cache holds real tokens "
                f"only; decode each sequence from its own length). Received: {', '.join(given)}")
        if key is not None and key is not value:
            raise ValueError(
                "A decoding call is self-attention: `key` must be None or `value`. "
                "Received: a separate key tensor")
        query, value = ops.convert_to_tensor(query), ops.convert_to_tensor(value)
        for t in (query, value):
            _set_keras_mask(t, None)
        self._validate_call(query, value, value, None, None, None, None)
        if query.shape[1] is not None and value.shape[1] is not None and (
                query.shape[1] != value.shape[1]):
            raise ValueError(
                "A decoding call is self-attention: `query` and `value` must have the "
                f"same length. Received: query.shape={tuple(query.shape)}, "
                f"value.shape={tuple(value.shape)}")
        if self.cache_stacks_key_value and self.value_dim != self.key_dim:
            raise ValueError(
                f"The decoding cache stacks keys and values: {name} needs value_dim == "
                f"key_dim. Received: key_dim={self.key_dim}, value_dim={self.value_dim}")
        cache = self._check_cache(cache, query.shape[0])
        index, bad = _check_cache_index(index, query.shape[1],
                                        cache.shape[2] if self.cache_length_free else None)
        if bad is not None:
            # XLA on TensorFlow cannot stop at a bad traced index: the call
            # computes at position 0, then writes nothing and returns NaN
            # (below; never a clamped write into the last slots).
            index = ops.where(bad, ops.zeros_like(index), index)
        if query.shape[1] == 0:
            # No new token: nothing to attend from, nothing to write.
            self.last_implementation = "decode"
            return self._empty_result(query, value, False), cache
        q = self._query_dense(query)
        k = self._key_dense(value)
        v = self._value_dense(value)
        if self.rotary_max_wavelength is not None:
            q = la_ops.apply_rotary(q, self.rotary_max_wavelength, start=index)
            k = la_ops.apply_rotary(k, self.rotary_max_wavelength, start=index)
        out, new_cache = self._decode(q, k, v, cache, index, training)
        out = self._output_dense(out)
        # The cache keeps its dtype (a compiled loop carries it unchanged).
        new_cache = ops.cast(new_cache, cache.dtype)
        if bad is not None:
            out = ops.where(bad, ops.full_like(out, float("nan")), out)
            new_cache = ops.where(bad, cache, new_cache)
        self.last_implementation = "decode"
        return out, new_cache

    def _written_full_cache(self, cache, key, value, index):
        """A full-length cache ``(B, 2, S, H_kv, d)`` with the new keys and
        values written at ``index`` (in the cache's dtype), and its keys and
        values in the keys' dtype, the slots not written yet (from ``index +
        T`` on) selected as zeros: whatever they hold never reaches an
        output. (Updating the keys and the values apart and stacking them
        decodes faster on XLA's CPU backend than one update of the stacked
        cache.)"""
        start = (0, index, 0, 0)
        keys = ops.slice_update(cache[:, 0], start, ops.cast(key, cache.dtype))
        values = ops.slice_update(cache[:, 1], start, ops.cast(value, cache.dtype))
        written = ops.arange(cache.shape[2], dtype="int32") < index + key.shape[1]
        return (ops.stack([keys, values], axis=1),
                only_written(keys, written, key.dtype),
                only_written(values, written, key.dtype))

    def _ring_keys(self, cache, key, value, index):
        """The keys and values of a ring cache ``(B, 2, W, H_kv, d)`` (the
        last ``W`` positions, position ``p`` in slot ``p mod W``) put in
        order, followed by the ``T`` new ones: ``(keys, values, k_pos,
        written)``, positions ``index - W .. index + T - 1``; slots of
        positions before 0 (never written) are selected as zeros."""
        W = cache.shape[2]
        order = ops.mod(index + ops.arange(W, dtype="int32"), W)  # positions index - W ..
        keys = ops.concatenate(
            [ops.cast(ops.take(cache[:, 0], order, axis=1), key.dtype), key], axis=1)
        values = ops.concatenate(
            [ops.cast(ops.take(cache[:, 1], order, axis=1), value.dtype), value], axis=1)
        k_pos = index - W + ops.arange(keys.shape[1], dtype="int32")
        written = k_pos >= 0
        return (only_written(keys, written, key.dtype), only_written(values, written, value.dtype),
                k_pos, written)

    @staticmethod
    def _ring_after(keys, values, index, T):
        """The ring of the last ``W`` of the ordered ``keys`` / ``values``
        (:meth:`_ring_keys`) after ``T`` new positions: slot ``s`` keeps
        the one of the last ``W`` positions that is ``s mod W``."""
        W = keys.shape[1] - T
        first = index + T - W
        slots = ops.mod(ops.arange(W, dtype="int32") - first, W)
        ring_k = ops.take(keys[:, T:], slots, axis=1)
        ring_v = ops.take(values[:, T:], slots, axis=1)
        return ops.stack([ring_k, ring_v], axis=1)

    def _decode_each_token(self, step, tokens, cache, index):
        """Decodes ``T`` new tokens one after the other: ``step(*token_slices,
        cache, position)`` returns ``(out (B, 1, H, dv), cache)`` for the
        token at ``position``; ``tokens`` are ``(B, T, ...)`` tensors sliced
        at each step (a compiled loop: ``keras.ops.fori_loop``)."""
        first = tokens[0]
        out = ops.zeros(tuple(first.shape[:3]) + (self.value_dim,), first.dtype)

        def body(i, state):
            out, cache = state
            parts = [ops.slice(x, (0, i) + (0,) * (len(x.shape) - 2),
                               (x.shape[0], 1) + tuple(x.shape[2:])) for x in tokens]
            one, cache = step(*parts, cache, index + i)
            return ops.slice_update(out, (0, i, 0, 0), ops.cast(one, out.dtype)), cache

        return ops.fori_loop(0, first.shape[1], body, (out, cache))

    def _pattern_decode(self, query, key, value, cache, index, training, head_patterns):
        """Decoding under an exact per-head pattern: the keys and values of
        every position in a full-length cache (as :class:`FullAttention`'s),
        the new queries at positions ``index ..`` attending the cached keys
        their head's pattern allows (``head_patterns``: one pattern per
        head, each ANDed with causality); O(max_length) work per token."""
        T, S = query.shape[1], cache.shape[2]
        cache, keys, values = self._written_full_cache(cache, key, value, index)
        q_pos = (index + ops.arange(T, dtype="int32"))[:, None]
        k_pos = ops.arange(S, dtype="int32")[None, :]
        causal = k_pos <= q_pos
        masks = {}
        for p in head_patterns:
            if p not in masks:
                masks[p] = ops.logical_and(causal, ops.broadcast_to(p.allowed(q_pos, k_pos), (T, S)))
        mask = ops.stack([masks[p] for p in head_patterns])[None]  # (1, H, T, S)
        out = la_ops.reference_attention(
            query, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
            mask=mask, scale=self._inverse_sqrt_key_dim, dropout_fn=self._dropout_fn(training))
        return out, cache

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

    @classmethod
    def from_multi_head_attention(cls, mha, **kwargs):
        """Builds a layer of this class with the weights of a built
        ``keras.layers.MultiHeadAttention``.

        Args:
            mha: a built ``keras.layers.MultiHeadAttention`` (default
                ``attention_axes``, rank-3 inputs).
            **kwargs: constructor arguments of this class (e.g. ``window``),
                which also override the values taken from ``mha``.
        """
        if not mha.built:
            raise ValueError(
                "`mha` must be built (called once) before its weights can be "
                f"copied. Received: mha={mha.name!r} (not built)"
            )
        config = mha.get_config()
        args = {k: config[k] for k in _MHA_CONFIG_KEYS if k in config}
        args.update(kwargs)
        return cls._with_weights_of(mha, args, config.get("sliding_window"))

    @classmethod
    def from_grouped_query_attention(cls, gqa, **kwargs):
        """Builds a layer of this class with the weights of a built
        ``keras.layers.GroupQueryAttention`` (``num_query_heads`` heads of
        ``head_dim``, ``num_key_value_heads`` key/value heads).

        A ``sliding_window`` of ``gqa`` is mapped as by
        :meth:`from_multi_head_attention`; a gated ``gqa``
        (``use_gate=True``) is refused.
        """
        if not gqa.built:
            raise ValueError(
                "`gqa` must be built (called once) before its weights can be "
                f"copied. Received: gqa={gqa.name!r} (not built)"
            )
        config = gqa.get_config()
        if config.get("use_gate"):
            raise ValueError(
                "keras_longattn layers have no output gate: a GroupedQueryAttention "
                "with use_gate=True cannot be copied. Received: use_gate=True")
        args = {
            "num_heads": config["num_query_heads"],
            "key_dim": config["head_dim"],
            "num_key_value_heads": config["num_key_value_heads"],
        }
        for name in _MHA_CONFIG_KEYS:
            if name in config and name not in ("num_heads", "key_dim", "value_dim",
                                               "output_shape"):
                args[name] = config[name]
        args.update(kwargs)
        return cls._with_weights_of(gqa, args, config.get("sliding_window"))

    @classmethod
    def _with_weights_of(cls, source, args, sliding_window):
        """A layer of ``cls`` (LocalAttention for FullAttention with a
        sliding window) from ``args``, built and holding ``source``'s
        weights."""
        target = cls
        if sliding_window is not None:
            from keras_longattn.layers.local_attention import LocalAttention

            if cls in (BaseAttention,) or cls.__name__ == "FullAttention":
                target = LocalAttention
            if not issubclass(target, LocalAttention):
                raise ValueError(
                    f"The source layer attends within sliding_window={sliding_window} "
                    f"positions, which is LocalAttention's pattern, not "
                    f"{cls.__name__}'s: use LocalAttention (or FullAttention, which "
                    "maps it to LocalAttention). "
                    f"Received: sliding_window={sliding_window}")
            # |i - j| <= sliding_window - 1, as Keras's band.
            reach = int(sliding_window) - 1
            args = {"window": 2 * reach + 1, "look_back": reach, "look_ahead": reach,
                    **args}
        layer = target(**args)
        dims = [
            source._query_dense.kernel.shape[0],
            source._value_dense.kernel.shape[0],
            source._key_dense.kernel.shape[0],
        ]
        layer.build(*[(None, None, int(d)) for d in dims])
        layer.set_weights(source.get_weights())
        return layer


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


def known_index(index):
    """``cache_update_index`` as a Python int when its value is known while
    the call is made (None when it is traced)."""
    return la_checks.concrete_int(index)


def only_written(x, written, dtype):
    """``x`` ``(B, S, ...)`` in ``dtype`` where ``written`` ``(S,)``, exact
    zeros elsewhere (a select: a non-finite value in a slot not written
    cannot reach an output, as it would through a zero weight)."""
    x = ops.cast(x, dtype)
    keep = ops.reshape(written, (1, -1) + (1,) * (len(x.shape) - 2))
    return ops.where(keep, x, ops.zeros_like(x))


def _check_cache_index(index, new_tokens, max_length):
    """``(index, bad)``: ``cache_update_index`` as an int32 scalar tensor,
    and None, or, for a traced index that the backend cannot refuse while
    the program runs, the traced flag of an index outside the cache. A
    Python int (or a concrete tensor) outside the cache is a ValueError
    naming it; a traced one is refused when the program runs (JAX, TensorFlow
    graphs; :func:`keras_longattn.ops.checks.refuse_when`)."""
    if isinstance(index, bool) or isinstance(index, (float, str)):
        raise ValueError(
            "`cache_update_index` must be an int or a scalar integer tensor. "
            f"Received: cache_update_index={index!r}")
    if not isinstance(index, numbers.Integral):
        index = ops.convert_to_tensor(index)
        if len(index.shape) != 0 or "int" not in keras.backend.standardize_dtype(index.dtype):
            raise ValueError(
                "`cache_update_index` must be an int or a scalar integer tensor. "
                f"Received: cache_update_index with shape {tuple(index.shape)} and dtype "
                f"{keras.backend.standardize_dtype(index.dtype)}")
    limit = None if max_length is None or new_tokens is None else max_length - new_tokens
    room = "" if limit is None else (f" and at most {limit} (cache length {max_length} "
                                     f"- {new_tokens} new tokens)")
    message = f"`cache_update_index` must be at least 0{room}. Received: cache_update_index="
    value = la_checks.concrete_int(index)
    if value is not None:
        if value < 0 or (limit is not None and value > limit):
            raise ValueError(message + str(value))
        return ops.convert_to_tensor(value, "int32"), None
    index = ops.cast(index, "int32")
    bad = index < 0
    if limit is not None:
        bad = ops.logical_or(bad, index > limit)
    return la_checks.refuse_when(bad, index, message + "{value}")


class _Held:
    """An argument carried through ``Layer.__call__`` unconverted."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


#: Dtypes a decoding cache may have.
_CACHE_DTYPES = ("float16", "bfloat16", "float32", "float64")


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


def _check_mask(name, mask, expected, legend):
    shape = tuple(mask.shape)
    if len(shape) != len(expected) or any(
        e is not None and s is not None and e != s for s, e in zip(shape, expected)
    ):
        raise ValueError(
            f"`{name}` must have shape {_fmt_shape(expected, legend)}. "
            f"Received: {name}.shape={shape}"
        )
    dtype = keras.backend.standardize_dtype(mask.dtype)
    if dtype != "bool" and "int" not in dtype:
        raise ValueError(
            f"`{name}` must be boolean (True = attend) or integer 0/1. "
            f"Received: {name}.dtype={dtype}"
        )


def _fmt_shape(shape, legend):
    parts = [str(d) if d is not None else l for d, l in zip(shape, legend)]
    return "(" + ", ".join(parts) + ")"
