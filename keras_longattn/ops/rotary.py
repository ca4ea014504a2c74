"""Rotary position embeddings on projected heads."""

from keras import ops

from keras_longattn.ops.shapes import length


def apply_rotary(x, max_wavelength=10000.0, start=0):
    """Rotates pairs of features of ``x`` by position-dependent angles.

    Args:
        x: ``(B, n, H, d)`` with ``d`` even; the entry at index ``i`` along
            axis 1 is at position ``start + i``.
        max_wavelength: the longest wavelength. Defaults to 10000.
        start: the position of the first entry (an int or a scalar integer
            tensor, e.g. a decoding cache's ``cache_update_index``).
            Defaults to 0.

    Returns:
        A tensor like ``x``. The dot product of a rotated query at ``i`` and
        a rotated key at ``j`` depends on ``i - j`` only.
    """
    x = ops.convert_to_tensor(x)
    # The length as a tensor where it is unknown while tracing.
    n, d = length(x, 1), x.shape[-1]
    half = d // 2
    freq = ops.power(
        float(max_wavelength), -ops.arange(half, dtype="float32") / float(half)
    )
    positions = ops.arange(n, dtype="float32") + ops.cast(start, "float32")
    angles = positions[:, None] * freq[None, :]  # (n, d/2)
    cos = ops.cast(ops.cos(angles), x.dtype)[None, :, None, :]
    sin = ops.cast(ops.sin(angles), x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
