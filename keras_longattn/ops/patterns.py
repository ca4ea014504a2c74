"""Attention patterns: which key positions a query position may attend to.

A pattern is data, kept apart from the computation. Every pattern is a
predicate on integer positions, ``allowed(q_pos, k_pos) -> bool``, evaluated
elementwise on broadcastable integer tensors. The same predicate serves two
purposes:

* the dense reference builds the full ``(T, S)`` mask from it
  (:meth:`AttentionPattern.dense_mask`), which is the specification;
* an efficient path evaluates it only on the (query, key) pairs that its
  blocks contain, so that it never builds anything of size ``T * S``.

Patterns compose with ``&`` (both allow, :class:`Intersection`), ``|``
(either allows, :class:`Union`) and :class:`Difference` (one and not the
other). Dense boolean masks (padding, a user's ``attention_mask``) combine
with :func:`combine_dense_masks`; :func:`exclude_self_unless_alone` is the
shared-query/key rule of the Reformer and the Routing Transformer.

Shape legend: B batch, T query length, S key length.
"""


import numpy as np
from keras import ops

from keras_longattn.ops import layouts as la_layouts

from keras_longattn._validation import non_negative_int as _check_non_negative_int
from keras_longattn._validation import positive_int as _check_positive_int


def _one_group(pos):
    return np.zeros(np.shape(pos), np.int64)


class AttentionPattern:
    """Base class of attention patterns.

    Subclasses implement :meth:`allowed`. A pattern does not know about
    padding: padding is per-example data and is handled by
    :class:`PaddingMask`.
    """

    #: True when the pattern never lets a query see a later key.
    is_causal = False

    def allowed(self, q_pos, k_pos):
        """Elementwise predicate: may query ``q_pos`` attend to key ``k_pos``?

        Args:
            q_pos: integer tensor of query positions.
            k_pos: integer tensor of key positions, broadcastable with
                ``q_pos``.

        Returns:
            A boolean tensor of the broadcast shape.
        """
        raise NotImplementedError

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        """True where every pair of a tile of consecutive positions
        ``q_first..q_last`` x ``k_first..k_last`` is allowed (False where
        some pair is not), or None when the pattern cannot tell from the
        four bounds.

        The bounds are int scalars (traced inside a kernel). A kernel skips
        the element mask of a tile this answers True for; None makes it
        evaluate :meth:`allowed` on every tile.
        """
        return None

    def segments(self):
        """How the pattern's allowed pairs are grouped, for listing tiles
        without evaluating :meth:`allowed` on every pair, or None
        (unknown).

        Returns ``(query_group, key_group, look_back, look_ahead)``: two
        functions from NumPy int positions to int64 group ids (``-1``: in
        no group) and two extents (int or None, unbounded), such that a
        pair is allowed only when both positions are in one group and
        ``-look_back <= k_pos - q_pos <= look_ahead``.
        """
        return None

    def candidate_tiles(self, q_positions, k_positions, block):
        """The tiles that may hold an allowed pair, as NumPy int64 arrays
        ``(query tile, key tile)``: a superset of the tiles of ``block`` x
        ``block`` arranged tokens with an allowed pair, listed from
        :meth:`segments` in O(tiles listed) time (every tile where the
        pattern has no segments).

        Args:
            q_positions: NumPy int, the position of each arranged query
                (``-1``: a slot that holds no query).
            k_positions: NumPy int, the same for the keys.
            block: the tile size.
        """
        q_positions = np.asarray(q_positions, np.int64)
        k_positions = np.asarray(k_positions, np.int64)
        segments = self.segments()
        if segments is None:
            return la_layouts.every_tile(q_positions.size, k_positions.size, block)
        query_group, key_group, look_back, look_ahead = segments
        q_group = np.where(q_positions >= 0, query_group(np.maximum(q_positions, 0)), -1)
        k_group = np.where(k_positions >= 0, key_group(np.maximum(k_positions, 0)), -1)
        return la_layouts.segment_tiles(q_group, q_positions, k_group, k_positions, block,
                                        look_back, look_ahead)

    def dense_mask(self, query_length, key_length):
        """The pattern as a dense boolean ``(T, S)`` tensor (O(T*S) memory)."""
        q_pos = ops.expand_dims(ops.arange(query_length, dtype="int32"), 1)
        k_pos = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
        mask = self.allowed(q_pos, k_pos)
        return ops.broadcast_to(mask, (query_length, key_length))

    def __and__(self, other):
        return Intersection(self, other)

    def __or__(self, other):
        return Union(self, other)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other):
        return type(self) is type(other) and self._fields() == other._fields()

    def __hash__(self):
        return hash((type(self).__name__, tuple(self._fields().items())))

    def _fields(self):
        return {}


