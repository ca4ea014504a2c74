"""Orders in which the block-sparse paths run their tokens (NumPy only,
shared by :mod:`keras_longattn.ops.layouts` and the backend kernels).

* :func:`column_order`: positions sorted by ``position mod stride`` (then
  position), so each residue (a strided column, a dilation's residue) is
  contiguous;
* :func:`summary_positions`: the positions in the last ``summary_width``
  cells of their block (the fixed pattern's summary keys);
* :func:`every_tile`: every ``(query tile, key tile)`` pair of a grid.

Both are cached and returned read-only.
"""

import functools

import numpy as np

__all__ = ["column_order", "every_tile", "summary_positions"]


@functools.lru_cache(maxsize=256)
def column_order(n, stride):
    """Positions ``0 .. n-1`` sorted by ``position mod stride``, then
    position (int32, read-only)."""
    pos = np.arange(int(n))
    order = pos[np.lexsort((pos, pos % int(stride)))].astype(np.int32)
    order.flags.writeable = False
    return order


@functools.lru_cache(maxsize=256)
def summary_positions(n, block_length, summary_width):
    """The positions of ``0 .. n-1`` in the last ``summary_width`` cells of
    their block of ``block_length`` (int32, read-only)."""
    pos = np.arange(int(n))
    order = np.flatnonzero(
        pos % int(block_length) >= int(block_length) - int(summary_width)).astype(np.int32)
    order.flags.writeable = False
    return order


def every_tile(num_q, num_k, block):
    """Every ``(query tile, key tile)`` pair of ``num_q`` x ``num_k`` tokens
    in tiles of ``block``: int64 ``(qb, kb)``."""
    nq, nk = -(-int(num_q) // block), -(-int(num_k) // block)
    flat = np.arange(nq * nk, dtype=np.int64)
    return flat // max(nk, 1), flat % max(nk, 1)
