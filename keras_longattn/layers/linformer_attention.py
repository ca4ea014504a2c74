"""Linformer (Wang et al. 2020): keys and values projected along the
sequence axis to a fixed number of slots, linear in the length."""

import numbers

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import length_within
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation

#: The values of ``LinformerAttention(sharing=...)``.
SHARINGS = ("none", "headwise", "key_value", "layerwise")


def default_projection_initializer(k):
    """Entries drawn from ``N(0, 1/k)``: the random projection of the
    paper's analysis (Johnson-Lindenstrauss), which keeps ``E x`` about as
    long as ``x``."""
    return keras.initializers.RandomNormal(mean=0.0, stddev=float(k) ** -0.5)


@keras.saving.register_keras_serializable(package="keras_longattn")
class LinformerProjection(keras.layers.Layer):
    """A ``(k, max_length)`` projection of the sequence axis, to share.

    Holds the matrix ``E`` of :class:`LinformerAttention`: one variable,
    ``kernel``, of shape ``(k, max_length)`` (or ``(num_heads, k,
    max_length)`` with ``num_heads``). Pass one instance as ``projection=``
    to several :class:`LinformerAttention` layers to share it between them
    (the paper's *layerwise* sharing: one matrix for the keys and values of
    every head of every layer). The sharing survives ``.keras`` files: a
    saved model keeps one variable, and the loaded layers use one object.

    Args:
        k: number of projected slots. Must be in ``1..max_length``.
        max_length: the longest key sequence the projection takes.
        num_heads: one matrix per head when set. Defaults to None (one
            matrix for all heads).
        initializer: initializer of the kernel. Defaults to a normal of
            standard deviation ``1 / sqrt(k)``.
        regularizer: regularizer of the kernel. Defaults to None.
        constraint: constraint of the kernel. Defaults to None.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> shared = keras_longattn.layers.LinformerProjection(k=4, max_length=32)
    >>> first = keras_longattn.layers.LinformerAttention(
    ...     num_heads=2, key_dim=8, projection=shared)
    >>> second = keras_longattn.layers.LinformerAttention(
    ...     num_heads=2, key_dim=8, projection=shared)
    >>> x = np.random.rand(2, 20, 16).astype("float32")
    >>> tuple(second(first(x, x), x).shape)
    (2, 20, 16)
    >>> first.projection.kernel is second.projection.kernel
    True
    """

    def __init__(self, k, max_length, num_heads=None, initializer=None,
                 regularizer=None, constraint=None, **kwargs):
        super().__init__(**kwargs)
        self.max_length = _positive_int("max_length", max_length)
        self.k = _check_k(k, self.max_length)
        self.num_heads = _positive_int("num_heads", num_heads, allow_none=True)
        if initializer is None:
            initializer = default_projection_initializer(self.k)
        self.initializer = keras.initializers.get(initializer)
        self.regularizer = keras.regularizers.get(regularizer)
        self.constraint = keras.constraints.get(constraint)

    def build(self, input_shape=None):
        if self.built:
            return
        shape = (self.k, self.max_length)
        if self.num_heads is not None:
            shape = (self.num_heads,) + shape
        self.kernel = self.add_weight(
            name="kernel",
            shape=shape,
            initializer=_per_head(self.initializer, shape),
            regularizer=self.regularizer,
            constraint=self.constraint,
        )
        self.built = True

    def matrix(self, length, dtype=None):
        """The kernel's leading ``length`` columns: ``(k, length)`` or
        ``(H, k, length)``."""
        kernel = ops.convert_to_tensor(self.kernel)
        if dtype is not None:
            kernel = ops.cast(kernel, dtype)
        return kernel[..., :length]

    def project(self, x, dtype=None):
        """``(B, S, H, d)`` -> ``(B, k, H, d)``: each slot a weighted sum of
        the ``S`` positions (``S <= max_length``)."""
        E = self.matrix(la_ops.length(x, 1), dtype=dtype or x.dtype)
        if self.num_heads is None:
            return ops.einsum("ks,bshd->bkhd", E, x)  # (k, S) x (B, S, H, d)
        return ops.einsum("hks,bshd->bkhd", E, x)  # (H, k, S) x (B, S, H, d)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "k": self.k,
                "max_length": self.max_length,
                "num_heads": self.num_heads,
                "initializer": keras.initializers.serialize(self.initializer),
                "regularizer": keras.regularizers.serialize(self.regularizer),
                "constraint": keras.constraints.serialize(self.constraint),
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_longattn")
class LinformerAttention(BaseAttention):
    """Linformer attention: keys and values projected along the sequence
    axis to ``k`` slots; linear in the sequence length.

    The ``S`` keys and values of each head are replaced by ``k`` mixtures of
    them, ``E K`` and ``F V`` (``E``, ``F``: ``(k, max_length)`` matrices,
    learned), and every query attends to the ``k`` slots:
    ``softmax(Q (E K)^T / sqrt(d)) (F V)``. Inputs shorter than
    ``max_length`` use the leading ``S`` columns of ``E`` and ``F`` (column
    ``j`` multiplies the key at position ``j``); longer ones are refused.

    **Padding** is masked before the projection: padded keys and values
    enter ``E K`` and ``F V`` as exact zeros (the projections' biases
    included), so an example right-padded to any length gives the output
    of the example alone. (Left padding shifts the columns of ``E`` a key
    meets, as any absolute position would.)

    **Sharing** (the paper's Section 4): ``"none"``: one ``E`` and one ``F``
    per head; ``"headwise"``: one ``E`` and one ``F`` for all heads;
    ``"key_value"``: one matrix for all heads, ``E = F``; ``"layerwise"``:
    one :class:`LinformerProjection` passed as ``projection=`` to several
    layers, used as ``E = F`` by all of them.

    **No causal mode**: a projected slot mixes keys of every position, so
    query ``i`` would see keys after ``i``. No attention scores either:
    the weights are over the ``k`` slots, not over the keys. A dense
    ``attention_mask`` only with ``implementation="reference"``.

    **Cost**: the ``"projected"`` path forms ``E K`` and ``F V`` (O(n k d)),
    then ``(T, k)`` weights: time O(n k d), memory O(n k) per head, never an
    ``n x n`` tensor. ``"projected_fused"`` hands the ``k`` slots to the
    backend's fused attention kernel (no dropout). ``"reference"`` is the
    explicit quadratic form of the same computation: the ``(T, S)`` scores
    ``Q K^T`` projected on the key axis by ``E``, the softmax over the
    slots, mapped back to the keys by ``F`` and applied to ``V``.

    With ``k = n`` and identity ``E = F`` the layer is exact multi-head
    attention (:meth:`full_attention_limit`).

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        k: number of projected slots, in ``1..max_length``. Defaults to 256
            (the projection's ``k`` with ``projection=``).
        max_length: the longest key sequence. Defaults to 512 (the
            projection's ``max_length`` with ``projection=``).
        sharing: ``"none"``, ``"headwise"``, ``"key_value"`` or
            ``"layerwise"`` (see above). Defaults to ``"layerwise"`` when a
            ``projection`` is given, else ``"headwise"``.
        projection: a :class:`LinformerProjection` shared with other
            layers (``sharing="layerwise"`` only). Defaults to None.
        projection_initializer: initializer of the layer's own ``E`` and
            ``F`` (``"identity"`` with ``k = max_length`` gives full
            attention). Defaults to a normal of standard deviation
            ``1 / sqrt(k)``.
        **kwargs: the arguments of :class:`BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"projected"``, ``"projected_fused"`` or
            ``"reference"``). The kernel regularizer and constraint also
            apply to the layer's own ``E`` and ``F``.

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)`` with ``S <= max_length``, ``key``,
        ``query_mask`` ``(B, T)``, ``value_mask``/``key_mask`` ``(B, S)``,
        ``training``. ``use_causal_mask=True`` and
        ``return_attention_scores=True`` are refused.

    Returns:
        ``(B, T, output_dim)``.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.LinformerAttention(
    ...     num_heads=2, key_dim=8, k=16, max_length=128)
    >>> x = np.random.rand(2, 100, 16).astype("float32")
    >>> mask = np.arange(100)[None, :] < np.array([[100], [60]])
    >>> tuple(layer(x, x, query_mask=mask, value_mask=mask).shape)
    (2, 100, 16)
    >>> [tuple(w.shape) for w in layer.weights[8:]]  # E and F, all heads
    [(16, 128), (16, 128)]

    Reference:
        Wang, Li, Khabsa, Fang and Ma, "Linformer: Self-Attention with
        Linear Complexity", arXiv:2006.04768, 2020.
    """

    is_exact = False
    supports_causal = False
    supports_scores = False
    supports_attention_mask = False
    reference_tolerance = 1e-5

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        k=None,
        max_length=None,
        sharing=None,
        projection=None,
        projection_initializer=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        if isinstance(projection, dict):
            projection = keras.saving.deserialize_keras_object(projection)
        if projection is not None and not isinstance(projection, LinformerProjection):
            raise ValueError(
                "`projection` must be a keras_longattn.layers.LinformerProjection "
                f"or None. Received: projection={projection!r}"
            )
        if sharing is None:
            sharing = "layerwise" if projection is not None else "headwise"
        if sharing not in SHARINGS:
            raise ValueError(
                f"`sharing` must be one of {SHARINGS}. Received: sharing={sharing!r}"
            )
        if sharing == "layerwise" and projection is None:
            raise ValueError(
                "sharing='layerwise' needs the shared matrix: pass the same "
                "keras_longattn.layers.LinformerProjection as `projection` to "
                "every layer that shares it. Received: projection=None"
            )
        if projection is not None and sharing != "layerwise":
            raise ValueError(
                "`projection` is the matrix shared by several layers, used "
                f"only with sharing='layerwise'. Received: sharing={sharing!r} "
                "with a projection"
            )
        if projection is not None:
            for name, value in (("k", k), ("max_length", max_length)):
                if value is not None and value != getattr(projection, name):
                    raise ValueError(
                        f"`{name}` must match the shared projection's "
                        f"({name}={getattr(projection, name)}). Received: "
                        f"{name}={value!r}"
                    )
            if projection.num_heads not in (None, self.num_heads):
                raise ValueError(
                    "The shared projection has one matrix per head for "
                    f"{projection.num_heads} heads, but the layer has "
                    f"{self.num_heads}. Received: num_heads={self.num_heads}"
                )
            k, max_length = projection.k, projection.max_length
        self.max_length = _positive_int(
            "max_length", 512 if max_length is None else max_length
        )
        self.k = _check_k(256 if k is None else k, self.max_length)
        self.sharing = sharing
        # Not tracked here: a shared projection becomes a sub-layer in
        # `build_extra`, after the projections of MultiHeadAttention, so
        # that the layer's weights start with exactly MHA's, in its order.
        object.__setattr__(self, "_shared_projection", projection)
        if projection_initializer is None:
            projection_initializer = default_projection_initializer(self.k)
        self.projection_initializer = keras.initializers.get(projection_initializer)
        self._key_projection = None
        self._value_projection = None

    @property
    def projection(self):
        """The shared :class:`LinformerProjection` (``sharing="layerwise"``),
        else None."""
        return self._shared_projection

    # ---------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        if self.sharing == "layerwise":
            self.projection.build()
            self._key_projection = self._value_projection = self.projection
            return
        per_head = self.num_heads if self.sharing == "none" else None

        def make(name):
            proj = LinformerProjection(
                self.k,
                self.max_length,
                num_heads=per_head,
                initializer=self.projection_initializer.__class__.from_config(
                    self.projection_initializer.get_config()
                ),
                regularizer=self.kernel_regularizer,
                constraint=self.kernel_constraint,
                dtype=self.dtype_policy,
                name=name,
            )
            proj.build()
            return proj

        if self.sharing == "key_value":
            self._key_projection = self._value_projection = make("key_value_projection")
        else:
            self._key_projection = make("key_projection")
            self._value_projection = make("value_projection")

    def set_weights(self, weights):
        """Sets the weights; a list of the projections' weights alone (e.g.
        ``MultiHeadAttention.get_weights()``) sets them and keeps ``E``
        and ``F``."""
        weights = list(weights)
        own = self.weights
        if len(weights) < len(own) and len(weights) == len(self._projection_weights()):
            weights += [ops.convert_to_numpy(w) for w in own[len(weights):]]
        super().set_weights(weights)

    def _projection_weights(self):
        return [
            w
            for layer in (self._query_dense, self._key_dense, self._value_dense,
                          self._output_dense)
            for w in layer.weights
        ]

    # -------------------------------------------------------------- checks
    def _select(self, context):
        if context.causal:
            raise ValueError(
                "LinformerAttention has no causal mode: each projected slot "
                "E K mixes the keys of every position, so query i would see "
                "keys after i. Use another layer for causal attention. "
                "Received: use_causal_mask=True"
            )
        return super()._select(context)

    def _dispatch(self, q, k, v, context):
        length_within("key", context.key_length, self.max_length,
                      "the projections of LinformerAttention")
        return super()._dispatch(q, k, v, context)

    # -------------------------------------------------------- efficient paths
    def project_keys_values(self, key, value, key_mask=None):
        """``E K`` and ``F V`` of projected heads, padding zeroed first:
        ``(B, S, H, d)`` -> ``(B, k, H, d)`` (and the same for values)."""
        if key_mask is not None:
            keep = ops.cast(key_mask, "bool")[:, :, None, None]
            key = ops.where(keep, key, ops.zeros_like(key))
            value = ops.where(keep, value, ops.zeros_like(value))
        return self._key_projection.project(key), self._value_projection.project(value)

    @implementation("projected")
    def _projected(self, query, key, value, context):
        """Attention of every query to the ``k`` projected slots."""
        key, value = self.project_keys_values(key, value, context.padding.key_mask)
        return la_ops.reference_attention(
            query,
            key,
            value,
            scale=self._inverse_sqrt_key_dim,
            dropout_fn=self._dropout_fn(context.training),
        )

    @implementation("projected_fused", kind="fused", dropout=False)
    def _projected_fused(self, query, key, value, context):
        """The same, through the backend's fused attention kernel."""
        key, value = self.project_keys_values(key, value, context.padding.key_mask)
        return la_ops.fused_dot_product_attention(
            query, key, value, scale=self._inverse_sqrt_key_dim
        )

    # ------------------------------------------------------------ reference
    def _attention_reference(self, query, key, value, context):
        """The explicit quadratic form: the ``(T, S)`` scores, projected by
        ``E`` on the key axis, the softmax over the ``k`` slots, mapped back
        to the keys by ``F`` (masked keys zero throughout)."""
        dtype = query.dtype
        q, k, v = (ops.cast(t, "float32") for t in (query, key, value))
        S = la_ops.length(k, 1)
        mask = la_ops.combine_dense_masks(
            context.padding.dense_mask(context.query_length, S),
            context.attention_mask,
        )  # (B, T, S) or None
        # (B, T, H, d) x (B, S, H, d) -> (B, H, T, S)
        scores = ops.einsum("bthd,bshd->bhts", q * self._inverse_sqrt_key_dim, k)
        if mask is not None:
            mask = ops.cast(mask, "bool")[:, None]  # (B, 1, T, S)
            scores = ops.where(mask, scores, ops.zeros_like(scores))
        E = self._key_projection.matrix(S, "float32")
        F = self._value_projection.matrix(S, "float32")
        h = "" if len(E.shape) == 2 else "h"
        logits = ops.einsum(f"bhts,{h}ks->bhtk", scores, E)  # (B, H, T, k)
        weights = ops.softmax(logits, axis=-1)
        dropout_fn = self._dropout_fn(context.training)
        if dropout_fn is not None:
            weights = dropout_fn(weights)
        effective = ops.einsum(f"bhtk,{h}ks->bhts", weights, F)  # (B, H, T, S)
        if mask is not None:
            effective = ops.where(mask, effective, ops.zeros_like(effective))
        out = ops.einsum("bhts,bshd->bthd", effective, v)  # (B, T, H, dv)
        return ops.cast(out, dtype)

    def attention_support(self, query, value, query_mask=None, value_mask=None):
        """Which keys each head of each query draws on, for inspection and
        the docs' figure: boolean ``(B, H, T, S)``, True where key ``s`` is
        real. Every slot mixes every real key, so every query draws on all
        of them (and on no padded key). O(T * S).

        Args:
            query: ``(B, T, dim)`` layer inputs.
            value: ``(B, S, dim)``.
            query_mask: optional boolean ``(B, T)`` (unused: a padded query
                still draws on the keys; its output is ignored).
            value_mask: optional boolean ``(B, S)``.
        """
        batch, T = query.shape[0], query.shape[1]
        S = value.shape[1]
        if value_mask is None:
            keys = ops.ones((batch, S), dtype="bool")
        else:
            keys = ops.cast(value_mask, "bool")
        return ops.broadcast_to(keys[:, None, None, :], (batch, self.num_heads, T, S))

    # ----------------------------------------------------------------- limit
    def full_attention_limit(self, sequence_length):
        """``k = max_length = n`` and identity ``E = F``: ``E K = K`` and
        ``F V = V``, exactly multi-head attention (up to float rounding)."""
        n = int(sequence_length)
        overrides = {
            "k": n,
            "max_length": n,
            "projection_initializer": "identity",
        }
        if self.sharing == "layerwise":
            overrides.update({"sharing": "key_value", "projection": None})
        return overrides, 1e-5

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "k": self.k,
                "max_length": self.max_length,
                "sharing": self.sharing,
                # The object itself, not its serialized dict: Keras
                # serializes it when the model is saved, and only then can
                # it mark the second and later uses as the same object
                # (`shared_object_id`), so that loading makes one projection.
                "projection": self.projection,
                "projection_initializer": keras.initializers.serialize(
                    self.projection_initializer
                ),
            }
        )
        return config


def _check_k(k, max_length):
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= max_length:
        raise ValueError(
            "`k` must be an integer in 1..max_length "
            f"(max_length={max_length}). Received: k={k!r}"
        )
    return int(k)


def _per_head(initializer, shape):
    """The initializer of a kernel of ``shape``; an identity initializer
    (2-D only in Keras) gives the identity to every head."""
    if len(shape) == 3 and isinstance(initializer, keras.initializers.Identity):

        def init(shape, dtype=None):
            return ops.tile(initializer(shape[1:], dtype=dtype)[None], (shape[0], 1, 1))

        return init
    return initializer
