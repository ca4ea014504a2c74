"""Performer attention (FAVOR+, Choromanski et al. 2021): softmax attention
estimated with positive orthogonal random features, linear in the length."""

import keras
import numpy as np
from keras import ops

from keras_longattn._validation import optional_seed as _optional_seed
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn import ops as la_ops
from keras_longattn.layers.base_attention import AttentionContext
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import is_training
from keras_longattn.ops import kernelized
from keras_longattn.ops import paths as la_paths
from keras_longattn.ops import performer as performer_ops

#: Default number of random features (the paper's m = 256).
DEFAULT_NUM_FEATURES = 256
#: Seeds of the redraws: draw ``r`` uses the seed pair ``(seed, r * _STRIDE)``.
_STRIDE = 1000
#: Seeds are below this bound: a redraw puts the seed in an int32 tensor.
SEED_BOUND = 2**31


class RandomFeatures(keras.layers.Layer):
    """The non-trainable state of :class:`PerformerAttention`: the
    ``(num_features, key_dim)`` random projection ``features`` and the
    number of training calls made, ``step`` (both saved in ``.keras``
    files).

    Draw 0 (at build) is NumPy's (the same numbers on every backend for one
    seed); draw ``r >= 1`` comes from ``keras.random`` seeded with
    ``(seed, r)``, inside the training step. With ``redraw_interval = N``,
    training calls ``0..N-1`` use draw 0, calls ``N..2N-1`` draw 1, and so
    on.

    A sub-layer (created after the projections) so that the attention
    layer's weights start with exactly MultiHeadAttention's, in its order.
    """

    def __init__(self, num_features, dim, seed, redraw_interval=None, **kwargs):
        super().__init__(**kwargs)
        self.num_features = int(num_features)
        self.dim = int(dim)
        self.feature_seed = int(seed)
        self.redraw_interval = redraw_interval
        self.seed_generator = (
            keras.random.SeedGenerator(self.feature_seed)
            if redraw_interval is not None
            else None
        )

    def build(self, input_shape=None):
        initial = performer_ops.orthogonal_gaussian_numpy(
            self.num_features, self.dim, self.feature_seed
        )
        self.features = self.add_weight(
            name="features",
            shape=(self.num_features, self.dim),
            initializer=lambda shape, dtype=None: ops.convert_to_tensor(initial),
            dtype="float32",
            trainable=False,
            autocast=False,
        )
        self.step = self.add_weight(
            name="step",
            shape=(),
            initializer="zeros",
            dtype="int32",
            trainable=False,
            autocast=False,
        )
        self.built = True

    def draw(self, index):
        """Draw ``index`` of the projection (0: the NumPy draw of build;
        ``index`` may be a scalar tensor >= 1 inside a training step)."""
        if isinstance(index, int) and index == 0:
            return ops.convert_to_tensor(
                performer_ops.orthogonal_gaussian_numpy(
                    self.num_features, self.dim, self.feature_seed
                )
            )
        generator = self.seed_generator
        if generator is None:
            generator = self.seed_generator = keras.random.SeedGenerator(
                self.feature_seed
            )
        state = ops.stack(
            [
                ops.convert_to_tensor(self.feature_seed, dtype="int32"),
                ops.cast(index, "int32") * _STRIDE,
            ]
        )
        generator.state.assign(ops.cast(state, generator.state.dtype))
        return performer_ops.orthogonal_gaussian(self.num_features, self.dim, generator)

    def advance(self):
        """One training call: redraws the projection when ``step`` is a
        positive multiple of the interval, then counts the call."""
        step = ops.convert_to_tensor(self.step)
        interval = int(self.redraw_interval)
        due = ops.logical_and(step > 0, ops.equal(step % interval, 0))
        fresh = self.draw(ops.maximum(step // interval, 1))
        current = ops.convert_to_tensor(self.features)
        self.features.assign(ops.where(due, fresh, current))
        self.step.assign(step + 1)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_features": self.num_features,
                "dim": self.dim,
                "seed": self.feature_seed,
                "redraw_interval": self.redraw_interval,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_longattn")
class PerformerAttention(BaseAttention):
    """Performer attention (FAVOR+): softmax attention estimated with
    positive orthogonal random features; linear in the sequence length.

    ``exp(q . k / sqrt(d))`` is replaced by ``phi(q) . phi(k)`` with
    ``phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m)``, ``x' = x / d**(1/4)`` and
    ``W`` an ``(m, d)`` matrix of random rows (``m = num_features``), drawn
    in exactly orthogonal blocks of ``d`` rows with Gaussian row norms; the
    estimate is unbiased and positive, and every query's weights are
    normalised by their sum as in :class:`LinearAttention`. One ``W`` is
    shared by the heads. Features are stabilised by subtracting a maximum
    before ``exp`` (per query; over all keys in bidirectional calls; a bound
    set by ``W`` for causal keys, so that no later key sets the scale of an
    earlier output): see :mod:`keras_longattn.ops.performer`.

    **Random features as state.** ``W`` and a count of training calls are
    non-trainable variables (a sub-layer, ``random_features``), saved in
    ``.keras`` files. ``feature_redraw_interval=None`` keeps ``W`` fixed;
    ``N`` redraws it before every ``N``-th training call (``training=True``;
    inference never changes it). Draws are seeded from ``seed`` (a random
    seed is chosen and recorded in the config when None).

    **Causal** calls use the chunked prefix sums of
    :func:`keras_longattn.ops.kernelized.causal_kernel_attention`, as
    :class:`LinearAttention`. Features, sums and the division are in
    float32 whatever the dtype policy.

    **Limit.** The estimate converges to softmax attention as ``m`` grows
    (error about ``1 / sqrt(m)``, slower for large ``|q + k|``);
    :meth:`full_attention_limit` names ``num_features=16384`` with a
    tolerance measured over seeds for small activations.

    Padding masks are honoured; a dense ``attention_mask`` only with
    ``implementation="reference"``; ``return_attention_scores=True`` returns
    the explicit weights of the reference path. No attention dropout.

    Implementations:
        ``"favor"``: the associative form, O(n * m * dv) time per head.
        ``"favor_fused"``: the same, the feature map and each mode one
        function with a written-out backward pass (PyTorch only; ``"auto"``
        prefers it there; refused on other backends).
        ``"reference"``: the explicit quadratic form: the ``(T, S)``
        weights ``phi(q_i) . phi(k_j)`` of the same features, masked and
        normalised per row.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        num_features: random features ``m`` (a positive integer). Defaults
            to 256.
        feature_redraw_interval: redraw ``W`` every this many training
            calls (a positive integer), or None (fixed). Defaults to None.
        chunk_size: positions per chunk of the causal prefix sums (a
            positive integer). Defaults to 64.
        epsilon: smallest normaliser, a finite number > 0. Defaults to
            1e-6.
        **kwargs: the arguments of :class:`BaseAttention`; ``seed`` (None
            or an integer in ``[0, 2**31)``, checked at construction) seeds
            the random features.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.PerformerAttention(
    ...     num_heads=2, key_dim=8, num_features=32, seed=0)
    >>> x = np.random.rand(2, 50, 16).astype("float32")
    >>> tuple(layer(x, x).shape)
    (2, 50, 16)
    >>> tuple(layer.random_features.features.shape)
    (32, 8)

    Reference:
        Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos, Hawkins,
        Davis, Mohiuddin, Kaiser, Belanger, Colwell and Weller, "Rethinking
        Attention with Performers", ICLR 2021.
    """

    is_exact = False
    reference_tolerance = 1e-4

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        num_features=DEFAULT_NUM_FEATURES,
        feature_redraw_interval=None,
        chunk_size=kernelized.DEFAULT_CHUNK_SIZE,
        epsilon=kernelized.DEFAULT_EPSILON,
        **kwargs,
    ):
        seed = _optional_seed("seed", kwargs.get("seed"), upper=SEED_BOUND)
        if seed is None:
            seed = int(np.random.randint(0, 2**30))
        kwargs["seed"] = seed
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.num_features = _positive_int("num_features", num_features)
        self.feature_redraw_interval = _positive_int(
            "feature_redraw_interval", feature_redraw_interval, allow_none=True
        )
        self.chunk_size = kernelized.check_chunk_size(chunk_size)
        self.epsilon = kernelized.check_epsilon(epsilon)
        kernelized.refuse_dropout(self)
        self.random_features = None

    def build_extra(self, query_shape, value_shape, key_shape):
        self.random_features = RandomFeatures(
            self.num_features,
            self.key_dim,
            seed=int(self.seed),
            redraw_interval=self.feature_redraw_interval,
            name="random_features",
        )
        self.random_features.build()

    def set_weights(self, weights):
        """Sets the weights; a list of the projections' weights alone (e.g.
        ``MultiHeadAttention.get_weights()``) sets them and keeps the random
        features and the step count."""
        weights = list(weights)
        own = self.weights
        if len(weights) == len(own) - 2:
            weights += [ops.convert_to_numpy(w) for w in own[len(weights):]]
        super().set_weights(weights)

    def projection(self, training=None):
        """The ``(m, key_dim)`` random rows for a call (redrawn first when
        a training call is due, see :class:`RandomFeatures`)."""
        if self.feature_redraw_interval is not None and is_training(training):
            self.random_features.advance()
        return ops.convert_to_tensor(self.random_features.features)

    def features(self, query, key, context, projection):
        """``(phi(Q), phi(K))``: float32 ``(B, T, H, m)`` and ``(B, S, H, m)``."""
        qf = performer_ops.softmax_kernel_features(
            query, projection, is_query=True, causal=context.causal
        )
        kf = performer_ops.softmax_kernel_features(
            key, projection, is_query=False, causal=context.causal,
            mask=context.padding.key_mask,
        )
        return qf, kf

    @implementation("favor", dropout=False)
    def _favor(self, query, key, value, context):
        """The associative form; chunked prefix sums when causal."""
        qf, kf = self.features(query, key, context, self.projection(context.training))
        return kernelized.associative_attention(
            qf, kf, value,
            causal=context.causal,
            key_mask=context.padding.key_mask,
            chunk_size=self.chunk_size,
            epsilon=self.epsilon,
        )

    @implementation("favor_fused", kind="fused", dropout=False)
    def _favor_fused(self, query, key, value, context):
        """``"favor"`` with the feature map and the associative form as
        functions with written-out backward passes (PyTorch), a few heads
        at a time (:func:`keras_longattn.ops.kernelized.head_slices`)."""
        fused = la_paths.fused_kernelized()
        projection = self.projection(context.training)
        outs = []
        for h0, h1 in kernelized.head_slices(query, key, self.num_features):
            # Head-major (B, h, n, m) features: no transposed copy of them.
            qf = fused.softmax_kernel_features(
                query[:, :, h0:h1], projection, is_query=True, causal=context.causal,
                head_major=True,
            )
            kf = fused.softmax_kernel_features(
                key[:, :, h0:h1], projection, is_query=False, causal=context.causal,
                mask=context.padding.key_mask, head_major=True,
            )
            outs.append(fused.associative_attention(
                qf, kf, value[:, :, h0:h1],
                causal=context.causal,
                key_mask=context.padding.key_mask,
                chunk_size=self.chunk_size,
                epsilon=self.epsilon,
                head_major=True,
            ))
        return outs[0] if len(outs) == 1 else ops.concatenate(outs, axis=2)

    @_favor_fused.refuses
    def _favor_fused(self, context):
        return la_paths.refusal("kernelized")

    def _attention_reference(self, query, key, value, context):
        """The explicit ``(T, S)`` weights of the same features under the
        call's mask (causal, padding, dense), normalised per row."""
        qf, kf = self.features(query, key, context, self.projection(context.training))
        mask = ops.expand_dims(self.reference_mask(context), 1)  # (B, 1, T, S)
        out, weights = kernelized.kernel_attention_reference(
            qf, kf, value, mask=mask, epsilon=self.epsilon, return_weights=True,
        )
        if context.return_scores:
            return out, ops.cast(weights, self.compute_dtype)
        return out

    # -------------------------------------------------------------- decoding
    cache_length_free = False
    cache_stacks_key_value = False

    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, num_heads, num_features, value_dim + 1)``: the
        recurrent state ``[sum_j phi(k_j) v_j^T | sum_j phi(k_j)]`` of each
        head (float32; causal features depend on their own token only)."""
        return (batch_size, self.num_heads, self.num_features, self.value_dim + 1)

    def init_cache(self, batch_size, max_length, dtype="float32"):
        """An empty state (float32: the sums overflow float16)."""
        return super().init_cache(batch_size, max_length, dtype=dtype)

    def _decode(self, query, key, value, cache, index, training):
        """The new tokens by the chunked prefix sums, from the state, with
        the causal features of the current random rows."""
        context = AttentionContext(padding=la_ops.PaddingMask(), causal=True)
        qf, kf = self.features(query, self.expand_key_value_heads(key), context,
                               self.projection(training))
        return kernelized.causal_kernel_attention(
            qf, kf, self.expand_key_value_heads(value), chunk_size=self.chunk_size,
            epsilon=self.epsilon, initial_state=cache, return_state=True)

    def full_attention_limit(self, sequence_length):
        """Many features: with ``num_features=16384`` the layer estimates
        softmax attention within a relative error of 3e-2 (max norm) for
        projected queries and keys of entries about 0.3 (measured over
        seeds: at most 1.5e-2). The estimator's relative variance per pair
        is about ``(exp(|q + k|^2 / sqrt(d)) - 1) / m``: for entries of
        about 1 it needs far more features (16384 give errors of 0.2 to 0.7
        at key_dim 8), so the tolerance is for that regime only."""
        return {"num_features": 16384, "feature_redraw_interval": None}, 3e-2

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_features": self.num_features,
                "feature_redraw_interval": self.feature_redraw_interval,
                "chunk_size": self.chunk_size,
                "epsilon": self.epsilon,
            }
        )
        return config
