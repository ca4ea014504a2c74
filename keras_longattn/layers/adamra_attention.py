"""Adaptive multi-resolution attention (AdaMRA, Zhang et al. 2021): heads
that attend to keys compressed at different rates, a router that sends
each query to one head, and kernelized attention, linear in the length."""

import keras
from keras import ops

from keras_longattn._validation import optional_seed as _optional_seed
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn import ops as la_ops
from keras_longattn.layers._head_kernel import HeadKernel
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.ops import adamra as adamra_ops
from keras_longattn.ops import kernelized
from keras_longattn.ops import segments


@keras.saving.register_keras_serializable(package="keras_longattn")
class AdaMRAAttention(BaseAttention):
    """Adaptive multi-resolution attention (AdaMRA): linear in the sequence
    length.

    Head ``h`` has a compression rate ``c_h``: its keys and values are
    replaced by ``m_h = ceil(n * c_h)`` landmarks, the means of consecutive
    segments of ``ceil(n / m_h)`` keys (padding takes no part in a mean, and
    an example's segments are cut from its own real keys, so they do not
    depend on the padding of its batch). A router ``P = softmax(Q W)``
    (``W``: ``(num_heads * key_dim, num_heads)``, the layer's ``router``
    weight, reading all heads of a query at once) sends each query to the
    head of highest probability; the other heads give that query nothing.
    Each head is split into ``num_subheads`` subheads of
    ``key_dim / num_subheads`` (and ``value_dim / num_subheads``) features
    that attend separately to the head's landmarks, with kernelized
    attention ``phi(q) (phi(K)^T V) / (phi(q) . sum phi(K))``. The output is
    ``sum_h head_h W_O^h``.

    **Router gradient.** The paper does not say how the router learns
    (``argmax`` has no gradient, and there is no official code). As in a
    switch mixture of experts, the chosen head's output is multiplied by its
    router probability, which gives ``W`` a gradient.

    **Output projection.** The paper sums the heads and applies one shared
    ``W_O``; this layer keeps MultiHeadAttention's output projection, one
    ``(value_dim, output_dim)`` slice per head, so ``sum_h head_h W_O^h``;
    the paper's form is the case of equal slices (and as each query uses one
    head, the difference is one output matrix per route).

    **Zero features.** ReLU features of a query with no positive coordinate
    are all zero, and so is its normaliser. The layer divides by
    ``max(normaliser, epsilon)``: such a query gets a zero attention output
    (the output projection's bias after ``W_O``) with finite gradients.
    On the ``"kernel"`` path the landmarks, features and sums are computed
    in float32 under mixed precision, and the heads' output is cast back to
    the compute dtype.

    **Cost.** The ``"kernel"`` path computes every head's landmarks with one
    segment sum over all heads, each subhead's ``(F, dv)`` summary
    ``phi(K~)^T V~``, and every head for every query, then keeps the routed
    head: time O(n * H * d^2 / S), memory O(n * H * d), no ``n x m`` tensor.
    ``attention="softmax"`` (the paper's "Softmax" ablation) forms the
    ``(n, m_h)`` weights over the landmarks: O(n * m) with ``m = n * c``, an
    ablation, not a linear path.

    Ablations (the paper's Tables 4 and 5): ``compression_rates`` (Table 4's
    rates per experiment), ``routing="random"`` (Table 5's "Rand": each query
    position goes to a fixed pseudo-random head drawn from ``seed``; the
    router is not created and gets no gradient), ``attention="softmax"``
    (Table 5's "Softmax"), ``feature_map="elu+1"`` (Table 5's "ELU+1").
    ``routing="all"`` (every head for every query, weight 1) is not in the
    paper: with rate 1, one subhead and a softmax it is exactly multi-head
    attention (:meth:`full_attention_limit`).

    Bidirectional only (no causal mode: a segment mean mixes future keys).
    Padding masks are honoured; a dense ``attention_mask`` only by the
    ``"reference"`` path, where each query's landmarks are cut from the keys
    it may see. No attention scores (a query's weights live on its head's
    landmarks, per subhead). ``dropout`` applies to the softmax weights of
    ``attention="softmax"``; kernelized attention never forms weights, so
    ``dropout > 0`` with ``attention="kernel"`` is refused.

    Implementations:
        ``"kernel"``: the associative form above (``attention="kernel"``).
        ``"softmax"``: a masked softmax over the landmarks, with dropout
        (``attention="softmax"``).
        ``"reference"``: the explicit quadratic form of the same
        computation: the ``(n, m)`` averaging matrix, the ``(n, m)`` kernel
        (or softmax) weights materialised and normalised, then the routing.

    Args:
        num_heads: number of heads (resolutions).
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        compression_rates: one rate in ``[1/10000, 1]`` per head (read as
            a fraction of denominator at most 10000). Defaults to
            ``(1/2, 1/4, ..., 1/2**num_heads)`` (the paper's choice for four
            heads).
        num_subheads: subheads per head; must divide ``key_dim`` and
            ``value_dim``. Defaults to 1.
        feature_map: ``"relu"`` (the paper) or ``"elu+1"``.
        routing: ``"learned"`` (the router), ``"random"`` or ``"all"``.
        attention: ``"kernel"`` (the paper) or ``"softmax"``.
        epsilon: smallest normaliser of kernelized attention, a finite
            number > 0. Defaults to 1e-6.
        **kwargs: the arguments of :class:`BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, ``implementation``). ``seed``
            (None or a non-negative integer, checked at construction) also
            seeds ``routing="random"`` (0 when None).

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.AdaMRAAttention(
    ...     num_heads=4, key_dim=8, compression_rates=(1/2, 1/4, 1/8, 1/16))
    >>> x = np.random.rand(2, 64, 32).astype("float32")
    >>> tuple(layer(x, x).shape)
    (2, 64, 32)
    >>> layer.last_implementation
    'kernel'

    Reference:
        Zhang, Ma, Seidl and Tresp, "Adaptive Multi-Resolution Attention
        with Linear Complexity", arXiv:2108.04962, 2021.
    """

    is_exact = False
    supports_causal = False
    supports_scores = False
    supports_attention_mask = False
    reference_tolerance = 1e-5
    #: Multiply the routed head's output by its router probability (the
    #: router's only gradient). A test switches it off to show that the
    #: gradient test fails without it.
    _scale_by_router_probability = True

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        compression_rates=None,
        num_subheads=1,
        feature_map="relu",
        routing="learned",
        attention="kernel",
        epsilon=kernelized.DEFAULT_EPSILON,
        **kwargs,
    ):
        if "seed" in kwargs:
            kwargs["seed"] = _optional_seed("seed", kwargs["seed"])
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        if compression_rates is None:
            compression_rates = adamra_ops.default_compression_rates(self.num_heads)
        self.compression_rates = adamra_ops.check_compression_rates(
            compression_rates, self.num_heads
        )
        self.num_subheads = _positive_int("num_subheads", num_subheads)
        for name, dim in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if dim % self.num_subheads:
                raise ValueError(
                    f"`num_subheads` must divide `{name}` ({name}={dim}). "
                    f"Received: num_subheads={num_subheads!r}"
                )
        self.feature_map = kernelized.check_feature_map(feature_map)
        if routing not in adamra_ops.ROUTINGS:
            raise ValueError(
                f"`routing` must be one of {adamra_ops.ROUTINGS}. "
                f"Received: routing={routing!r}"
            )
        self.routing = routing
        if attention not in adamra_ops.ATTENTIONS:
            raise ValueError(
                f"`attention` must be one of {adamra_ops.ATTENTIONS}. "
                f"Received: attention={attention!r}"
            )
        self.attention = attention
        self.epsilon = kernelized.check_epsilon(epsilon)
        if attention == "kernel" and self.dropout > 0.0:
            raise ValueError(
                "Kernelized attention never forms attention weights, so there "
                "is nothing for attention dropout to drop: use dropout=0 or "
                f"attention='softmax'. Received: dropout={self.dropout!r} with "
                "attention='kernel'"
            )
        self._router = None

    # ---------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        if self.routing != "learned":
            return
        self._router = HeadKernel(
            self.num_heads * self.key_dim,
            self.num_heads,
            initializer=self._sublayer_kwargs()["kernel_initializer"],
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            dtype=self.dtype_policy,
            name="router",
        )
        self._router.build()

    def set_weights(self, weights):
        """Sets the weights; a list without the router's kernel (e.g.
        ``MultiHeadAttention.get_weights()``) sets the projections and keeps
        the router."""
        weights = list(weights)
        if self._router is not None and len(weights) == len(self.weights) - 1:
            weights.append(ops.convert_to_numpy(self._router.kernel))
        super().set_weights(weights)

    # ------------------------------------------------------------ routing
    def routing_weights(self, query, query_mask=None):
        """The weight of each head's output for each query: float32
        ``(B, T, H)``, one non-zero entry per query (``"learned"``: the
        chosen head's router probability; ``"random"``: 1), or all ones
        (``"all"``).

        Args:
            query: projected queries ``(B, T, H, key_dim)``.
            query_mask: optional boolean ``(B, T)``.
        """
        batch, T = segments.dims(query)[:2]
        probabilities = ranks = None
        if self.routing == "learned":
            probabilities = adamra_ops.router_probabilities(query, self._router.kernel)
        else:
            ranks = adamra_ops.query_ranks(batch, T, query_mask)
        return adamra_ops.routing_weights(
            self.routing,
            self.num_heads,
            probabilities=probabilities,
            ranks=ranks,
            seed=self.seed,
            scale_by_probability=self._scale_by_router_probability,
        )

    def _assemble(self, heads, query, context):
        """``(B, T, H * S, dv / S)`` subhead outputs -> ``(B, T, H, dv)``,
        each head weighted by the routing."""
        batch, T = segments.dims(query)[:2]
        out = ops.reshape(heads, (batch, T, self.num_heads, self.value_dim))
        weights = self.routing_weights(query, context.padding.query_mask)
        out = ops.cast(out, "float32") * weights[..., None]
        return ops.cast(out, self.compute_dtype)

    # ------------------------------------------------------------ landmarks
    def _slots(self, key_length):
        return adamra_ops.max_landmarks(key_length, self.compression_rates)

    def _subheads(self, x):
        """``(..., H, d)`` -> ``(..., H * S, d / S)``."""
        shape = segments.dims(x)
        S = self.num_subheads
        return ops.reshape(x, tuple(shape[:-2]) + (shape[-2] * S, shape[-1] // S))

    def _landmark_valid(self, counts):
        """Segments holding at least one real key, per subhead:
        ``(..., M, H)`` -> boolean ``(..., M, H * S)``."""
        return ops.repeat(counts > 0.0, self.num_subheads, axis=-1)

    def landmarks(self, key, value, key_mask=None):
        """Each head's landmarks: segment means of its keys and values.

        Args:
            key: projected keys ``(B, S, H, key_dim)``.
            value: projected values ``(B, S, H, value_dim)``.
            key_mask: optional boolean ``(B, S)``.

        Returns:
            ``(keys, values, counts)``: ``(B, M, H, key_dim)``,
            ``(B, M, H, value_dim)`` and float32 ``(B, M, H)`` (real keys per
            landmark; 0 for the slots past a head's ``m_h``), with
            ``M = ceil(S * max(compression_rates))``.
        """
        batch, S = segments.dims(key)[:2]
        if key_mask is None:
            real = ops.full((batch,), S, dtype="int32")
        else:
            real = ops.sum(ops.cast(ops.cast(key_mask, "bool"), "int32"), axis=1)
        seg_len = adamra_ops.segment_lengths(real, self.compression_rates)
        both = ops.concatenate([key, ops.cast(value, key.dtype)], axis=-1)
        means, counts = segments.contiguous_segment_means(
            both, seg_len, self._slots(S), mask=key_mask
        )
        return means[..., : self.key_dim], means[..., self.key_dim :], counts

    # -------------------------------------------------------- efficient paths
    @implementation("kernel", dropout=False)
    def _kernel(self, query, key, value, context):
        """Kernelized attention over the landmarks, associative form. The
        landmarks, the features and the sums are float32 under every dtype
        policy (as on the reference path)."""
        k_land, v_land, counts = self.landmarks(
            ops.cast(key, "float32"), ops.cast(value, "float32"),
            context.padding.key_mask,
        )
        out = kernelized.kernel_attention(
            kernelized.feature_map(
                ops.cast(self._subheads(query), "float32"), self.feature_map
            ),
            kernelized.feature_map(self._subheads(k_land), self.feature_map),
            self._subheads(v_land),
            key_mask=self._landmark_valid(counts),
            epsilon=self.epsilon,
        )
        return self._assemble(out, query, context)

    @_kernel.refuses
    def _kernel(self, context):
        if self.attention != "kernel":
            return "attention='softmax' runs on the 'softmax' path"
        return None

    @implementation("softmax")
    def _softmax(self, query, key, value, context):
        """A masked softmax over the landmarks (O(n * m) weights)."""
        k_land, v_land, counts = self.landmarks(key, value, context.padding.key_mask)
        valid = self._landmark_valid(counts)  # (B, M, H * S)
        mask = ops.transpose(valid, (0, 2, 1))[:, :, None, :]  # (B, H*S, 1, M)
        out = la_ops.reference_attention(
            self._subheads(query),
            self._subheads(k_land),
            self._subheads(v_land),
            mask=mask,
            scale=self._subhead_scale(),
            dropout_fn=self._dropout_fn(context.training),
        )
        return self._assemble(out, query, context)

    @_softmax.refuses
    def _softmax(self, context):
        if self.attention != "softmax":
            return "attention='kernel' runs on the 'kernel' path"
        return None

    def _subhead_scale(self):
        return 1.0 / float(self.key_dim // self.num_subheads) ** 0.5

    # ------------------------------------------------------------ reference
    def _attention_reference(self, query, key, value, context):
        """The explicit quadratic form: the ``(M, S)`` averaging matrix of
        each head's segments (one per query under a dense
        ``attention_mask``: its landmarks are cut from the keys it may see),
        the ``(T, M)`` weights over the landmarks materialised and
        normalised (kernel) or soft-maxed, then the routing."""
        dtype = self.compute_dtype
        q, k, v = (ops.cast(t, "float32") for t in (query, key, value))
        batch, S = segments.dims(k)[:2]
        rows = context.padding.key_mask
        per_query = context.attention_mask is not None
        if per_query:
            dense = ops.cast(context.attention_mask, "bool")
            if rows is not None:
                dense = ops.logical_and(dense, ops.cast(rows, "bool")[:, None, :])
            rows = dense  # (B, T, S)
        if rows is None:
            real = ops.full((batch,), S, dtype="int32")
        else:
            real = ops.sum(ops.cast(ops.cast(rows, "bool"), "int32"), axis=-1)
        seg_len = adamra_ops.segment_lengths(real, self.compression_rates)
        matrix, counts = segments.contiguous_segment_matrix(
            seg_len, self._slots(S), S, mask=rows
        )
        t = "t" if per_query else ""
        k_land = ops.einsum(f"b{t}mhs,bshd->b{t}mhd", matrix, k)
        v_land = ops.einsum(f"b{t}mhs,bshd->b{t}mhd", matrix, v)
        valid = self._landmark_valid(counts)  # (B, [T,] M, H*S)
        mask = (
            ops.transpose(valid, (0, 3, 1, 2))
            if per_query
            else ops.transpose(valid, (0, 2, 1))[:, :, None, :]
        )  # (B, H*S, T or 1, M)
        qs, ks, vs = self._subheads(q), self._subheads(k_land), self._subheads(v_land)
        if self.attention == "kernel":
            qs = kernelized.feature_map(qs, self.feature_map)
            ks = kernelized.feature_map(ks, self.feature_map)
            similarity = ops.einsum(f"bthf,b{t}mhf->bhtm", qs, ks)
            weights = kernelized.normalized_kernel_weights(
                similarity, mask, epsilon=self.epsilon
            )
        else:
            scores = ops.einsum(f"bthf,b{t}mhf->bhtm", qs, ks) * self._subhead_scale()
            weights = la_ops.masked_softmax(scores, mask)
            dropout_fn = self._dropout_fn(context.training)
            if dropout_fn is not None:
                weights = dropout_fn(weights)
        out = ops.einsum(f"bhtm,b{t}mhv->bthv", weights, vs)
        return ops.cast(self._assemble(out, query, context), dtype)

    def attention_support(self, query, value, query_mask=None, value_mask=None):
        """Which keys each head of each query draws on, for inspection and
        the docs' figure: boolean ``(B, H, T, S)``, True where query ``t`` is
        routed to head ``h`` (any head for ``routing="all"``) and key ``s`` is
        real (it reaches the query through one of head ``h``'s landmarks).
        O(T * S): not for long sequences.

        Args:
            query: ``(B, T, dim)`` layer inputs (the layer must be built).
            value: ``(B, S, dim)``.
            query_mask: optional boolean ``(B, T)``.
            value_mask: optional boolean ``(B, S)``.
        """
        q = self._query_dense(query)
        routed = self.routing_weights(q, query_mask) > 0.0  # (B, T, H)
        routed = ops.transpose(routed, (0, 2, 1))[..., None]  # (B, H, T, 1)
        batch, S = segments.dims(value)[:2]
        if value_mask is None:
            keys = ops.ones((batch, S), dtype="bool")
        else:
            keys = ops.cast(value_mask, "bool")
        return ops.logical_and(routed, keys[:, None, None, :])

    # ----------------------------------------------------------------- limit
    def full_attention_limit(self, sequence_length):
        """Rate 1 (every key its own landmark), a softmax, one subhead and
        every head for every query (``routing="all"``): exactly multi-head
        softmax attention, up to float rounding. With routing the output of
        a query is one head's, scaled by its probability, which no
        configuration of :class:`FullAttention` computes."""
        overrides = {
            "compression_rates": (1.0,) * self.num_heads,
            "num_subheads": 1,
            "attention": "softmax",
            "routing": "all",
        }
        if self.implementation != "reference":
            overrides["implementation"] = "auto"
        return overrides, 1e-5

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "compression_rates": self.compression_rates,
                "num_subheads": self.num_subheads,
                "feature_map": self.feature_map,
                "routing": self.routing,
                "attention": self.attention,
                "epsilon": self.epsilon,
            }
        )
        return config
