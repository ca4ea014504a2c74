"""Decoding with a cache for :class:`LongformerAttention` (causal): a ring
of the last positions of the widest dilated window, the ordinary keys and
values of the global positions (the first ``global_tokens``), and their
global-projection keys and values for the global rows."""

from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn.layers.base_attention import AttentionContext
from keras_longattn.layers.decoding import only_written
from keras_longattn.ops.checks import concrete_int
from keras_longattn.ops import longformer as la_longformer


class LongformerDecoding:
    """The decoding methods of :class:`LongformerAttention` (a mixin)."""

    cache_length_free = False

    def decode_refusal(self):
        return None

    def _ring_length(self):
        """Positions a causal window reaches: ``max(dilation) * window``
        back, and the query's own."""
        look_back, _ = la_longformer.window_extents(self.window, True)
        return max(self.dilations) * look_back + 1

    def _global_rows(self):
        """Rows of ``num_key_value_heads`` heads that hold the ``num_heads``
        global-projection heads of one position."""
        return self.num_heads // self.num_key_value_heads

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, L + g + g * G, num_key_value_heads, key_dim)``
        whatever ``max_length``: keys (``[:, 0]``) and values (``[:, 1]``)
        of a ring of the last ``L = max(dilation) * window + 1`` positions
        (position ``p`` in slot ``p mod L``), of the ``g = global_tokens``
        global positions, and of those positions' global projections
        (``G = num_heads / num_key_value_heads`` rows each). O(w + g)
        memory and work per token."""
        g = self.global_tokens
        rows = self._ring_length() + g + g * self._global_rows()
        return (batch_size, 2, rows, self.num_key_value_heads, self.key_dim)

    def _call_with_cache(self, query, value, key, cache, index, masks,
                         return_attention_scores, training, use_causal_mask):
        self._call_state.decode_inputs = query
        try:
            return super()._call_with_cache(
                query, value, key, cache, index, masks, return_attention_scores,
                training, use_causal_mask)
        finally:
            self._call_state.decode_inputs = None

    def _decode(self, query, key, value, cache, index, training):
        """The first tokens from an empty cache (``cache_update_index`` 0,
        known) run the forward pass (global rows included), then fill the
        cache; any other call runs its tokens one at a time (a loop of
        steps for several)."""
        inputs = self._call_state.decode_inputs
        cache = ops.cast(cache, key.dtype)
        if query.shape[1] > 1 and concrete_int(index) == 0:
            return self._decode_prefill(query, key, value, inputs, cache, training)

        def step(q, k, v, x, cache, position):
            return self._decode_step(q, k, v, x, cache, position, training)

        if query.shape[1] == 1:
            return step(query, key, value, inputs, cache, index)
        return self._decode_each_token(step, (query, key, value, inputs), cache, index)

    def _global_kv(self, inputs, start):
        """Global-projection keys and values ``(B, n, H, d)`` of ``inputs``
        at positions ``start ..``."""
        kg = self._key_global_dense(inputs)
        vg = self._value_global_dense(inputs)
        if self.rotary_max_wavelength is not None:
            kg = la_ops.apply_rotary(kg, self.rotary_max_wavelength, start=start)
        return kg, vg

    def _as_rows(self, x):
        """``(B, n, H, d)`` -> ``(B, n * G, H_kv, d)``."""
        B, n = ops.shape(x)[0], x.shape[1]
        return ops.reshape(x, (B, n * self._global_rows(), self.num_key_value_heads,
                               x.shape[-1]))

    def _decode_prefill(self, query, key, value, inputs, cache, training):
        T = query.shape[1]
        context = AttentionContext(
            padding=la_ops.PaddingMask(None, None), causal=True, training=training,
            query_length=T, key_length=T)
        self._call_state.pending = (inputs, inputs, inputs, None)
        out = self._dispatch(query, self.expand_key_value_heads(key),
                             self.expand_key_value_heads(value), context)
        L, g = self._ring_length(), self.global_tokens
        # Slot s of the ring holds the last prompt position that is s mod L.
        slots = ops.arange(L, dtype="int32")
        positions = (T - 1) - ops.mod(T - 1 - slots, L)
        written = (positions >= 0)[None, :, None, None]
        taken = ops.maximum(positions, 0)
        parts = []
        for x in (key, value):
            ring = ops.where(written, ops.take(x, taken, axis=1), ops.zeros_like(x[:, :1]))
            parts.append([ring])
        if g:
            n = min(g, T)
            kg, vg = self._global_kv(inputs[:, :n], 0)
            for part, x, xg in zip(parts, (key, value), (kg, vg)):
                part.append(la_ops.pad_axis(x[:, :n], 1, g))
                part.append(la_ops.pad_axis(self._as_rows(ops.cast(xg, x.dtype)), 1,
                                            g * self._global_rows()))
        block = ops.stack([ops.concatenate(p, axis=1) for p in parts], axis=1)
        return out, ops.cast(block, cache.dtype)

    def _decode_step(self, query, key, value, inputs, cache, index, training):
        """One token at ``index``: written into the ring (and, at a global
        position, into the global slots); a global position's row attends
        every earlier key with the global projections, any other row its
        dilated window and the global keys."""
        L, g, G = self._ring_length(), self.global_tokens, self._global_rows()
        look_back, _ = la_longformer.window_extents(self.window, True)
        new = ops.stack([key, value], axis=1)  # (B, 2, 1, Hkv, d)
        cache = ops.slice_update(cache, (0, 0, ops.mod(index, L), 0, 0), ops.cast(new, cache.dtype))
        if g:
            is_global = index < g
            slot = ops.minimum(index, g - 1)
            kg, vg = self._global_kv(inputs, index)
            rows = ops.stack([self._as_rows(ops.cast(kg, key.dtype)),
                              self._as_rows(ops.cast(vg, key.dtype))], axis=1)
            for start, block in ((L + slot, new), (L + g + slot * G, rows)):
                old = ops.slice(cache, (0, 0, start, 0, 0), tuple(block.shape[:2]) +
                                (block.shape[2],) + tuple(block.shape[3:]))
                block = ops.where(is_global, ops.cast(block, cache.dtype), old)
                cache = ops.slice_update(cache, (0, 0, start, 0, 0), block)
        cache_k = ops.cast(cache[:, 0], query.dtype)
        cache_v = ops.cast(cache[:, 1], query.dtype)
        # The ring: slot s holds the latest position p <= index with p = s mod L.
        slots = ops.arange(L, dtype="int32")
        distance = ops.mod(index - slots, L)
        position = index - distance
        kept = position >= max(g, 0)  # global positions are read from their slots
        head_masks = []
        for r in self.dilations:
            head_masks.append(ops.logical_and(
                kept, ops.logical_and(ops.equal(ops.mod(distance, r), 0),
                                      distance <= r * look_back)))
        mask = ops.stack(head_masks)[None, :, None, :]  # (1, H, 1, L)
        # Slots not written yet are selected as zeros (never reach an output).
        keys = only_written(cache_k[:, :L], position >= 0, query.dtype)
        values = only_written(cache_v[:, :L], position >= 0, query.dtype)
        if g:
            seen = ops.arange(g, dtype="int32") <= index
            mask = ops.concatenate(
                [mask, ops.broadcast_to(seen[None, None, None, :], (1, self.num_heads, 1, g))],
                axis=-1)
            keys = ops.concatenate(
                [keys, only_written(cache_k[:, L:L + g], seen, query.dtype)], axis=1)
            values = ops.concatenate(
                [values, only_written(cache_v[:, L:L + g], seen, query.dtype)], axis=1)
        dropout_fn = self._dropout_fn(training)
        scale = self._inverse_sqrt_key_dim
        out = la_ops.reference_attention(
            query, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
            mask=mask, scale=scale, dropout_fn=dropout_fn)
        if not g:
            return out, cache
        B = ops.shape(query)[0]
        qg = self._query_global_dense(inputs)
        if self.rotary_max_wavelength is not None:
            qg = la_ops.apply_rotary(qg, self.rotary_max_wavelength, start=index)
        kg = only_written(ops.reshape(cache_k[:, L + g:], (B, g, self.num_heads, self.key_dim)),
                          seen, query.dtype)
        vg = only_written(ops.reshape(cache_v[:, L + g:], (B, g, self.num_heads, self.key_dim)),
                          seen, query.dtype)
        seen = seen[None, None, :]
        rows = la_ops.reference_attention(ops.cast(qg, query.dtype), kg, vg, mask=seen,
                                          scale=scale, dropout_fn=dropout_fn)
        return ops.where(is_global, rows, out), cache
