"""Dense attention with α-entmax in place of the softmax (Adaptively Sparse
Transformers)."""

import math
import numbers

import keras
from keras import ops

from keras_longattn._validation import positive_int
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.ops import entmax as entmax_ops

#: The value of ``alpha`` that makes α a trainable weight per head.
LEARNED = "learned"


class _AlphaLogits(keras.layers.Layer):
    """Holds the ``(num_heads,)`` logits ``w`` of a learned α = 1 + sigmoid(w).

    A sub-layer created after the projections, so that the layer's weights
    start with exactly MultiHeadAttention's, in its order.
    """

    def __init__(self, num_heads, initial_logit, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.initial_logit = initial_logit

    def build(self, input_shape=None):
        self.logits = self.add_weight(
            name="logits",
            shape=(self.num_heads,),
            initializer=keras.initializers.Constant(self.initial_logit),
        )
        self.built = True


@keras.saving.register_keras_serializable(package="keras_longattn")
class EntmaxAttention(BaseAttention):
    """Multi-head attention whose weights are α-entmax of the scores instead
    of their softmax: sparse weights, with exact zeros.

    Every query sees every key (or every earlier key, causally), as in
    :class:`FullAttention`; the scores ``q.k / sqrt(d)`` of a query are
    normalised by α-entmax (:mod:`keras_longattn.ops.entmax`),

        p_j = [(α - 1) s_j - τ]_+ ^ (1 / (α - 1)),   τ such that Σ p = 1,

    so keys whose score is far enough below the best get a weight of
    exactly 0. α = 1 is the softmax, α = 2 sparsemax, α = 1.5 the exact
    sort-based 1.5-entmax; any other α in (1, 2) uses bisection on τ.
    With ``alpha="learned"`` each head learns its own α = 1 + sigmoid(w_h)
    in (1, 2) (Correia, Niculae & Martins 2019), and gradients reach α
    exactly (the closed form of :func:`keras_longattn.ops.entmax.entmax_bisect`).

    Cost: O(T * S * d) time and O(T * S) memory, like the dense reference,
    plus one sort of each row (``alpha`` 1.5 or 2, O(S log S)) or
    ``n_iter`` passes over it (bisection). The normalisation is computed in
    float32 under every dtype policy.

    Why a layer and not a ``normalizer=`` argument of the other layers:
    every efficient path of the library is built on the softmax's
    exp / log-sum-exp structure: fused and flash kernels
    (``keras.ops.dot_product_attention``, Pallas, FlexAttention) stream
    the keys with a running maximum and sum, and the band, global and
    random parts of the sparse layers are merged by their log-sum-exp
    (:func:`keras_longattn.ops.merge_attention_parts`). α-entmax has no
    such decomposition: its threshold τ needs every visible score of the
    row at once (a sort or a bisection), so it can be neither streamed nor
    merged across key blocks. A ``normalizer=`` would be refused by
    nearly every path it was given to and honoured only by their O(T * S)
    references; one layer whose only path is that dense computation keeps
    the cost visible, owns the learned α, and leaves the other layers'
    configs as they are.

    Implementations:
        ``"reference"`` (the only one, what ``"auto"`` runs): explicit
        scores, α-entmax under the call's masks, attention dropout.

    Accepts a dense ``attention_mask`` ``(B, T, S)``.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        alpha: a number in [1, 2] (the same fixed α for every head), or
            ``"learned"`` (one trainable α per head). Defaults to 1.5.
        alpha_init: with ``alpha="learned"``, the α every head starts at,
            in (1, 2) (the logits start at ``log((α - 1) / (2 - α))``).
            Defaults to 1.5, the value the paper's learned α starts from.
        n_iter: bisection steps where bisection is used (a learned α, or
            a fixed α other than 1, 1.5 and 2). Defaults to
            ``keras_longattn.ops.entmax.DEFAULT_N_ITER`` (50).
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, ``implementation``,
            ``num_key_value_heads``, ``rotary_max_wavelength``).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``attention_mask``
        ``(B, T, S)``, ``use_causal_mask``, ``return_attention_scores``
        (the ``(B, H, T, S)`` entmax weights, exact zeros included),
        ``training``; and ``cache``/``cache_update_index`` for decoding
        (a full-length cache of keys and values, as FullAttention's).

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested).

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.EntmaxAttention(
    ...     num_heads=2, key_dim=8, alpha="learned")
    >>> x = np.random.rand(2, 16, 32).astype("float32")
    >>> out, weights = layer(x, x, use_causal_mask=True,
    ...                      return_attention_scores=True)
    >>> tuple(out.shape), tuple(weights.shape)
    ((2, 16, 32), (2, 2, 16, 16))
    >>> tuple(layer.alphas().shape)
    (2,)

    Reference:
        Correia, Niculae & Martins, "Adaptively Sparse Transformers",
        EMNLP 2019; Peters, Niculae & Martins, "Sparse Sequence-to-Sequence
        Models", ACL 2019.
    """

    supports_attention_mask = True
    # Entmax weights are not softmax attention under a pattern: the
    # reference is the explicit dense computation of this layer.
    is_exact = False
    # The only path is the dense one: nothing cheaper to fall from.
    warns_on_reference_fallback = False

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        alpha=1.5,
        alpha_init=1.5,
        n_iter=entmax_ops.DEFAULT_N_ITER,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.alpha = _check_alpha(alpha)
        self.alpha_init = _check_alpha_init(alpha_init)
        self.n_iter = positive_int("n_iter", n_iter)
        self._alpha_logits = None

    @property
    def learns_alpha(self):
        """Whether α is a trainable weight per head."""
        return self.alpha == LEARNED

    # ---------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        if not self.learns_alpha:
            return
        a = self.alpha_init - 1.0
        self._alpha_logits = _AlphaLogits(
            self.num_heads,
            math.log(a / (1.0 - a)),
            dtype=self.dtype_policy,
            name="alpha",
        )
        self._alpha_logits.build()

    def set_weights(self, weights):
        """Sets the weights; a list without the α logits (e.g.
        ``MultiHeadAttention.get_weights()``) sets the projections and keeps
        the learned α."""
        weights = list(weights)
        if self._alpha_logits is not None and len(weights) == len(self.weights) - 1:
            weights.append(ops.convert_to_numpy(self._alpha_logits.logits))
        super().set_weights(weights)

    # ---------------------------------------------------------------- alpha
    def alphas(self):
        """The α of each head, float32 ``(num_heads,)``: the fixed α
        repeated, or the learned ``1 + sigmoid(w)`` as it is used (clipped
        to ``[ops.entmax.TENSOR_ALPHA_MIN, 2]``). The layer must be built
        for a learned α."""
        if not self.learns_alpha:
            return ops.full((self.num_heads,), self.alpha, dtype="float32")
        if self._alpha_logits is None:
            raise ValueError(
                "EntmaxAttention.alphas() with alpha='learned' needs a built "
                "layer: call the layer once or build it first"
            )
        return self._alpha_tensor()

    def _alpha_tensor(self):
        logits = ops.cast(self._alpha_logits.logits, "float32")
        return ops.clip(1.0 + ops.sigmoid(logits), entmax_ops.TENSOR_ALPHA_MIN, 2.0)

    def normalize(self, scores, mask):
        """α-entmax of ``(B, H, T, S)`` scores over the keys under a boolean
        ``mask`` broadcastable to them (exact zeros where masked, all-zero
        rows where nothing is visible), in float32, returned in the dtype
        of ``scores``."""
        if self.learns_alpha:
            alpha = ops.reshape(self._alpha_tensor(), (self.num_heads, 1))  # (H, T=1)
            return entmax_ops.entmax_bisect(scores, alpha, mask=mask, axis=-1,
                                            n_iter=self.n_iter)
        return entmax_ops.entmax(scores, self.alpha, mask=mask, axis=-1, n_iter=self.n_iter)

    # ------------------------------------------------------------ attention
    def _attention_reference(self, query, key, value, context):
        """Dense scores, α-entmax under the call's mask, weighted values."""
        mask = ops.expand_dims(self.reference_mask(context), 1)  # (B or 1, 1, T, S)
        return self._entmax_attention(query, key, value, mask, context.training,
                                      context.return_scores)

    def _entmax_attention(self, query, key, value, mask, training, return_scores=False):
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        scores = ops.einsum("bthd,bshd->bhts", query, key)  # (B, H, T, S)
        weights = ops.cast(self.normalize(scores, mask), value.dtype)
        dropout_fn = self._dropout_fn(training)
        probs = weights if dropout_fn is None else dropout_fn(weights)
        out = ops.einsum("bhts,bshd->bthd", probs, value)
        if return_scores:
            return out, weights
        return out

    def full_attention_limit(self, sequence_length):
        # α = 1 is the masked softmax itself.
        return {"alpha": 1.0}, 1e-6

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, max_length, num_key_value_heads, key_dim)``: the
        keys (``[:, 0]``) and values (``[:, 1]``) of every position, as
        :class:`FullAttention`'s cache (entmax needs every earlier score of
        a row)."""
        return (batch_size, 2, max_length, self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        """Writes the new keys and values at ``index`` and attends the new
        queries, with α-entmax, to every cached position up to their own."""
        T, S = query.shape[1], cache.shape[2]
        cache, keys, values = self._written_full_cache(cache, key, value, index)
        q_pos = index + ops.arange(T, dtype="int32")
        visible = ops.arange(S, dtype="int32")[None, :] <= q_pos[:, None]  # (T, S)
        out = self._entmax_attention(
            query, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
            visible[None, None], training)
        return out, cache

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {"alpha": self.alpha, "alpha_init": self.alpha_init, "n_iter": self.n_iter}
        )
        return config


def _check_alpha(alpha):
    """``alpha`` as a float in [1, 2] or the string ``"learned"``."""
    if isinstance(alpha, str):
        if alpha == LEARNED:
            return alpha
    elif not isinstance(alpha, bool) and isinstance(alpha, numbers.Real):
        try:
            value = float(alpha)
        except OverflowError:
            value = float("nan")
        if 1.0 <= value <= 2.0:  # NaN fails
            return value
    raise ValueError(
        "`alpha` must be a number in [1, 2] (1: softmax, 1.5: 1.5-entmax, "
        f"2: sparsemax) or {LEARNED!r} (one α per head). Received: alpha={alpha!r}"
    )


def _check_alpha_init(alpha_init):
    """``alpha_init`` as a float in the open interval (1, 2), where
    ``1 + sigmoid(w)`` can start."""
    if not isinstance(alpha_init, bool) and isinstance(alpha_init, numbers.Real):
        try:
            value = float(alpha_init)
        except OverflowError:
            value = float("nan")
        if 1.0 < value < 2.0:  # NaN fails
            return value
    raise ValueError(
        "`alpha_init` must be a number in the open interval (1, 2) (a learned "
        f"α = 1 + sigmoid(w) never reaches 1 or 2). Received: alpha_init={alpha_init!r}"
    )

