"""The ``implementation="flex"`` paths of the block-sparse layers (torch only):
PyTorch's FlexAttention (``torch.nn.attention.flex_attention``).

FlexAttention computes attention under a ``mask_mod(b, h, q_idx, kv_idx)``
evaluated inside a compiled kernel, visiting only the tiles that a
``BlockMask`` lists. Here both come from the layer's own pattern object:
the layer builds its :mod:`keras_longattn.ops` pattern (``LocalPattern``,
``StridedPattern & CausalPattern``, ``Difference(B, A)``, ...) and passes
it in; this module never imports :mod:`keras_longattn.ops` and never
restates a predicate. ``pattern.allowed(q_pos, k_pos)`` is evaluated

* by :func:`block_structure`, on the pairs of the candidate tiles that the
  pattern lists (``pattern.candidate_tiles``: from its segments, in time
  that grows with the tiles listed, never with ``T * S``), to tell for
  each tile of :data:`BLOCK` x :data:`BLOCK` pairs whether it holds an
  allowed pair (*partial*) or only allowed pairs (*full*): the
  ``BlockMask``, built once per shapes, pattern and device
  (:data:`MAX_STRUCTURES` kept);
* by FlexAttention's kernel, as the ``mask_mod``, on the pairs of the
  partial tiles (with the call's data: key padding, global slots,
  cluster positions; a call with such data has only partial tiles).

Tokens keep their original positions when an arrangement reorders them
(the columns of a stride, the residues of a dilation, the summary keys, a
cluster's members), so the predicate means exactly what it means in the
dense reference. Arrangements, as in the Pallas paths
(``keras_longattn/ops/block_sparse.py``):

* band (local attention, strided A, fixed A): tokens in order;
* columns (strided B, a Longformer dilation ``r``): tokens sorted by
  ``position mod l`` (then position), each residue contiguous;
* summary keys (fixed B): every query in order against the keys in the
  last ``c`` cells of each block;
* Longformer: per dilation, the arranged keys followed by the ``G`` global
  keys (one softmax over both, as ``"blocked_fused"``), then the global
  rows (the global queries against every key) written over their rows;
* BigBird: tokens in order; the tiles are the layer's own block mask
  (per example when keys are padded) coarsened to :data:`BLOCK`;
* Routing: each head's tokens gathered cluster by cluster, the clusters
  block-diagonal "documents"; a query's output is the mean over the
  clusters in which it sees a key.

Only the Sparse Transformer's strided ``"merged"`` combination merges two
parts by log-sum-exp (its parts need different arrangements of the
queries); the fixed ``"merged"`` one appends the summary keys to the keys
in order and runs one softmax.

Compilation: FlexAttention is fused only under ``torch.compile``. Each
distinct call (the site, the pattern, the shapes, dtype and device) gets
its own compiled function (:data:`MAX_COMPILED` kept), built on a fresh
code object: TorchDynamo keeps compiled graphs, and counts recompilations
against ``recompile_limit`` (8), per code object, and one shared function
would fall back to the unfused eager computation after 8 patterns or
shapes. The entry points themselves stay eager inside a
``torch.compile``-d model (``torch.compiler.disable``, as the other torch
kernels of :mod:`keras_longattn.kernels`): the model's graph breaks there
and the entry point runs its own compiled function.

On the CPU, torch 2.13's FlexAttention runs forward only (see
:func:`refusal`): no input may require grad, no log-sum-exp is returned,
and only float32, bfloat16 and float16 inputs of one dtype are taken.

Shape legend: B batch, T query length, S key length, H heads, d head
size, dv value head size, G global slots, k clusters, wq / wk queries /
keys per cluster.
"""

import collections
import contextlib
import itertools
import sys
import types
import warnings

import numpy as np
import torch

from keras_longattn.kernels import arrangements
from keras_longattn.kernels.arrangements import column_order
from keras_longattn.kernels.arrangements import summary_positions

try:
    from torch.nn.attention import flex_attention as _flex_module
except ImportError:  # torch < 2.5
    _flex_module = None

#: Tile of the block masks (FlexAttention's default sparse block size).
BLOCK = 128
#: Block masks kept (least recently used dropped first).
MAX_STRUCTURES = 128
#: Compiled functions kept (least recently used dropped first).
MAX_COMPILED = 128
#: Most (query, key) pairs evaluated at once while a block mask is built.
STRUCTURE_PAIRS = 1 << 24
#: Dtypes FlexAttention takes (on the CPU, the only ones).
DTYPES = ("float32", "bfloat16", "float16")

#: Why calls that need gradients are refused on the CPU (torch 2.13).
CPU_GRAD_REASON = (
    "FlexAttention on the CPU runs forward only (torch: 'FlexAttention does "
    "not support backward on CPU'): call the layer under torch.no_grad(), "
    "with layer.trainable = False and inputs that do not require grad, or "
    "on a GPU"
)
#: Why calls that merge parts by log-sum-exp are refused on the CPU.
CPU_LSE_REASON = (
    "FlexAttention on the CPU returns no log-sum-exp (torch: 'torch.compile "
    "on CPU only supports inference and `return_lse` is not supported yet'), "
    "which this call needs to merge its parts"
)


# ----------------------------------------------------------------- refusal
def available():
    """Whether this torch has FlexAttention."""
    return _flex_module is not None


def _device():
    from keras.src.backend.torch.core import get_device

    return torch.device(get_device())


