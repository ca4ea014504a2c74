"""Decoding with a cache, shared by every layer that has one: the
``cache`` / ``cache_update_index`` branch of ``BaseAttention.call``
(keras-hub's convention: the layer returns ``(output, new cache)``), the
checks of the cache and of the index (concrete ones when the call is made,
traced ones while the program runs: :mod:`keras_longattn.ops.checks`), empty
calls, the cache's dtype, and the full-length and ring caches' reads and
writes (slots not written yet are selected out, never multiplied by zero).
A layer with a cache gives :meth:`DecodingMixin.cache_shape`,
:meth:`DecodingMixin._decode` and a ``None`` :meth:`DecodingMixin.decode_refusal`."""

import numbers

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn.layers.masking import set_keras_mask
from keras_longattn.ops import checks as la_checks


class DecodingMixin:
    """The decoding methods of :class:`keras_longattn.layers.BaseAttention`."""

    def __call__(self, *args, **kwargs):
        # Keras casts every float argument to the layer's input dtype before
        # `call`: a decoding cache must keep its own dtype (a bfloat16 cache
        # of a float32 layer stays bfloat16), so it passes held.
        if kwargs.get("cache") is not None:
            kwargs["cache"] = HeldArgument(kwargs["cache"])
        return super().__call__(*args, **kwargs)
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
        if isinstance(cache, HeldArgument):
            cache = cache.value
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
            set_keras_mask(t, None)
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


class HeldArgument:
    """An argument carried through ``Layer.__call__`` unconverted."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


#: Dtypes a decoding cache may have.
_CACHE_DTYPES = ("float16", "bfloat16", "float32", "float64")


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
