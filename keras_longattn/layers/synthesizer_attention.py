"""Synthesizer (Tay et al. 2020): attention weights synthesized from each
token alone (dense) or learned per position (random), without the
query-key dot product, alone or mixed with it."""

import math
import numbers

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import length_within
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.ops import segments

#: The components of ``SynthesizerAttention(kind=...)``, joined by "+".
KINDS = (
    "dense",
    "random",
    "fixed_random",
    "factorized_dense",
    "factorized_random",
    "vanilla",
)
#: Components whose logits depend on the query position only through a
#: learned table: they need ``T <= max_length`` as well as ``S``.
_POSITIONAL = ("random", "fixed_random", "factorized_random")


def parse_kind(kind):
    """``"random+vanilla"`` -> ``("random", "vanilla")``, or a ValueError
    naming ``kind`` (unknown, empty or repeated components)."""
    if not isinstance(kind, str):
        raise ValueError(
            f"`kind` must be a string of {KINDS} joined by '+'. "
            f"Received: kind={kind!r}"
        )
    parts = tuple(p.strip() for p in kind.split("+"))
    if any(not p for p in parts):
        raise ValueError(
            "`kind` has an empty component: name one or more of "
            f"{KINDS}, joined by '+' (e.g. 'random+vanilla'). "
            f"Received: kind={kind!r}"
        )
    for p in parts:
        if p not in KINDS:
            raise ValueError(
                f"Unknown component {p!r} in `kind`: each component must be "
                f"one of {KINDS}. Received: kind={kind!r}"
            )
    if len(set(parts)) != len(parts):
        raise ValueError(
            f"`kind` names a component twice. Received: kind={kind!r}"
        )
    return parts


def default_factors(max_length):
    """``(a, b)`` with ``a = ceil(sqrt(l))`` and ``a * b >= l``."""
    a = max(1, math.isqrt(max_length - 1) + 1) if max_length > 1 else 1
    return a, -(-max_length // a)


class _SynthesizerWeights(keras.layers.Layer):
    """The synthetic parameters of every component and the mixture logits.

    A sub-layer created after the projections, so that the layer's weights
    start with exactly MultiHeadAttention's, in its order.
    """

    def __init__(self, components, num_heads, key_dim, max_length, rank, factors,
                 kernel_initializer, bias_initializer, random_initializer,
                 regularizer=None, constraint=None, **kwargs):
        super().__init__(**kwargs)
        self.components = components
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.max_length = max_length
        self.rank = rank
        self.factors = factors
        self.kernel_initializer = kernel_initializer
        self.bias_initializer = bias_initializer
        self.random_initializer = random_initializer
        self.regularizer = regularizer
        self.constraint = constraint

    def _add(self, name, shape, initializer, trainable=True, kernel=True):
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=_clone(initializer),
            regularizer=self.regularizer if kernel else None,
            constraint=self.constraint if kernel else None,
            trainable=trainable,
        )

    def build(self, input_shape=None):
        H, d, l = self.num_heads, self.key_dim, self.max_length
        c = self.components
        if "dense" in c:
            self.dense_kernel = self._add("dense_kernel", (H, d, l), self.kernel_initializer)
            self.dense_bias = self._add("dense_bias", (H, l), self.bias_initializer,
                                        kernel=False)
        if "factorized_dense" in c:
            a, b = self.factors
            self.factor_a_kernel = self._add("factor_a_kernel", (H, d, a),
                                             self.kernel_initializer)
            self.factor_a_bias = self._add("factor_a_bias", (H, a), self.bias_initializer,
                                           kernel=False)
            self.factor_b_kernel = self._add("factor_b_kernel", (H, d, b),
                                             self.kernel_initializer)
            self.factor_b_bias = self._add("factor_b_bias", (H, b), self.bias_initializer,
                                           kernel=False)
        if "random" in c:
            self.random_logits = self._add("random_logits", (H, l, l),
                                           self.random_initializer)
        if "factorized_random" in c:
            r = self.rank
            self.random_left = self._add("random_left", (H, l, r), self.random_initializer)
            self.random_right = self._add("random_right", (H, l, r), self.random_initializer)
        if "fixed_random" in c:
            self.fixed_random_logits = self._add(
                "fixed_random_logits", (H, l, l), self.random_initializer, trainable=False
            )
        if len(c) > 1:
            self.mixture_logits = self.add_weight(
                name="mixture_logits", shape=(len(c),), initializer="zeros"
            )
        self.built = True


