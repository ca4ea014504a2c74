"""Model parallelism: a ``keras.distribution.LayoutMap`` for the layers and
builders of this package.

:func:`layout_map` shards, over the ``model`` axis of a device mesh, the
weights Megatron-style tensor parallelism splits:

* every attention layer's query, key and value projections (and
  Longformer's separate global projections) by head: kernels
  ``(dim, heads, head_dim)`` on axis 1, biases ``(heads, head_dim)`` on
  axis 0; the output projection ``(heads, head_dim, dim)`` on axis 0;
* Synthesizer's per-head tables (``dense_kernel``, ``dense_bias``,
  ``random_logits``) on their head axis;
* the feed-forward sublayer's hidden kernel ``(dim, feedforward_dim)`` on
  axis 1 (and its bias), its output kernel ``(feedforward_dim, dim)`` on
  axis 0.

Everything else (embeddings, norms, routing centroids, Linformer's
projections, Performer's features, AdaMRA's router) is replicated. Keras
places each variable with its layout when it is created, so build the
model inside the distribution's scope (or after
``keras.distribution.set_distribution``). The sharded sizes (``num_heads``,
``num_key_value_heads`` unless ``shard_key_value_heads=False``, and
``feedforward_dim``) must be multiples of the model axis size; a
multi-query layer (one key/value head) needs ``shard_key_value_heads=False``.

Example (8 devices: 4-way data parallel, 2-way model parallel)::

    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"))
    distribution = keras.distribution.ModelParallel(
        layout_map=keras_longattn.parallel.layout_map(mesh),
        batch_dim_name="batch")
    with distribution.scope():
        model = keras_longattn.models.build_causal_language_model(...)
"""

from __future__ import annotations

__all__ = ["layout_map", "LAYOUT_RULES"]

#: ``(path regex, layout)`` pairs; in a layout, ``"model"`` stands for the
#: model axis and None for a replicated dimension.
LAYOUT_RULES = (
    (r".*/(query|query_global)/kernel", (None, "model", None)),
    (r".*/(query|query_global)/bias", ("model", None)),
    (r".*/(key|value|key_global|value_global)/kernel", (None, "model", None)),
    (r".*/(key|value|key_global|value_global)/bias", ("model", None)),
    (r".*/attention_output/kernel", ("model", None, None)),
    (r".*/synthesizer/dense_kernel", ("model", None, None)),
    (r".*/synthesizer/dense_bias", ("model", None)),
    (r".*/synthesizer/random_logits", ("model", None, None)),
    (r".*/hidden/kernel", (None, "model")),
    (r".*/hidden/bias", ("model",)),
    (r".*/output/kernel", ("model", None)),
)

_KEY_VALUE = (r".*/(key|value|key_global|value_global)/kernel",
              r".*/(key|value|key_global|value_global)/bias")


def layout_map(device_mesh, model_axis="model", shard_key_value_heads=True):
    """The ``keras.distribution.LayoutMap`` of :data:`LAYOUT_RULES` on
    ``device_mesh``.

    Args:
        device_mesh: a ``keras.distribution.DeviceMesh``.
        model_axis: the mesh axis the weights are sharded over.
        shard_key_value_heads: shard the key and value projections by head
            (False: replicate them, e.g. for one key/value head).

    Returns:
        A ``keras.distribution.LayoutMap`` for
        ``keras.distribution.ModelParallel``.

    Raises:
        NotImplementedError: on a Keras backend other than JAX (where
            ``keras.distribution`` does not run).
    """
    import keras

    if keras.backend.backend() != "jax":
        raise NotImplementedError(
            "keras.distribution (DeviceMesh, LayoutMap, ModelParallel) runs on the JAX "
            f"backend; the Keras backend is {keras.backend.backend()!r}"
        )
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "`device_mesh` must be a keras.distribution.DeviceMesh. "
            f"Received: device_mesh={device_mesh!r}"
        )
    if model_axis not in device_mesh.axis_names:
        raise ValueError(
            f"`model_axis` must name an axis of the mesh {tuple(device_mesh.axis_names)}. "
            f"Received: model_axis={model_axis!r}"
        )
    result = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in LAYOUT_RULES:
        if not shard_key_value_heads and pattern in _KEY_VALUE:
            axes = (None,) * len(axes)
        result[pattern] = tuple(model_axis if a == "model" else None for a in axes)
    return result
