"""Decoding with a cache for :class:`RoutingAttention` (causal token
routing): a full-length cache of the keys and values, and per position and
routing head its routing record (its query's and key's nearest centroid and
its key's rank in its cluster) in slots after them; the centroids are not
moved while decoding."""

from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn.layers.decoding import only_written
from keras_longattn.ops import kmeans
from keras_longattn.ops import routing as routing_ops
from keras_longattn.ops.checks import concrete_int

# The local heads' kernel, compiled as one program on JAX.
_local_attention = routing_ops.local_heads_attention


class RoutingDecoding:
    """The decoding methods of :class:`RoutingAttention` (a mixin)."""

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
