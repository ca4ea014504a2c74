"""Factorized sparse attention of the Sparse Transformer (Child et al. 2019)."""


import keras
from keras import ops

from keras_longattn._validation import positive_int as _positive_int
from keras_longattn import ops as la_ops
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import CONTEXT_PARALLEL
from keras_longattn.layers.dispatch import context_parallel_axes
from keras_longattn.layers.dispatch import context_parallel_devices
from keras_longattn.layers.dispatch import context_parallel_refusal
from keras_longattn.layers.dispatch import implementation
from keras_longattn.ops import sparse as la_sparse


@keras.saving.register_keras_serializable(package="keras_longattn")
class SparseAttention(BaseAttention):
    """Strided or fixed factorized attention (Sparse Transformer).

    Each query attends through two patterns, A and B, chosen so that any
    earlier position is reachable in two steps. With ``l`` the block length
    (stride), ``c`` the summary width, query ``i`` and key ``j``:

    * ``pattern="strided"`` (suits data aligned with the stride, e.g.
      images): A attends the previous ``l`` positions
      ``{j : i - l < j <= i}`` (bidirectional: ``|i - j| < l``); B attends
      every ``l``-th position ``{j : (i - j) mod l == 0}``.
    * ``pattern="fixed"`` (suits text): A attends the own block
      ``{j : floor(j / l) == floor(i / l)}``; B attends the summary cells,
      the last ``c`` positions of every block, ``{j : j mod l in [l-c, l)}``.

    Causal calls (``use_causal_mask=True``) also require ``j <= i`` in both;
    bidirectional calls drop that condition. The patterns are the objects of
    :func:`keras_longattn.ops.sparse.sparse_head_patterns`; the ``"reference"``
    implementation is dense attention under them.

    ``combination`` says how the two patterns are used (the paper's three
    ways):

    * ``"multihead"``: the first ``ceil(H / 2)`` heads use A, the other
      ``floor(H / 2)`` use B, computed side by side and concatenated before
      the output projection (with ``num_heads=1`` this is ``"first"``);
    * ``"merged"``: every head attends to the union of A and B, with one
      softmax over it in which a key both patterns allow counts once;
    * ``"first"`` / ``"second"``: every head uses only A / only B. The
      paper's third way, one pattern per residual block interleaved, is two
      layers, ``combination="first"`` and ``combination="second"``, in
      alternating blocks.

    The ``"blocked"`` implementation is block-sparse, with ``keras.ops`` only
    and never a ``(T, S)`` tensor: A is attention inside blocks of ``l``
    (with the previous block, and the next one when bidirectional, for
    strided); strided B is attention within each column of the sequence
    seen as ``(n / l, l)``; fixed B is every query against the ``c * n / l``
    summary keys. The merged combination computes both parts with their
    log-sum-exp and combines them exactly. Cost, n = max(T, S): strided
    O(n * (l + n / l)), fixed O(n * (l + c * n / l)) time and memory, i.e.
    O(n * sqrt(n)) with the default ``l ~ sqrt(n)`` (and ``c <= 32``). The
    sequence is padded internally to a multiple of ``l`` and stripped after.

    Implementations:
        ``"blocked"``: the block-sparse computation above (static sequence
        lengths). ``"blocked_fused"``: the same layouts given to
        ``keras.ops.dot_product_attention`` (PyTorch's fused
        ``scaled_dot_product_attention``; preferred by ``"auto"`` on the
        torch backend, ``"blocked"`` elsewhere; not for ``"merged"`` or
        attention dropout in training). ``"band_kernel"``: ``"blocked_fused"``
        with the backend's kernels (PyTorch on the CPU, float32, equal
        lengths, ``value_dim == key_dim``; preferred by ``"auto"`` there;
        not ``"merged"``, nor ``"second"`` with the strided pattern): the
        strided window part on the band kernel, and with no padded key
        both parts of either pattern in one autograd function (fixed:
        lengths that are a multiple of ``l``, any length when causal). ``"pallas"`` (JAX only): every part
        in one block-sparse flash-attention Pallas kernel, tokens reordered
        so that a stride's column or the summary keys are contiguous (preferred
        by ``"auto"`` on GPU/TPU, interpreted on the CPU; no attention
        dropout; ``remat`` is moot, the kernel stores no weights).
        ``"flex"`` (PyTorch only, by name): every part in FlexAttention
        (``torch.nn.attention.flex_attention``), block masks and masks from
        the same patterns, tokens arranged as for ``"pallas"``; strided
        ``"merged"`` merges A and B by log-sum-exp (not on the CPU, whose
        FlexAttention returns none), fixed ``"merged"`` appends the summary
        keys to the keys (one softmax); no attention dropout, and on the
        CPU forward only.
        ``"context_parallel"`` (JAX, ``pattern="strided"``, under a
        :class:`keras_longattn.parallel.ContextParallel` distribution,
        where ``"auto"`` picks it first): the sequence split over the
        distribution's sequence axis, part A from the window's halo of the
        neighbouring devices, part B on whole columns dealt out to the
        devices by an all-to-all, merged by log-sum-exp
        (:func:`keras_longattn.parallel.halo_strided_attention`);
        self-attention, each device's share a multiple of ``l`` and ``l`` a
        multiple of the devices; no attention dropout in training.
        ``"reference"``: dense attention under each head's
        pattern, O(T * S); also used for ``return_attention_scores``.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        pattern: ``"strided"`` or ``"fixed"``. Defaults to ``"strided"``.
        block_length: ``l``, the stride (strided) or block length (fixed).
            Defaults to ``None``: fixed when the layer is built, from the
            sequence lengths it is built with (or at its first call when it
            is built without a known length),
            as the integer nearest to ``sqrt(max(T, S))`` (halves round up),
            at least 2 and, when ``summary_width`` is given, at least
            ``summary_width + 1``
            (:func:`keras_longattn.ops.sparse.default_block_length`);
            ``get_config`` reports the resolved value. Fixed at build so that
            an example's output never depends on how much padding its batch
            has. A
            block length longer than the sequence is allowed: the sequence
            is then one block (strided A becomes full attention, strided B
            the position itself), computed on ``l`` padded positions.
        summary_width: ``c``, summary cells per block, ``1 <= c < l``
            (``pattern="fixed"`` only). Defaults to ``None``:
            ``max(1, min(l // 8, 32))``, the paper's ratio
            (``c = 16`` for ``l = 128``, ``c = 32`` for ``l = 256``).
        combination: ``"multihead"``, ``"merged"``, ``"first"`` or
            ``"second"`` (see above). Defaults to ``"multihead"``.
        remat: recompute the attention in the backward pass instead of
            storing its weights (gradient checkpointing, ``keras.remat``),
            trading compute for memory. Cannot be combined with attention
            ``dropout`` (the recomputation would draw a different dropout
            mask). Defaults to False.
        **kwargs: the other arguments of
            :class:`keras_longattn.layers.BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"blocked"``, ``"blocked_fused"``, ``"band_kernel"``,
            ``"pallas"``, ``"flex"``, ``"context_parallel"`` or ``"reference"``).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``: ``query`` ``(B, T, dim)``,
        ``value`` ``(B, S, dim)``, ``key``, ``query_mask`` ``(B, T)``,
        ``value_mask``/``key_mask`` ``(B, S)``, ``use_causal_mask``,
        ``return_attention_scores`` (dense ``(B, H, T, S)`` per head, from
        the reference path: O(n^2)), ``training``. A dense
        ``attention_mask`` is only accepted with
        ``implementation="reference"``. Positions are absolute, so ``T``
        and ``S`` may differ.

    Returns:
        ``(B, T, output_dim)`` (and the weights if requested). Queries that
        see no key get a zero attention output.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.SparseAttention(
    ...     num_heads=2, key_dim=8, pattern="fixed", block_length=4,
    ...     summary_width=1)
    >>> x = np.random.rand(1, 10, 16).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (1, 10, 16)
    >>> layer.last_implementation in ("blocked", "band_kernel")  # torch (CPU): band_kernel
    True

    Reference:
        Child, Gray, Radford, Sutskever, "Generating Long Sequences with
        Sparse Transformers", arXiv:1904.10509, 2019.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        pattern="strided",
        block_length=None,
        summary_width=None,
        combination="multihead",
        remat=False,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        la_sparse.check_sparse_pattern(pattern)
        la_sparse.check_sparse_combination(combination)
        block_length = _positive_int("block_length", block_length, allow_none=True)
        summary_width = _positive_int("summary_width", summary_width, allow_none=True)
        if summary_width is not None and pattern != "fixed":
            raise ValueError(
                "`summary_width` only applies to pattern='fixed'. "
                f"Received: pattern={pattern!r}, summary_width={summary_width!r}"
            )
        if pattern == "fixed" and block_length is not None:
            c = (
                la_sparse.default_summary_width(block_length)
                if summary_width is None
                else summary_width
            )
            if c >= block_length:
                given = "" if summary_width is not None else " (the default)"
                raise ValueError(
                    "`summary_width` must be smaller than `block_length` (the "
                    "summary cells are the last `summary_width` cells of each "
                    f"block; pattern='fixed' needs block_length >= 2). Received: "
                    f"summary_width={c}{given}, block_length={block_length}"
                )
        if not isinstance(remat, bool):
            raise ValueError(f"`remat` must be a bool. Received: remat={remat!r}")
        if remat and self.dropout > 0.0:
            raise ValueError(
                "`remat=True` cannot be combined with attention `dropout`: the "
                "recomputation in the backward pass would draw another dropout "
                f"mask. Received: remat=True, dropout={self.dropout}"
            )
        self.pattern = pattern
        self.block_length = block_length
        self.summary_width = summary_width
        self.combination = combination
        self.remat = remat

    # ------------------------------------------------------------- patterns
    def build_extra(self, query_shape, value_shape, key_shape):
        if self.block_length is None and None not in (query_shape[1], key_shape[1]):
            self.block_length = la_sparse.default_block_length(
                max(int(query_shape[1]), int(key_shape[1])), self.summary_width
            )

    def resolve_block_length(self, length):
        """``l`` of a call whose longer sequence has ``length`` positions: the
        block length, which a layer built without a known length fixes at
        its first call."""
        if self.block_length is not None:
            return self.block_length
        if not isinstance(length, int):
            raise ValueError(
                "SparseAttention fixes its default `block_length` (about the "
                "square root of the sequence length) from the first known "
                "sequence length, and this call's length is unknown (traced "
                "with a variable length). Pass block_length=... . Received: "
                "block_length=None"
            )
        if not self.built:
            return la_sparse.default_block_length(length, self.summary_width)
        self.block_length = la_sparse.default_block_length(length, self.summary_width)
        return self.block_length

    def resolve_summary_width(self, block_length):
        """``c`` of a call with block length ``block_length`` (None for
        strided)."""
        if self.pattern != "fixed":
            return None
        if self.summary_width is not None:
            return self.summary_width
        return la_sparse.default_summary_width(block_length)

    def head_patterns(self, query_length, key_length, causal):
        """The pattern of each head of a call, a tuple of ``num_heads``
        ``ops.AttentionPattern`` objects."""
        l = self.resolve_block_length(la_ops.shapes.larger(query_length, key_length))
        return la_sparse.sparse_head_patterns(
            self.pattern,
            l,
            self.resolve_summary_width(l),
            self.combination,
            self.num_heads,
            causal,
        )

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        if self.block_length is None:
            return ("SparseAttention decodes with a fixed block length only (its default "
                    "is fixed from the first sequence length the layer sees, and this "
                    "layer has seen none): set `block_length` or call the layer once")
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, max_length, num_key_value_heads, key_dim)``: the
        keys and values of every position (a new token reads its window
        and its strided columns or summary positions among them)."""
        reason = self.decode_refusal()
        if reason is not None:
            raise ValueError(reason)
        return (batch_size, 2, max_length, self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        l = self.block_length
        patterns = self.head_patterns(l, l, True)
        return self._pattern_decode(query, key, value, cache, index, training, patterns)

    def attention_pattern(self, query_length, key_length, causal):
        """The keys any head sees: for ``"multihead"`` the union of A and B
        (each head sees one of them, see :meth:`head_patterns`)."""
        patterns = self.head_patterns(query_length, key_length, causal)
        distinct = []
        for p in patterns:
            if p not in distinct:
                distinct.append(p)
        return distinct[0] if len(distinct) == 1 else la_ops.Union(*distinct)

    def reference_mask(self, context):
        T, S = context.query_length, context.key_length
        patterns = self.head_patterns(T, S, context.causal)
        if all(p == patterns[0] for p in patterns):
            return super().reference_mask(context)
        masks = {}
        for p in patterns:
            if p not in masks:
                masks[p] = p.dense_mask(T, S)
        mask = ops.stack([masks[p] for p in patterns])[None]  # (1, H, T, S)
        padding = context.padding.dense_mask(T, S)  # (B, 1, S) or None
        if padding is not None:
            padding = ops.expand_dims(padding, 1)  # (B, 1, 1, S)
        dense = context.attention_mask
        if dense is not None:
            dense = ops.expand_dims(ops.cast(dense, "bool"), 1)  # (B, 1, T, S)
        return la_ops.combine_dense_masks(mask, padding, dense)

    # ---------------------------------------------------------- computation
    @implementation("blocked")
    def _blocked(self, query, key, value, context):
        """The block-sparse layouts with explicit einsums and softmax."""
        return self._block_sparse(query, key, value, context, fused=False)

    @implementation("band_kernel", kind="fused", dropout=False)
    def _band_kernel(self, query, key, value, context):
        """``"blocked_fused"`` with the backend's kernels (PyTorch on the
        CPU): strided part A (a sliding window) on the band-attention
        kernel (``keras_longattn/kernels/torch/band.py``); when the length
        is a multiple of ``l`` (fixed and causal: any length) and nothing is
        padded, both parts of either pattern in one autograd function on
        views of the inputs (``kernels/torch/strided.py``,
        ``kernels/torch/fixed.py``); otherwise the fused layouts of
        ``"blocked_fused"`` for fixed, which ``last_implementation`` reports
        as ``"band_kernel:blocked_fused"``."""
        T = context.query_length
        l = self.resolve_block_length(la_ops.shapes.larger(T, context.key_length))
        heads = self.num_heads
        heads_a = {"multihead": la_sparse.multihead_split(heads), "first": heads,
                   "second": 0}[self.combination]
        plan = self._band_kernel_plan(context)
        if plan == "fixed":
            # Both parts in one kernel call each. Causal calls of another
            # length run padded to a multiple of l: keys appended after the
            # last query are seen by no real query; the extra rows are dropped.
            N = -(-T // l) * l
            if N != T:
                query, key, value = (la_ops.blocked.pad_axis(t, 1, N)
                                     for t in (query, key, value))
            out = la_ops.paths.fixed_attention(
                query, key, value, l, self.resolve_summary_width(l), context.causal,
                heads_a, self._inverse_sqrt_key_dim,
            )
            return out[:, :T] if N != T else out
        if plan == "strided":
            # Both parts in one kernel call each, on views of the inputs.
            return la_ops.paths.strided_attention(
                query, key, value, l, context.causal, heads_a,
                self._inverse_sqrt_key_dim,
            )
        return self._block_sparse(query, key, value, context, fused=True, band_kernel=True)

    @_band_kernel.refuses
    def _band_kernel(self, context):
        if self.combination == "merged":
            return "combination='merged' needs each part's log-sum-exp"
        if self.pattern == "strided" and self.combination == "second":
            return "combination='second' has no window part"
        return la_ops.paths.refusal(
            "band_kernel", self.compute_dtype, context.query_length, context.key_length,
            self.key_dim, self.value_dim,
        )

    @_band_kernel.reports
    def _band_kernel(self, context):
        # "band_kernel:blocked_fused" where the fixed pattern ran the layouts
        # of "blocked_fused" (no band kernel at all); "band_kernel:flash"
        # where the compiled kernel did not run.
        if self._band_kernel_plan(context) == "blocked_fused":
            return "blocked_fused"
        return la_ops.paths.variant("band_kernel")

    def _band_kernel_plan(self, context):
        """What ``"band_kernel"`` runs for ``context``: ``"fixed"`` or
        ``"strided"`` (both parts in the pattern's kernel), ``"window"``
        (strided part A on the band kernel, part B in the fused layouts) or
        ``"blocked_fused"`` (fixed with padded keys, a length known only
        while running, or a bidirectional length not a multiple of ``l``:
        the layouts of ``"blocked_fused"``)."""
        T = context.query_length
        l = self.resolve_block_length(la_ops.shapes.larger(T, context.key_length))
        unpadded = context.padding.key_mask is None and isinstance(T, int)
        if self.pattern == "fixed" and unpadded and (context.causal or T % l == 0):
            return "fixed"
        if unpadded and T % l == 0:
            return "strided"
        return "window" if self.pattern == "strided" else "blocked_fused"

    @implementation("blocked_fused", kind="fused", dropout=False)
    def _blocked_fused(self, query, key, value, context):
        """The same layouts through ``keras.ops.dot_product_attention``."""
        return self._block_sparse(query, key, value, context, fused=True)

    @_blocked_fused.refuses
    def _blocked_fused(self, context):
        if self.combination == "merged":
            return "combination='merged' needs each part's log-sum-exp"
        return None

    @implementation("pallas", kind="pallas", dropout=False)
    def _pallas(self, query, key, value, context):
        """Every part in the block-sparse Pallas kernel (JAX only)."""
        T, S = context.query_length, context.key_length
        l = self.resolve_block_length(la_ops.shapes.larger(T, S))
        return la_ops.block_sparse.sparse_attention(
            query, key, value, self.pattern, l, self.resolve_summary_width(l),
            self.combination, context.causal,
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_pallas.refuses
    def _pallas(self, context):
        return la_ops.paths.refusal("block_sparse")

    @implementation("flex", kind="flex", dropout=False)
    def _flex(self, query, key, value, context):
        """Every part in PyTorch's FlexAttention (torch only, by name)."""
        T, S = context.query_length, context.key_length
        l = self.resolve_block_length(la_ops.shapes.larger(T, S))
        c = self.resolve_summary_width(l)
        first, second = la_sparse.sparse_transformer_patterns(
            self.pattern, l, c, context.causal)
        return la_ops.paths.flex_attention(
            "sparse", query, key, value, self.pattern, l, c, self.combination, first, second,
            second_only=la_ops.Difference(second, first),
            first_heads=la_sparse.multihead_split(self.num_heads),
            key_mask=context.padding.key_mask,
            scale=self._inverse_sqrt_key_dim,
        )

    @_flex.refuses
    def _flex(self, context):
        # Strided "merged" merges its parts by log-sum-exp.
        return la_ops.paths.refusal(
            "flex", self.compute_dtype, trainable=self.trainable,
            needs_lse=self.pattern == "strided" and self.combination == "merged",
        )

    @implementation("context_parallel", kind=CONTEXT_PARALLEL, dropout=False)
    def _context_parallel(self, query, key, value, context):
        """The strided pattern with the sequence split over the devices of
        the :class:`~keras_longattn.parallel.ContextParallel` in scope."""
        from keras_longattn.parallel.context import halo_strided_attention

        T, S = context.query_length, context.key_length
        axes = context_parallel_axes(query.shape[0])

        def attend(q, k, v):
            return halo_strided_attention(
                q, k, v, stride=self.resolve_block_length(la_ops.shapes.larger(T, S)),
                combination=self.combination, causal=context.causal,
                key_mask=context.padding.key_mask, scale=self._inverse_sqrt_key_dim,
                **axes,
            )

        if self.remat:
            attend = keras.remat(attend)
        return attend(query, key, value)

    @_context_parallel.refuses
    def _context_parallel(self, context):
        if self.pattern != "strided":
            return (f"pattern={self.pattern!r} has no context-parallel path (only "
                    "'strided')")
        reason = context_parallel_refusal(context)
        if reason is not None:
            return reason
        devices = context_parallel_devices()
        shard = context.query_length // devices
        l = self.resolve_block_length(context.query_length)
        if shard % l:
            return (f"each device's {shard} positions are not a multiple of the stride "
                    f"block_length={l}")
        if l % devices:
            return (f"block_length={l} is not a multiple of the {devices} devices of the "
                    "sequence axis (each device takes whole columns)")
        return None

    def _block_sparse(self, query, key, value, context, fused, band_kernel=False):
        T, S = context.query_length, context.key_length
        l = self.resolve_block_length(la_ops.shapes.larger(T, S))
        c = self.resolve_summary_width(l)
        key_mask = context.padding.key_mask
        dropout_fn = self._dropout_fn(context.training)
        scale = self._inverse_sqrt_key_dim

        def attend(q, k, v):
            return la_sparse.sparse_attention(
                q,
                k,
                v,
                pattern=self.pattern,
                block_length=l,
                summary_width=c,
                combination=self.combination,
                causal=context.causal,
                key_mask=key_mask,
                scale=scale,
                dropout_fn=None if fused else dropout_fn,
                fused=fused,
                band_kernel=band_kernel,
            )

        if self.remat:
            attend = keras.remat(attend)
        return attend(query, key, value)

    def full_attention_limit(self, sequence_length):
        # Strided A with a stride at least the length sees every key.
        n = max(int(sequence_length), 2)
        return {
            "pattern": "strided",
            "block_length": n,
            "summary_width": None,
            "combination": "first",
        }, 1e-5

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "pattern": self.pattern,
                "block_length": self.block_length,
                "summary_width": self.summary_width,
                "combination": self.combination,
                "remat": self.remat,
            }
        )
        return config
