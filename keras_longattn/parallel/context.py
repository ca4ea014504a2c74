"""Context parallelism on JAX: attention with the sequence axis sharded
across the devices of a mesh.

Exact algorithms, all run under ``jax.shard_map`` on one axis of a
:class:`keras.distribution.DeviceMesh` (or a ``jax.sharding.Mesh``), both
differentiable (the backward pass runs the same collectives in reverse):

* :func:`ring_attention`, full attention: each device keeps its block of
  queries and passes its block of keys and values around the ring, one
  neighbour per step; the attention parts of the ``P`` steps are merged
  exactly by their log-sum-exp. With ``causal=True`` and
  ``load_balance=True`` (default) the sequence is laid out in "zigzag"
  order (device ``i`` holds chunks ``i`` and ``2P - 1 - i`` of ``2P``
  chunks), so that every device computes the same number of visible
  query/key sub-blocks; invisible sub-blocks are skipped.
  Each device sends ``(P - 1) / P`` of the keys and values per pass:
  O(n) communication, O(n / P) memory per device (each step's scores are
  recomputed in the backward pass, not stored, with ``checkpoint=True``).
* :func:`halo_local_attention`, sliding-window attention
  (:class:`~keras_longattn.layers.LocalAttention`'s window): each device
  receives only the ``look_back`` keys and values before its block from
  its left neighbour and the ``look_ahead`` keys after it from its right
  neighbour (the halo), then runs the blocked O(n * w) band attention of
  :func:`keras_longattn.ops.local_attention` on its block: O(w)
  communication and O(n / P * w) memory per device.
* :func:`halo_longformer_attention`, Longformer's dilated window (a halo)
  and global tokens (shared from the first device, the global rows merged
  across devices by log-sum-exp): O(w + g) communication per device.
* :func:`halo_strided_attention`, the Sparse Transformer's strided
  pattern: the window part from a halo, the column part (every
  ``stride``-th key) on whole columns that one all-to-all deals out to the
  devices, merged by log-sum-exp: O(w + n / P) communication per device.

All take and return global arrays ``(B, T, H, d)`` (they may be traced
values inside a ``jax.jit``, e.g. a Keras layer's call under a
``keras.distribution`` distribution) and place the sequence axis on
``sequence_axis``; the batch and head axes may be sharded too
(``batch_axis``, ``head_axis``). Padding is given as ``key_mask``
``(B, S)`` (False for padded keys); a query that sees no key gets a zero
output, as in :func:`keras_longattn.ops.reference_attention`.

The layers run them themselves (their ``"context_parallel"`` paths) while
a :class:`~keras_longattn.parallel.ContextParallel` distribution is in
scope. Other Keras backends refuse: :func:`context_parallel_refusal` says
why.
"""

from __future__ import annotations


import numpy as np

from keras_longattn._validation import non_negative_int
from keras_longattn._validation import positive_int
from keras_longattn.kernels.constants import MASKED_LOGIT

__all__ = [
    "context_parallel_refusal",
    "halo_local_attention",
    "halo_longformer_attention",
    "halo_strided_attention",
    "ring_attention",
    "causal_schedule",
    "zigzag_order",
]


def context_parallel_refusal(backend=None):
    """Why context parallelism cannot run on ``backend`` (default: Keras'
    backend), or None when it can (JAX)."""
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if backend == "jax":
        return None
    return (
        "context parallelism runs on the JAX backend only (it shards the "
        "sequence with jax.shard_map and passes key/value blocks between "
        f"devices with jax.lax.ppermute); the Keras backend is {backend!r}"
    )


def _require_jax():
    reason = context_parallel_refusal()
    if reason is not None:
        raise NotImplementedError(reason)


def _shard_map(body, mesh, in_specs, out_specs):
    """``jax.shard_map`` without replication checks (``jax.experimental``'s
    on JAX releases before it moved)."""
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                     check_rep=False)


def _jax_mesh(mesh):
    import jax

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    backend_mesh = getattr(mesh, "backend_mesh", None)
    if isinstance(backend_mesh, jax.sharding.Mesh):
        return backend_mesh
    raise TypeError(
        "`mesh` must be a keras.distribution.DeviceMesh or a jax.sharding.Mesh. "
        f"Received: mesh={mesh!r}"
    )


def _axis_size(mesh, name, argument):
    if name is None:
        return 1
    if name not in mesh.shape:
        raise ValueError(
            f"`{argument}` must name an axis of the mesh {tuple(mesh.axis_names)}. "
            f"Received: {argument}={name!r}"
        )
    return int(mesh.shape[name])


