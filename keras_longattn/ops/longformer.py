"""What is specific to Longformer (Beltagy et al. 2020): its window
convention, per-head dilations, the static slots of the global tokens of a
call, and the whole efficient computation in O(n * (w + g)).

Longformer's attention is the union of three patterns:

* a sliding window of ``w`` keys: ``w / 2`` on each side, or the ``w``
  previous positions in causal mode (plus the query's own position);
* the same window dilated by ``r`` per head (:class:`DilatedPattern`):
  keys ``i + r * t``, same number of keys, ``r`` times the reach;
* global positions (:class:`GlobalPattern`): a global query attends to
  every key and every query attends to the global keys. Global rows use
  their own query/key/value projections (computed by the layer and passed
  in as ``global_query``, ``global_key``, ``global_value``).

Causal calls AND everything with ``j <= i``: a global key is seen only by
the queries at or after it, a global query sees only the keys up to itself.

Global tokens are per-call data (a boolean mask), so their number varies by
example, while array shapes must be static. A call therefore has ``G``
*slots* (:func:`global_slots`): the first ``G`` global positions of each
example in ascending order, with a validity flag per slot. The rows of the
slots are gathered and written back by index (:func:`gather_slots`,
:func:`scatter_slots`), never by a product with a one-hot ``(B, G, n)``
matrix: a slot reads its own position only, so a non-finite value at any
other position (e.g. a padded query, whose output is not used) cannot
reach a global row (``0 * inf`` is NaN).

The computation (:func:`longformer_attention`):

1. band part: every query against its (dilated) window, global keys left
   out, one layout per distinct dilation (:func:`dilated_band_attention`):
   O(n * w);
2. key-subset part: every query against the ``G`` global keys
   (:func:`key_subset_attention`): O(n * G);
3. the two parts merged into one softmax by their log-sum-exps
   (:func:`merge_attention_parts`);
4. global rows: the ``G`` global queries against every key, with the global
   projections, written over the merged rows: O(n * G).

Shape legend: B batch, T query length, S key length, H heads, d key/query
head size, dv value head size, G global slots.
"""

import collections
import numbers

import numpy as np
from keras import ops

from keras_longattn.kernels import compiled
from keras_longattn.ops.blocked import dilated_band_attention
from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.patterns import CausalPattern
from keras_longattn.ops.patterns import DilatedPattern
from keras_longattn.ops.patterns import FullPattern
from keras_longattn.ops.patterns import GlobalPattern
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.reference import merge_attention_parts
from keras_longattn.ops.reference import reference_attention
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length
from keras_longattn.ops.blocked import pad_axis
from keras_longattn.ops.segments import take_rows
from keras_longattn.ops.subset import key_subset_attention

#: The global slots of a call: ``positions`` int32 ``(B or 1, G)``
#: (ascending among valid slots), ``query_valid`` / ``key_valid`` boolean
#: ``(B or 1, G)`` (whether the slot is a real global query / key position).
GlobalSlots = collections.namedtuple(
    "GlobalSlots", ["positions", "query_valid", "key_valid"]
)


# ------------------------------------------------------------- arguments
def check_window(window):
    """``window`` as a positive even int (``w / 2`` keys on each side), or
    a ValueError naming it."""
    if (
        isinstance(window, bool)
        or not isinstance(window, numbers.Integral)
        or window < 2
        or window % 2
    ):
        raise ValueError(
            "`window` must be a positive even integer (w / 2 keys on each "
            f"side of the query). Received: window={window!r}"
        )
    return int(window)


def check_dilation(dilation, num_heads):
    """The dilation of each head, a tuple of ``num_heads`` ints >= 1, from
    one int or a sequence of ``num_heads`` ints; a ValueError naming
    ``dilation`` otherwise."""
    message = (
        "`dilation` must be a positive integer or a list of "
        f"num_heads={num_heads} positive integers. Received: dilation={dilation!r}"
    )

    def one(r):
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1:
            raise ValueError(message)
        return int(r)

    if isinstance(dilation, (str, bytes)):
        raise ValueError(message)
    if isinstance(dilation, numbers.Integral) and not isinstance(dilation, bool):
        return (one(dilation),) * num_heads
    try:
        values = tuple(dilation)
    except TypeError:
        raise ValueError(message) from None
    if len(values) != num_heads:
        raise ValueError(message)
    return tuple(one(r) for r in values)