class FullPattern(AttentionPattern):
    """Every query attends to every key."""

    def segments(self):
        return _one_group, _one_group, None, None

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        return True

    def allowed(self, q_pos, k_pos):
        return ops.equal(q_pos * 0 + k_pos * 0, 0)


class CausalPattern(AttentionPattern):
    """Query ``i`` attends to keys ``j <= i`` (top-left aligned, as in
    ``keras.layers.MultiHeadAttention(use_causal_mask=True)``)."""

    is_causal = True

    def segments(self):
        return _one_group, _one_group, None, 0

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        return k_last <= q_first

    def allowed(self, q_pos, k_pos):
        return ops.less_equal(k_pos, q_pos)


class LocalPattern(AttentionPattern):
    """An exact sliding window: query ``i`` attends to keys
    ``i - look_back <= j <= i + look_ahead``.

    Args:
        look_back: how many earlier keys are visible (>= 0).
        look_ahead: how many later keys are visible (>= 0). With
            ``look_ahead=0`` the pattern is causal.
    """

    def __init__(self, look_back, look_ahead):
        look_back = _check_non_negative_int("look_back", look_back)
        look_ahead = _check_non_negative_int("look_ahead", look_ahead)
        self.look_back = look_back
        self.look_ahead = look_ahead

    @property
    def is_causal(self):
        return self.look_ahead == 0

    def segments(self):
        return _one_group, _one_group, self.look_back, self.look_ahead

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        # The smallest offset of the tile is k_first - q_last, the largest
        # k_last - q_first.
        return (k_first - q_last >= -self.look_back) & (k_last - q_first <= self.look_ahead)

    def allowed(self, q_pos, k_pos):
        offset = k_pos - q_pos
        return ops.logical_and(
            ops.greater_equal(offset, -self.look_back),
            ops.less_equal(offset, self.look_ahead),
        )

    def _fields(self):
        return {"look_back": self.look_back, "look_ahead": self.look_ahead}


class DilatedPattern(AttentionPattern):
    """A dilated sliding window: query ``i`` attends to keys
    ``j = i + dilation * t`` for ``-look_back <= t <= look_ahead``.

    With ``dilation=1`` it is :class:`LocalPattern`. A dilation ``r`` keeps
    the number of keys of the window and stretches its reach by ``r``
    (Longformer's dilated sliding window).

    Args:
        look_back: how many earlier keys are visible (>= 0).
        look_ahead: how many later keys are visible (>= 0). With
            ``look_ahead=0`` the pattern is causal.
        dilation: the gap between two visible keys (>= 1).
    """

    def __init__(self, look_back, look_ahead, dilation=1):
        self.look_back = _check_non_negative_int("look_back", look_back)
        self.look_ahead = _check_non_negative_int("look_ahead", look_ahead)
        self.dilation = _check_positive_int("dilation", dilation)

    @property
    def is_causal(self):
        return self.look_ahead == 0

    def segments(self):
        r = self.dilation

        def residue(pos):
            return np.asarray(pos, np.int64) % r

        return residue, residue, self.look_back * r, self.look_ahead * r

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        if self.dilation != 1:
            return None
        return (k_first - q_last >= -self.look_back) & (k_last - q_first <= self.look_ahead)

    def allowed(self, q_pos, k_pos):
        offset = k_pos - q_pos
        r = self.dilation
        inside = ops.logical_and(
            ops.greater_equal(offset, -self.look_back * r),
            ops.less_equal(offset, self.look_ahead * r),
        )
        if r == 1:
            return inside
        return ops.logical_and(inside, ops.equal(ops.mod(offset, r), 0))

    def _fields(self):
        return {
            "look_back": self.look_back,
            "look_ahead": self.look_ahead,
            "dilation": self.dilation,
        }


