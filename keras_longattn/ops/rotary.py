"""Rotary position embeddings on projected heads."""

from keras import ops

from keras_longattn.ops.shapes import length


def apply_rotary(x, max_wavelength=10000.0):
    """Rotates pairs of features of ``x`` by position-dependent angles.

    Args:
        x: ``(B, n, H, d)`` with ``d`` even; position ``i`` is the index
            along axis 1.
        max_wavelength: the longest wavelength. Defaults to 10000.

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
    angles = ops.arange(n, dtype="float32")[:, None] * freq[None, :]  # (n, d/2)
    cos = ops.cast(ops.cos(angles), x.dtype)[None, :, None, :]
    sin = ops.cast(ops.sin(angles), x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