def _cpu_refusal():
    """Why the compiled CPU kernel cannot run on this machine (None: it can)."""
    if sys.platform == "darwin":
        return "torch's CPU FlexAttention kernel is not built for macOS"
    try:
        from torch._inductor.kernel.flex import flex_cpu
    except ImportError:
        flex_cpu = None
    if flex_cpu is not None and not flex_cpu.check_cpu_supported():
        return ("torch's CPU FlexAttention kernel needs AVX2 (and "
                "ATEN_CPU_CAPABILITY other than 'default') and no XPU device")
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except ImportError:
        pass
    except Exception as error:  # no compiler: TorchInductor cannot build the kernel
        return f"TorchInductor finds no C++ compiler for the CPU kernel ({error})"
    return None


def refusal(dtype, trainable=False, needs_lse=False):
    """Why FlexAttention cannot run a call here (None: it can), decided
    before any tensor exists.

    Args:
        dtype: the compute dtype of the call.
        trainable: whether the call's query, key and value come from
            trainable weights, so that with gradients enabled
            (``torch.is_grad_enabled()``) they require grad.
        needs_lse: whether the call merges parts by their log-sum-exps.

    Refused: a torch without FlexAttention; dtypes other than float32,
    bfloat16 and float16; and on the CPU (torch 2.13): gradients (torch
    raises ``NotImplementedError: FlexAttention does not support backward
    on CPU``), a log-sum-exp (``torch.compile on CPU only supports
    inference and `return_lse` is not supported yet``), a machine whose
    CPU kernel torch does not build (no AVX2, ``ATEN_CPU_CAPABILITY=default``,
    an XPU device, macOS) or without a C++ compiler.
    """
    if _flex_module is None:
        return (f"FlexAttention (torch.nn.attention.flex_attention) is missing "
                f"from torch {torch.__version__}; it needs torch >= 2.5")
    dtype = str(dtype).replace("torch.", "")
    if dtype not in DTYPES:
        return f"FlexAttention takes float32, bfloat16 or float16 (compute dtype {dtype})"
    if _device().type == "cpu":
        reason = _cpu_refusal()
        if reason is not None:
            return reason
        if trainable and torch.is_grad_enabled():
            return CPU_GRAD_REASON
        if needs_lse:
            return CPU_LSE_REASON
    return None


def _check(query, key, value):
    """Tensors as FlexAttention takes them, or a ValueError (what
    :func:`refusal` cannot see before the call: an input that requires grad
    on the CPU)."""
    if _flex_module is None:
        raise ValueError(refusal("float32"))
    query, key, value = (torch.as_tensor(t) for t in (query, key, value))
    if query.device.type == "cpu" and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(CPU_GRAD_REASON)
    dtype = str(query.dtype).replace("torch.", "")
    if dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            "FlexAttention takes float32, bfloat16 or float16 inputs of one dtype. "
            f"Received: query {query.dtype}, key {key.dtype}, value {value.dtype}")
    return query, key, value


# ------------------------------------------------------------------ caches
class _Cache:
    """A small least-recently-used dictionary."""

    def __init__(self, size):
        self.size = int(size)
        self.items = collections.OrderedDict()

    def get(self, key, make):
        value = self.items.get(key)
        if value is None:
            value = make()
            self.items[key] = value
            if len(self.items) > self.size:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return value

    def clear(self):
        self.items.clear()


_STRUCTURES = _Cache(MAX_STRUCTURES)
_COMPILED = _Cache(MAX_COMPILED)
#: Whole BlockMasks of calls whose mask_mod reads no per-call tensor (no
#: padding): building one costs more than a short kernel.
_MASKS = _Cache(MAX_STRUCTURES)


def clear_caches():
    """Drops every cached block mask and compiled function."""
    _STRUCTURES.clear()
    _COMPILED.clear()
    _MASKS.clear()


def compiled_count():
    """How many compiled functions are cached (one per distinct call)."""
    return len(_COMPILED.items)


def _flex_call(query, key, value, block_mask, scale, return_lse):
    """One FlexAttention call: ``out`` or ``(out, lse)`` (natural log)."""
    fa = _flex_module
    if not return_lse:
        return fa.flex_attention(query, key, value, block_mask=block_mask, scale=scale)
    if hasattr(fa, "AuxRequest"):
        out, aux = fa.flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                                     return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return fa.flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                             return_lse=True)


_COPIES = itertools.count()


def _compiled(key):
    """The compiled :func:`_flex_call` of one distinct call (see the module
    docstring): a copy on its own code object, so that its graph and its
    recompilations are its own."""

    def make():
        code = _flex_call.__code__.replace(co_name=f"_flex_call_{next(_COPIES)}")
        fn = types.FunctionType(code, _flex_call.__globals__, code.co_name)
        return torch.compile(fn, dynamic=False, fullgraph=True)

    return _COMPILED.get(key, make)


_UNFUSED = [False]