class GlobalPattern(AttentionPattern):
    """Global positions: a global query attends to every key and every query
    attends to the global keys (Longformer's and BigBird's global tokens).
    AND it with :class:`CausalPattern` for ``j <= i``.

    Args:
        positions: the global positions, a sequence of non-negative ints
            (``range(k)`` for the first ``k`` positions).
    """

    def __init__(self, positions):
        positions = tuple(
            _check_non_negative_int("positions", p) for p in positions
        )
        self.positions = tuple(sorted(set(positions)))

    def is_global(self, pos):
        """Boolean tensor: whether each entry of ``pos`` is a global
        position."""
        result = ops.zeros_like(pos, dtype="bool")
        for p in self.positions:
            result = ops.logical_or(result, ops.equal(pos, p))
        return result

    def candidate_tiles(self, q_positions, k_positions, block):
        """The tiles of a global query (every key tile) and those of a
        global key (every query tile)."""
        q_positions = np.asarray(q_positions, np.int64)
        k_positions = np.asarray(k_positions, np.int64)
        nq, nk = -(-q_positions.size // block), -(-k_positions.size // block)
        glob = np.asarray(self.positions, np.int64)
        rows = np.unique(np.flatnonzero(np.isin(q_positions, glob)) // block)
        cols = np.unique(np.flatnonzero(np.isin(k_positions, glob)) // block)
        return la_layouts.union_tiles(
            [(np.repeat(rows, nk), np.tile(np.arange(nk), rows.size)),
             (np.tile(np.arange(nq), cols.size), np.repeat(cols, nq))],
            k_positions.size, block)

    def allowed(self, q_pos, k_pos):
        # `q_pos * 0 + k_pos * 0` broadcasts both to the (query, key) shape.
        zero = q_pos * 0 + k_pos * 0
        return ops.logical_or(self.is_global(q_pos + zero), self.is_global(k_pos + zero))

    def _fields(self):
        return {"positions": self.positions}


class Intersection(AttentionPattern):
    """Keys allowed by every one of ``patterns``."""

    def __init__(self, *patterns):
        flat = []
        for p in patterns:
            if not isinstance(p, AttentionPattern):
                raise TypeError(
                    "Intersection expects AttentionPattern objects. "
                    f"Received: {p!r}"
                )
            flat.extend(p.patterns if isinstance(p, Intersection) else [p])
        self.patterns = tuple(flat)

    @property
    def is_causal(self):
        return any(p.is_causal for p in self.patterns)

    def segments(self):
        """The members' segments combined (one group per tuple of groups,
        the tightest extents), when every member has segments."""
        parts = [p.segments() for p in self.patterns]
        if any(part is None for part in parts):
            return None

        def combine(which):
            def group(pos):
                out = np.zeros(np.shape(pos), np.uint64)
                missing = np.zeros(np.shape(pos), bool)
                for part in parts:
                    g = np.asarray(part[which](pos), np.int64)
                    missing |= g < 0
                    # A hash of the tuple of groups, the same for queries
                    # and keys (a collision merges two groups: more tiles
                    # listed, never fewer).
                    out = (out ^ np.maximum(g, 0).astype(np.uint64)) * np.uint64(0x100000001B3)
                out = (out >> np.uint64(2)).astype(np.int64)
                return np.where(missing, -1, out)
            return group

        def tightest(values):
            known = [v for v in values if v is not None]
            return min(known) if known else None

        return (combine(0), combine(1), tightest([p[2] for p in parts]),
                tightest([p[3] for p in parts]))

    def candidate_tiles(self, q_positions, k_positions, block):
        if self.segments() is not None:
            return super().candidate_tiles(q_positions, k_positions, block)
        return la_layouts.intersect_tiles(
            [p.candidate_tiles(q_positions, k_positions, block) for p in self.patterns],
            np.size(k_positions), block)

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        result = True
        for p in self.patterns:
            part = p.tile_all_allowed(q_first, q_last, k_first, k_last)
            if part is None:
                return None
            result = part if result is True else result & part
        return result

    def allowed(self, q_pos, k_pos):
        result = self.patterns[0].allowed(q_pos, k_pos)
        for p in self.patterns[1:]:
            result = ops.logical_and(result, p.allowed(q_pos, k_pos))
        return result

    def _fields(self):
        return {"patterns": self.patterns}


class Union(AttentionPattern):
    """Keys allowed by at least one of ``patterns``."""

    def __init__(self, *patterns):
        flat = []
        for p in patterns:
            if not isinstance(p, AttentionPattern):
                raise TypeError(
                    f"Union expects AttentionPattern objects. Received: {p!r}"
                )
            flat.extend(p.patterns if isinstance(p, Union) else [p])
        self.patterns = tuple(flat)

    @property
    def is_causal(self):
        return all(p.is_causal for p in self.patterns)

    def candidate_tiles(self, q_positions, k_positions, block):
        return la_layouts.union_tiles(
            [p.candidate_tiles(q_positions, k_positions, block) for p in self.patterns],
            np.size(k_positions), block)

    def allowed(self, q_pos, k_pos):
        result = self.patterns[0].allowed(q_pos, k_pos)
        for p in self.patterns[1:]:
            result = ops.logical_or(result, p.allowed(q_pos, k_pos))
        return result

    def _fields(self):
        return {"patterns": self.patterns}


class Difference(AttentionPattern):
    """Keys allowed by ``include`` and not by ``exclude``.

    The *merged* combination computes pattern B as ``Difference(B, A)`` so
    that a key both patterns allow is counted once.
    """

    def __init__(self, include, exclude):
        for name, p in (("include", include), ("exclude", exclude)):
            if not isinstance(p, AttentionPattern):
                raise TypeError(
                    f"Difference expects AttentionPattern objects. Received: {name}={p!r}"
                )
        self.include = include
        self.exclude = exclude

    @property
    def is_causal(self):
        return self.include.is_causal

    def segments(self):
        return self.include.segments()

    def candidate_tiles(self, q_positions, k_positions, block):
        return self.include.candidate_tiles(q_positions, k_positions, block)

    def allowed(self, q_pos, k_pos):
        return ops.logical_and(
            self.include.allowed(q_pos, k_pos),
            ops.logical_not(self.exclude.allowed(q_pos, k_pos)),
        )

    def _fields(self):
        return {"include": self.include, "exclude": self.exclude}


class PaddingMask:
    """Per-example padding of queries and keys, kept structural.

    Args:
        query_mask: optional boolean ``(B, T)``; False marks a padded query.
        key_mask: optional boolean ``(B, S)``; False marks a padded key
            (the AND of the value and key masks of a layer call).

    Padded keys are never attended to. Padded queries still produce an
    output (whatever their row of the pattern gives), which callers should
    ignore; rows with no visible key produce zeros.
    """

    def __init__(self, query_mask=None, key_mask=None):
        self.query_mask = query_mask
        self.key_mask = key_mask

    @property
    def is_empty(self):
        return self.query_mask is None and self.key_mask is None

    def dense_mask(self, query_length, key_length):
        """Dense key-visibility mask, broadcastable to ``(B, T, S)``.

        Only the key mask restricts attention; the query mask does not
        (a padded query's output is simply ignored), so that a padded query
        has exactly the same output as if it were a real one.
        """
        if self.key_mask is None:
            return None
        return ops.expand_dims(ops.cast(self.key_mask, "bool"), 1)

    def __repr__(self):
        q = None if self.query_mask is None else tuple(self.query_mask.shape)
        k = None if self.key_mask is None else tuple(self.key_mask.shape)
        return f"PaddingMask(query_mask shape={q}, key_mask shape={k})"


def causal_pattern():
    """Shortcut for :class:`CausalPattern`."""
    return CausalPattern()


def local_pattern(window=None, look_back=None, look_ahead=None, causal=False):
    """Builds the exact sliding-window pattern of :class:`LocalAttention`.

    Causal: query ``i`` attends keys ``i - window + 1 .. i``. Bidirectional:
    keys within ``window // 2`` on each side. ``look_back`` and
    ``look_ahead``, when given, override the values derived from ``window``;
    ``causal=True`` always forces ``look_ahead = 0``.
    """
    look_back, look_ahead = resolve_window(window, look_back, look_ahead, causal)
    return LocalPattern(look_back, look_ahead)


def resolve_window(window, look_back, look_ahead, causal):
    """Turns ``window`` / ``look_back`` / ``look_ahead`` into the two extents."""
    if window is not None:
        window = _check_positive_int("window", window)
    if look_back is None:
        if window is None:
            raise ValueError(
                "Either `window` or `look_back` must be given. "
                "Received: window=None, look_back=None"
            )
        look_back = window - 1 if causal else window // 2
    if look_ahead is None:
        if window is None:
            look_ahead = 0 if causal else look_back
        else:
            look_ahead = 0 if causal else window // 2
    look_back = _check_non_negative_int("look_back", look_back)
    look_ahead = _check_non_negative_int("look_ahead", look_ahead)
    if causal:
        look_ahead = 0
    return look_back, look_ahead


def combine_dense_masks(*masks):
    """AND of boolean masks that may be None; None when all are None."""
    result = None
    for m in masks:
        if m is None:
            continue
        m = ops.cast(m, "bool")
        result = m if result is None else ops.logical_and(result, m)
    return result


def exclude_self_unless_alone(mask, is_self):
    """Removes the ``is_self`` entries of every row of ``mask`` that has
    another visible entry (attention with shared queries and keys: a token
    sees itself only when nothing else is visible).

    Args:
        mask: boolean mask, or None (everything visible).
        is_self: boolean, broadcastable with ``mask``; the last axis is the
            key axis.

    Returns:
        A boolean mask of the broadcast shape.
    """
    if mask is None:
        mask = ops.ones_like(is_self, dtype="bool")
    mask = ops.logical_and(
        ops.cast(mask, "bool"), ops.ones_like(is_self, dtype="bool")
    )
    others = ops.logical_and(mask, ops.logical_not(is_self))
    has_other = ops.any(others, axis=-1, keepdims=True)
    return ops.where(has_other, others, mask)