def window_extents(window, causal):
    """``(look_back, look_ahead)`` of a window of ``w`` keys: ``(w, 0)``
    causal, ``(w / 2, w / 2)`` otherwise (each plus the query's own
    position)."""
    window = check_window(window)
    return (window, 0) if causal else (window // 2, window // 2)


def fused_block_size(window):
    """Block size of the fused path when none is given: the window side
    ``w / 2`` rounded up to a multiple of 8 (at least 8). Fewer, larger
    kernel calls than the explicit path's half side: at ``w = 512`` this
    was about 10-25% faster forward and backward on PyTorch's CPU kernel,
    for 768 keys read per query instead of 640."""
    side = check_window(window) // 2
    return max(8, -(-side // 8) * 8)


def longformer_head_patterns(window, dilations, causal, global_positions=()):
    """The pattern of each head: the (dilated) window, OR the global
    positions (a :class:`GlobalPattern` when any), AND ``j <= i`` when
    causal. A tuple of ``len(dilations)`` patterns."""
    look_back, look_ahead = window_extents(window, causal)
    patterns = []
    for r in dilations:
        p = DilatedPattern(look_back, look_ahead, r)
        if global_positions:
            p = p | GlobalPattern(global_positions)
            if causal:
                p = p & CausalPattern()
        patterns.append(p)
    return tuple(patterns)


# ----------------------------------------------------------- global slots
@compiled(("query_length", "key_length", "global_tokens", "max_global"))
def global_slots(query_length, key_length, global_mask=None, global_tokens=0,
                 max_global=None):
    """The ``G`` static global slots of a call (see the module docstring).

    Args:
        query_length: T.
        key_length: S.
        global_mask: optional boolean ``(B, n)`` of global positions
            (self-attention, ``n = T = S``). Only the first ``max_global``
            global positions of each example get a slot; the others stay
            ordinary (local) positions.
        global_tokens: without a mask, the first ``global_tokens`` positions
            are global.
        max_global: ``G`` with a mask (capped at ``n`` when static).

    Returns:
        A :class:`GlobalSlots`, or None when the call has no global slot.
    """
    if global_mask is not None:
        n = length(global_mask, 1)
        G = int(max_global) if not is_static(n) else min(int(max_global), n)
        mask = ops.cast(global_mask, "bool")
        mask = pad_axis(mask, 1, larger(n, G), value=False)
        size = length(mask, 1)
        # Earlier positions score higher; non-global positions score 0.
        score = ops.cast(size - ops.arange(size, dtype="int32"), "float32")
        score = ops.where(mask, score[None, :], 0.0)
        values, positions = ops.top_k(score, G, sorted=True)
        valid = values > 0
        positions = ops.where(valid, ops.cast(positions, "int32"), 0)
        return GlobalSlots(positions, valid, valid)
    k = int(global_tokens)
    if k == 0:
        return None
    positions = ops.convert_to_tensor(np.arange(k, dtype="int32")[None])  # (1, G)
    return GlobalSlots(positions, positions < query_length, positions < key_length)


def slot_matrix(positions, valid, length_, dtype="bool"):
    """One-hot ``(B or 1, G, n)``: slot ``g`` at its position, where valid."""
    pos = ops.arange(length_, dtype="int32")
    hot = ops.logical_and(
        ops.equal(positions[:, :, None], pos[None, None, :]), valid[:, :, None]
    )
    return hot if dtype == "bool" else ops.cast(hot, dtype)


def gather_slots(x, positions, valid):
    """The rows of the slots: ``(B, G, ...)``, row ``positions[b, g]`` of
    ``x`` ``(B, n, ...)`` where ``valid[b, g]``, zeros elsewhere.

    An indexed gather (one row gather of the flattened positions): each
    slot reads its own position only, so a NaN or inf at any other
    position never reaches it. ``positions`` (int) and ``valid`` (bool)
    are ``(B or 1, G)``; invalid slots may hold any position (they read
    position 0). ``G`` may be unknown while tracing.
    """
    batch, n = ops.shape(x)[0], length(x, 1)
    tail = tuple(int(s) for s in x.shape[2:])
    G = length(positions, 1)
    valid = ops.broadcast_to(ops.cast(valid, "bool"), (batch, G))
    positions = ops.where(valid, ops.cast(positions, "int32"), 0)
    rows = ops.arange(batch, dtype="int32")[:, None] * n + positions  # (B, G)
    width = int(np.prod(tail, dtype="int64"))
    out = take_rows(ops.reshape(x, (-1, width)), ops.reshape(rows, (-1,)))
    out = ops.reshape(out, (-1, G) + tail)
    keep = ops.reshape(valid, (-1, G) + (1,) * len(tail))
    return ops.where(keep, out, ops.zeros_like(out))


def scatter_slots(rows, positions, valid, out):
    """``out`` ``(B, n, ...)`` with row ``positions[b, g]`` replaced by
    ``rows[b, g]`` ``(B, G, ...)`` for every valid slot (valid slots hold
    distinct positions).

    Each position takes its slot's row by an indexed gather and a select,
    never a product with a one-hot matrix: a NaN or inf in one slot's row
    (or in ``out``) stays at its own position.
    """
    hot = slot_matrix(positions, valid, length(out, 1))  # (B or 1, G, n)
    is_slot = ops.any(hot, axis=1)  # (B or 1, n)
    slot = ops.cast(ops.argmax(ops.cast(hot, "int32"), axis=1), "int32")
    taken = gather_slots(ops.cast(rows, out.dtype), slot, is_slot)  # (B, n, ...)
    for _ in range(len(out.shape) - 2):
        is_slot = ops.expand_dims(is_slot, -1)
    return ops.where(is_slot, taken, out)


def global_flags(slots, query_length, key_length):
    """Boolean ``(B or 1, T)`` global queries and ``(B or 1, S)`` global
    keys of a call's slots (all False without slots)."""
    if slots is None:
        return None, None
    q = ops.any(slot_matrix(slots.positions, slots.query_valid, query_length), axis=1)
    k = ops.any(slot_matrix(slots.positions, slots.key_valid, key_length), axis=1)
    return q, k


# ------------------------------------------------------------ computation
@compiled(("window", "dilation", "causal", "scale", "block_size", "dropout_fn", "fused"))
def longformer_attention(
    query,
    key,
    value,
    window,
    dilation=1,
    causal=False,
    slots=None,
    global_query=None,
    global_key=None,
    global_value=None,
    global_projections=None,
    key_mask=None,
    scale=None,
    block_size=None,
    dropout_fn=None,
    fused=False,
    band_kernel=None,
):
    """Longformer attention in O(n * (w + G)) time and memory.

    Equal to dense attention under :func:`longformer_head_patterns` with the
    call's global positions, the global rows computed with the global
    projections (the specification, checked by the tests). No tensor of
    size ``T * S`` is built.

    Args:
        query: ``(B, T, H, d)``, local query projections.
        key: ``(B, S, H, d)``, local key projections.
        value: ``(B, S, H, dv)``, local value projections.
        window: ``w``, even (see :func:`window_extents`).
        dilation: one int or one per head.
        causal: whether query ``i`` only sees keys ``j <= i``.
        slots: the :class:`GlobalSlots` of the call (:func:`global_slots`),
            or None for a plain (dilated) sliding window.
        global_query: ``(B, G, H, d)``, the global query projections of the
            slots' positions. Defaults to the local ones.
        global_key: ``(B, S, H, d)``, global key projections of every
            position. Defaults to ``key``.
        global_value: ``(B, S, H, dv)``. Defaults to ``value``.
        global_projections: instead of ``global_key`` / ``global_value``,
            ``(key_input, value_input, key_kernel, value_kernel, value_bias,
            key_bias)``: the inputs ``(B, S, C)`` and ``(B, S, Cv)``, the
            ``(C, H, d)`` and ``(Cv, H, dv)`` kernels and the optional
            ``(H, dv)`` and ``(H, d)`` biases of the global value and key
            projections. The global rows are then computed in input space
            (:func:`input_space_attention`), without projecting every
            position.
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        block_size: positions per block of the band part. Defaults to
            :func:`keras_longattn.ops.default_block_size` (explicit) or
            :func:`fused_block_size` (fused).
        dropout_fn: optional callable applied to the attention weights
            (not with ``fused=True``).
        fused: compute every part with
            :func:`keras_longattn.ops.fused_dot_product_attention` (the
            backend's fused kernel): the global keys are appended to the
            keys of every window block, so that one softmax covers both
            (no log-sum-exp merge); no dropout.
        band_kernel: optional backend band kernel with the signature of
            :meth:`keras_longattn.kernels.BackendOps.band_attention`: the
            window and the global keys in one call (its ``extra_keys``),
            then the global rows as above. Dilation 1 only; no dropout.

    Returns:
        ``(B, T, H, dv)``. Queries with no visible key get zeros.
    """
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    if fused and block_size is None:
        block_size = fused_block_size(window)
    T, S = length(query, 1), length(key, 1)
    H, d = query.shape[2], query.shape[3]
    if scale is None:
        scale = 1.0 / float(d) ** 0.5
    dilations = check_dilation(dilation, H)
    look_back, look_ahead = window_extents(window, causal)
    batch = ops.shape(query)[0]
    local_keys = None if key_mask is None else ops.cast(key_mask, "bool")
    extra = None
    if slots is not None:
        positions = ops.broadcast_to(slots.positions, (batch,) + tuple(slots.positions.shape[1:]))
        G = positions.shape[1]
        q_valid = ops.broadcast_to(slots.query_valid, (batch, G))
        k_valid = ops.broadcast_to(slots.key_valid, (batch, G))
        if key_mask is not None:  # a padded global key is no key at all
            k_valid = ops.logical_and(
                k_valid, ops.any(ops.logical_and(slot_matrix(positions, k_valid, S),
                                                 local_keys[:, None, :]), axis=-1))
        hot_k = slot_matrix(positions, k_valid, S)  # (B, G, S)
        # The band leaves the global keys to the key-subset part.
        not_global = ops.logical_not(ops.any(hot_k, axis=1))  # (B, S)
        local_keys = not_global if local_keys is None else ops.logical_and(local_keys, not_global)
        # (B, G, H, d): the keys and values of the slots.
        keys_g = gather_slots(key, positions, k_valid)
        values_g = gather_slots(value, positions, k_valid)
        subset_pattern = CausalPattern() if causal else FullPattern()

    if band_kernel is not None:
        if dropout_fn is not None or any(r != 1 for r in dilations):
            raise ValueError("`band_kernel` takes dilation 1 and no dropout.")
        extra = {}
        if slots is not None:
            # A global key inside a query's window is seen there (once);
            # the extra keys hold it for the queries outside. The band's
            # key mask then stays the padding alone: its blocks share one
            # mask when nothing is padded.
            q_pos = ops.arange(T, dtype="int32")[None, :, None]
            g_pos = positions[:, None, :]  # (B, 1, G)
            in_band = ops.logical_and(g_pos >= q_pos - look_back, g_pos <= q_pos + look_ahead)
            seen = ops.logical_and(k_valid[:, None, :], ops.logical_not(in_band))
            if causal:
                seen = ops.logical_and(seen, g_pos <= q_pos)  # (B, T, G)
            extra = dict(extra_keys=keys_g, extra_values=values_g,
                         extra_mask=ops.broadcast_to(seen, (batch, T, G)))
        band_keys = None if key_mask is None else ops.cast(key_mask, "bool")
        out = band_kernel(query, key, value, look_back, look_ahead, block_size=block_size,
                          key_mask=band_keys, scale=scale, **extra)
        if slots is None:
            return out
    else:
        # 1. The band, one layout per distinct dilation.
        outs, lses, order = [], [], []
        for r, heads in _dilation_groups(dilations).items():
            def pick(x, heads=heads):
                if len(heads) == H:
                    return x
                if heads == list(range(heads[0], heads[-1] + 1)):
                    return x[:, :, heads[0] : heads[-1] + 1]
                return ops.take(x, np.asarray(heads, dtype="int32"), axis=2)

            if fused and slots is not None:
                extra = (pick(keys_g), pick(values_g), positions, k_valid, subset_pattern)
            out, lse = dilated_band_attention(
                pick(query), pick(key), pick(value), look_back, look_ahead, r,
                block_size=block_size, key_mask=local_keys, scale=scale,
                dropout_fn=dropout_fn, fused=fused, extra_keys=extra,
            )
            outs.append(out)
            lses.append(lse)
            order.extend(heads)
        if len(outs) == 1:
            out, lse = outs[0], lses[0]
        else:
            inverse = np.argsort(np.asarray(order)).astype("int32")
            out = ops.take(ops.concatenate(outs, axis=2), inverse, axis=2)
            lse = None if fused else ops.take(ops.concatenate(lses, axis=2), inverse, axis=2)
        if slots is None:
            return out

        if not fused:
            # 2-3. Every query against the global keys, merged with the band.
            subset_out, subset_lse = key_subset_attention(
                query, keys_g, values_g, positions, k_valid, subset_pattern,
                scale=scale, dropout_fn=dropout_fn,
            )
            out = merge_attention_parts([(out, lse), (subset_out, subset_lse)])

    # 4. The global rows: each global query against every key.
    if global_query is None:
        global_query = gather_slots(query, positions, q_valid)  # (B, G, H, d)
    global_key = key if global_key is None else global_key
    global_value = value if global_value is None else global_value
    visible = ops.ones((1, 1, 1, 1), dtype="bool")
    if key_mask is not None:
        visible = ops.cast(key_mask, "bool")[:, None, None, :]  # (B, 1, 1, S)
    if causal:
        k_pos = ops.arange(S, dtype="int32")
        visible = ops.logical_and(visible, positions[:, None, :, None] >= k_pos)  # (B, 1, G, S)
    if global_projections is not None:
        key_input, value_input, key_kernel, value_kernel, value_bias, key_bias = (
            global_projections
        )
        rows = input_space_attention(
            global_query, key_input, value_input, key_kernel, value_kernel,
            value_bias, mask=visible, scale=scale, dropout_fn=dropout_fn,
            key_bias=key_bias,
        )
    elif fused or band_kernel is not None:  # no dropout on these paths
        rows = fused_dot_product_attention(
            global_query, global_key, global_value, mask=visible, scale=scale
        )
    else:
        rows = reference_attention(
            global_query, global_key, global_value, mask=visible, scale=scale,
            dropout_fn=dropout_fn,
        )  # (B, G, H, dv)
    return scatter_slots(rows, positions, q_valid, out)  # (B, T, H, dv)


def _dilation_groups(dilations):
    """``{dilation: [heads]}`` in order of first appearance."""
    groups = {}
    for h, r in enumerate(dilations):
        groups.setdefault(r, []).append(h)
    return groups


def input_space_attention(
    query,
    key_input,
    value_input,
    key_kernel,
    value_kernel,
    value_bias=None,
    mask=None,
    scale=None,
    dropout_fn=None,
    key_bias=None,
):
    """Attention of a few queries over projected keys and values, computed
    without projecting the keys and values.

    For ``G`` queries and ``S`` positions, with keys ``x W_k + b_k`` and
    values ``y W_v + b_v``: the scores are ``(q W_k^T) x^T`` (the key bias
    adds one constant per query row, which the softmax cancels) and the
    output is ``(p y) W_v + (sum p) b_v``. That costs ``O(G * S * C * H)``
    instead of the ``O(S * C * H * d)`` of projecting every position:
    Longformer's global rows (``G`` global tokens) need the global
    projections of all ``S`` keys only through these products.

    Args:
        query: ``(B, G, H, d)``.
        key_input: ``(B, S, C)``.
        value_input: ``(B, S, Cv)``.
        key_kernel: ``(C, H, d)``.
        value_kernel: ``(Cv, H, dv)``.
        value_bias: optional ``(H, dv)``.
        mask: optional boolean broadcastable to ``(B, H, G, S)``.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights.
        key_bias: optional ``(H, d)``: adds ``q . b_k`` to every score of a
            row (no change to the result; it keeps the bias in the
            gradient graph, where its gradient is zero, as with projected
            keys).

    Returns:
        ``(B, G, H, dv)``; rows that see no key are zero.
    """
    dtype = query.dtype
    if scale is None:
        scale = 1.0 / float(query.shape[-1]) ** 0.5
    query = ops.multiply(query, ops.cast(scale, dtype))
    # (B, G, H, d) x (C, H, d) -> (B, G, H, C): the queries in input space.
    lifted = ops.einsum("bghd,chd->bghc", query, ops.cast(key_kernel, dtype))
    scores = ops.einsum("bghc,bsc->bhgs", lifted, ops.cast(key_input, dtype))
    if key_bias is not None:
        shift = ops.einsum("bghd,hd->bhg", query, ops.cast(key_bias, dtype))
        scores = scores + shift[..., None]
    probs = masked_softmax(scores, mask, axis=-1)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    # (B, H, G, S) x (B, S, Cv) -> (B, G, H, Cv), then the value kernel.
    mixed = ops.einsum("bhgs,bsc->bghc", probs, ops.cast(value_input, dtype))
    out = ops.einsum("bghc,chd->bghd", mixed, ops.cast(value_kernel, dtype))
    if value_bias is not None:
        total = ops.transpose(ops.sum(probs, axis=-1), (0, 2, 1))  # (B, G, H)
        out = out + total[..., None] * ops.cast(value_bias, dtype)
    return out