def _check_shapes(query, key, value, key_mask):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 4:
            raise ValueError(
                f"`{name}` must have shape (batch, length, heads, head_dim). "
                f"Received: {name}.shape={tuple(x.shape)}"
            )
    if tuple(key.shape[:3]) != tuple(value.shape[:3]):
        raise ValueError(
            "`key` and `value` must agree on batch, length and heads. Received: "
            f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(
            "`query` and `key` must agree on batch and heads. Received: "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if query.shape[3] != key.shape[3]:
        raise ValueError(
            "`query` and `key` must have the same head size. Received: "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if key_mask is not None and tuple(key_mask.shape) != (key.shape[0], key.shape[1]):
        raise ValueError(
            "`key_mask` must have shape (batch, key_length) = "
            f"{(key.shape[0], key.shape[1])}. Received: key_mask.shape={tuple(key_mask.shape)}"
        )


def _check_divisible(length, parts, argument, what):
    if length % parts:
        raise ValueError(
            f"The sequence length must be a multiple of {parts} ({what}). "
            f"Received: {argument} length {length}"
        )


def _defaults(query, key, key_mask, scale):
    """A call's ``scale`` (``1 / sqrt(d)`` when None) and boolean key mask
    (every key real when None)."""
    import jax.numpy as jnp

    if scale is None:
        scale = 1.0 / float(query.shape[-1]) ** 0.5
    if key_mask is None:
        key_mask = jnp.ones(key.shape[:2], bool)
    return scale, jnp.asarray(key_mask).astype(bool)


def zigzag_order(length, num_devices):
    """The load-balanced causal layout of :func:`ring_attention`.

    Returns ``(order, inverse)``, int32 NumPy arrays: position ``j`` of the
    laid-out sequence holds token ``order[j]``, and ``x[inverse]`` undoes the
    layout. The sequence is cut into ``2 * num_devices`` chunks; device
    ``i`` (the ``i``-th contiguous shard) holds chunks ``i`` and
    ``2 * num_devices - 1 - i``.
    """
    if length % (2 * num_devices):
        raise ValueError(
            f"The zigzag layout needs a length divisible by 2 * num_devices = "
            f"{2 * num_devices}. Received: length={length}"
        )
    chunks = np.arange(length, dtype=np.int32).reshape(2 * num_devices, -1)
    order = np.concatenate(
        [np.concatenate([chunks[i], chunks[2 * num_devices - 1 - i]])
         for i in range(num_devices)]
    )
    return order, np.argsort(order).astype(np.int32)


def causal_schedule(length, num_devices):
    """Which query/key sub-blocks a causal ring pass in zigzag layout
    computes: a boolean NumPy array ``(step, device, query_chunk,
    key_chunk)``, shape ``(P, P, 2, 2)``.

    At step ``s`` device ``i`` holds the keys of device ``(i - s) mod P``;
    its two query chunks and the two key chunks it holds form four
    sub-blocks, computed when one of their query positions is at or after
    one of their key positions (the others are skipped). Every device
    computes the same number of sub-blocks (the load balance).
    """
    order, _ = zigzag_order(length, num_devices)
    chunks = order.reshape(num_devices, 2, -1)  # device, chunk, positions
    last = chunks.max(axis=-1)
    first = chunks.min(axis=-1)
    table = np.zeros((num_devices, num_devices, 2, 2), bool)
    for step in range(num_devices):
        for device in range(num_devices):
            source = (device - step) % num_devices
            table[step, device] = last[device][:, None] >= first[source][None, :]
    return table


def _specs(batch_axis, sequence_axis, head_axis):
    from jax.sharding import PartitionSpec as P

    tokens = P(batch_axis, sequence_axis, head_axis, None)
    positions = P(sequence_axis)
    mask = P(batch_axis, sequence_axis)
    return tokens, positions, mask


def _masked_part(q, k, v, q_pos, k_pos, k_mask, causal):
    """Attention of ``q`` (scaled) over one key block: ``(out, lse)`` in
    float32, ``out`` normalised, ``lse`` ``(B, T, H)`` (about
    ``MASKED_LOGIT`` where a query sees no key of the block), as
    :func:`keras_longattn.ops.merge_attention_parts` takes them."""
    import jax.numpy as jnp

    from keras_longattn.ops.reference import softmax_with_lse

    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
    visible = k_mask[:, None, None, :]
    if causal:
        visible = jnp.logical_and(visible, (q_pos[:, None] >= k_pos[None, :])[None, None])
    probs, lse = softmax_with_lse(scores, visible)
    out = jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out, jnp.transpose(lse, (0, 2, 1))


def _merge(out, lse, part_out, part_lse):
    import jax.numpy as jnp

    new_lse = jnp.logaddexp(lse, part_lse)
    out = (out * jnp.exp(lse - new_lse)[..., None]
           + part_out * jnp.exp(part_lse - new_lse)[..., None])
    return out, new_lse


def _empty_part(q, v):
    import jax.numpy as jnp

    b, t, h = q.shape[:3]
    return (jnp.zeros((b, t, h, v.shape[-1]), jnp.float32),
            jnp.full((b, t, h), MASKED_LOGIT, jnp.float32))


def _halo(x, size, take_last, num, axis):
    """The ``size`` last (``take_last``) or first positions of each device's
    block ``x`` ``(B, c, ...)``, sent to the next (resp. previous) device on
    ``axis``; a device with no neighbour on that side gets zeros (False)."""
    import jax
    import jax.numpy as jnp

    piece = x[:, -size:] if take_last else x[:, :size]
    if num == 1:
        return jnp.zeros_like(piece)
    pairs = ([(i, i + 1) for i in range(num - 1)] if take_last
             else [(i + 1, i) for i in range(num - 1)])
    return jax.lax.ppermute(piece, axis, pairs)


def _with_halo(x, before, after, num=None, axis=None):
    """``x`` ``(B, c, ...)`` between its neighbours' ``before`` last and
    ``after`` first positions (:func:`_halo`), or between zeros when
    ``axis`` is None (the rows of a halo that is computed and dropped)."""
    import jax.numpy as jnp

    def side(size, take_last):
        if not size:
            return None
        if axis is None:
            return jnp.zeros((x.shape[0], size) + tuple(x.shape[2:]), x.dtype)
        return _halo(x, size, take_last, num, axis)

    pieces = (side(before, True), x, side(after, False))
    return jnp.concatenate([p for p in pieces if p is not None], axis=1)


def _causal_block(q, k, v, q_pos, k_pos, k_mask, visible):
    """The causal part of one ring step in zigzag layout: the queries' two
    chunks against the keys' two chunks, sub-block ``(a, c)`` computed only
    where ``visible[a, c]`` (a row of :func:`causal_schedule`)."""
    import jax
    import jax.numpy as jnp

    tq, tk = q.shape[1] // 2, k.shape[1] // 2
    outs, lses = [], []
    for a in range(2):
        qa = q[:, a * tq:(a + 1) * tq]
        qpa = q_pos[a * tq:(a + 1) * tq]
        out, lse = _empty_part(qa, v)
        for c in range(2):
            kc = k[:, c * tk:(c + 1) * tk]
            vc = v[:, c * tk:(c + 1) * tk]
            kpc = k_pos[c * tk:(c + 1) * tk]
            kmc = k_mask[:, c * tk:(c + 1) * tk]
            part = jax.lax.cond(
                visible[a, c],
                lambda qa=qa, kc=kc, vc=vc, qpa=qpa, kpc=kpc, kmc=kmc: _masked_part(
                    qa, kc, vc, qpa, kpc, kmc, True),
                lambda qa=qa, vc=vc: _empty_part(qa, vc),
            )
            out, lse = _merge(out, lse, *part)
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def ring_attention(
    query,
    key,
    value,
    *,
    mesh,
    sequence_axis,
    batch_axis=None,
    head_axis=None,
    causal=False,
    key_mask=None,
    scale=None,
    load_balance=True,
    checkpoint=True,
):
    """Full (softmax) attention with the sequence sharded over a mesh axis:
    ring attention.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        mesh: a ``keras.distribution.DeviceMesh`` or ``jax.sharding.Mesh``.
        sequence_axis: the mesh axis the sequence is sharded over (``P``
            devices); ``T`` and ``S`` must be multiples of ``P`` (of ``2P``
            with the causal load-balanced layout).
        batch_axis: optional mesh axis the batch is sharded over.
        head_axis: optional mesh axis the heads are sharded over.
        causal: query ``i`` sees keys ``0 .. i`` (needs ``T == S``).
        key_mask: optional boolean ``(B, S)``, False for padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        load_balance: with ``causal``, lay the sequence out in zigzag order
            (:func:`zigzag_order`) so that every device has the same work;
            the result is returned in the input's order.
        checkpoint: recompute each step's scores in the backward pass
            instead of storing them (O(n / P) memory per device rather than
            O(n^2 / P)).

    Returns:
        ``(B, T, H, dv)`` in ``query``'s dtype, equal to
        :func:`keras_longattn.ops.reference_attention` with the same mask.
    """
    _require_jax()
    import jax
    import jax.numpy as jnp

    _check_shapes(query, key, value, key_mask)
    jmesh = _jax_mesh(mesh)
    num = _axis_size(jmesh, sequence_axis, "sequence_axis")
    _axis_size(jmesh, batch_axis, "batch_axis")
    _axis_size(jmesh, head_axis, "head_axis")
    T, S = int(query.shape[1]), int(key.shape[1])
    if causal and T != S:
        raise ValueError(
            "causal ring attention needs query and key of the same length. "
            f"Received: query length {T}, key length {S}"
        )
    zigzag = bool(causal and load_balance and num > 1)
    parts = 2 * num if zigzag else num
    _check_divisible(T, parts, "query", "2 x the devices of the sequence axis" if zigzag
                     else "the devices of the sequence axis")
    _check_divisible(S, parts, "key", "2 x the devices of the sequence axis" if zigzag
                     else "the devices of the sequence axis")
    scale, key_mask = _defaults(query, key, key_mask, scale)
    dtype = query.dtype
    q_pos = np.arange(T, dtype=np.int32)
    k_pos = np.arange(S, dtype=np.int32)
    inverse = None
    if zigzag:
        order, inverse = zigzag_order(T, num)
        query, key, value = (jnp.take(x, order, axis=1) for x in (query, key, value))
        key_mask = jnp.take(key_mask, order, axis=1)
        q_pos, k_pos = order, order
    q_pos, k_pos = jnp.asarray(q_pos), jnp.asarray(k_pos)

    schedule = causal_schedule(T, num) if zigzag else None

    def step(q, k, v, qp, kp, km, visible):
        if zigzag:
            return _causal_block(q, k, v, qp, kp, km, visible)
        return _masked_part(q, k, v, qp, kp, km, causal)

    if checkpoint:
        step = jax.checkpoint(step)
    ring = [(i, (i + 1) % num) for i in range(num)]

    table = None if schedule is None else jnp.asarray(schedule)

    def body(q, k, v, qp, kp, km):
        q = q * jnp.asarray(scale, q.dtype)
        device = jax.lax.axis_index(sequence_axis)

        # One ring step per iteration of a scan: the buffers of a step are
        # reused by the next (an unrolled loop lets XLA keep every step's).
        def one(carry, i):
            out, lse, k, v, kp, km = carry
            visible = None if table is None else table[i, device]
            out, lse = _merge(out, lse, *step(q, k, v, qp, kp, km, visible))
            k, v, kp, km = (jax.lax.ppermute(x, sequence_axis, ring) for x in (k, v, kp, km))
            return (out, lse, k, v, kp, km), None

        out, lse = _empty_part(q, v)
        carry = (out, lse, k, v, kp, km)
        if num > 1:
            carry, _ = jax.lax.scan(one, carry, jnp.arange(num - 1))
        out, lse, k, v, kp, km = carry
        last = None if table is None else table[num - 1, device]
        out, lse = _merge(out, lse, *step(q, k, v, qp, kp, km, last))
        return out.astype(dtype)

    tokens, positions, mask = _specs(batch_axis, sequence_axis, head_axis)
    run = _shard_map(body, jmesh, (tokens, tokens, tokens, positions, positions, mask), tokens)
    out = run(query, key, value, q_pos, k_pos, key_mask)
    if inverse is not None:
        out = jnp.take(out, inverse, axis=1)
    return out


def halo_local_attention(
    query,
    key,
    value,
    *,
    mesh,
    sequence_axis,
    look_back,
    look_ahead=0,
    batch_axis=None,
    head_axis=None,
    key_mask=None,
    scale=None,
    block_size=None,
):
    """Sliding-window attention (query ``i`` sees keys ``i - look_back ..
    i + look_ahead``) with the sequence sharded over a mesh axis, exchanging
    only the window's halo with the neighbouring devices.

    Args:
        query, key, value: ``(B, n, H, d)``, ``(B, n, H, d)``,
            ``(B, n, H, dv)``: self-attention lengths (``T == S``), a
            multiple of the ``P`` devices of ``sequence_axis``, with
            ``n / P >= max(look_back, look_ahead)`` (the halo comes from one
            neighbour on each side).
        mesh, sequence_axis, batch_axis, head_axis: as :func:`ring_attention`.
        look_back: keys visible before the query (``window - 1`` for a causal
            :class:`~keras_longattn.layers.LocalAttention`).
        look_ahead: keys visible after the query (0 when causal).
        key_mask: optional boolean ``(B, n)``, False for padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        block_size: block length of the per-device band attention
            (:func:`keras_longattn.ops.local_attention`).

    Returns:
        ``(B, n, H, dv)``, equal to :func:`keras_longattn.ops.local_attention`
        on one device.
    """
    _require_jax()
    import jax.numpy as jnp

    from keras_longattn.ops import local_attention

    _check_shapes(query, key, value, key_mask)
    look_back = non_negative_int("look_back", look_back)
    look_ahead = non_negative_int("look_ahead", look_ahead)
    jmesh = _jax_mesh(mesh)
    num = _axis_size(jmesh, sequence_axis, "sequence_axis")
    _axis_size(jmesh, batch_axis, "batch_axis")
    _axis_size(jmesh, head_axis, "head_axis")
    n = int(query.shape[1])
    if int(key.shape[1]) != n:
        raise ValueError(
            "halo_local_attention needs query and key of the same length. "
            f"Received: query length {n}, key length {int(key.shape[1])}"
        )
    _check_divisible(n, num, "query", "the devices of the sequence axis")
    shard = n // num
    if num > 1 and max(look_back, look_ahead) > shard:
        raise ValueError(
            f"Each device holds {shard} positions (length {n} over {num} devices), fewer "
            "than the window extent: the halo would span more than one neighbour. "
            f"Received: look_back={look_back}, look_ahead={look_ahead}"
        )
    key_mask = _defaults(query, key, key_mask, scale)[1]
    def body(q, k, v, km):
        # Only keys, values and their mask travel; the halo's query rows are
        # zeros, computed and dropped (O(w) extra rows per device).
        qe = _with_halo(q, look_back, look_ahead)
        ke, ve, kme = (_with_halo(x, look_back, look_ahead, num, sequence_axis)
                       for x in (k, v, km))
        out = local_attention(qe, ke, ve, look_back, look_ahead, block_size=block_size,
                              key_mask=kme, scale=scale)
        return out[:, look_back:look_back + q.shape[1]]

    tokens, _, mask = _specs(batch_axis, sequence_axis, head_axis)
    run = _shard_map(body, jmesh, (tokens, tokens, tokens, mask), tokens)
    return run(query, key, value, key_mask)


def _from_first_device(x, axis):
    """``x`` of the first device of ``axis`` on every device (the others
    contribute zeros to one sum)."""
    import jax
    import jax.numpy as jnp

    first = jax.lax.axis_index(axis) == 0
    if x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(first, x, False).astype(jnp.int32), axis) > 0
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axis)


def halo_longformer_attention(
    query,
    key,
    value,
    *,
    mesh,
    sequence_axis,
    window,
    dilation=1,
    causal=False,
    global_tokens=0,
    global_query=None,
    global_key=None,
    global_value=None,
    batch_axis=None,
    key_mask=None,
    scale=None,
    block_size=None,
):
    """Longformer attention (:class:`~keras_longattn.layers.LongformerAttention`'s
    pattern: a dilated sliding window plus the first ``global_tokens``
    positions as global tokens) with the sequence sharded over a mesh axis.

    What travels between devices: the window's halo (``dilation x`` the
    window's extent, keys, values and their mask) from the neighbouring
    devices; the global tokens' keys and values and the global queries'
    partial results (sums over each device's keys, merged by their
    log-sum-exp): O(w + g) per device, independent of the sequence length.

    Args:
        query, key, value: ``(B, n, H, d)``, ``(B, n, H, d)``, ``(B, n, H, dv)``:
            the ordinary projections, ``n`` a multiple of the ``P`` devices of
            ``sequence_axis``, with ``n / P`` at least the halo
            (``max(dilation) x window`` causal, half that otherwise) and at
            least ``global_tokens``.
        mesh, sequence_axis, batch_axis: as :func:`ring_attention` (heads
            are not sharded: a head's dilation is a static property).
        window: ``w``, even: ``w`` keys before the query when causal, ``w / 2``
            on each side otherwise (:func:`keras_longattn.ops.longformer.window_extents`).
        dilation: one int or one per head.
        causal: query ``i`` sees keys ``j <= i`` only (global ones too).
        global_tokens: ``g``: positions ``0 .. g - 1`` are global.
        global_query: ``(B, g, H, d)``: the global query projections of
            the global positions (default: their ordinary queries).
        global_key, global_value: ``(B, n, H, d)`` / ``(B, n, H, dv)``: the
            global key and value projections of every position (default:
            ``key`` and ``value``).
        key_mask: optional boolean ``(B, n)``, False for padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        block_size: block length of the per-device band.

    Returns:
        ``(B, n, H, dv)``, equal to
        :func:`keras_longattn.ops.longformer.longformer_attention` on one
        device with the slots of ``global_tokens``.
    """
    _require_jax()
    import jax
    import jax.numpy as jnp

    from keras_longattn.ops.blocked import dilated_band_attention
    from keras_longattn.ops.longformer import _dilation_groups, check_dilation, window_extents

    _check_shapes(query, key, value, key_mask)
    jmesh = _jax_mesh(mesh)
    num = _axis_size(jmesh, sequence_axis, "sequence_axis")
    _axis_size(jmesh, batch_axis, "batch_axis")
    n, H = int(query.shape[1]), int(query.shape[2])
    if int(key.shape[1]) != n:
        raise ValueError(
            "halo_longformer_attention needs query and key of the same length. "
            f"Received: query length {n}, key length {int(key.shape[1])}")
    _check_divisible(n, num, "query", "the devices of the sequence axis")
    dilations = check_dilation(dilation, H)
    look_back, look_ahead = window_extents(window, causal)
    reach = max(dilations)
    before, after = reach * look_back, reach * look_ahead
    shard = n // num
    g = non_negative_int("global_tokens", global_tokens)
    if num > 1 and max(before, after) > shard:
        raise ValueError(
            f"Each device holds {shard} positions (length {n} over {num} devices), fewer than "
            f"the dilated window's reach {max(before, after)}: the halo would span more than "
            f"one neighbour. Received: window={window}, dilation={dilation!r}")
    if g > shard:
        raise ValueError(
            f"The global tokens must lie on the first device, which holds {shard} positions. "
            f"Received: global_tokens={g}")
    scale, key_mask = _defaults(query, key, key_mask, scale)
    dtype = query.dtype
    global_key = key if global_key is None else global_key
    global_value = value if global_value is None else global_value
    if g and global_query is None:
        global_query = query[:, :g]
    if g and tuple(global_query.shape) != (query.shape[0], g) + tuple(query.shape[2:]):
        raise ValueError(
            "`global_query` must have shape (batch, global_tokens, heads, head_dim) = "
            f"{(query.shape[0], g) + tuple(query.shape[2:])}. "
            f"Received: global_query.shape={tuple(global_query.shape)}")
    groups = _dilation_groups(dilations)

    def body(q, k, v, km, kg, vg, qg):
        c = q.shape[1]
        device = jax.lax.axis_index(sequence_axis)
        position = device * c + jnp.arange(c)
        qe = _with_halo(q, before, after)
        ke, ve, kme = (_with_halo(x, before, after, num, sequence_axis) for x in (k, v, km))
        # The band leaves the global keys to the global part.
        ext_position = device * c - before + jnp.arange(qe.shape[1])
        band_keys = jnp.logical_and(kme, (ext_position >= g)[None])
        outs, lses, order = [], [], []
        for r, heads in groups.items():
            pick = np.asarray(heads)
            out, lse = dilated_band_attention(
                qe[:, :, pick], ke[:, :, pick], ve[:, :, pick], look_back, look_ahead, r,
                block_size=block_size, key_mask=band_keys, scale=scale)
            outs.append(out[:, before:before + c])
            lses.append(lse[:, before:before + c])
            order.extend(heads)
        inverse = np.argsort(np.asarray(order))
        out = jnp.concatenate(outs, axis=2)[:, :, inverse].astype(jnp.float32)
        lse = jnp.concatenate(lses, axis=2)[:, :, inverse]
        if not g:
            return out.astype(dtype)
        scaled = q * jnp.asarray(scale, q.dtype)
        # Every query against the global keys (ordinary projections).
        gk, gv, gm = (x[:, :g] if num == 1 else _from_first_device(x[:, :g], sequence_axis)
                      for x in (k, v, km))
        g_pos = jnp.arange(g)
        part = _masked_part(scaled, gk, gv, position, g_pos, gm, causal)
        out, lse = _merge(out, lse, *part)
        # The global rows: each global query against every key (global
        # projections), a partial sum per device merged across devices.
        rows, row_lse = _masked_part(qg * jnp.asarray(scale, qg.dtype), kg, vg, g_pos,
                                     position, km, causal)
        if num > 1:
            # A shift for stability only (the merge does not depend on it).
            top = jax.lax.pmax(jax.lax.stop_gradient(row_lse), sequence_axis)
            weight = jnp.exp(row_lse - top)
            total = jax.lax.psum(weight, sequence_axis)
            rows = jax.lax.psum(rows * weight[..., None], sequence_axis) / total[..., None]
        is_global = (position < g)[None, :, None, None]
        rows = jnp.pad(rows, ((0, 0), (0, max(c - g, 0)), (0, 0), (0, 0)))[:, :c]
        out = jnp.where(is_global, rows, out)
        return out.astype(dtype)

    tokens, _, mask = _specs(batch_axis, sequence_axis, None)
    from jax.sharding import PartitionSpec as P

    replicated = P(batch_axis, None, None, None)
    run = _shard_map(body, jmesh,
                     (tokens, tokens, tokens, mask, tokens, tokens, replicated), tokens)
    if not g:
        global_query = jnp.zeros((query.shape[0], 0) + tuple(query.shape[2:]), query.dtype)
    return run(query, key, value, key_mask, global_key, global_value, global_query)


def _to_columns(x, stride, axis):
    """A device's block ``x`` ``(B, c, ...)`` (``c`` a multiple of
    ``stride``) as ``(B, n / stride, stride / P, ...)``: the whole sequence's
    rows for this device's share of the ``stride`` columns (residues), by
    one all-to-all over ``axis``."""
    import jax

    b, c = x.shape[:2]
    rows = x.reshape((b, c // stride, stride) + tuple(x.shape[2:]))
    return jax.lax.all_to_all(rows, axis, 2, 1, tiled=True)


def _from_columns(x, axis):
    """The inverse of :func:`_to_columns`: ``(B, n / stride, stride / P,
    ...)`` back to the device's block ``(B, c, ...)``."""
    import jax

    rows = jax.lax.all_to_all(x, axis, 1, 2, tiled=True)
    b, r, s = rows.shape[:3]
    return rows.reshape((b, r * s) + tuple(rows.shape[3:]))


def _column_part(q, k, v, km, causal, skip_self):
    """Attention within each column of the sequence seen as
    ``(n / stride, stride)``: ``q``, ``k``, ``v`` ``(B, R, C, H, d)``
    (``R`` rows, ``C`` columns), ``km`` ``(B, R, C)``. Row ``a`` sees rows
    ``a'`` of its column (``a' <= a`` when ``causal``; ``a' != a`` when
    ``skip_self``). Returns ``(out, lse)`` in float32, ``(B, R, C, H, dv)``
    and ``(B, R, C, H)``."""
    import jax.numpy as jnp

    from keras_longattn.ops.reference import softmax_with_lse

    rows = q.shape[1]
    scores = jnp.einsum("bachd,bxchd->bchax", q, k, preferred_element_type=jnp.float32)
    a = np.arange(rows)
    allowed = np.ones((rows, rows), bool)
    if causal:
        allowed &= a[:, None] >= a[None, :]
    if skip_self:
        allowed &= a[:, None] != a[None, :]
    visible = jnp.logical_and(jnp.transpose(km, (0, 2, 1))[:, :, None, None, :],
                              jnp.asarray(allowed)[None, None, None])
    probs, lse = softmax_with_lse(scores, visible)
    out = jnp.einsum("bchax,bxchd->bachd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out, jnp.transpose(lse, (0, 3, 1, 2))


def halo_strided_attention(
    query,
    key,
    value,
    *,
    mesh,
    sequence_axis,
    stride,
    combination="merged",
    causal=False,
    batch_axis=None,
    key_mask=None,
    scale=None,
    block_size=None,
):
    """Strided Sparse Transformer attention
    (:class:`~keras_longattn.layers.SparseAttention` with
    ``pattern="strided"``) with the sequence sharded over a mesh axis.

    The pattern's two parts, with ``l = stride``: A, the window of the
    ``l - 1`` previous keys (and ``l - 1`` next ones when not causal), runs
    as :func:`halo_local_attention` does, from the ``l - 1`` keys each
    neighbour sends (the halo); B, every ``l``-th key (``j = i mod l``), runs
    on the sequence seen as ``(n / l, l)``: one all-to-all gives each device
    ``l / P`` whole columns (the keys of a column lie on every device), the
    attention within each column is local, and a second all-to-all returns
    the outputs and their log-sum-exps. What travels per device: O(l) halo
    positions and ``(P - 1) / P`` of its own block of queries, keys and
    values for B (O(n / P), never the O(n) keys of an all-gather). With
    ``"merged"`` the two parts are merged by their log-sum-exp (a key in
    both, the query's own position, counts once).

    Args:
        query, key, value: ``(B, n, H, d)``, ``(B, n, H, d)``,
            ``(B, n, H, dv)``: self-attention, each device's block
            ``n / P`` a multiple of ``stride``.
        mesh, sequence_axis, batch_axis: as :func:`ring_attention` (heads
            are not sharded: ``"multihead"`` gives them different parts).
        stride: ``l``, a multiple of the ``P`` devices of ``sequence_axis``
            (B's columns are dealt out ``l / P`` per device).
        combination: ``"merged"`` (every head A and B in one softmax),
            ``"multihead"`` (the first ``ceil(H / 2)`` heads A, the others
            B), ``"first"`` (A) or ``"second"`` (B), as
            :func:`keras_longattn.ops.sparse.sparse_head_patterns`.
        causal: query ``i`` sees keys ``j <= i`` only.
        key_mask: optional boolean ``(B, n)``, False for padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        block_size: block length of the per-device band of part A.

    Returns:
        ``(B, n, H, dv)``, equal to
        :func:`keras_longattn.ops.sparse.sparse_attention` with
        ``pattern="strided"`` on one device.
    """
    _require_jax()
    import jax.numpy as jnp

    from keras_longattn.ops.blocked import dilated_band_attention
    from keras_longattn.ops.sparse import check_sparse_combination
    from keras_longattn.ops.sparse import multihead_split

    _check_shapes(query, key, value, key_mask)
    check_sparse_combination(combination)
    jmesh = _jax_mesh(mesh)
    num = _axis_size(jmesh, sequence_axis, "sequence_axis")
    _axis_size(jmesh, batch_axis, "batch_axis")
    n, H = int(query.shape[1]), int(query.shape[2])
    if int(key.shape[1]) != n:
        raise ValueError(
            "halo_strided_attention needs query and key of the same length. "
            f"Received: query length {n}, key length {int(key.shape[1])}")
    l = positive_int("stride", stride)
    _check_divisible(n, num, "query", "the devices of the sequence axis")
    shard = n // num
    if shard % l:
        raise ValueError(
            f"Each device's block ({shard} positions: length {n} over {num} devices) must be "
            f"a multiple of the stride, so that no row of the (n / stride, stride) layout "
            f"straddles two devices. Received: stride={l}")
    if l % num:
        raise ValueError(
            f"`stride` must be a multiple of the {num} devices of the sequence axis (each "
            f"device takes stride / devices whole columns). Received: stride={l}")
    scale, key_mask = _defaults(query, key, key_mask, scale)
    dtype = query.dtype
    heads_a = {"multihead": multihead_split(H), "merged": H, "first": H,
               "second": 0}[combination]
    heads_b = {"multihead": H - heads_a, "merged": H, "first": 0, "second": H}[combination]
    before, after = l - 1, 0 if causal else l - 1

    def band(q, k, v, km):
        qe = _with_halo(q, before, after)
        ke, ve, kme = (_with_halo(x, before, after, num, sequence_axis) for x in (k, v, km))
        out, lse = dilated_band_attention(qe, ke, ve, before, after, 1, block_size=block_size,
                                          key_mask=kme, scale=scale)
        c = q.shape[1]
        return (out[:, before:before + c].astype(jnp.float32), lse[:, before:before + c])

    def columns(q, k, v, km):
        qc, kc, vc, kmc = (_to_columns(x, l, sequence_axis) for x in (q, k, v, km))
        out, lse = _column_part(qc * jnp.asarray(scale, qc.dtype), kc, vc, kmc, causal,
                                skip_self=combination == "merged")
        return _from_columns(out, sequence_axis), _from_columns(lse, sequence_axis)

    def body(q, k, v, km):
        if combination == "merged":
            out, lse = _merge(*band(q, k, v, km), *columns(q, k, v, km))
            return out.astype(dtype)
        pieces = []
        if heads_a:
            pieces.append(band(q[:, :, :heads_a], k[:, :, :heads_a], v[:, :, :heads_a], km)[0])
        if heads_b:
            pieces.append(columns(q[:, :, heads_a:], k[:, :, heads_a:], v[:, :, heads_a:],
                                  km)[0])
        return jnp.concatenate(pieces, axis=2).astype(dtype)

    tokens, _, mask = _specs(batch_axis, sequence_axis, None)
    run = _shard_map(body, jmesh, (tokens, tokens, tokens, mask), tokens)
    return run(query, key, value, key_mask)
