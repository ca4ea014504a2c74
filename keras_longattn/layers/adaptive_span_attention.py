"""Attention whose heads each learn how far back they look (Adaptive
Attention Span)."""

import math
import numbers

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import positive_int
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import is_training
from keras_longattn.ops.blocked import band_blocks
from keras_longattn.ops.shapes import ceil_div
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length

#: Smallest soft-mask value whose logarithm is taken: below it (a key at
#: the very end of the ramp) the weight's gradient with respect to the
#: span is cut rather than formed as a product of a denormal weight and a
#: huge ``1 / m``.
_MIN_MASK = 1e-30


class _UnitInterval(keras.constraints.Constraint):
    """Clips a weight to [0, 1] after each optimizer step (the authors'
    ``clamp_param``)."""

    def __call__(self, w):
        return ops.clip(w, 0.0, 1.0)


class _SpanFractions(keras.layers.Layer):
    """Holds the ``(num_heads,)`` span fractions ``v`` (the span is
    ``max_span * v``), constrained to [0, 1].

    A sub-layer created after the projections, so that the layer's weights
    start with exactly MultiHeadAttention's, in its order.
    """

    def __init__(self, num_heads, initial_fraction, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.initial_fraction = initial_fraction

    def build(self, input_shape=None):
        self.fractions = self.add_weight(
            name="fractions",
            shape=(self.num_heads,),
            initializer=keras.initializers.Constant(self.initial_fraction),
            constraint=_UnitInterval(),
        )
        self.built = True


@keras.saving.register_keras_serializable(package="keras_longattn")
class AdaptiveSpanAttention(BaseAttention):
    """Multi-head attention in which each head learns its span: a soft mask
    on the distance to the key, computed only as far as the spans reach.

    Head ``h`` has a span ``z_h = max_span * v_h`` with a trainable
    ``v_h`` in [0, 1] (kept there by a constraint after each optimizer step,
    and clipped where it is used, as the authors' ``clamp_param``). A query
    ``i`` weighs key ``j`` at distance ``x = i - j`` (``|i - j|``
    bidirectionally) by the soft mask

        m_z(x) = clamp((R + z - x) / R, 0, 1)

    with the ramp ``R``: keys within ``z`` count fully, the next ``R`` fade
    out linearly, keys at ``x >= z + R`` not at all. The softmax weights
    are multiplied by the mask and renormalised, ``w_j = p_j m_j / Σ_k p_k
    m_k``. It is computed as the masked softmax of ``s_j + log m_j`` over
    the keys with ``m_j > 0``: the same weights (the paper divides by the
    sum plus 1e-8; a row whose masked sum is 0 gets zeros here), without
    underflow when the best-scoring key lies on the ramp. The mask is
    linear in ``z``, so the spans receive gradients through the ramp.

    Span penalty: in training each call adds ``span_penalty * mean_h(z_h)``
    to the layer's losses (``add_loss``). The paper adds ``λ / M Σ_i z_i``
    over the ``M`` heads of each layer, which is this mean; with several
    layers Keras sums their losses, as the paper's sum over layers.

    Cost follows the spans: the ``"blocked"`` path computes a band of
    ``reach = ceil(max_h z_h + R) - 1`` keys before each query (and after,
    bidirectionally), beyond which every mask is 0, in blocks
    (``keras_longattn.ops.blocked``): O(n * reach) time and memory, never
    a ``(T, S)`` tensor. The reach is read from the spans at every eager
    call, so a span that shrinks in training makes the next steps cheaper.
    Inside a compiled function (``jit_compile`` in ``fit``, ``jax.jit``,
    ``tf.function``) the spans are not known while tracing, and the band
    is the static bound ``max_span + R - 1`` (:meth:`current_reach`);
    the result is the same, only the cost differs.

    Implementations:
        ``"blocked"``: the band above with explicit einsums, attention
        dropout. ``"reference"``: the same weights on dense ``(B, H, T, S)``
        scores.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        max_span: the largest span ``S`` a head can learn (int >= 1);
            ``z_h`` is in [0, max_span].
        ramp: ``R``, the length of the soft mask's linear ramp (int >= 1).
            Defaults to 32, the paper's value.
        span_init: the fraction ``v`` of ``max_span`` every head starts at,
            in [0, 1]. Defaults to 0.0 (every head starts at span 0 and
            sees the ``R`` keys of the ramp), the authors' code's default
            (quoted from memory).
        span_penalty: ``λ`` of the span penalty ``λ * mean_h(z_h)`` added
            in training (>= 0). The paper tunes λ per task; defaults to 0.0
            (no penalty, the layer's losses stay empty).
        block_size: positions per block of the ``"blocked"`` path.
            Defaults to :func:`keras_longattn.ops.default_block_size` of the
            reach.
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, ``implementation``,
            ``num_key_value_heads``, ``rotary_max_wavelength``).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``use_causal_mask``,
        ``return_attention_scores`` (dense ``(B, H, T, S)``, O(n^2)),
        ``training``; and ``cache``/``cache_update_index`` for decoding (a
        ring of the last ``max_span + ramp - 1`` keys and values). A dense
        ``attention_mask`` is only accepted with
        ``implementation="reference"``.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested).

    Example:

    >>> import keras
    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.AdaptiveSpanAttention(
    ...     num_heads=2, key_dim=8, max_span=64, ramp=8, span_init=0.25)
    >>> x = np.random.rand(1, 100, 16).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (1, 100, 16)
    >>> keras.ops.convert_to_numpy(layer.current_spans()).tolist()
    [16.0, 16.0]
    >>> layer.current_reach()
    23

    Reference:
        Sukhbaatar, Grave, Bojanowski & Joulin, "Adaptive Attention Span in
        Transformers", ACL 2019.
    """

    # A soft mask reweights the softmax: not softmax under a pattern; the
    # reference is this layer's own dense computation.
    is_exact = False

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        max_span,
        ramp=32,
        span_init=0.0,
        span_penalty=0.0,
        block_size=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.max_span = positive_int("max_span", max_span)
        self.ramp = positive_int("ramp", ramp)
        self.span_init = _check_real("span_init", span_init, 0.0, 1.0, "in [0, 1]")
        self.span_penalty = _check_real("span_penalty", span_penalty, 0.0, math.inf,
                                        "a finite number >= 0")
        self.block_size = positive_int("block_size", block_size, allow_none=True)
        self._spans = None

    # ---------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        self._spans = _SpanFractions(
            self.num_heads, self.span_init, dtype=self.dtype_policy, name="span"
        )
        self._spans.build()

    def set_weights(self, weights):
        """Sets the weights; a list without the span fractions (e.g.
        ``MultiHeadAttention.get_weights()``) sets the projections and keeps
        the spans."""
        weights = list(weights)
        if self._spans is not None and len(weights) == len(self.weights) - 1:
            weights.append(ops.convert_to_numpy(self._spans.fractions))
        super().set_weights(weights)

    # ---------------------------------------------------------------- spans
    def current_spans(self):
        """The span ``z_h = max_span * clip(v_h, 0, 1)`` of each head,
        float32 ``(num_heads,)`` (differentiable). The layer must be
        built."""
        if self._spans is None:
            raise ValueError(
                "AdaptiveSpanAttention.current_spans() needs a built layer: call "
                "the layer once or build it first"
            )
        v = ops.clip(ops.cast(self._spans.fractions, "float32"), 0.0, 1.0)
        return v * float(self.max_span)

    @property
    def static_reach(self):
        """The largest distance a key can have and still be weighed, for
        any spans: ``max_span + ramp - 1``."""
        return self.max_span + self.ramp - 1

    def current_reach(self):
        """The distance of the furthest key any head weighs now,
        ``ceil(max_h z_h + R) - 1`` (a key at ``x >= z + R`` has mask 0), as a
        Python int. Where the spans cannot be read (inside a compiled
        function) it is :attr:`static_reach`."""
        try:
            top = float(ops.convert_to_numpy(ops.max(self.current_spans())))
        except Exception:  # traced: no value while tracing
            return self.static_reach
        if not math.isfinite(top):
            return self.static_reach
        return max(0, min(self.static_reach, math.ceil(top + self.ramp) - 1))

    def span_mask(self, distance):
        """The soft mask ``m_z(x)`` of every head: float32, the heads axis
        first, then the shape of ``distance`` (integer or float distances
        ``x >= 0``)."""
        z = self.current_spans()
        x = ops.cast(distance, "float32")
        z = ops.reshape(z, (self.num_heads,) + (1,) * len(x.shape))
        return ops.clip((self.ramp + z - x[None]) / float(self.ramp), 0.0, 1.0)

    def span_loss(self):
        """The span penalty ``span_penalty * mean_h(z_h)`` (float32 scalar)."""
        return self.span_penalty * ops.mean(self.current_spans())

    def attention_pattern(self, query_length, key_length, causal):
        """The keys any span can reach: ``LocalPattern(reach, 0)`` causally,
        ``LocalPattern(reach, reach)`` bidirectionally, with
        ``reach = max_span + ramp - 1``; within it the soft mask weighs
        them."""
        reach = self.static_reach
        return la_ops.LocalPattern(reach, 0 if causal else reach)

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
        if self.span_penalty > 0.0 and is_training(training) and self._spans is not None:
            self.add_loss(self.span_loss())
        return super().call(
            query,
            value,
            key=key,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            return_attention_scores=return_attention_scores,
            training=training,
            use_causal_mask=use_causal_mask,
            cache=cache,
            cache_update_index=cache_update_index,
        )

    # ------------------------------------------------------------ attention
    def _span_weights(self, scores, visible, mask):
        """``p m / Σ p m`` for softmax weights ``p`` of ``scores`` over the
        last axis, as the masked softmax of ``scores + log m`` over the
        visible keys with ``m > 0`` (float32; exact zeros elsewhere, zero
        rows where no key is left)."""
        support = ops.logical_and(visible, mask > 0.0)
        logits = ops.cast(scores, "float32") + ops.log(ops.maximum(mask, _MIN_MASK))
        return la_ops.masked_softmax(logits, support, axis=-1)

    def _attention_reference(self, query, key, value, context):
        """Dense scores, the soft span mask on every (query, key) pair."""
        T, S = context.query_length, context.key_length
        visible = ops.expand_dims(self.reference_mask(context), 1)  # (B or 1, 1, T, S)
        distance = ops.arange(T, dtype="int32")[:, None] - ops.arange(S, dtype="int32")[None]
        if not context.causal:
            distance = ops.abs(distance)
        mask = self.span_mask(distance)[None]  # (1, H, T, S)
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        scores = ops.einsum("bthd,bshd->bhts", query, key)
        weights = ops.cast(self._span_weights(scores, visible, mask), value.dtype)
        return self._weighted_values(weights, value, context)

    @implementation("blocked")
    def _blocked(self, query, key, value, context):
        """The band of the current reach in blocks, explicit einsums."""
        reach = self.current_reach()
        return self._band(query, key, value, reach, 0 if context.causal else reach,
                          context.causal, context.padding.key_mask, context.training)

    def _band(self, query, key, value, look_back, look_ahead, causal, key_mask, training):
        """Span-masked attention of every query to the keys within
        ``look_back`` before and ``look_ahead`` after it, block by block:
        ``(B, T, H, d)`` queries, ``(B, S, H, d|dv)`` keys and values,
        ``(B, T, H, dv)`` out (zeros where no key is left)."""
        T, S = length(query, 1), length(key, 1)
        longest = larger(T, S)
        H, dv = query.shape[2], value.shape[3]
        b = self.block_size or la_ops.default_block_size(
            look_back, look_ahead, longest if is_static(longest) else None
        )
        n = ceil_div(longest, b)
        N = n * b
        before = -(-int(look_back) // b)
        after = -(-int(look_ahead) // b)
        C = (before + 1 + after) * b
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        query = la_ops.pad_axis(query, 1, N)
        key = la_ops.pad_axis(key, 1, N)
        value = la_ops.pad_axis(value, 1, N)
        valid = ops.expand_dims(ops.arange(N, dtype="int32") < S, 0)  # (1, N)
        if key_mask is not None:
            km = la_ops.pad_axis(ops.cast(key_mask, "bool"), 1, N, value=False)
            valid = ops.logical_and(valid, km)  # (B or 1, N)
        pattern = la_ops.LocalPattern(look_back, look_ahead)
        q, k, v, visible = band_blocks(query, key, value, valid, pattern, b, before, after)
        # Query i of a block and slot c of its keys are at distance
        # i - c + before * b in every block: one (H, b, C) mask serves all
        # blocks (broadcast), rather than one per block.
        distance = ops.arange(b, dtype="int32")[:, None] - (
            ops.arange(C, dtype="int32") - before * b)[None, :]
        if not causal:
            distance = ops.abs(distance)
        mask = self.span_mask(distance)[None, None]  # (1, 1, H, b, C)
        # (B, n, b, H, d) x (B, n, C, H, d) -> (B, n, H, b, C)
        scores = ops.einsum("bnqhd,bnkhd->bnhqk", q, k)
        probs = ops.cast(self._span_weights(scores, visible[:, :, None], mask), v.dtype)
        dropout_fn = self._dropout_fn(training)
        if dropout_fn is not None:
            probs = dropout_fn(probs)
        out = ops.einsum("bnhqk,bnkhd->bnqhd", probs, v)  # (B, n, b, H, dv)
        return ops.reshape(out, (-1, N, H, dv))[:, :T]

    def full_attention_limit(self, sequence_length):
        # Spans at a maximum of at least n: every mask of a distance below
        # n is 1 (m = (R + n - x) / R > 1).
        n = max(1, int(sequence_length))
        return {"max_span": max(n, self.max_span), "span_init": 1.0}, 1e-5

    # -------------------------------------------------------------- decoding
    cache_length_free = False

    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, max_span + ramp - 1, num_key_value_heads,
        key_dim)``: a ring of the keys (``[:, 0]``) and values (``[:, 1]``)
        of the last :attr:`static_reach` positions, whatever ``max_length``
        (the spans may grow up to it): position ``p`` is in slot
        ``p mod (max_span + ramp - 1)``."""
        return (batch_size, 2, self.static_reach, self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        """The new queries against the ring (put in order) and the new
        keys: one new token attends ``W + 1`` keys directly (O(W) work); more
        run the blocked band over the ``W + T`` keys. The ring then keeps
        the last ``W`` of them."""
        W, T = cache.shape[2], query.shape[1]
        keys, values, k_pos, written = self._ring_keys(cache, key, value, index)
        full_keys = self.expand_key_value_heads(keys)
        full_values = self.expand_key_value_heads(values)
        if T == 1:
            distance = index - k_pos[None, :]  # (1, W + 1)
            mask = self.span_mask(distance)[None]  # (1, H, 1, W + 1)
            query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
            scores = ops.einsum("bthd,bshd->bhts", query, full_keys)
            weights = ops.cast(
                self._span_weights(scores, written[None, None, None, :], mask),
                full_values.dtype)
            dropout_fn = self._dropout_fn(training)
            if dropout_fn is not None:
                weights = dropout_fn(weights)
            out = ops.einsum("bhts,bshd->bthd", weights, full_values)
        else:
            # The new queries are the last T of W + T positions in order.
            padded = ops.concatenate(
                [ops.zeros((ops.shape(query)[0], W) + tuple(query.shape[2:]), query.dtype),
                 query], axis=1)
            key_mask = ops.broadcast_to(written[None, :], (ops.shape(query)[0], W + T))
            out = self._band(padded, full_keys, full_values, self.current_reach(), 0, True,
                             key_mask, training)[:, W:]
        return out, self._ring_after(keys, values, index, T)

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_span": self.max_span,
                "ramp": self.ramp,
                "span_init": self.span_init,
                "span_penalty": self.span_penalty,
                "block_size": self.block_size,
            }
        )
        return config


def _check_real(name, value, low, high, what):
    """``value`` as a float in ``[low, high]`` (finite), else a ValueError
    naming ``name`` and the value."""
    number = None
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:
            number = None
    if number is None or not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")
    return number
