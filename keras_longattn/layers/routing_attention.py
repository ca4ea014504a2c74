"""Routing attention (Routing Transformer, Roy et al. 2021): content-based
sparse attention inside k-means clusters, with optional local heads."""

import dataclasses
import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_longattn._validation import positive_int as _positive_int
from keras_longattn import ops as la_ops
from keras_longattn.layers.base_attention import AttentionContext
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.decoding import only_written
from keras_longattn.ops.checks import concrete_int
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import is_training
from keras_longattn.ops import kmeans
from keras_longattn.ops import routing as routing_ops

_CAUSAL_ROUTINGS = ("token", "balanced")

# The local heads' kernel, compiled as one program on JAX.
_local_attention = routing_ops.local_heads_attention


class _Centroids(keras.layers.Layer):
    """Holds the non-trainable ``(heads, clusters, key_dim)`` centroids.

    A sub-layer (created after the projections) so that the layer's weights
    start with exactly MultiHeadAttention's, in its order.
    """

    def __init__(self, num_heads, num_clusters, dim, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.num_clusters = num_clusters
        self.dim = dim
        self.seed = seed

    def build(self, input_shape=None):
        seed = self.seed

        def unit_normal(shape, dtype=None):
            # Random unit vectors, drawn with NumPy: the seed when given,
            # else NumPy's global state (set by keras.utils.set_random_seed).
            # Cheaper than a backend RNG, which JAX compiles per shape.
            rng = np.random if seed is None else np.random.default_rng(seed)
            x = rng.standard_normal(shape).astype("float32")
            x /= np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
            return ops.convert_to_tensor(x, dtype=dtype or "float32")

        self.centroids = self.add_weight(
            name="centroids",
            shape=(self.num_heads, self.num_clusters, self.dim),
            initializer=unit_normal,
            trainable=False,
            autocast=False,
            dtype="float32",
        )
        self.built = True


@keras.saving.register_keras_serializable(package="keras_longattn")
class RoutingAttention(BaseAttention):
    """Routing attention: each query attends to the keys of its k-means
    cluster (Routing Transformer).

    Queries and keys of the routing heads are projected onto the unit sphere
    (layer normalisation without scale or bias, then divided by ``sqrt(d)``:
    the authors' ``layer_norm(x, scaling=False)`` up to a constant) and
    compared with ``num_clusters`` centroids per head by cosine similarity.

    * **Bidirectional calls** use the authors' balanced routing: every
      centroid takes its ``window`` most similar queries and its ``window``
      most similar keys (``window = ceil(n / num_clusters)`` by default), so
      each cluster is a dense ``window x window`` block. A query taken by
      several centroids gets the mean of its outputs over the clusters in
      which it sees a key; a query taken by none gets a zero routing output
      (its local heads, if any, still see it).
    * **Causal calls** (``use_causal_mask=True``) by default use *token*
      routing, which is strictly causal: every query and every key joins its
      nearest centroid; inside a cluster queries and keys are ordered by
      position and cut into chunks of ``window`` members, and a query attends
      to the keys of its own and the previous chunk that are not after it
      (so the keys it sees are decided by tokens at or before it only).
      Balanced top-w routing is not causal — whether token ``i`` is taken by
      a centroid depends on how similar *later* tokens are — and leaks the
      future into a language model; ``causal_routing="balanced"`` reproduces
      the authors' training computation anyway (masking inside each cluster
      by comparing positions).

    Centroids are non-trainable weights, updated in training only
    (``training=True``, as ``fit`` does) by an exponential moving average
    of the normalised queries and keys assigned to them (nearest centroid,
    queries and keys pooled), the way ``BatchNormalization`` updates its
    moving statistics: ``mu <- ema_decay * mu + (1 - ema_decay) * mean``.
    Padded tokens never move a centroid, a centroid with no token in the
    batch stays where it is, and no gradient reaches the centroids. With
    ``commitment_weight > 0`` the commitment loss
    ``mean ||x_hat - stop_gradient(mu_hat)||^2`` over real tokens is added
    with ``add_loss`` (the authors used 1e-4).

    The first ``local_heads`` heads do exact sliding-window attention over
    ``local_window`` positions (as :class:`LocalAttention`); the others
    route. The paper mixes both kinds of heads in its models.

    Cost: O(n * k * d) to route and O(n * w * d) = O(n^2 * d / k) to attend
    (time and memory), with ``n`` the sequence length, ``k`` the number of
    clusters, ``w = n / k`` the window; ``k = sqrt(n)`` gives
    O(n^1.5 * d). Nothing of size ``n^2`` is built (the ``"reference"``
    path and ``return_attention_scores`` build the dense ``(B, H, T, S)``
    weights, for inspection).

    Implementations: ``"routed"`` computes the cluster blocks with explicit
    einsums and a masked softmax; ``"routed_fused"`` gives the same blocks to
    ``keras.ops.dot_product_attention`` as a batch (PyTorch's fused
    ``scaled_dot_product_attention``; preferred by ``"auto"`` on the torch
    backend, ``"routed"`` elsewhere). Both equal the reference path.
    ``"pallas"`` (JAX only; preferred by ``"auto"`` on GPU/TPU, interpreted
    on the CPU; no attention dropout) runs the balanced clusters as dense
    blocks of gathered tokens (each token's cluster and position encoded
    in its kernel position) and the local heads' band in the block-sparse
    Pallas kernel; it refuses ``shared_qk=True`` and causal token routing.
    ``"flex"`` (PyTorch only, by name; no attention dropout, and on the CPU
    forward only) runs the same in FlexAttention
    (``torch.nn.attention.flex_attention``): each head's tokens gathered
    cluster by cluster, the clusters block-diagonal "documents" (causal:
    AND ``CausalPattern`` on the gathered positions), the local heads'
    band from their ``LocalPattern``; it refuses the same calls.

    Reference path: the same clusters (computed once, from the same
    centroids) turned into dense ``(T, S)`` masks. For balanced routing,
    one dense softmax per cluster restricted to its members, averaged over
    the clusters of each query exactly as the routed path does (averaging
    is not one softmax over the union); for token routing, one dense mask
    whose ranks are counted directly. It checks the gathers, scatters,
    sorting and masking of the routed path independently.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        num_clusters: centroids per routing head (k). Centroids are created
            at build time, so the number is fixed then: when None,
            ``max(1, round(sqrt(n)))`` of the sequence length ``n`` the layer
            is built with (which must then be known); the resolved number is
            what ``get_config`` reports afterwards. Balanced routing needs
            ``num_clusters <=`` the call's (padded) sequence length.
        window: members per cluster (balanced) or per chunk (token routing),
            capped at each call's length. Defaults to ``None``: fixed when
            the layer is built, as ``ceil(n / num_clusters)`` of the longer
            sequence ``n`` it is built with (or of its first call, when it is
            built without a known length); the resolved value is what
            ``get_config`` reports. Fixed at build so
            that an example's output never depends on how much padding its
            batch has.
        local_heads: how many heads (the first ones) do local attention,
            in ``[0, num_heads]``. Defaults to 0.
        local_window: window of the local heads (causal: keys
            ``i - local_window + 1 .. i``; bidirectional: ``local_window // 2``
            on each side). Defaults to the routing window of the call.
        ema_decay: decay of the centroids' moving average, in ``(0, 1)``.
            Defaults to 0.999 (the authors' value).
        commitment_weight: weight of the commitment loss (>= 0). Defaults
            to 0.
        shared_qk: routing heads use the unit-normalised queries as keys
            (the key projection is then unused by them), and a token does not
            attend to itself unless nothing else is visible. Self-attention
            only (``T == S``). Defaults to False.
        causal_routing: ``"token"`` (strictly causal, default) or
            ``"balanced"`` (the authors' top-w, not strictly causal) for
            causal calls.
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"routed"``, ``"routed_fused"``, ``"pallas"``,
            ``"flex"`` or ``"reference"``).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``use_causal_mask``,
        ``return_attention_scores`` (dense ``(B, H, T, S)``, O(n^2)),
        ``training`` (True moves the centroids). A dense ``attention_mask``
        is only accepted with ``implementation="reference"``. Padded queries
        and keys are never routed ahead of real ones and never move a
        centroid.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested).

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.RoutingAttention(
    ...     num_heads=2, key_dim=8, local_heads=1)
    >>> x = np.random.rand(2, 37, 16).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (2, 37, 16)
    >>> layer.num_clusters  # round(sqrt(37)), fixed at build
    6
    >>> clusters = layer.compute_clusters(x)
    >>> tuple(clusters["query_indices"].shape)  # (B, routing heads, k, w)
    (2, 1, 6, 7)

    Reference:
        Roy, Saffar, Vaswani and Grangier, "Efficient Content-Based Sparse
        Attention with Routing Transformers", TACL 2021
        (arXiv:2003.05997).
    """

    implementations = ("routed", "routed_torch", "routed_fused")

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        num_clusters=None,
        window=None,
        local_heads=0,
        local_window=None,
        ema_decay=0.999,
        commitment_weight=0.0,
        shared_qk=False,
        causal_routing="token",
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.num_clusters = _positive_int("num_clusters", num_clusters, allow_none=True)
        self.window = _positive_int("window", window, allow_none=True)
        if (
            isinstance(local_heads, bool)
            or not isinstance(local_heads, numbers.Integral)
            or not 0 <= local_heads <= self.num_heads
        ):
            raise ValueError(
                f"`local_heads` must be an integer in [0, num_heads={self.num_heads}]. "
                f"Received: local_heads={local_heads!r}"
            )
        self.local_heads = int(local_heads)
        self.local_window = _positive_int("local_window", local_window, allow_none=True)
        if (
            isinstance(ema_decay, bool)
            or not isinstance(ema_decay, numbers.Real)
            or not 0.0 < float(ema_decay) < 1.0
        ):
            raise ValueError(
                "`ema_decay` must be a float in (0, 1). "
                f"Received: ema_decay={ema_decay!r}"
            )
        self.ema_decay = float(ema_decay)
        if (
            isinstance(commitment_weight, bool)
            or not isinstance(commitment_weight, numbers.Real)
            or not float(commitment_weight) >= 0.0
            or math.isinf(float(commitment_weight))
        ):
            raise ValueError(
                "`commitment_weight` must be a finite float >= 0. "
                f"Received: commitment_weight={commitment_weight!r}"
            )
        self.commitment_weight = float(commitment_weight)
        if not isinstance(shared_qk, bool):
            raise ValueError(
                f"`shared_qk` must be a bool. Received: shared_qk={shared_qk!r}"
            )
        self.shared_qk = shared_qk
        if causal_routing not in _CAUSAL_ROUTINGS:
            raise ValueError(
                f"`causal_routing` must be one of {_CAUSAL_ROUTINGS}. "
                f"Received: causal_routing={causal_routing!r}"
            )
        self.causal_routing = causal_routing
        self._centroid_layer = None

    # ------------------------------------------------------------------ build
    @property
    def routing_heads(self):
        """Number of routing heads (``num_heads - local_heads``)."""
        return self.num_heads - self.local_heads

    @property
    def centroids(self):
        """The ``(routing_heads, num_clusters, key_dim)`` centroid variable
        (None before build or without routing heads)."""
        return None if self._centroid_layer is None else self._centroid_layer.centroids

    def build_extra(self, query_shape, value_shape, key_shape):
        lengths = (query_shape[1], key_shape[1])
        known = all(n is not None for n in lengths)
        if self.num_clusters is None and self.routing_heads:
            n = query_shape[1]
            if n is None:
                raise ValueError(
                    "RoutingAttention creates its centroids at build time and "
                    "needs `num_clusters` when the sequence length is not known "
                    "then. Pass num_clusters=... (about sqrt of the sequence "
                    f"length). Received: num_clusters=None, query.shape={query_shape}"
                )
            self.num_clusters = max(1, int(round(math.sqrt(int(n)))))
        if self.window is None and known:
            self.window = self._default_window(max(int(n) for n in lengths))
        if self.routing_heads == 0:
            return
        self._centroid_layer = _Centroids(
            self.routing_heads,
            self.num_clusters,
            self.key_dim,
            seed=self.seed,
            dtype=self.dtype_policy,
            name="centroids",
        )
        self._centroid_layer.build()

    # ---------------------------------------------------------------- windows
    def _default_window(self, n):
        k = self.num_clusters or max(1, int(round(math.sqrt(n))))
        return max(1, -(-int(n) // k))

    def routing_window(self, length):
        """Members per cluster (or chunk) for a sequence of ``length``: the
        window, capped at the length (not capped while tracing an unknown
        length: the call is then padded to at least the window). A layer
        built without a known length fixes its default window at its first
        call."""
        if self.window is None:
            if not isinstance(length, int):
                raise ValueError(
                    "RoutingAttention fixes its default `window` "
                    "(ceil(n / num_clusters)) from the first known sequence "
                    "length, and this call's length is unknown (traced with a "
                    "variable length). Pass window=... . Received: window=None"
                )
            self.window = self._default_window(length)
        if not isinstance(length, int):
            return self.window
        return max(1, min(self.window, int(length)))

    def _local_extents(self, causal, window):
        w = self.local_window or window
        return la_ops.resolve_window(w, None, None, causal)

    # ---------------------------------------------------------------- routing
    def _route(self, query, key, context, add_losses=True, nearest=True):
        """Routing decisions for the routing heads (a
        :class:`keras_longattn.ops.Routing`); moves the centroids when
        training and adds the commitment loss. ``query``/``key``:
        ``(B, T|S, Hr, d)``. With ``nearest=False`` the nearest centroids are
        only computed where they are used (training, commitment loss, token
        routing)."""
        T, S = la_ops.length(query, 1), la_ops.length(key, 1)
        static = la_ops.shapes.is_static(T, S)
        if self.shared_qk and static and T != S:
            raise ValueError(
                "`shared_qk=True` needs a self-attention call (as many keys "
                f"as queries). Received: query length {T}, key length {S}"
            )
        k = self.num_clusters
        balanced = not (context.causal and self.causal_routing == "token")
        if balanced and static and k > min(T, S):
            raise ValueError(
                "Balanced routing needs `num_clusters` <= the (padded) "
                "sequence length, so that every cluster can take a token. "
                f"Received: num_clusters={k} for query length {T} and key "
                f"length {S}"
            )
        padding = context.padding
        q_valid = None if padding.query_mask is None else ops.cast(padding.query_mask, "bool")
        k_valid = None if padding.key_mask is None else ops.cast(padding.key_mask, "bool")
        if self.shared_qk:
            q_valid = la_ops.combine_dense_masks(q_valid, k_valid)
            k_valid = q_valid
        training = is_training(context.training)
        commitment = add_losses and self.commitment_weight > 0.0
        if balanced:
            window, key_window = self.routing_window(T), self.routing_window(S)
        else:
            window = key_window = self.routing_window(la_ops.shapes.larger(T, S))
        routing = kmeans.route(
            query,
            key,
            # A copy: the update below writes the variable in place, which
            # must not change a tensor that autograd saved (torch).
            ops.copy(self.centroids),
            mode="balanced" if balanced else "token",
            window=window,
            key_window=key_window,
            query_valid=q_valid,
            key_valid=k_valid,
            shared=self.shared_qk,
            ema_decay=self.ema_decay if training else None,
            commitment=commitment,
            nearest=nearest,
        )
        if routing.centroids is not None:
            self.centroids.assign(routing.centroids)
        if routing.loss is not None:
            self.add_loss(self.commitment_weight * routing.loss)
        return routing

    # ------------------------------------------------------------ attention
    def _split_heads(self, x):
        h = self.local_heads
        return x[:, :, :h], x[:, :, h:]

    @implementation("routed")
    def _routed(self, query, key, value, context):
        """Cluster blocks with explicit einsums and a masked softmax."""
        return self._clustered(query, key, value, context, fused=False)

    @implementation("routed_torch", kind="fused", dropout=False)
    def _routed_torch(self, query, key, value, context):
        """PyTorch only: token routing through the planned flash-attention
        kernel of ``keras_longattn.kernels.torch.routing`` (compacted
        chunks, gather-only backward); balanced clusters and local heads as
        ``"routed_fused"``."""
        return self._clustered(query, key, value, context, fused=True, torch_kernel=True)

    @_routed_torch.refuses
    def _routed_torch(self, context):
        return la_ops.paths.refusal("routing")

    @_routed_torch.reports
    def _routed_torch(self, context):
        # The torch kernel only serves token routing (causal calls with
        # causal_routing="token"); balanced clusters and the local heads run
        # the code of "routed_fused": "routed_torch:routed_fused".
        if self.routing_heads and context.causal and self.causal_routing == "token":
            return None
        return "routed_fused"

    @implementation("routed_fused", kind="fused", dropout=False)
    def _routed_fused(self, query, key, value, context):
        """The same blocks through ``keras.ops.dot_product_attention``."""
        return self._clustered(query, key, value, context, fused=True)

    def _band_and_clusters(self, query, key, value, context, path, clusters):
        """The local heads' band (``la_ops.paths.band_attention`` on
        ``path``) beside the routing heads' balanced clusters
        (``clusters(q, routing, value, key_mask, scale)``): the two kernel
        paths' shared frame."""
        T, S = context.query_length, context.key_length
        scale = self._inverse_sqrt_key_dim
        key_mask = context.padding.key_mask
        q_loc, q_rt = self._split_heads(query)
        k_loc, k_rt = self._split_heads(key)
        v_loc, v_rt = self._split_heads(value)
        parts = []
        window = self.routing_window(la_ops.shapes.larger(T, S))
        if self.routing_heads:
            routing = self._route(q_rt, k_rt, context, nearest=False)
            window = routing.window
        if self.local_heads:
            look_back, look_ahead = self._local_extents(context.causal, window)
            parts.append(la_ops.paths.band_attention(
                q_loc, k_loc, v_loc, look_back, look_ahead, path=path,
                key_mask=key_mask, scale=scale))
        if self.routing_heads:
            parts.append(clusters(q_rt, routing, v_rt, key_mask, scale))
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=2)

    @implementation("pallas", kind="pallas", dropout=False)
    def _pallas(self, query, key, value, context):
        """Balanced clusters as dense blocks of gathered tokens (and the
        local heads' band) in the block-sparse Pallas kernel (JAX only)."""

        def clusters(q, routing, v, key_mask, scale):
            return la_ops.block_sparse.cluster_attention(
                q, routing.keys, v, routing.query_indices, routing.key_indices,
                context.causal, key_mask=key_mask, scale=scale)

        return self._band_and_clusters(query, key, value, context, "block_sparse", clusters)

    @_pallas.refuses
    def _pallas(self, context):
        reason = la_ops.paths.refusal("block_sparse")
        if reason is not None:
            return reason
        T, S = context.query_length, context.key_length
        if not la_ops.shapes.is_static(T, S):
            return "the Pallas path needs sequence lengths known while tracing"
        if self.shared_qk:
            return ("shared_qk=True (no attention to oneself unless alone) is "
                    "not in the kernel")
        if context.causal and self.causal_routing == "token":
            return "causal_routing='token' (sorted chunks) is not in the kernel"
        if self.routing_heads and self.num_clusters is not None:
            if self.num_clusters * la_ops.layouts.cluster_stride(max(T, S)) >= 2**31:
                return ("num_clusters * the position stride overflows the "
                        "kernel's int32 positions")
        return None

    @implementation("flex", kind="flex", dropout=False)
    def _flex(self, query, key, value, context):
        """Balanced clusters as block-diagonal documents (and the local
        heads' band) in PyTorch's FlexAttention (torch only, by name)."""
        causal = la_ops.CausalPattern() if context.causal else None

        def clusters(q, routing, v, key_mask, scale):
            return la_ops.paths.flex_attention(
                "cluster", q, routing.keys, v, routing.query_indices, routing.key_indices,
                causal_pattern=causal, key_mask=key_mask, scale=scale)

        return self._band_and_clusters(query, key, value, context, "flex", clusters)

    @_flex.refuses
    def _flex(self, context):
        if self.shared_qk:
            return ("shared_qk=True (no attention to oneself unless alone) is "
                    "not in the FlexAttention path")
        if context.causal and self.causal_routing == "token":
            return ("causal_routing='token' (sorted chunks) is not in the "
                    "FlexAttention path")
        return la_ops.paths.refusal("flex", self.compute_dtype, trainable=self.trainable)

    def _clustered(self, query, key, value, context, fused, torch_kernel=False):
        if not la_ops.shapes.is_static(context.query_length, context.key_length):
            return self._at_least_window(
                self._clustered_core, query, key, value, context, fused, torch_kernel
            )
        return self._clustered_core(query, key, value, context, fused, torch_kernel)

    def _clustered_core(self, query, key, value, context, fused, torch_kernel=False):
        T, S = context.query_length, context.key_length
        dropout_fn = self._dropout_fn(context.training)
        scale = self._inverse_sqrt_key_dim
        q_loc, q_rt = self._split_heads(query)
        k_loc, k_rt = self._split_heads(key)
        v_loc, v_rt = self._split_heads(value)
        parts = []
        window = self.routing_window(la_ops.shapes.larger(T, S))
        if self.routing_heads:
            routing = self._route(q_rt, k_rt, context, nearest=False)
            window = routing.window
        if self.local_heads:
            look_back, look_ahead = self._local_extents(context.causal, window)
            parts.append(
                _local_attention(
                    q_loc,
                    k_loc,
                    v_loc,
                    look_back,
                    look_ahead,
                    key_mask=context.padding.key_mask,
                    scale=scale,
                    dropout_fn=None if fused else dropout_fn,
                    fused=fused,
                )
            )
        if self.routing_heads:
            if routing.mode == "balanced":
                out = routing_ops.balanced_cluster_attention(
                    q_rt,
                    routing.keys,
                    v_rt,
                    routing.query_indices,
                    routing.key_indices,
                    causal=context.causal,
                    key_mask=context.padding.key_mask,
                    exclude_self=self.shared_qk,
                    scale=scale,
                    dropout_fn=None if fused else dropout_fn,
                    fused=fused,
                )
            elif torch_kernel:
                out = la_ops.paths.token_routing_attention(
                    q_rt,
                    routing.keys,
                    v_rt,
                    routing.query_clusters,
                    routing.key_clusters,
                    self.num_clusters,
                    routing.window,
                    shared=self.shared_qk,
                    scale=scale,
                )
            else:
                out = la_ops.sorted_chunk_attention(
                    q_rt,
                    routing.keys,
                    v_rt,
                    routing.query_clusters,
                    routing.key_clusters,
                    self.num_clusters,
                    routing.window,
                    shared=self.shared_qk,
                    scale=scale,
                    dropout_fn=None if fused else dropout_fn,
                    fused=fused,
                )
            parts.append(out)
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=2)

    def _attention_reference(self, query, key, value, context):
        """Dense attention under the same clusters (see the class docstring)."""
        if not la_ops.shapes.is_static(context.query_length, context.key_length):
            return self._at_least_window(self._reference_core, query, key, value, context)
        return self._reference_core(query, key, value, context)

    def _reference_core(self, query, key, value, context):
        T, S = context.query_length, context.key_length
        q_loc, q_rt = self._split_heads(query)
        k_loc, k_rt = self._split_heads(key)
        extra = la_ops.combine_dense_masks(
            context.padding.dense_mask(T, S), context.attention_mask
        )  # (B, T, S) or None
        extra = None if extra is None else ops.expand_dims(extra, 1)
        window = self.routing_window(la_ops.shapes.larger(T, S))
        routing = None
        if self.routing_heads:
            routing = self._route(q_rt, k_rt, context, nearest=False)
            window = routing.window
        local_extents = None
        if self.local_heads:
            local_extents = self._local_extents(context.causal, window)
        weights = routing_ops.routing_reference_weights(
            q_loc if self.local_heads else None,
            k_loc if self.local_heads else None,
            q_rt if routing is not None else None,
            routing.keys if routing is not None else None,
            extra,
            None if routing is None else routing.query_indices,
            None if routing is None else routing.key_indices,
            None if routing is None else routing.query_clusters,
            None if routing is None else routing.key_clusters,
            local_extents=local_extents,
            mode=None if routing is None else routing.mode,
            causal=context.causal,
            shared=self.shared_qk,
            num_clusters=self.num_clusters,
            window=window,
            scale=self._inverse_sqrt_key_dim,
        )
        return self._weighted_values(weights, value, context)

    def _at_least_window(self, fn, query, key, value, context, *args):
        """Runs ``fn`` on a call whose lengths are unknown while tracing:
        padded (as padding) to at least the window, so that every cluster can
        take ``window`` members; the padding is cut from the result."""
        T, S = context.query_length, context.key_length
        w = self.window
        Tp, Sp = la_ops.shapes.larger(T, w), la_ops.shapes.larger(S, w)
        padding = context.padding

        def extend(mask, n, n_padded):
            real = ops.expand_dims(ops.arange(n_padded, dtype="int32") < n, 0)
            if mask is None:
                return real
            mask = la_ops.pad_axis(ops.cast(mask, "int32"), 1, n_padded)
            return ops.logical_and(real, ops.cast(mask, "bool"))

        dense = context.attention_mask
        if dense is not None:
            dense = la_ops.pad_axis(ops.cast(dense, "int32"), 1, Tp)
            dense = ops.cast(la_ops.pad_axis(dense, 2, Sp), "bool")
        padded = dataclasses.replace(
            context,
            padding=la_ops.PaddingMask(
                extend(padding.query_mask, T, Tp), extend(padding.key_mask, S, Sp)
            ),
            attention_mask=dense,
            query_length=Tp,
            key_length=Sp,
        )
        result = fn(
            la_ops.pad_axis(query, 1, Tp),
            la_ops.pad_axis(key, 1, Sp),
            la_ops.pad_axis(value, 1, Sp),
            padded,
            *args,
        )
        if isinstance(result, tuple):
            out, scores = result
            return out[:, :T], scores[:, :, :T, :S]
        return result[:, :T]

    # ------------------------------------------------------------ inspection
    def compute_clusters(
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        use_causal_mask=False,
    ):
        """The clusters the layer forms for these inputs (no centroid update).

        Args:
            query: ``(B, T, dim)``.
            value: ``(B, S, dim)``; defaults to ``query``.
            key: defaults to ``value``.
            query_mask, value_mask, key_mask: optional boolean padding masks.
            use_causal_mask: which routing a causal call uses.

        Returns:
            A dict of tensors over the routing heads only (head ``h`` of
            these is head ``local_heads + h`` of the layer). Keys:
            ``"query_indices"``, int ``(B, Hr, k, wq)``, the queries each
            centroid takes under balanced routing, ascending;
            ``"key_indices"``, int ``(B, Hr, k, wk)``, the same for keys;
            ``"query_clusters"``, int ``(B, Hr, T)``, the nearest centroid of
            each query (``k`` for padding), the clusters of token routing;
            ``"key_clusters"``, int ``(B, Hr, S)``, the same for keys;
            ``"mode"``, ``"balanced"`` or ``"token"``, what a call with
            ``use_causal_mask`` uses; ``"window"``, its window.
        """
        if self.routing_heads == 0:
            raise ValueError(
                "This layer has no routing heads (local_heads == num_heads). "
                f"Received: local_heads={self.local_heads}, num_heads={self.num_heads}"
            )
        value = query if value is None else value
        key = value if key is None else key
        if not self.built:
            self.build(tuple(query.shape), tuple(value.shape), tuple(key.shape))
        q = self._query_dense(query)
        k = self._key_dense(key)
        if self.rotary_max_wavelength is not None:
            q = la_ops.apply_rotary(q, self.rotary_max_wavelength)
            k = la_ops.apply_rotary(k, self.rotary_max_wavelength)
        k = self.expand_key_value_heads(k)
        key_padding = la_ops.combine_dense_masks(value_mask, key_mask)
        q_padding = None if query_mask is None else ops.cast(query_mask, "bool")
        T, S = q.shape[1], k.shape[1]
        context = AttentionContext(
            padding=la_ops.PaddingMask(q_padding, key_padding),
            causal=bool(use_causal_mask),
            training=False,
            query_length=T,
            key_length=S,
        )
        _, q_rt = self._split_heads(q)
        _, k_rt = self._split_heads(k)
        routing = self._route(q_rt, k_rt, context, add_losses=False)
        if routing.query_indices is None:
            # A causal call routes by tokens: report its balanced clusters
            # too (what a bidirectional call would take).
            q_valid = context.padding.query_mask
            k_valid = key_padding
            if self.shared_qk:
                q_valid = la_ops.combine_dense_masks(q_valid, k_valid)
                k_valid = q_valid
            balanced = kmeans.route(
                q_rt,
                k_rt,
                self.centroids,
                mode="balanced",
                window=self.routing_window(T),
                key_window=self.routing_window(S),
                query_valid=q_valid,
                key_valid=k_valid,
                shared=self.shared_qk,
                nearest=False,
            )
            routing.query_indices = balanced.query_indices
            routing.key_indices = balanced.key_indices
        return {
            "query_indices": routing.query_indices,
            "key_indices": routing.key_indices,
            "query_clusters": routing.query_clusters,
            "key_clusters": routing.key_clusters,
            "mode": routing.mode,
            "window": routing.window,
        }

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        if self.shared_qk:
            return ("RoutingAttention with shared_qk=True has no decoding cache (a "
                    "token's own key is excluded unless it is alone, a rule of the "
                    "whole row)")
        if self.routing_heads and self.causal_routing != "token":
            return ("RoutingAttention with causal_routing='balanced' has no decoding "
                    "cache: its clusters depend on later tokens, so decoding would not "
                    "give its forward pass")
        return None

    #: Base-256 digits per integer of a routing record: exact in every
    #: float dtype a cache may be cast to (bfloat16 holds the integers up to
    #: 256), for values below 2**24.
    _DIGITS = 3

    def _record_width(self):
        return 3 * self.routing_heads * self._DIGITS

    def _meta_slots(self):
        """Slots of the cache after keys and values that hold, per position
        and routing head, the query's cluster, the key's cluster and the
        key's rank in its cluster (each as base-256 digits)."""
        width = self.num_key_value_heads * self.key_dim
        return -(-self._record_width() // width) if self.routing_heads else 0

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2 + m, max_length, num_key_value_heads, key_dim)``:
        the keys (``[:, 0]``) and values (``[:, 1]``) of every position,
        then ``m`` slots with each position's routing record (its query's
        and key's nearest centroid and its key's rank among the members of
        its cluster, per routing head, each integer as three base-256
        digits so that any float dtype holds it exactly; ``m = ceil(9 *
        routing_heads / (num_key_value_heads * key_dim))``). O(max_length)
        memory and work per token: the clusters of the earlier tokens are
        kept, the centroids are not moved while decoding."""
        reason = self.decode_refusal()
        if reason is not None:
            raise ValueError(reason)
        if max_length is not None and 2 * int(max_length) >= 256 ** self._DIGITS:
            raise ValueError(
                "RoutingAttention decodes up to 8388607 positions. "
                f"Received: max_length={max_length}")
        return (batch_size, 2 + self._meta_slots(), max_length, self.num_key_value_heads,
                self.key_dim)

    def _nearest(self, x):
        """Nearest centroid ``(B, Hr, n)`` of projected routing heads
        ``(B, n, Hr, d)`` (frozen centroids)."""
        x_hat = kmeans.sphere_normalize(ops.stop_gradient(x))
        near, _ = kmeans.assign_by_heads(x_hat, ops.cast(self.centroids, "float32"))
        return near

    def _decode(self, query, key, value, cache, index, training):
        """New tokens against the full-length cache. A call of several
        tokens from an empty cache (``cache_update_index`` 0, known) runs
        the forward pass's sorted chunks and band (O(T * w)); any other call
        runs its tokens one at a time, each against the cache through
        per-head masks (O(max_length) per token)."""
        T = query.shape[1]
        if T > 1 and concrete_int(index) == 0:
            return self._decode_prefill(query, key, value, cache, training)

        def step(q, k, v, cache, position):
            return self._decode_step(q, k, v, cache, position, training)

        if T == 1:
            return step(query, key, value, cache, index)
        return self._decode_each_token(step, (query, key, value), cache, index)

    def _window_parts(self, query, key, value):
        keys = self.expand_key_value_heads(key)
        values = self.expand_key_value_heads(value)
        return self._split_heads(query), self._split_heads(keys), self._split_heads(values)

    def _write(self, cache, keys, values, meta, index):
        """The cache with the keys, values and routing records ``(B, T, 3,
        Hr)`` of ``T`` positions from ``index`` written in."""
        B, T = ops.shape(keys)[0], keys.shape[1]
        Hk, d = self.num_key_value_heads, self.key_dim
        parts = [ops.cast(keys, cache.dtype)[:, None], ops.cast(values, cache.dtype)[:, None]]
        m = self._meta_slots()
        if m:
            digits = [ops.mod(ops.floor_divide(meta, 256 ** i), 256) for i in range(self._DIGITS)]
            flat = ops.reshape(ops.cast(ops.stack(digits, axis=-1), cache.dtype),
                               (B, T, self._record_width()))
            flat = ops.pad(flat, ((0, 0), (0, 0), (0, m * Hk * d - self._record_width())))
            parts.append(ops.transpose(ops.reshape(flat, (B, T, m, Hk, d)), (0, 2, 1, 3, 4)))
        block = ops.concatenate(parts, axis=1)
        return ops.slice_update(cache, (0, 0, index, 0, 0), block)

    def _records(self, cache):
        """The routing records of every cache position: int32 ``(B, Hr, S)``
        query clusters, key clusters and key ranks."""
        B, m, S = ops.shape(cache)[0], self._meta_slots(), cache.shape[2]
        Hk, d, Hr = self.num_key_value_heads, self.key_dim, self.routing_heads
        width = self._record_width()
        # Only the entries that hold records, slot by slot (no copy of the
        # rest of the slots).
        parts = [ops.reshape(cache[:, 2 + i], (B, S, Hk * d))[:, :, :width - i * Hk * d]
                 for i in range(m)]
        flat = parts[0] if m == 1 else ops.concatenate(parts, axis=-1)
        digits = ops.reshape(flat, (B, S, 3, Hr, self._DIGITS))
        digits = ops.cast(ops.round(ops.cast(digits, "float32")), "int32")
        meta = sum(digits[..., i] * 256 ** i for i in range(self._DIGITS))
        return [ops.transpose(meta[:, :, i], (0, 2, 1)) for i in range(3)]

    def _decode_prefill(self, query, key, value, cache, training):
        """The first ``T`` tokens: the forward pass's computation with the
        layer's full window (not capped at ``T``), and their records."""
        dropout_fn = self._dropout_fn(training)
        scale = self._inverse_sqrt_key_dim
        (q_loc, q_rt), (k_loc, k_rt), (v_loc, v_rt) = self._window_parts(query, key, value)
        parts, meta = [], None
        if self.local_heads:
            look_back, _ = self._local_extents(True, self.window)
            parts.append(_local_attention(q_loc, k_loc, v_loc, look_back, 0, scale=scale,
                                          dropout_fn=dropout_fn))
        if self.routing_heads:
            cq, ck = self._nearest(q_rt), self._nearest(k_rt)
            parts.append(la_ops.sorted_chunk_attention(
                q_rt, k_rt, v_rt, cq, ck, self.num_clusters, self.window, scale=scale,
                dropout_fn=dropout_fn))
            # A key's rank: the members of its cluster before it (keys before
            # it, queries before its position).
            k = self.num_clusters
            one_q = ops.one_hot(cq, k, dtype="int32")  # (B, Hr, T, k)
            one_k = ops.one_hot(ck, k, dtype="int32")
            before = ops.cumsum(one_q + one_k, axis=2) - one_q - one_k
            rank = ops.squeeze(ops.take_along_axis(before, ck[..., None], axis=3), -1)
            meta = ops.stack([cq, ck, rank], axis=1)  # (B, 3, Hr, T)
            meta = ops.transpose(meta, (0, 3, 1, 2))
        out = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=2)
        return out, self._write(cache, key, value, meta, 0)

    def _decode_step(self, query, key, value, cache, index, training):
        """One token at ``index``: its clusters and key rank from the
        records of the positions before it, then attention over the cache
        under per-head masks (local heads: the band; routing heads: the
        keys of its query's cluster in its own and the previous chunk)."""
        S, w = cache.shape[2], self.window
        k_pos = ops.arange(S, dtype="int32")
        before = k_pos < index
        meta = None
        if self.routing_heads:
            _, (_, k_rt), _ = self._window_parts(query, key, value)
            cq = self._nearest(self._split_heads(query)[1])  # (B, Hr, 1)
            ck = self._nearest(k_rt)
            old_q, old_k, _ = self._records(cache)

            def count(records, cluster):
                hit = ops.logical_and(ops.equal(records, cluster), before)
                return ops.sum(ops.cast(hit, "int32"), axis=-1, keepdims=True)

            # Members before the query: earlier queries and keys of its
            # cluster, and its own key when that joined the same cluster.
            rank_q = count(old_q, cq) + count(old_k, cq) + ops.cast(ops.equal(ck, cq), "int32")
            rank_k = count(old_k, ck) + count(old_q, ck)
            meta = ops.transpose(ops.stack([cq, ck, rank_k], axis=1), (0, 3, 1, 2))
        cache = self._write(cache, key, value, meta, index)
        upto = k_pos <= index
        keys = only_written(cache[:, 0], upto, query.dtype)
        values = only_written(cache[:, 1], upto, query.dtype)
        masks = []
        if self.local_heads:
            look_back, _ = self._local_extents(True, self.window)
            band = ops.logical_and(upto, k_pos >= index - look_back)
            masks.append(ops.broadcast_to(band[None, None, None, :],
                                          (ops.shape(query)[0], self.local_heads, 1, S)))
        if self.routing_heads:
            _, all_k, all_rank = self._records(cache)
            chunk_q = ops.floor_divide(rank_q, w)  # (B, Hr, 1)
            seen = ops.logical_and(ops.equal(all_k, cq), upto)
            seen = ops.logical_and(seen, ops.floor_divide(all_rank, w) >= chunk_q - 1)
            masks.append(seen[:, :, None, :])
        mask = masks[0] if len(masks) == 1 else ops.concatenate(masks, axis=1)
        out = la_ops.reference_attention(
            query, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
            mask=mask, scale=self._inverse_sqrt_key_dim, dropout_fn=self._dropout_fn(training))
        return out, cache

    def full_attention_limit(self, sequence_length):
        # One cluster holding every token: full attention (causal token
        # routing: one chunk of the whole sequence).
        return {
            "num_clusters": 1,
            "window": None,
            "local_heads": 0,
            "local_window": None,
            "shared_qk": False,
        }, 1e-5

    def set_weights(self, weights):
        """Sets the weights; a list without the centroids (e.g.
        ``MultiHeadAttention.get_weights()``) sets the projections and keeps
        the centroids."""
        weights = list(weights)
        if self.centroids is not None and len(weights) == len(self.weights) - 1:
            weights.append(ops.convert_to_numpy(self.centroids))
        super().set_weights(weights)

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_clusters": self.num_clusters,
                "window": self.window,
                "local_heads": self.local_heads,
                "local_window": self.local_window,
                "ema_decay": self.ema_decay,
                "commitment_weight": self.commitment_weight,
                "shared_qk": self.shared_qk,
                "causal_routing": self.causal_routing,
            }
        )
        return config