@keras.saving.register_keras_serializable(package="keras_longattn")
class SynthesizerAttention(BaseAttention):
    """Synthesizer attention: weights synthesized without (or besides) the
    query-key dot product.

    Each component of ``kind`` gives every head a ``(T, S)`` table of
    logits; the weights are ``softmax(sum_c w_c B_c)`` (masked) and the
    output ``softmax(...) V``, with ``V`` the value projection (the paper's
    ``G(X)``). Components, for a head, a query ``t`` and a key position
    ``s``:

    * ``"dense"``: each query predicts its own row of ``max_length``
      logits, ``B_t = relu(q_t) W2 + b2`` (the query projection serves as
      the paper's first layer ``W1 x + b1``: the layer's attention takes
      projected heads, see :meth:`attend`), sliced to ``S``;
    * ``"random"``: a learned ``(max_length, max_length)`` table ``R``,
      the same for every input, sliced to ``(T, S)``;
      ``"fixed_random"``: the same, drawn once and not trained;
    * ``"factorized_dense"``: each query predicts ``a`` and ``b`` logits
      (``factors``, ``a * b >= max_length``), combined by tiling:
      ``B_t[s] = A_t[s mod a] * B'_t[s // a]``;
    * ``"factorized_random"``: ``R = R1 R2^T`` with ``R1``, ``R2`` of
      ``(max_length, rank)``;
    * ``"vanilla"``: dot-product attention, ``q_t . k_s / sqrt(d)``.

    Components are joined by ``"+"`` (``"random+vanilla"``,
    ``"dense+random+vanilla"``); a mixture weighs them by ``w =
    softmax(m)``, ``m`` one learned scalar per component (the
    ``mixture_logits`` weight, zeros at first: equal weights). The weights
    stay positive and sum to 1, as the paper's mixture coefficients.
    ``"vanilla"`` alone is multi-head attention
    (:meth:`full_attention_limit`).

    Inputs shorter than ``max_length`` use the leading rows and columns of
    each table; longer ones are refused (any length with ``"vanilla"``
    alone). ``use_causal_mask=True`` masks the synthetic logits as the
    dot-product ones (query ``t`` sees keys ``s <= t``); padded keys get
    weight 0; a dense ``attention_mask`` is honoured.

    **Cost**: O(T * S) time and memory per head, as full attention: the
    synthesizer removes the dot product, not the ``(T, S)`` weights.
    ``"dense"`` costs O(T * max_length * key_dim) for the logits, and
    ``"random"`` needs ``max_length^2`` parameters per head (``"factorized_*"``
    fewer). The ``"synthetic"`` path computes in the layer's compute dtype;
    ``"reference"`` is the same computation in float32 with the dense mask of
    the call.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        kind: one component or several joined by ``"+"`` (see above).
            Defaults to ``"dense"``.
        max_length: the longest sequence of the synthetic tables. Defaults
            to 512.
        rank: ``R1``, ``R2`` columns of ``"factorized_random"``. Defaults
            to 8.
        factors: ``(a, b)`` of ``"factorized_dense"``, ``a * b >=
            max_length``. Defaults to ``a = ceil(sqrt(max_length))``,
            ``b = ceil(max_length / a)``.
        random_initializer: initializer of the random tables (``R``,
            ``R1``, ``R2``). Defaults to a standard normal.
        **kwargs: the arguments of :class:`BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"synthetic"`` or ``"reference"``). The kernel and
            bias initializers, regularizer and constraint also apply to the
            dense components' weights.

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``attention_mask``
        ``(B, T, S)``, ``use_causal_mask``, ``return_attention_scores``
        (the synthesized ``(B, H, T, S)`` weights), ``training``.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested).

    Example:

    >>> import numpy as np
    >>> import keras
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.SynthesizerAttention(
    ...     num_heads=2, key_dim=8, kind="random+vanilla", max_length=64)
    >>> x = np.random.rand(2, 40, 16).astype("float32")
    >>> out, weights = layer(x, x, use_causal_mask=True,
    ...                      return_attention_scores=True)
    >>> tuple(out.shape), tuple(weights.shape)
    ((2, 40, 16), (2, 2, 40, 40))
    >>> keras.ops.convert_to_numpy(layer.mixture_weights())
    array([0.5, 0.5], dtype=float32)

    Reference:
        Tay, Bahri, Metzler, Juan, Zhao and Zheng, "Synthesizer: Rethinking
        Self-Attention in Transformer Models", arXiv:2005.00743, 2020
        (ICML 2021).
    """

    is_exact = False
    supports_causal = True
    supports_scores = True
    supports_attention_mask = True
    reference_tolerance = 1e-5

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        kind="dense",
        max_length=512,
        rank=8,
        factors=None,
        random_initializer=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.components = parse_kind(kind)
        self.kind = kind
        self.max_length = _positive_int("max_length", max_length)
        self.rank = _positive_int("rank", rank)
        if factors is None:
            factors = default_factors(self.max_length)
        self.factors = _check_factors(factors, self.max_length)
        if random_initializer is None:
            random_initializer = keras.initializers.RandomNormal(mean=0.0, stddev=1.0)
        self.random_initializer = keras.initializers.get(random_initializer)
        self._synthesizer = None

    # ---------------------------------------------------------------- build
    def build_extra(self, query_shape, value_shape, key_shape):
        if self.components == ("vanilla",):
            return
        self._synthesizer = _SynthesizerWeights(
            self.components,
            self.num_heads,
            self.key_dim,
            self.max_length,
            self.rank,
            self.factors,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            random_initializer=self.random_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            dtype=self.dtype_policy,
            name="synthesizer",
        )
        self._synthesizer.build()

    def set_weights(self, weights):
        """Sets the weights; a list of the projections' weights alone (e.g.
        ``MultiHeadAttention.get_weights()``) sets them and keeps the
        synthetic ones."""
        weights = list(weights)
        own = self.weights
        mha = [w for layer in (self._query_dense, self._key_dense, self._value_dense,
                               self._output_dense) for w in layer.weights]
        if len(weights) < len(own) and len(weights) == len(mha):
            weights += [ops.convert_to_numpy(w) for w in own[len(weights):]]
        super().set_weights(weights)

    def mixture_weights(self):
        """The weight of each component (float32 ``(C,)``, in the order of
        ``kind``; ``[1.0]`` for one component)."""
        if len(self.components) == 1:
            return ops.ones((1,), dtype="float32")
        m = ops.cast(ops.convert_to_tensor(self._synthesizer.mixture_logits), "float32")
        return ops.softmax(m)

    # -------------------------------------------------------------- checks
    def _dispatch(self, q, k, v, context):
        if self.components != ("vanilla",):
            lengths = [("key", context.key_length)]
            if any(c in _POSITIONAL for c in self.components):
                lengths.insert(0, ("query", context.query_length))
            for name, n in lengths:
                length_within(name, n, self.max_length,
                              "the synthetic tables of SynthesizerAttention")
        return super()._dispatch(q, k, v, context)

    # -------------------------------------------------------------- logits
    def synthetic_logits(self, query, key, dtype, query_start=0):
        """The mixed logits of every component: ``(B, H, T, S)`` in
        ``dtype``, from projected heads ``query`` ``(B, T, H, d)`` and
        ``key`` ``(B, S, H, d)``, the queries at positions ``query_start
        ..`` (an int or a scalar tensor; the rows of the positional
        tables). O(T * S) per head."""
        q = ops.cast(query, dtype)
        batch, T = segments.dims(q)[:2]
        S = la_ops.length(key, 1)
        w = ops.cast(self.mixture_weights(), dtype)
        syn = self._synthesizer

        def var(x):
            return ops.cast(ops.convert_to_tensor(x), dtype)

        def rows(table):  # (H, l, ...) -> the rows of the T queries
            table = var(table)
            if isinstance(query_start, numbers.Integral) and query_start == 0:
                return table[:, :T]
            return ops.slice(table, (0, query_start) + (0,) * (len(table.shape) - 2),
                             (table.shape[0], T) + tuple(table.shape[2:]))

        total = None
        for i, component in enumerate(self.components):
            if component == "vanilla":
                # (B, T, H, d) x (B, S, H, d) -> (B, H, T, S)
                logits = ops.einsum(
                    "bthd,bshd->bhts", q * self._inverse_sqrt_key_dim, ops.cast(key, dtype)
                )
            elif component == "dense":
                hidden = ops.relu(q)
                # (B, T, H, d) x (H, d, S) -> (B, H, T, S)
                logits = ops.einsum("bthd,hds->bhts", hidden, var(syn.dense_kernel)[..., :S])
                logits = logits + var(syn.dense_bias)[None, :, None, :S]
            elif component == "factorized_dense":
                hidden = ops.relu(q)
                a, b = self.factors
                # (B, T, H, d) x (H, d, a) -> (B, H, T, a), and (H, d, b) -> (B, H, T, b)
                fa = ops.einsum("bthd,hda->bhta", hidden, var(syn.factor_a_kernel))
                fa = fa + var(syn.factor_a_bias)[None, :, None, :]
                fb = ops.einsum("bthd,hdc->bhtc", hidden, var(syn.factor_b_kernel))
                fb = fb + var(syn.factor_b_bias)[None, :, None, :]
                # Position s = j * a + i takes A[i] * B[j]: A tiled b times,
                # each entry of B repeated a times.
                grid = fb[..., :, None] * fa[..., None, :]  # (B, H, T, b, a)
                logits = ops.reshape(grid, (batch, self.num_heads, T, a * b))[..., :S]
            elif component in ("random", "fixed_random"):
                table = syn.random_logits if component == "random" else syn.fixed_random_logits
                logits = rows(table)[None, :, :, :S]  # (1, H, T, S)
            else:  # factorized_random
                # (H, T, r) x (H, S, r) -> (1, H, T, S)
                logits = ops.einsum(
                    "htr,hsr->hts", rows(syn.random_left), var(syn.random_right)[:, :S]
                )[None]
            if len(self.components) > 1:
                logits = w[i] * logits
            total = logits if total is None else total + logits
        return total

    def _weights(self, query, key, context, dtype):
        logits = self.synthetic_logits(query, key, dtype)
        mask = self.reference_mask(context)  # (B or 1, T, S)
        return la_ops.masked_softmax(logits, ops.expand_dims(mask, 1), axis=-1)

    # -------------------------------------------------------- efficient path
    @implementation("synthetic")
    def _synthetic(self, query, key, value, context):
        """The mixed logits, masked softmax and weighted sum, in the compute
        dtype."""
        weights = self._weights(query, key, context, query.dtype)
        dropout_fn = self._dropout_fn(context.training)
        if dropout_fn is not None:
            weights = dropout_fn(weights)
        # (B, H, T, S) x (B, S, H, dv) -> (B, T, H, dv)
        return ops.einsum("bhts,bshd->bthd", weights, ops.cast(value, weights.dtype))

    # ------------------------------------------------------------ reference
    def _attention_reference(self, query, key, value, context):
        """The same computation in float32 (returns the weights too when
        asked)."""
        dtype = query.dtype
        weights = self._weights(query, key, context, "float32")
        probs = weights
        dropout_fn = self._dropout_fn(context.training)
        if dropout_fn is not None:
            probs = dropout_fn(probs)
        out = ops.einsum("bhts,bshd->bthd", probs, ops.cast(value, "float32"))
        out = ops.cast(out, dtype)
        if context.return_scores:
            # Input-independent kinds give (1, H, T, S): one row per example,
            # as keras.layers.MultiHeadAttention returns them.
            batch = ops.shape(query)[0]
            weights = ops.broadcast_to(weights, (batch,) + tuple(ops.shape(weights)[1:]))
            return out, ops.cast(weights, dtype)
        return out

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, max_length, num_key_value_heads, key_dim)``: the
        keys and values of every position, ``max_length`` at most the
        layer's ``max_length`` (the synthetic tables' size). A new token's
        logits come from its own projection (dense kinds), its position's
        table row (random kinds) and the cached keys (vanilla)."""
        if max_length is not None and int(max_length) > self.max_length:
            raise ValueError(
                "A decoding cache of SynthesizerAttention holds at most the layer's "
                f"max_length={self.max_length} positions (its synthetic tables). "
                f"Received: max_length={max_length}")
        return (batch_size, 2, max_length, self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        T, S = query.shape[1], cache.shape[2]
        cache, keys, values = self._written_full_cache(cache, key, value, index)
        logits = self.synthetic_logits(query, self.expand_key_value_heads(keys), query.dtype,
                                       query_start=index)
        q_pos = (index + ops.arange(T, dtype="int32"))[:, None]
        visible = ops.arange(S, dtype="int32")[None, :] <= q_pos
        weights = la_ops.masked_softmax(logits, visible[None, None], axis=-1)
        dropout_fn = self._dropout_fn(training)
        if dropout_fn is not None:
            weights = dropout_fn(weights)
        out = ops.einsum("bhts,bshd->bthd", weights,
                         ops.cast(self.expand_key_value_heads(values), weights.dtype))
        return out, cache

    # ----------------------------------------------------------------- limit
    def full_attention_limit(self, sequence_length):
        """``kind="vanilla"``: dot-product attention alone, exactly
        multi-head attention."""
        return {"kind": "vanilla"}, 1e-5

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "kind": self.kind,
                "max_length": self.max_length,
                "rank": self.rank,
                "factors": self.factors,
                "random_initializer": keras.initializers.serialize(self.random_initializer),
            }
        )
        return config


def _check_factors(factors, max_length):
    message = (
        "`factors` must be two positive integers (a, b) with a * b >= "
        f"max_length (max_length={max_length}). Received: factors={factors!r}"
    )
    try:
        a, b = factors
    except (TypeError, ValueError):
        raise ValueError(message) from None
    for f in (a, b):
        if isinstance(f, bool) or not isinstance(f, numbers.Integral) or f < 1:
            raise ValueError(message)
    if a * b < max_length:
        raise ValueError(message)
    return (int(a), int(b))


def _clone(initializer):
    initializer = keras.initializers.get(initializer)
    return initializer.__class__.from_config(initializer.get_config())