@contextlib.contextmanager
def unfused():
    """Within it, calls run FlexAttention uncompiled: its unfused
    implementation, which evaluates the same ``mask_mod`` on every score
    (O(T * S)) and also returns a log-sum-exp on the CPU. For tests: of the
    parts the CPU kernel refuses (the log-sum-exp merge of strided
    ``"merged"``) and of a layer's wiring without compiling a kernel per
    case; never used otherwise."""
    _UNFUSED.append(True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            yield
    finally:
        _UNFUSED.pop()


def _run(site, query, key, value, structure, mask_mod, scale, return_lse=False,
         mask_key=None):
    """FlexAttention on ``(B, H, L, d)`` tensors under ``mask_mod`` and the
    tiles of ``structure`` (:func:`block_structure`). ``mask_key``: where
    ``mask_mod`` reads no per-call tensor, the key under which the built
    BlockMask is kept for the next call."""
    T, S = query.shape[2], key.shape[2]

    def make():
        return _flex_module.BlockMask.from_kv_blocks(
            *structure, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(T, S))

    if mask_key is None:
        block_mask = make()
    else:
        block_mask = _MASKS.get((mask_key, T, S, str(query.device)), make)
    scale = float(scale) if scale is not None else 1.0 / float(query.shape[-1]) ** 0.5
    if _UNFUSED[-1]:
        return _flex_call(query, key, value, block_mask, scale, return_lse)
    key_ = (site, tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype,
            str(query.device), bool(return_lse))
    return _compiled(key_)(query, key, value, block_mask, scale, return_lse)


# ---------------------------------------------------------- block structure
def _ordered(flags):
    """``(num, indices)`` int32 of a boolean ``(..., nq, nk)`` tile table:
    the listed tiles of each row first, in ascending order."""
    num = flags.sum(-1, dtype=torch.int32)
    indices = torch.argsort(flags.to(torch.int8), dim=-1, descending=True, stable=True)
    return num, indices.to(torch.int32)


def _as_structure(partial, full=None):
    """The ``from_kv_blocks`` arguments of tile tables ``(B or 1, H or 1, nq,
    nk)``: partial tiles (the mask is evaluated there) and full ones (every
    pair allowed, not evaluated)."""
    num, idx = _ordered(partial)
    if full is None:
        return num, idx, None, None
    full_num, full_idx = _ordered(full)
    return num, idx, full_num, full_idx


def every_tile(T, S):
    """Every tile of ``T`` x ``S`` pairs (tiles of :data:`BLOCK`): NumPy
    int64 ``(query tile, key tile)``."""
    return arrangements.every_tile(T, S, BLOCK)


def union_tiles(*tile_sets):
    """The union of ``(query tile, key tile)`` sets (pairs may repeat)."""
    return (np.concatenate([np.asarray(t[0], np.int64) for t in tile_sets]),
            np.concatenate([np.asarray(t[1], np.int64) for t in tile_sets]))


def block_structure(predicate, T, S, device, tiles):
    """Tiles of the ``(T, S)`` pairs under ``predicate(q_idx, kv_idx)``
    (int32 tensors -> boolean, broadcast): boolean ``(1, 1, nq, nk)``
    tables ``(partial, full)`` of tiles of :data:`BLOCK` pairs with some /
    only allowed pairs (tiles that overhang the lengths are never full).

    The predicate is evaluated only on the candidate ``tiles`` (NumPy int
    ``(query tile, key tile)``, a superset of the tiles with an allowed
    pair, e.g. a pattern's ``candidate_tiles``), at most
    :data:`STRUCTURE_PAIRS` pairs at once: the work grows with the tiles
    listed, not with ``T * S``."""
    nq, nk = -(-T // BLOCK), -(-S // BLOCK)
    any_tiles = torch.zeros((nq, nk), dtype=torch.bool, device=device)
    all_tiles = torch.zeros((nq, nk), dtype=torch.bool, device=device)
    qb = torch.as_tensor(np.asarray(tiles[0], np.int64), device=device)
    kb = torch.as_tensor(np.asarray(tiles[1], np.int64), device=device)
    if qb.numel():
        if int(qb.min()) < 0 or int(qb.max()) >= nq or int(kb.min()) < 0 or int(kb.max()) >= nk:
            raise ValueError(f"`tiles` must lie in the {nq} x {nk} tiles of {T} x {S} pairs")
    offsets = torch.arange(BLOCK, dtype=torch.int32, device=device)
    chunk = max(1, STRUCTURE_PAIRS // (BLOCK * BLOCK))
    for start in range(0, int(qb.numel()), chunk):
        q_tile, k_tile = qb[start:start + chunk], kb[start:start + chunk]
        q = (q_tile.to(torch.int32)[:, None, None] * BLOCK + offsets[None, :, None])
        kv = (k_tile.to(torch.int32)[:, None, None] * BLOCK + offsets[None, None, :])
        inside = (q < T) & (kv < S)
        allowed = torch.as_tensor(predicate(torch.clamp(q, max=T - 1),
                                            torch.clamp(kv, max=S - 1))).to(torch.bool)
        allowed = torch.broadcast_to(allowed, inside.shape) & inside
        any_tiles[q_tile, k_tile] = allowed.any(dim=2).any(dim=1)
        all_tiles[q_tile, k_tile] = allowed.all(dim=2).all(dim=1)
    return (any_tiles & ~all_tiles)[None, None], all_tiles[None, None]


def _structure(key, predicate, T, S, device, full_blocks, tiles):
    """The cached :func:`block_structure` of ``key`` (on the candidate
    ``tiles``, a function called only when it is built) as
    ``from_kv_blocks`` arguments; with ``full_blocks=False`` every listed
    tile is partial (the call's mask has data the structure does not
    know)."""

    def make():
        partial, full = block_structure(predicate, T, S, device, tiles())
        return _as_structure(partial, full), _as_structure(partial | full)

    separated, merged = _STRUCTURES.get(key + (T, S, BLOCK, str(device)), make)
    return separated if full_blocks else merged


def _positions(order, device):
    """``order`` (numpy int) as an int32 tensor on ``device``, cached."""
    if order is None:
        return None
    return _STRUCTURES.get(
        ("positions", _order_key(order, "order"), str(device)),
        lambda: torch.tensor(np.asarray(order, dtype=np.int32), device=device))


def _heads_first(x):
    """``(B, L, H, d)`` -> FlexAttention's ``(B, H, L, d)`` (a view)."""
    return x.transpose(1, 2)


def _key_valid(key_mask, device):
    return None if key_mask is None else torch.as_tensor(key_mask, device=device).to(torch.bool)


# ---------------------------------------------------------------- patterns
def pattern_block_mask(pattern, query_length, key_length, device=None, q_order=None,
                       k_order=None):
    """FlexAttention's ``BlockMask`` of ``pattern`` (an object with
    ``allowed(q_pos, k_pos)``, hashable) on ``query_length`` x ``key_length``
    tokens, optionally reordered (``q_order`` / ``k_order``: the position of
    each arranged token, numpy int): the block mask that
    :func:`pattern_attention` uses for a call without padding."""
    device = torch.device(device) if device is not None else _device()
    T, S = int(query_length), int(key_length)
    structure, mask_mod = _pattern_parts(pattern, T, S, device, q_order, k_order, None)
    return _flex_module.BlockMask.from_kv_blocks(
        *structure, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(T, S))


def _order_key(order, name):
    return None if order is None else (name, len(order), hash(np.asarray(order).tobytes()))


def _pattern_parts(pattern, T, S, device, q_order, k_order, valid):
    q_pos, k_pos = _positions(q_order, device), _positions(k_order, device)

    def at(pos, idx):
        return idx if pos is None else pos[idx]

    def predicate(q_idx, kv_idx):
        return pattern.allowed(at(q_pos, q_idx), at(k_pos, kv_idx))

    def tiles():
        return pattern.candidate_tiles(np.arange(T) if q_order is None else q_order,
                                       np.arange(S) if k_order is None else k_order, BLOCK)

    key = ("pattern", pattern, _order_key(q_order, "q"), _order_key(k_order, "k"))
    structure = _structure(key, predicate, T, S, device, full_blocks=valid is None,
                           tiles=tiles)
    if valid is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return pattern.allowed(at(q_pos, q_idx), at(k_pos, kv_idx))
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return pattern.allowed(at(q_pos, q_idx), at(k_pos, kv_idx)) & valid[b, kv_idx]
    return structure, mask_mod


@torch.compiler.disable
def pattern_attention(query, key, value, pattern, key_mask=None, scale=None, q_order=None,
                      k_order=None, return_lse=False):
    """Attention of query position ``i`` to key position ``j`` where
    ``pattern.allowed(i, j)``, by FlexAttention.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        pattern: an object with ``allowed(q_pos, k_pos)`` (elementwise on
            int32 tensors, ``keras.ops``), hashable (a
            :class:`keras_longattn.ops.AttentionPattern`).
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        q_order: optional numpy int ``(T,)``, a permutation of the query
            positions: the queries run in this order (and come back in
            theirs).
        k_order: optional numpy int ``(S',)``: the key positions used, in
            this order (keys not listed are not seen).
        return_lse: also return the log-sum-exp of each row (``(B, T, H)``
            float32, ``-inf`` where the row sees no key).

    Returns:
        ``(B, T, H, dv)`` (and the log-sum-exp); a query that sees no key
        gets zeros.
    """
    query, key, value = _check(query, key, value)
    device = query.device
    T = query.shape[1]
    if q_order is not None:
        query = query[:, _positions(q_order, device).long()]
    if k_order is not None:
        keep = _positions(k_order, device).long()
        key, value = key[:, keep], value[:, keep]
    valid = _key_valid(key_mask, device)
    if valid is not None and k_order is not None:
        valid = valid[:, keep]
    S = key.shape[1]
    if S == 0:
        out = query.new_zeros(query.shape[:3] + (value.shape[3],))
        lse = torch.full(query.shape[:3], -float("inf"), device=device)
        return (out, lse) if return_lse else out
    structure, mask_mod = _pattern_parts(pattern, T, S, device, q_order, k_order, valid)
    site = ("pattern", pattern, _order_key(q_order, "q"), _order_key(k_order, "k"),
            valid is not None)
    result = _run(site, _heads_first(query), _heads_first(key), _heads_first(value),
                  structure, mask_mod, scale, return_lse,
                  mask_key=site if valid is None else None)
    out, lse = result if return_lse else (result, None)
    out = _heads_first(out)
    if q_order is not None:
        inverse = _positions(np.argsort(np.asarray(q_order)), device).long()
        out = out[:, inverse]
        lse = None if lse is None else lse[:, :, inverse]
    if not return_lse:
        return out
    return out, lse.transpose(1, 2)


@torch.compiler.disable
def local_attention(query, key, value, pattern, key_mask=None, scale=None):
    """Sliding-window attention: tokens in order, the band of tiles of
    ``pattern`` (the layer's ``LocalPattern``). See
    :func:`pattern_attention`."""
    return pattern_attention(query, key, value, pattern, key_mask=key_mask, scale=scale)


def merge_parts(parts):
    """One softmax from parts over disjoint key sets: ``parts`` are
    ``(out (B, T, H, dv), lse (B, T, H))``; rows that see no key in any part
    stay zero."""
    dtype = parts[0][0].dtype
    lses = torch.stack([lse.float() for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)  # 0 where a part sees no key
    total = weights.sum(dim=0)
    out = sum(o.float() * w[..., None] for (o, _), w in zip(parts, weights))
    out = out / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out.to(dtype)


# ------------------------------------------------------- Sparse Transformer
@torch.compiler.disable
def sparse_attention(query, key, value, pattern, block_length, summary_width, combination,
                     first, second, second_only=None, first_heads=None, key_mask=None,
                     scale=None):
    """The Sparse Transformer's strided or fixed attention.

    Args:
        query, key, value: ``(B, T, H, d)``, ``(B, S, H, d)``,
            ``(B, S, H, dv)``.
        pattern: ``"strided"`` or ``"fixed"``.
        block_length: ``l``.
        summary_width: ``c`` (fixed).
        combination: ``"multihead"``, ``"merged"``, ``"first"`` or
            ``"second"``.
        first, second: the patterns A and B (causality included).
        second_only: with ``"merged"``, B without the keys of A
            (``Difference(B, A)``).
        first_heads: with ``"multihead"``, how many heads (the first) use A.
        key_mask: optional boolean ``(B, S)``.
        scale: logit multiplier.

    A runs on tokens in order; strided B on tokens sorted by column; fixed
    B on the summary keys only. ``"merged"``: strided merges A and
    ``second_only`` by log-sum-exp (not on the CPU, see :func:`refusal`);
    fixed appends the summary keys to the keys in order, one softmax.
    """
    l = int(block_length)
    T, S = query.shape[1], key.shape[1]

    def part_a(q, k, v, return_lse=False):
        return pattern_attention(q, k, v, first, key_mask, scale, return_lse=return_lse)

    def part_b(q, k, v, predicate, return_lse=False):
        if pattern == "strided":
            return pattern_attention(q, k, v, predicate, key_mask, scale,
                                     q_order=column_order(T, l), k_order=column_order(S, l),
                                     return_lse=return_lse)
        return pattern_attention(q, k, v, predicate, key_mask, scale,
                                 k_order=summary_positions(S, l, summary_width),
                                 return_lse=return_lse)

    if combination == "first":
        return part_a(query, key, value)
    if combination == "second":
        return part_b(query, key, value, second)
    if combination == "merged":
        if pattern == "fixed":
            return _appended_keys_attention(
                query, key, value, first, second_only,
                summary_positions(S, l, summary_width), key_mask, scale)
        return merge_parts([part_a(query, key, value, return_lse=True),
                            part_b(query, key, value, second_only, return_lse=True)])
    h = int(first_heads)
    out = part_a(query[:, :, :h], key[:, :, :h], value[:, :, :h])
    if h == query.shape[2]:
        return out
    rest = part_b(query[:, :, h:], key[:, :, h:], value[:, :, h:], second)
    return torch.cat([out, rest], dim=2)


def _appended_keys_attention(query, key, value, first, extra, extra_positions, key_mask,
                             scale):
    """One softmax over the keys in order under ``first`` and the keys at
    ``extra_positions`` appended after them under ``extra``."""
    query, key, value = _check(query, key, value)
    device = query.device
    T, S = query.shape[1], key.shape[1]
    pos = torch.as_tensor(np.asarray(extra_positions, np.int64), device=device)
    G = int(pos.shape[0])
    if G == 0:
        return pattern_attention(query, key, value, first, key_mask, scale)
    valid = _key_valid(key_mask, device)
    last = S - 1
    extra_pos = pos.to(torch.int32)

    def split(kv_idx):
        inside = kv_idx < S
        return inside, torch.clamp(kv_idx, max=last), extra_pos[torch.clamp(kv_idx - S, 0, G - 1)]

    def predicate(q_idx, kv_idx):
        inside, own, appended = split(kv_idx)
        return torch.where(inside, torch.as_tensor(first.allowed(q_idx, own)),
                           torch.as_tensor(extra.allowed(q_idx, appended)))

    def tiles():
        queries = np.arange(T)
        extra_np = np.asarray(extra_positions, np.int64)
        none_s, none_g = np.full(S, -1, np.int64), np.full(G, -1, np.int64)
        return union_tiles(
            first.candidate_tiles(queries, np.concatenate([np.arange(S), none_g]), BLOCK),
            extra.candidate_tiles(queries, np.concatenate([none_s, extra_np]), BLOCK))

    structure = _structure(("appended", first, extra, _order_key(extra_positions, "k")),
                           predicate, T, S + G, device, full_blocks=valid is None,
                           tiles=tiles)
    if valid is None:
        def mask_mod(b, h, q_idx, kv_idx):
            inside, own, appended = split(kv_idx)
            return torch.where(inside, first.allowed(q_idx, own), extra.allowed(q_idx, appended))
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            inside, own, appended = split(kv_idx)
            seen = torch.where(inside, first.allowed(q_idx, own),
                               extra.allowed(q_idx, appended))
            return seen & valid[b, torch.where(inside, own, appended)]
    keys = torch.cat([key, key[:, pos]], dim=1)
    values = torch.cat([value, value[:, pos]], dim=1)
    out = _run(("appended", first, extra, _order_key(extra_positions, "k"), valid is not None),
               _heads_first(query), _heads_first(keys), _heads_first(values), structure,
               mask_mod, scale)
    return _heads_first(out)


# --------------------------------------------------------------- Longformer
@torch.compiler.disable
def longformer_attention(query, key, value, window_patterns, dilations, global_pattern=None,
                         global_positions=None, global_query_valid=None,
                         global_key_valid=None, global_query=None, global_key=None,
                         global_value=None, key_mask=None, scale=None):
    """Longformer attention: each head's (dilated) window and the global keys
    in one softmax, then the global rows.

    Args:
        query, key, value: ``(B, T, H, d)``, ``(B, S, H, d)``,
            ``(B, S, H, dv)``: the local projections.
        window_patterns: one pattern per head (its window,
            ``DilatedPattern``); heads with the same pattern run together.
        dilations: one int per head, the dilation ``r`` of its window: its
            tokens run sorted by ``position mod r``.
        global_pattern: the pattern of (query position, global key
            position) pairs and of the global rows: ``CausalPattern()``
            for a causal call, ``FullPattern()`` otherwise. Unused without
            global slots.
        global_positions: int ``(B or 1, G)``, the global slots' positions
            (None: no global slot).
        global_query_valid, global_key_valid: boolean ``(B or 1, G)``:
            whether each slot is a real global query / key.
        global_query: ``(B, G, H, d)``, the global queries of the slots.
            Defaults to the local queries at their positions.
        global_key, global_value: ``(B, S, H, d)``, ``(B, S, H, dv)``, the
            global projections of every position. Default to ``key`` and
            ``value``.
        key_mask: optional boolean ``(B, S)``.
        scale: logit multiplier.

    Returns:
        ``(B, T, H, dv)``; a query that sees no key gets zeros.
    """
    query, key, value = _check(query, key, value)
    device = query.device
    B, T, H = query.shape[:3]
    S = key.shape[1]
    valid = _key_valid(key_mask, device)
    slots = None
    if global_positions is not None:
        positions = torch.as_tensor(global_positions, device=device).to(torch.int64)
        G = positions.shape[1]
        positions = positions.expand(B, G)
        q_valid = torch.as_tensor(global_query_valid, device=device).to(torch.bool).expand(B, G)
        k_valid = torch.as_tensor(global_key_valid, device=device).to(torch.bool).expand(B, G)
        k_valid = k_valid & (positions < S)
        at = torch.clamp(positions, 0, S - 1)
        if valid is not None:  # a padded global key is no key at all
            k_valid = k_valid & torch.gather(valid, 1, at)
        # The window leaves the global keys to the appended keys.
        is_global = torch.zeros((B, S + 1), dtype=torch.bool, device=device)
        is_global.scatter_(1, torch.where(k_valid, at, S), True)
        local = ~is_global[:, :S]
        valid = local if valid is None else valid & local
        slots = (positions, q_valid, k_valid, at)

    groups = {}
    for h, (r, p) in enumerate(zip(dilations, window_patterns)):
        groups.setdefault((int(r), p), []).append(h)
    outs, order = [], []
    for (r, p), heads in groups.items():
        index = torch.as_tensor(heads, device=device)
        pick = (lambda x: x) if len(heads) == H else (lambda x: x.index_select(2, index))
        outs.append(_dilated_window(pick(query), pick(key), pick(value), p, r, valid, slots,
                                    global_pattern, scale))
        order.extend(heads)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)[
        :, :, torch.as_tensor(np.argsort(order), device=device)]
    if slots is None:
        return out

    # The global rows: each global query against every key.
    positions, q_valid, _, _ = slots
    if global_query is None:
        global_query = _gather_rows(query, torch.clamp(positions, 0, T - 1), q_valid)
    global_key = key if global_key is None else torch.as_tensor(global_key)
    global_value = value if global_value is None else torch.as_tensor(global_value)
    global_query, global_key, global_value = _check(global_query, global_key, global_value)
    rows = _global_rows(global_query, global_key, global_value, positions,
                        _key_valid(key_mask, device), global_pattern, scale)
    # Written over their rows: a scatter, invalid slots into a dropped row.
    target = torch.where(q_valid & (positions < T), positions, T)
    out = torch.cat([out, out.new_zeros((B, 1) + tuple(out.shape[2:]))], dim=1)
    index = target[:, :, None, None].expand(-1, -1, H, out.shape[3])
    return out.scatter(1, index, rows.to(out.dtype))[:, :T]


def _gather_rows(x, positions, valid):
    """``x`` ``(B, n, H, d)`` at ``positions`` ``(B, G)``: ``(B, G, H, d)``,
    zeros where not ``valid``."""
    index = positions[:, :, None, None].expand(-1, -1, x.shape[2], x.shape[3])
    rows = torch.gather(x, 1, index)
    return torch.where(valid[:, :, None, None], rows, torch.zeros_like(rows))


def _dilated_window(query, key, value, pattern, dilation, valid, slots, global_pattern,
                    scale):
    """One group of heads: the window (tokens sorted by residue when
    dilated), and the global keys appended after the keys."""
    if slots is None:
        order = None if dilation == 1 else column_order(query.shape[1], dilation)
        k_order = None if dilation == 1 else column_order(key.shape[1], dilation)
        return pattern_attention(query, key, value, pattern, key_mask=valid, scale=scale,
                                 q_order=order, k_order=k_order)
    device = query.device
    T, S = query.shape[1], key.shape[1]
    positions, _, k_valid, at = slots
    G = positions.shape[1]
    q_np = np.arange(T, dtype=np.int32) if dilation == 1 else column_order(T, dilation)
    k_np = np.arange(S, dtype=np.int32) if dilation == 1 else column_order(S, dilation)
    q_pos, k_pos = _positions(q_np, device), _positions(k_np, device)
    g_pos = positions.to(torch.int32)
    q_arr = query if dilation == 1 else query[:, q_pos.long()]
    k_arr = key if dilation == 1 else key[:, k_pos.long()]
    v_arr = value if dilation == 1 else value[:, k_pos.long()]
    keys = torch.cat([k_arr, _gather_rows(key, at, k_valid)], dim=1)
    values = torch.cat([v_arr, _gather_rows(value, at, k_valid)], dim=1)
    last = S - 1
    local = valid  # (B, S): real keys that are not global

    def predicate(q_idx, kv_idx):  # the tiles: the window, and every global key
        inside = kv_idx < S
        kp = k_pos[torch.clamp(kv_idx, max=last)]
        window = torch.as_tensor(pattern.allowed(q_pos[q_idx], kp))
        return torch.where(inside, window, torch.ones_like(window))

    def mask_mod(b, h, q_idx, kv_idx):
        inside = kv_idx < S
        qp = q_pos[q_idx]
        kp = k_pos[torch.clamp(kv_idx, max=last)]
        g = torch.clamp(kv_idx - S, 0, G - 1)
        window = pattern.allowed(qp, kp) & local[b, kp]
        glob = global_pattern.allowed(qp, g_pos[b, g]) & k_valid[b, g]
        return torch.where(inside, window, glob)

    def tiles():  # the window's, and every query tile against the global keys
        window = pattern.candidate_tiles(q_np, np.concatenate([k_np, np.full(G, -1)]), BLOCK)
        rows = np.arange(-(-T // BLOCK))
        cols = np.arange(S // BLOCK, -(-(S + G) // BLOCK))
        return union_tiles(window, (np.repeat(rows, cols.size), np.tile(cols, rows.size)))

    key_ = ("longformer", pattern, dilation, global_pattern, G)
    structure = _structure(key_, predicate, T, S + G, device, full_blocks=False, tiles=tiles)
    out = _run(key_, _heads_first(q_arr), _heads_first(keys), _heads_first(values), structure,
               mask_mod, scale)
    out = _heads_first(out)
    if dilation != 1:
        out = out[:, _positions(np.argsort(q_np), device).long()]
    return out


def _global_rows(global_query, key, value, positions, valid, global_pattern, scale):
    """The global queries ``(B, G, H, d)`` (of positions ``(B, G)``) against
    every key: ``(B, G, H, dv)``."""
    device = global_query.device
    G, S = global_query.shape[1], key.shape[1]
    g_pos = positions.to(torch.int32)
    if valid is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return global_pattern.allowed(g_pos[b, q_idx], kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return global_pattern.allowed(g_pos[b, q_idx], kv_idx) & valid[b, kv_idx]
    structure = _structure(("every pair",), lambda q, k: torch.ones_like(q + k, dtype=torch.bool),
                           G, S, device, full_blocks=False, tiles=lambda: every_tile(G, S))
    out = _run(("global rows", global_pattern, valid is not None), _heads_first(global_query),
               _heads_first(key), _heads_first(value), structure, mask_mod, scale)
    return _heads_first(out)


# ----------------------------------------------------------------- BigBird
def coarse_tiles(block_table, block_size, T, S):
    """The tiles of :data:`BLOCK` pairs that hold a pair of a listed block:
    ``block_table`` boolean ``(B or 1, nq, nk)`` over blocks of
    ``block_size`` -> ``(B or 1, 1, NQ, NK)``."""
    b = int(block_size)
    device = block_table.device
    nq, nk = block_table.shape[1], block_table.shape[2]

    def overlap(n_fine, length):
        fine = torch.arange(n_fine, device=device)[:, None]
        tile = torch.arange(-(-length // BLOCK), device=device)[None, :]
        start, stop = fine * b, torch.clamp((fine + 1) * b, max=length)
        return ((start < (tile + 1) * BLOCK) & (stop > tile * BLOCK) & (start < length)).float()

    counts = overlap(nq, T).T @ block_table.float() @ overlap(nk, S)
    return (counts > 0)[:, None]


@torch.compiler.disable
def bigbird_attention(query, key, value, block_table, block_size, causal_pattern=None,
                      key_mask=None, scale=None):
    """BigBird's attention: the layer's block mask ``block_table`` (boolean
    ``(B or 1, nq, nk)`` over blocks of ``block_size``: window, global and
    random blocks, global rows included) as the mask, AND
    ``causal_pattern`` (``CausalPattern()`` for a causal call) AND key
    padding. The tiles: those of the block table, AND those of the causal
    pattern."""
    query, key, value = _check(query, key, value)
    device = query.device
    T, S = query.shape[1], key.shape[1]
    b = int(block_size)
    table = torch.as_tensor(block_table, device=device).to(torch.bool)
    valid = _key_valid(key_mask, device)
    per_example = table.shape[0] > 1
    tiles = coarse_tiles(table, b, T, S)
    if causal_pattern is not None:
        partial, full = _STRUCTURES.get(
            ("causal tiles", causal_pattern, T, S, BLOCK, str(device)),
            lambda: block_structure(causal_pattern.allowed, T, S, device,
                                    causal_pattern.candidate_tiles(np.arange(T), np.arange(S),
                                                                   BLOCK)))
        tiles = tiles & (partial | full)
    structure = _as_structure(tiles)

    def mask_mod(b_, h, q_idx, kv_idx):
        seen = table[b_ if per_example else 0, q_idx // b, kv_idx // b]
        if causal_pattern is not None:
            seen = seen & causal_pattern.allowed(q_idx, kv_idx)
        if valid is not None:
            seen = seen & valid[b_, kv_idx]
        return seen

    out = _run(("bigbird", b, causal_pattern, valid is not None, per_example),
               _heads_first(query), _heads_first(key), _heads_first(value), structure,
               mask_mod, scale)
    return _heads_first(out)


# ------------------------------------------------------------------ Routing
def document_tiles(k, wq, wk):
    """The tiles of ``k`` block-diagonal documents of ``wq`` queries and
    ``wk`` keys each (queries and keys gathered cluster by cluster): each
    query tile against the key tiles of the clusters its queries are in."""
    nq = -(-(k * wq) // BLOCK)
    q_tile = np.arange(nq, dtype=np.int64)
    first = (q_tile * BLOCK) // wq
    last = (np.minimum((q_tile + 1) * BLOCK, k * wq) - 1) // wq
    lo, hi = (first * wk) // BLOCK, ((last + 1) * wk - 1) // BLOCK
    counts = hi - lo + 1
    rows = np.repeat(q_tile, counts)
    cols = np.repeat(lo - np.cumsum(np.concatenate([[0], counts[:-1]])), counts) + np.arange(
        counts.sum())
    return rows, cols


@torch.compiler.disable
def cluster_attention(query, key, value, query_indices, key_indices, causal_pattern=None,
                      key_mask=None, scale=None):
    """Attention inside balanced clusters, each head's tokens gathered
    cluster by cluster (block-diagonal "documents"), a query's output the
    mean over the clusters in which it sees a key (zeros in none), as
    :func:`keras_longattn.ops.routing.balanced_cluster_attention` without
    ``exclude_self``.

    Args:
        query, key, value: ``(B, T, H, d)``, ``(B, S, H, d)``,
            ``(B, S, H, dv)``.
        query_indices: int ``(B, H, k, wq)``, the queries of each cluster.
        key_indices: int ``(B, H, k, wk)``, its keys.
        causal_pattern: ``CausalPattern()`` for a causal call (a query sees
            the keys of its clusters at or before its position), else None.
        key_mask: optional boolean ``(B, S)``.
        scale: logit multiplier.
    """
    query, key, value = _check(query, key, value)
    device = query.device
    B, T, H = query.shape[:3]
    S = key.shape[1]
    qi = torch.as_tensor(query_indices, device=device).to(torch.int64)
    ki = torch.as_tensor(key_indices, device=device).to(torch.int64)
    k, wq, wk = qi.shape[2], qi.shape[3], ki.shape[3]
    q_flat, k_flat = qi.reshape(B, H, k * wq), ki.reshape(B, H, k * wk)

    def gather(x, index):  # (B, n, H, d) -> (B, H, k * w, d)
        x = x.transpose(1, 2)
        return torch.gather(x, 2, index[..., None].expand(-1, -1, -1, x.shape[3]))

    q_pos, k_pos = q_flat.to(torch.int32), k_flat.to(torch.int32)
    valid = _key_valid(key_mask, device)
    k_valid = None if valid is None else torch.gather(valid[:, None].expand(B, H, S), 2, k_flat)

    def documents(q_idx, kv_idx):
        return q_idx // wq == kv_idx // wk

    def mask_mod(b, h, q_idx, kv_idx):
        seen = documents(q_idx, kv_idx)
        if causal_pattern is not None:
            seen = seen & causal_pattern.allowed(q_pos[b, h, q_idx], k_pos[b, h, kv_idx])
        if k_valid is not None:
            seen = seen & k_valid[b, h, kv_idx]
        return seen

    data = causal_pattern is not None or k_valid is not None
    structure = _structure(("documents", wq, wk), documents, k * wq, k * wk, device,
                           full_blocks=not data, tiles=lambda: document_tiles(k, wq, wk))
    out = _run(("clusters", wq, wk, causal_pattern, k_valid is not None),
               gather(query, q_flat), gather(key, k_flat), gather(value, k_flat), structure,
               mask_mod, scale)  # (B, H, k * wq, dv)
    # Whether each gathered query sees a key: its cluster has a real key
    # (causal: its earliest real key is visible).
    real = torch.ones((B, H, k, wk), dtype=torch.bool, device=device) if k_valid is None \
        else k_valid.reshape(B, H, k, wk)
    seen = real.any(dim=-1, keepdim=True).expand(B, H, k, wq)
    if causal_pattern is not None:
        first = torch.where(real, ki, S).amin(dim=-1, keepdim=True)  # (B, H, k, 1)
        seen = seen & torch.as_tensor(causal_pattern.allowed(qi, first))
    seen = seen.reshape(B, H, k * wq)
    dv = out.shape[3]
    sums = torch.zeros((B, H, T, dv), dtype=torch.float32, device=device)
    sums.scatter_add_(2, q_flat[..., None].expand(-1, -1, -1, dv),
                      torch.where(seen[..., None], out.float(), torch.zeros_like(out.float())))
    counts = torch.zeros((B, H, T), dtype=torch.float32, device=device)
    counts.scatter_add_(2, q_flat, seen.float())
    mean = sums / torch.clamp(counts, min=1.0)[..., None]
    return mean.transpose(1, 2).to(query.dtype)
