"""Calls and padding rows shared by the property suite and the layer tests:
a layer called as one compiled program on JAX (:func:`call_layer`), boolean
padding rows (:func:`padding_row`) and sums over real rows only
(:func:`masked_sum`)."""

import keras
import numpy as np

def _np(x):
    return keras.ops.convert_to_numpy(x)


def _backend():
    return keras.backend.backend()


PADDINGS = ("none", "right", "left", "middle", "all")


def padding_row(kind, n, cut):
    """A boolean row of ``n`` (True = real) with ``cut`` padded positions
    placed by ``kind`` ("none", "right", "left", "middle" or "all")."""
    row = np.ones(n, dtype=bool)
    cut = int(min(max(cut, 1), n))
    if kind == "none":
        return row
    if kind == "all":
        row[:] = False
    elif kind == "right":
        row[n - cut :] = False
    elif kind == "left":
        row[:cut] = False
    elif kind == "middle":
        start = (n - cut) // 2
        row[start : start + cut] = False
    else:
        raise ValueError(f"unknown padding kind {kind!r}")
    return row


def call_layer(layer, query, value, jit=True, **kwargs):
    """``layer(query, value, **kwargs)`` as numpy. On JAX with ``jit`` the
    call runs as one compiled program (``stateless_call`` under
    ``jax.jit``, cached per layer and static arguments): eager JAX compiles
    every primitive once per new shape, which makes random lengths cost
    seconds per call. Other backends call the layer eagerly."""
    if not layer.built:
        layer.build(tuple(query.shape), tuple(value.shape))
    if not jit or _backend() != "jax":
        return _np(layer(query, value, **kwargs))
    import jax

    static = {k: v for k, v in kwargs.items() if v is None or isinstance(v, (bool, str))}
    arrays = {k: v for k, v in kwargs.items() if k not in static}
    key = (tuple(sorted(static.items())), tuple(sorted(arrays)))
    cache = layer.__dict__.setdefault("_property_jit_cache", {})
    if key not in cache:

        def run(trainable, non_trainable, q, v, arrs):
            out, _ = layer.stateless_call(trainable, non_trainable, q, v, **arrs, **static)
            return out

        cache[key] = jax.jit(run)
    out = cache[key](
        [v.value for v in layer.trainable_variables],
        [v.value for v in layer.non_trainable_variables],
        query,
        value,
        arrays,
    )
    return np.asarray(out)


def masked_sum(out, row_mask):
    """``sum(out)`` over the rows where ``row_mask`` (B, T) is True; other
    rows contribute exactly nothing (``where``, not a product, so a NaN
    there cannot leak into the sum or its gradient)."""
    out = keras.ops.cast(out, "float32")
    keep = keras.ops.convert_to_tensor(row_mask)[:, :, None]
    return keras.ops.sum(keras.ops.where(keep, out, keras.ops.zeros_like(out)))
