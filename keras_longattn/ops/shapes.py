"""Sequence lengths that may be unknown while a graph is traced.

Keras on TensorFlow traces ``predict``/``fit`` with the sequence axis left
unknown (``None``) when a model takes variable lengths. The efficient paths
therefore read a length as a Python int when it is static and as a scalar
tensor otherwise; layouts then use the same arithmetic on either. With
static shapes (JAX, PyTorch, TensorFlow with fixed shapes) everything stays
a Python int and nothing changes.
"""

from keras import ops


def length(x, axis=1):
    """The size of ``x`` along ``axis``: an int when static, else a scalar
    int32 tensor."""
    size = x.shape[axis]
    if size is not None:
        return int(size)
    return ops.cast(ops.shape(x)[axis], "int32")


def is_static(*sizes):
    """Whether every size is a Python int."""
    return all(isinstance(s, int) for s in sizes)


def larger(a, b):
    """``max(a, b)`` of two lengths (ints or scalar tensors)."""
    if is_static(a, b):
        return max(a, b)
    return ops.maximum(a, b)


def smaller(a, b):
    """``min(a, b)`` of two lengths (ints or scalar tensors)."""
    if is_static(a, b):
        return min(a, b)
    return ops.minimum(a, b)


def ceil_div(a, b):
    """``ceil(a / b)`` of lengths (ints or scalar tensors)."""
    return -(-a // b)


def head_slices(batch, length, heads, width, limit):
    """``(h0, h1)`` ranges of the heads axis, each with at most ``limit``
    elements ``batch * length * (h1 - h0) * width`` when one head allows it;
    one range (all heads) when a size is not a Python int.

    Paths whose heads are independent run a few heads at a time with
    ``limit = 1 << 22`` (16 MiB of float32): on a CPU, glibc maps a buffer
    above its largest mmap threshold (32 MiB) afresh on every call and
    page-faults it, while smaller ones reuse the allocator's memory.
    """
    if not is_static(batch, length, heads, width):
        return [(0, heads)]
    step = max(1, int(limit) // max(1, batch * length * width))
    return [(h0, min(heads, h0 + step)) for h0 in range(0, heads, step)]
