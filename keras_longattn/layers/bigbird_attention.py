"""BigBird attention: window, global and random blocks (Zaheer et al. 2020)."""

import random

import keras

from keras_longattn import ops as la_ops
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import is_training
from keras_longattn.ops import bigbird as la_bigbird


@keras.saving.register_keras_serializable(package="keras_longattn")
class BigBirdAttention(BaseAttention):
    """BigBird attention: block-sparse window, global and random blocks.

    The sequence is cut into blocks of ``block_size`` positions ``b``.
    Query block ``i`` attends to the key blocks

    * window: ``i - w // 2 .. i + w // 2`` (``w = window_blocks``);
    * global: the first ``g = global_blocks`` blocks, whose queries also
      attend to every key;
    * random: ``r = random_blocks`` other blocks (neither window nor
      global), seeded.

    In causal mode (``use_causal_mask=True``) everything is ANDed with
    ``j <= i``: the window keeps the previous blocks and the diagonal block
    (masked inside it), random blocks are drawn among the blocks before the
    window only, and a global row is a causal full-attention row.

    Random blocks are fixed per layer: a deterministic function of ``seed``
    (a constructor argument, in the config), of the query block and of the
    number of blocks up to the last real key of the example. They are the same on every call
    and every backend, and an example gets the same blocks alone or padded
    in a batch. A query block with fewer candidates than ``r`` (short
    inputs) gets fewer random blocks: short inputs take the same path and
    the same pattern, never a silent full attention.

    Cost: the ``"blocked"`` path gathers the ``K = w + g + r`` key blocks of
    each query block (one row gather of whole blocks) and attends to them
    in one softmax, then computes the ``g * b`` global rows against every
    key: O(n * b * (w + g + r)) time and memory, never a ``(T, S)`` tensor.
    ``"blocked_fused"`` (preferred by ``"auto"`` on PyTorch; no attention
    dropout in training) gives the same layouts to
    ``keras.ops.dot_product_attention``. ``"pallas"`` (JAX only; preferred
    by ``"auto"`` on GPU/TPU, interpreted on the CPU; no attention dropout)
    gives the layer's block mask, global rows included, as the layout of
    one block-sparse flash-attention kernel. ``"flex"`` (PyTorch only, by
    name; no attention dropout, and on the CPU forward only) gives the same
    block mask to FlexAttention (``torch.nn.attention.flex_attention``):
    its tiles, and in the kernel the block mask AND ``CausalPattern`` when
    causal. ``"reference"`` is dense attention
    under the same pattern (:func:`keras_longattn.ops.bigbird.dense_mask`),
    O(n^2). The random blocks are computed inside the graph (a hash of
    ``(seed, query block, key block)``), so the efficient paths also run
    with lengths unknown while tracing (a TensorFlow model fed several
    sequence lengths).

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        block_size: ``b``, positions per block. Defaults to 64 (the
            paper's).
        window_blocks: ``w``, a positive odd number of window blocks
            centred on the query block. Defaults to 3 (the paper's).
        global_blocks: ``g``, the number of leading global blocks.
            Defaults to 2 (the paper's ITC setting).
        random_blocks: ``r``, random key blocks per query block. Defaults
            to 3 (the paper's).
        seed: non-negative int, the seed of the random blocks. Defaults to
            None: one is drawn from Python's ``random`` generator when the
            layer is made (as Keras draws its default seeds), so that after
            ``keras.utils.set_random_seed(s)`` a script builds the same
            random blocks on every run; the drawn value is stored as
            ``seed`` (the config and ``.keras`` files keep it).
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"blocked"``, ``"blocked_fused"``, ``"pallas"``,
            ``"flex"`` or ``"reference"``).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``use_causal_mask``,
        ``return_attention_scores`` (dense ``(B, H, T, S)``, from the
        reference path: O(n^2)), ``training``. A dense ``attention_mask``
        is only accepted with ``implementation="reference"``.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested). Queries that
        see no key get a zero attention output.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.BigBirdAttention(
    ...     num_heads=2, key_dim=8, block_size=4, window_blocks=3,
    ...     global_blocks=1, random_blocks=2, seed=0)
    >>> x = np.random.rand(2, 30, 16).astype("float32")
    >>> tuple(layer(x, x).shape)
    (2, 30, 16)
    >>> layer.last_implementation in ("blocked", "blocked_fused")  # torch: fused
    True

    Reference:
        Zaheer, Guruganesh, Dubey, Ainslie, Alberti, Ontanon, Pham,
        Ravula, Wang, Yang, Ahmed, "Big Bird: Transformers for Longer
        Sequences", NeurIPS 2020, arXiv:2007.14062.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        block_size=64,
        window_blocks=3,
        global_blocks=2,
        random_blocks=3,
        seed=None,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        if seed is None:
            # Seeded by keras.utils.set_random_seed (random.seed).
            seed = random.randrange(2**31)
        (self.block_size, self.window_blocks, self.global_blocks,
         self.random_blocks, self.seed) = la_bigbird.check_arguments(
            block_size, window_blocks, global_blocks, random_blocks, seed)

    # -------------------------------------------------------------- patterns
    def attention_pattern(self, query_length, key_length, causal):
        """The :class:`keras_longattn.ops.BigBirdPattern` of a call without
        padding (its random blocks depend on the lengths)."""
        return la_bigbird.BigBirdPattern(
            self.block_size, self.window_blocks, self.global_blocks,
            self.random_blocks, self.seed, causal, int(query_length), int(key_length),
        )

    def reference_mask(self, context):
        """Dense ``(B or 1, T, S)``: the pattern (random blocks per example,
        from its real length) AND key padding AND ``attention_mask``."""
        T, S = context.query_length, context.key_length
        key_mask = context.padding.key_mask
        mask = la_bigbird.dense_mask(
            T, S, self.block_size, self.window_blocks, self.global_blocks,
            self.random_blocks, self.seed, context.causal, key_mask=key_mask,
        )
        return la_ops.combine_dense_masks(
            mask, context.padding.dense_mask(T, S), context.attention_mask
        )

    # ---------------------------------------------------------- computation
    @implementation("blocked")
    def _blocked(self, query, key, value, context):
        """Gathered key blocks with explicit einsums and softmax, plus the
        global rows."""
        return self._attend_blocks(
            query, key, value, context, fused=False,
            # Outside training dropout is the identity: no dropout_fn, so
            # that JAX runs the compiled program.
            dropout_fn=(
                self._dropout_fn(context.training) if is_training(context.training) else None
            ),
        )

    @implementation("blocked_fused", kind="fused", dropout=False)
    def _blocked_fused(self, query, key, value, context):
        """The same layouts through ``keras.ops.dot_product_attention``."""
        return self._attend_blocks(query, key, value, context, fused=True)

    @implementation("pallas", kind="pallas", dropout=False)
    def _pallas(self, query, key, value, context):
        """The layer's block mask as the layout of the block-sparse Pallas
        kernel (JAX only), global rows included."""
        return la_ops.block_sparse.bigbird_attention(
            query, key, value, self.block_size, self.window_blocks,
            self.global_blocks, self.random_blocks, self.seed, context.causal,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_pallas.refuses
    def _pallas(self, context):
        return la_ops.paths.refusal("block_sparse")

    @implementation("flex", kind="flex", dropout=False)
    def _flex(self, query, key, value, context):
        """The layer's block mask (global rows included) in PyTorch's
        FlexAttention (torch only, by name)."""
        T, S = context.query_length, context.key_length
        b = self.block_size
        key_mask = context.padding.key_mask
        used = la_bigbird.used_key_blocks(key_mask, S, b)
        table = la_bigbird.block_mask(
            -(-T // b), -(-S // b), used, self.window_blocks, self.global_blocks,
            self.random_blocks, self.seed, context.causal)
        return la_ops.paths.flex_attention(
            "bigbird", query, key, value, table, b,
            causal_pattern=la_ops.CausalPattern() if context.causal else None,
            key_mask=key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_flex.refuses
    def _flex(self, context):
        return la_ops.paths.refusal("flex", self.compute_dtype, trainable=self.trainable)

    def _attend_blocks(self, query, key, value, context, fused, dropout_fn=None):
        return la_bigbird.bigbird_attention(
            query, key, value, self.block_size,
            window_blocks=self.window_blocks,
            global_blocks=self.global_blocks,
            random_blocks=self.random_blocks,
            seed=self.seed,
            causal=context.causal,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
            dropout_fn=dropout_fn,
            fused=fused,
        )

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, max_length, num_key_value_heads, key_dim)``: the
        keys and values of every position. A causal query block's random
        blocks are drawn among the earlier blocks from ``(seed, block)``
        alone, so a new token sees what the forward pass over any longer
        sequence lets it see: its window blocks, the global blocks and its
        random blocks (a token of a global block: every earlier key)."""
        return (batch_size, 2, max_length, self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        S = cache.shape[2]
        pattern = self.attention_pattern(S, S, True)
        return self._pattern_decode(query, key, value, cache, index, training,
                                    [pattern] * self.num_heads)

    def full_attention_limit(self, sequence_length):
        blocks = -(-int(sequence_length) // self.block_size)
        return {"window_blocks": 2 * blocks + 1, "global_blocks": 0,
                "random_blocks": 0}, 1e-5

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "block_size": self.block_size,
                "window_blocks": self.window_blocks,
                "global_blocks": self.global_blocks,
                "random_blocks": self.random_blocks,
                "seed": self.seed,
            }
        )
        return config
