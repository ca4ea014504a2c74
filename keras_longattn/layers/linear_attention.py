"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"):
a positive feature map in place of the softmax, linear in the length."""

import keras
from keras import ops

from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.ops import kernelized
from keras_longattn.ops import paths as la_paths


@keras.saving.register_keras_serializable(package="keras_longattn")
class LinearAttention(BaseAttention):
    """Linear attention: ``phi(q) . phi(k)`` with a positive feature map in
    place of ``exp(q . k / sqrt(d))``; linear in the sequence length.

    Each head computes ``out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) /
    (phi(q_i)^T sum_j phi(k_j))``, the sums over the keys query ``i`` may
    see, with ``phi(x) = elu(x) + 1`` (the paper) or ``relu(x)``. The
    associative form never builds the ``(T, S)`` weights.

    **Causal** calls keep running sums by chunks of ``chunk_size``
    positions (the paper's RNN view, computed in parallel): inside a chunk
    the ``(C, C)`` weights are explicit, earlier chunks arrive through a
    prefix sum of the chunks' ``(d, dv)`` summaries. Memory
    O(n * (C + d * dv / C)) per head, never one ``(d, dv)`` state per
    position.

    **Precision.** Features, sums and the division are computed in float32
    whatever the dtype policy (a sum of thousands of products overflows
    float16), and the output is cast back to the compute dtype.

    **Zero features.** ReLU features of a query with no positive coordinate
    are all zero, and so is its normaliser. The layer divides by
    ``max(normaliser, epsilon)``: such a query gets a zero attention output
    with finite gradients (likewise a query that sees no real key).

    **No exact limit.** No feature map of this family gives softmax
    attention, so :meth:`full_attention_limit` is None; the ``"reference"``
    path, the explicit ``(T, S)`` weights ``phi(q_i) . phi(k_j)`` normalised
    per row, is the specification the fast path is checked against.

    Padding masks are honoured (padded keys enter no sum); a dense
    ``attention_mask`` only with ``implementation="reference"``.
    ``return_attention_scores=True`` returns the explicit weights (from the
    reference path). No attention dropout (there are no weights to drop).

    Implementations:
        ``"kernel"``: the associative form (chunked prefix sums when
        causal): O(n * d * dv) time per head.
        ``"kernel_fused"``: the same, one function per mode with a
        written-out backward pass (PyTorch only: fewer passes over memory;
        ``"auto"`` prefers it there; refused on other backends).
        ``"reference"``: the explicit quadratic form, O(T * S).

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key (the feature count).
        value_dim: size of each head for value. Defaults to ``key_dim``.
        feature_map: ``"elu+1"`` (the paper) or ``"relu"``.
        chunk_size: positions per chunk of the causal prefix sums (a
            positive integer). Defaults to 64.
        epsilon: smallest normaliser, a finite number > 0. Defaults to
            1e-6.
        **kwargs: the arguments of :class:`BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, ``implementation``).

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.LinearAttention(num_heads=2, key_dim=8)
    >>> x = np.random.rand(2, 50, 16).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (2, 50, 16)
    >>> layer.last_implementation in ("kernel", "kernel_fused")  # fused on PyTorch
    True

    Reference:
        Katharopoulos, Vyas, Pappas and Fleuret, "Transformers are RNNs:
        Fast Autoregressive Transformers with Linear Attention", ICML 2020.
    """

    is_exact = False
    reference_tolerance = 1e-5

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        feature_map="elu+1",
        chunk_size=kernelized.DEFAULT_CHUNK_SIZE,
        epsilon=kernelized.DEFAULT_EPSILON,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.feature_map = kernelized.check_feature_map(feature_map)
        self.chunk_size = kernelized.check_chunk_size(chunk_size)
        self.epsilon = kernelized.check_epsilon(epsilon)
        kernelized.refuse_dropout(self)

    def features(self, x):
        """``phi(x)`` in float32: ``(B, n, H, d)``."""
        return kernelized.feature_map(ops.cast(x, "float32"), self.feature_map)

    @implementation("kernel", dropout=False)
    def _kernel(self, query, key, value, context):
        """The associative form; chunked prefix sums when causal."""
        qf, kf = self.features(query), self.features(key)
        return kernelized.associative_attention(
            qf, kf, value,
            causal=context.causal,
            key_mask=context.padding.key_mask,
            chunk_size=self.chunk_size,
            epsilon=self.epsilon,
        )

    @implementation("kernel_fused", kind="fused", dropout=False)
    def _kernel_fused(self, query, key, value, context):
        """The associative form as one function per mode with a written-out
        backward pass (PyTorch; the same numbers as ``"kernel"``), a few
        heads at a time (:func:`keras_longattn.ops.kernelized.head_slices`)."""
        outs = []
        for h0, h1 in kernelized.head_slices(query, key, query.shape[3]):
            q, k = query[:, :, h0:h1], key[:, :, h0:h1]
            outs.append(la_paths.fused_kernelized().associative_attention(
                self.features(q), self.features(k), value[:, :, h0:h1],
                causal=context.causal,
                key_mask=context.padding.key_mask,
                chunk_size=self.chunk_size,
                epsilon=self.epsilon,
            ))
        return outs[0] if len(outs) == 1 else ops.concatenate(outs, axis=2)

    @_kernel_fused.refuses
    def _kernel_fused(self, context):
        return la_paths.refusal("kernelized")

    def _attention_reference(self, query, key, value, context):
        """The explicit ``(T, S)`` weights ``phi(q_i) . phi(k_j)`` under the
        call's mask (causal, padding, dense), each row divided by its
        (safe) sum, applied to the values."""
        mask = ops.expand_dims(self.reference_mask(context), 1)  # (B, 1, T, S)
        out, weights = kernelized.kernel_attention_reference(
            self.features(query), self.features(key), value,
            mask=mask, epsilon=self.epsilon, return_weights=True,
        )
        if context.return_scores:
            return out, ops.cast(weights, self.compute_dtype)
        return out

    def full_attention_limit(self, sequence_length):
        """None: no feature map of this family gives softmax attention."""
        return None

    # -------------------------------------------------------------- decoding
    cache_length_free = False
    cache_stacks_key_value = False

    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, num_heads, key_dim, value_dim + 1)``: the recurrent
        state ``[sum_j phi(k_j) v_j^T | sum_j phi(k_j)]`` of each head
        (float32), the same size whatever ``max_length``."""
        return (batch_size, self.num_heads, self.key_dim, self.value_dim + 1)

    def init_cache(self, batch_size, max_length, dtype="float32"):
        """An empty state (float32: the sums overflow float16)."""
        return super().init_cache(batch_size, max_length, dtype=dtype)

    def _decode(self, query, key, value, cache, index, training):
        """The new tokens by the chunked prefix sums, starting from the
        state: O(T * (C + d * dv)) work, O(1) memory in the context."""
        return kernelized.causal_kernel_attention(
            self.features(query), self.features(self.expand_key_value_heads(key)),
            self.expand_key_value_heads(value), chunk_size=self.chunk_size,
            epsilon=self.epsilon, initial_state=cache, return_state=True)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "feature_map": self.feature_map,
                "chunk_size": self.chunk_size,
                "epsilon": self.epsilon,
            }
        )
        return config
