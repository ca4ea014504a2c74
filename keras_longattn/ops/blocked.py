"""Blocked attention: a band of key blocks around each query block (local
attention, the Sparse Transformer's local parts), and dense attention inside
a batch of independent gathered blocks (routing clusters, sorted chunks).
Band attention costs O(n * w) time and memory.

The sequence is cut into blocks of ``block_size`` positions. Each query block
attends to the key blocks that can hold a key within ``look_back`` positions
before or ``look_ahead`` positions after any of its queries; inside those
blocks the exact pattern predicate masks every (query, key) pair. Blocks are
how it is computed, not what it means: the result equals the dense reference
of the same pattern.

Shape legend: B batch, n number of blocks, b block size, C context length
(keys visible to a block), H heads, d head size.
"""

import math

from keras import ops

from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.patterns import AttentionPattern
from keras_longattn.ops.patterns import DilatedPattern
from keras_longattn.ops.patterns import LocalPattern
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.reference import softmax_with_lse
from keras_longattn.ops.shapes import ceil_div
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length


def default_block_size(look_back, look_ahead, length=None):
    """Block size used when none is given.

    Half the larger extent of the window, rounded up to a multiple of 8 (the
    extent itself for windows under 64): a causal window ``w`` then reads
    ``1.5 * w`` keys per query instead of ``2 * w`` with blocks of ``w``,
    while blocks stay large enough for efficient matrix products. Never
    larger than the (rounded) sequence length.
    """
    extent = max(int(look_back), int(look_ahead), 1)
    b = extent if extent < 64 else -(-extent // 2)
    b = _round_up(b, 8) if b > 8 else b
    if length is not None:
        b = min(b, _round_up(max(int(length), 1), 8))
    return max(b, 1)


def pad_axis(x, axis, new_length, value=0):
    """Pads ``x`` with ``value`` at the end of ``axis`` up to ``new_length``
    (lengths may be scalar tensors while tracing)."""
    size = length(x, axis)
    if is_static(size, new_length) and size == new_length:
        return x
    widths = [[0, 0] for _ in range(len(x.shape))]
    widths[axis] = [0, new_length - size]
    return _pad(x, widths, value)


def blocked_band_attention(
    query,
    key,
    value,
    pattern,
    look_back,
    look_ahead,
    block_size=None,
    key_mask=None,
    scale=None,
    dropout_fn=None,
    fused=False,
):
    """Attention restricted to keys within a band around each query.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        pattern: an :class:`AttentionPattern`; it must not allow any key
            further than ``look_back`` before or ``look_ahead`` after the
            query (keys outside the band are never looked at).
        look_back: band extent before the query, in positions (>= 0).
        look_ahead: band extent after the query, in positions (>= 0).
        block_size: positions per block. Defaults to
            :func:`default_block_size`.
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights
            (not with ``fused=True``).
        fused: compute each block with ``keras.ops.dot_product_attention``
            (the backend's fused kernel, e.g. PyTorch's
            ``scaled_dot_product_attention``) instead of explicit einsums
            and softmax. Same result; no dropout.

    Returns:
        ``(B, T, H, dv)``. Queries with no visible key get zeros.
    """
    if not isinstance(pattern, AttentionPattern):
        raise TypeError(f"`pattern` must be an AttentionPattern. Received: {pattern!r}")
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    T, S = length(query, 1), length(key, 1)
    longest = larger(T, S)
    H = query.shape[2]
    d = query.shape[3]
    dv = value.shape[3]
    if scale is None:
        scale = 1.0 / float(d) ** 0.5
    b = block_size or default_block_size(
        look_back, look_ahead, longest if is_static(longest) else None
    )
    n = ceil_div(longest, b)
    N = n * b
    nb = -(-int(look_back) // b)  # key blocks before the query block
    na = -(-int(look_ahead) // b)  # key blocks after the query block
    span = nb + 1 + na
    C = span * b

    query = pad_axis(query, 1, N)
    key = pad_axis(key, 1, N)
    value = pad_axis(value, 1, N)
    valid = ops.arange(N, dtype="int32") < S  # (N,)
    valid = ops.expand_dims(valid, 0)
    if key_mask is not None:
        km = pad_axis(ops.cast(key_mask, "bool"), 1, N, value=False)
        valid = ops.logical_and(valid, km)  # (B or 1, N)

    q, k, v, mask = band_blocks(query, key, value, valid, pattern, b, nb, na)

    if fused:
        out = fused_blocks(q, k, v, mask, scale)
    else:
        q = ops.multiply(q, ops.cast(scale, q.dtype))
        # (B, n, b, H, d) x (B, n, C, H, d) -> (B, n, H, b, C)
        scores = ops.einsum("bnqhd,bnkhd->bnhqk", q, k)
        probs = masked_softmax(scores, mask[:, :, None], axis=-1)
        if dropout_fn is not None:
            probs = dropout_fn(probs)
        # (B, n, H, b, C) x (B, n, C, H, dv) -> (B, n, b, H, dv)
        out = ops.einsum("bnhqk,bnkhd->bnqhd", probs, v)
    out = ops.reshape(out, (-1, N, H, dv))
    return out[:, :T]


def band_blocks(query, key, value, valid, pattern, block_size, before, after,
                extra_kv=None):
    """Lays a padded sequence out as query blocks and their key bands.

    Args:
        query: ``(B, N, H, d)`` with ``N`` a multiple of ``block_size``.
        key: ``(B, N, H, d)``.
        value: ``(B, N, H, dv)``.
        valid: boolean ``(B or 1, N)``, False for padded keys.
        pattern: the :class:`AttentionPattern` evaluated on every
            (query, key) pair of the layout.
        block_size: ``b``, positions per block.
        before: key blocks before each query block.
        after: key blocks after each query block.
        extra_kv: optional ``(keys, values)``, ``(B, G, H, d|dv)``, appended
            after the band of every block (in the same copy); their mask is
            the caller's (``mask`` covers the band only).

    Returns:
        ``q`` ``(B, n, b, H, d)``, ``k`` ``(B, n, C (+ G), H, d)``, ``v``
        ``(B, n, C (+ G), H, dv)`` and ``mask`` ``(B, n, b, C)`` (pattern
        AND key validity), with ``C = (before + 1 + after) * b``.
    """
    b = block_size
    N, H, d = length(query, 1), query.shape[2], query.shape[3]
    dv = value.shape[3]
    n = N // b
    C = (before + 1 + after) * b
    q = ops.reshape(query, (-1, n, b, H, d))
    ek, ev = (None, None) if extra_kv is None else extra_kv
    k = _band(ops.reshape(key, (-1, n, b, H, d)), before, after, extra=ek)
    v = _band(ops.reshape(value, (-1, n, b, H, dv)), before, after, extra=ev)
    kv_valid = _band(ops.reshape(valid, (-1, n, b)), before, after, fill=False)  # (B, n, C)
    # Absolute positions of the queries and of the band's keys.
    q_pos = ops.reshape(ops.arange(N, dtype="int32"), (n, b))  # (n, b)
    block_start = ops.arange(n, dtype="int32") * b  # (n,)
    offsets = ops.arange(C, dtype="int32") - before * b  # (C,)
    k_pos = block_start[:, None] + offsets[None, :]  # (n, C)
    allowed = pattern.allowed(q_pos[:, :, None], k_pos[:, None, :])  # (n, b, C)
    allowed = ops.broadcast_to(allowed, (n, b, C))
    mask = ops.logical_and(allowed[None], kv_valid[:, :, None, :])  # (B, n, b, C)
    return q, k, v, mask


def band_part(query, key, value, valid, pattern, block_size, before, after,
              dropout_fn=None):
    """Band attention with its log-sum-exp, to be merged with other parts.

    Each block of ``block_size`` queries against its own key block and
    ``before`` / ``after`` neighbouring blocks (:func:`band_blocks`), with an
    explicit softmax. O(N * block_size) time and memory. Queries must be
    scaled already.

    Args:
        query: ``(B, N, H, d)`` with ``N`` a multiple of ``block_size``.
        key: ``(B, N, H, d)``.
        value: ``(B, N, H, dv)``.
        valid: boolean ``(B or 1, N)``, False for keys to leave out.
        pattern: the :class:`AttentionPattern` of the band.
        block_size: positions per block.
        before: key blocks before each query block.
        after: key blocks after each query block.
        dropout_fn: optional callable applied to the attention weights.

    Returns:
        ``(out, lse)``: ``out`` ``(B, N, H, dv)`` (zeros where a query sees
        no key) and the float32 log-sum-exp ``(B, N, H)`` of each query's
        logits (about ``MASKED_LOGIT`` where it sees none), as
        :func:`keras_longattn.ops.merge_attention_parts` takes them.
    """
    N, H, dv = length(query, 1), query.shape[2], value.shape[3]
    q, k, v, mask = band_blocks(query, key, value, valid, pattern, block_size,
                                before, after)
    mask = mask[:, :, None]  # (B, n, 1, b, C): the same mask for every head
    # (B, n, b, H, d) x (B, n, C, H, d) -> (B, n, H, b, C)
    scores = ops.einsum("bnqhd,bnkhd->bnhqk", q, k)
    probs, lse = softmax_with_lse(scores, mask)  # lse: (B, n, H, b)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    # (B, n, H, b, C) x (B, n, C, H, dv) -> (B, n, b, H, dv)
    out = ops.einsum("bnhqk,bnkhd->bnqhd", probs, v)
    out = ops.reshape(out, (-1, N, H, dv))
    lse = ops.reshape(ops.transpose(lse, (0, 1, 3, 2)), (-1, N, H))
    return out, lse


def dilated_band_attention(
    query,
    key,
    value,
    look_back,
    look_ahead,
    dilation=1,
    block_size=None,
    key_mask=None,
    scale=None,
    dropout_fn=None,
    fused=False,
    extra_keys=None,
):
    """Dilated sliding-window attention with its log-sum-exp, in O(n * w).

    Query ``i`` attends keys ``i + dilation * t``,
    ``-look_back <= t <= look_ahead`` (:class:`DilatedPattern`). The padded
    sequence is seen as ``(N / r, r)`` with ``r = dilation``: the positions
    of one column (the same residue mod ``r``) are exactly the keys a
    dilated window can reach, so each column is a plain sliding window of
    ``look_back`` / ``look_ahead`` column steps, computed by
    :func:`band_part`. The cost is that of an undilated window of the same
    number of keys, whatever the dilation; no dense mask is built.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        look_back: window steps before the query (>= 0).
        look_ahead: window steps after the query (>= 0).
        dilation: ``r`` (>= 1).
        block_size: positions per block along a column. Defaults to
            :func:`default_block_size` of the extents.
        key_mask: optional boolean ``(B, S)``; False marks keys to leave
            out (padding, or keys another part attends to).
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights
            (not with ``fused=True``).
        fused: compute every block with
            :func:`keras_longattn.ops.fused_dot_product_attention` (no
            log-sum-exp is returned then, and no dropout).
        extra_keys: with ``fused=True`` only, optional keys that every
            query may also see, in the same softmax as its window (global
            tokens): ``(keys, values, positions, valid, pattern)`` with
            ``keys`` ``(B, G, H, d)``, ``values`` ``(B, G, H, dv)``,
            ``positions`` int ``(B, G)``, ``valid`` boolean ``(B, G)`` and
            the :class:`AttentionPattern` evaluated on (query position, key
            position) pairs. They are appended to every block's keys
            (O(n * G)); they must not also be inside the window (leave them
            out with ``key_mask``).

    Returns:
        ``(out, lse)``: ``(B, T, H, dv)`` and the float32 ``(B, T, H)``
        log-sum-exp (see :func:`band_part`); ``lse`` is None with
        ``fused=True``.
    """
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    if extra_keys is not None and not fused:
        raise ValueError("`extra_keys` needs `fused=True` (merge the parts instead).")
    pattern = DilatedPattern(look_back, 0 if look_ahead is None else look_ahead, dilation)
    r = pattern.dilation
    T, S = length(query, 1), length(key, 1)
    longest = larger(T, S)
    H, d, dv = query.shape[2], query.shape[3], value.shape[3]
    if scale is None:
        scale = 1.0 / float(d) ** 0.5
    m = ceil_div(longest, r)  # positions per column
    b = block_size or default_block_size(
        pattern.look_back, pattern.look_ahead, m if is_static(m) else None
    )
    m = ceil_div(m, b) * b
    N = m * r
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    query = pad_axis(query, 1, N)
    key = pad_axis(key, 1, N)
    value = pad_axis(value, 1, N)
    valid = ops.expand_dims(ops.arange(N, dtype="int32") < S, 0)  # (1, N)
    if key_mask is not None:
        km = pad_axis(ops.cast(key_mask, "bool"), 1, N, value=False)
        valid = ops.logical_and(valid, km)  # (B or 1, N)
    before = -(-pattern.look_back // b)
    after = -(-pattern.look_ahead // b)
    column = LocalPattern(pattern.look_back, pattern.look_ahead)
    if r == 1 and not fused:
        out, lse = band_part(query, key, value, valid, column, b, before, after,
                             dropout_fn)
        return out[:, :T], lse[:, :T]
    batch = ops.shape(query)[0]
    valid = ops.broadcast_to(valid, (batch, N))

    def columns(x):  # (B, N, ...) -> (B * r, m, ...): position c + r * t at [c, t]
        rest = tuple(x.shape[2:])
        x = ops.reshape(x, (-1, m, r) + rest)
        x = ops.transpose(x, (0, 2, 1) + tuple(range(3, 3 + len(rest))))
        return ops.reshape(x, (-1, m) + rest)

    def positions(x):  # (B * r, m, ...) -> (B, N, ...)
        rest = tuple(x.shape[2:])
        x = ops.reshape(x, (-1, r, m) + rest)
        x = ops.transpose(x, (0, 2, 1) + tuple(range(3, 3 + len(rest))))
        return ops.reshape(x, (-1, N) + rest)

    if r == 1:
        columns = positions = lambda x: x  # noqa: E731
    if fused:
        out = _fused_band(columns(query), columns(key), columns(value),
                          columns(valid), column, b, before, after, r,
                          extra_keys)
        return positions(out)[:, :T], None
    out, lse = band_part(columns(query), columns(key), columns(value),
                         columns(valid), column, b, before, after, dropout_fn)
    return positions(out)[:, :T], positions(lse)[:, :T]


def _fused_band(query, key, value, valid, pattern, b, before, after, r, extra_keys):
    """The band of a (column) layout through the fused kernel, with the
    optional extra keys appended to every block. Queries already scaled.
    ``query`` ``(B * r, m, H, d)``; returns ``(B * r, m, H, dv)``."""
    m, H, dv = length(query, 1), query.shape[2], value.shape[3]
    if extra_keys is None:
        q, k, v, mask = band_blocks(query, key, value, valid, pattern, b, before, after)
    else:
        ek, ev, epos, evalid, epattern = extra_keys
        if r > 1:  # one copy per column: row c of example e is e * r + c
            ek, ev, epos, evalid = (ops.repeat(x, r, axis=0) for x in (ek, ev, epos, evalid))
        q, k, v, mask = band_blocks(query, key, value, valid, pattern, b, before, after,
                                    extra_kv=(ek, ev))
        n = m // b
        G = ek.shape[1]
        # Position of each query of the layout: column c, step t -> c + r * t.
        batch = ops.shape(query)[0]
        column = ops.mod(ops.arange(batch, dtype="int32"), r)  # (B * r,)
        steps = ops.reshape(ops.arange(m, dtype="int32"), (n, b))
        q_pos = column[:, None, None] + r * steps[None]  # (B * r, n, b)
        allowed = epattern.allowed(q_pos[..., None], epos[:, None, None, :])
        allowed = ops.logical_and(allowed, ops.cast(evalid, "bool")[:, None, None, :])
        mask = ops.concatenate(
            [ops.broadcast_to(mask, (batch, n, b, mask.shape[-1])),
             ops.broadcast_to(allowed, (batch, n, b, G))], axis=-1)
    out = fused_blocks(q, k, v, mask, scale=1.0)
    return ops.reshape(out, (-1, m, H, dv))


def fused_blocks(q, k, v, mask, scale=None):
    """Every block as one item of a batched :func:`fused_dot_product_attention`.

    ``q`` ``(B, n, b, H, d)``, ``k``/``v`` ``(B, n, C, H, d|dv)``, ``mask``
    boolean ``(B or 1, n, b, C)``. Returns ``(B, n, b, H, dv)``, zeros where
    a query sees no key.
    """
    n, b, H, d = length(q, 1), q.shape[2], q.shape[3], q.shape[4]
    C, dv = k.shape[2], v.shape[4]
    qf = ops.reshape(q, (-1, b, H, d))  # (B*n, b, H, d)
    kf = ops.reshape(k, (-1, C, H, d))
    vf = ops.reshape(v, (-1, C, H, dv))
    mask = ops.broadcast_to(mask, (ops.shape(q)[0], n, b, C))
    mf = ops.reshape(mask, (-1, 1, b, C))  # (B*n, 1, b, C)
    out = fused_dot_product_attention(qf, kf, vf, mask=mf, scale=scale)
    return ops.reshape(out, (-1, n, b, H, dv))


def block_attention(qg, kg, vg, mask, scale, dropout_fn=None, fused=False):
    """Dense attention inside every block of gathered ``(B, H, G, w, .)``
    layouts (``G`` independent blocks per head: clusters, chunks).

    ``qg`` ``(B, H, G, wq, d)``, ``kg``/``vg`` ``(B, H, G, wk, d|dv)``,
    ``mask`` broadcastable to ``(B, H, G, wq, wk)`` or None. With ``fused``
    through :func:`_fused_gathered_blocks` (no ``dropout_fn`` allowed), else
    with explicit einsums and a masked softmax. Returns the outputs
    ``(B, H, G, wq, dv)`` (zeros where a query sees no key) and the boolean
    ``(B, H, G, wq)`` of the queries that see a key (None without a mask).
    """
    if fused:
        if dropout_fn is not None:
            raise ValueError("`fused=True` does not support attention dropout.")
        return _fused_gathered_blocks(qg, kg, vg, mask, scale)
    qg = ops.multiply(qg, ops.cast(scale, qg.dtype))
    scores = ops.einsum("bhgqd,bhgkd->bhgqk", qg, kg)
    probs = masked_softmax(scores, mask, axis=-1)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    out = ops.einsum("bhgqk,bhgkd->bhgqd", probs, vg)
    if mask is None:
        return out, None
    return out, ops.any(ops.broadcast_to(mask, ops.shape(scores)), axis=-1)


def _fused_gathered_blocks(qg, kg, vg, mask, scale):
    """Each block as one item of a batched ``dot_product_attention``.

    ``qg`` ``(B, H, k, wq, d)``, ``kg``/``vg`` ``(B, H, k, wk, d|dv)``,
    ``mask`` broadcastable to ``(B, H, k, wq, wk)`` or None. Returns the
    outputs ``(B, H, k, wq, dv)`` (zeros where a query sees no key) and the
    boolean ``(B, H, k, wq)`` of the queries that see a key (None without
    a mask)."""
    shape = tuple(ops.shape(qg))
    wq, d = qg.shape[3], qg.shape[4]
    wk, dv = kg.shape[3], vg.shape[4]
    # (B*H*k, w, 1, d): reshapes only, one attention "head" per cluster.
    qf = ops.reshape(qg, (-1, wq, 1, d))
    kf = ops.reshape(kg, (-1, wk, 1, d))
    vf = ops.reshape(vg, (-1, wk, 1, dv))
    if mask is None:
        out = fused_dot_product_attention(qf, kf, vf, scale=scale)
        return ops.reshape(out, shape[:4] + (dv,)), None
    mask = ops.broadcast_to(mask, shape[:4] + (wk,))
    out = fused_dot_product_attention(
        qf, kf, vf, mask=ops.reshape(mask, (-1, 1, wq, wk)), scale=scale
    )
    return ops.reshape(out, shape[:4] + (dv,)), ops.any(mask, axis=-1)


def local_attention(
    query,
    key,
    value,
    look_back,
    look_ahead,
    block_size=None,
    key_mask=None,
    scale=None,
    dropout_fn=None,
    fused=False,
):
    """Exact sliding-window attention (keys ``i - look_back .. i + look_ahead``)
    computed block by block in O(n * w) time and memory.

    Arguments as :func:`blocked_band_attention`, whose pattern is
    ``LocalPattern(look_back, look_ahead)``.
    """
    return blocked_band_attention(
        query,
        key,
        value,
        LocalPattern(look_back, look_ahead),
        look_back,
        look_ahead,
        block_size=block_size,
        key_mask=key_mask,
        scale=scale,
        dropout_fn=dropout_fn,
        fused=fused,
    )


def _band(x, before, after, fill=0, extra=None):
    """Concatenates each block with its ``before`` predecessors and ``after``
    successors along the position axis (and ``extra``, ``(B, G, ...)``,
    after them in every block).

    ``x``: ``(B, n, b, ...)`` -> ``(B, n, (before + 1 + after) * b, ...)``;
    blocks outside the sequence are filled with ``fill``.
    """
    n = length(x, 1)
    if extra is not None:
        tail = ops.broadcast_to(
            extra[:, None], (ops.shape(x)[0], n) + tuple(extra.shape[1:])
        )
    if before == 0 and after == 0:
        return x if extra is None else ops.concatenate([x, tail], axis=2)
    widths = [[0, 0] for _ in range(len(x.shape))]
    widths[1] = [before, after]
    padded = _pad(x, widths, fill)
    parts = [padded[:, j : j + n] for j in range(before + 1 + after)]
    if extra is not None:
        parts.append(tail)
    return ops.concatenate(parts, axis=2)


def _pad(x, widths, value):
    # Some backends cannot pad boolean tensors: pad them as integers.
    if x.dtype == "bool":
        x = ops.pad(ops.cast(x, "int32"), widths, constant_values=int(bool(value)))
        return ops.cast(x, "bool")
    return ops.pad(x, widths, constant_values=value)


def _round_up(x, m):
    return int(math.ceil(x / m) * m)
