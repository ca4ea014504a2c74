"""Model and context parallelism on ``keras.distribution``: a
``LayoutMap`` for the layers and builders of this package, and a
distribution that splits the sequence axis of the inputs.

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

import keras

__all__ = ["ContextParallel", "layout_map", "LAYOUT_RULES"]

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


class ContextParallel(keras.distribution.ModelParallel):
    """``keras.distribution.ModelParallel`` that also splits the
    sequence: model inputs of rank >= 2 are laid out with their batch
    axis on ``batch_dim_name`` and their second (sequence) axis on
    ``sequence_dim_name``; the weights follow ``layout_map`` (default:
    replicated, see :func:`layout_map` to also split heads).

    XLA partitions the position-wise parts of a model (embeddings,
    projections, feed-forward, norms) along the sequence from this
    layout. While it is in scope, ``implementation="auto"`` runs the
    attention core of ``FullAttention``, ``LocalAttention``,
    ``LongformerAttention`` and strided ``SparseAttention`` as their
    ``"context_parallel"`` path (:func:`~keras_longattn.parallel.ring_attention`,
    :func:`~keras_longattn.parallel.halo_local_attention`,
    :func:`~keras_longattn.parallel.halo_longformer_attention`,
    :func:`~keras_longattn.parallel.halo_strided_attention`), which send
    only key/value blocks, the window's halo or whole columns between
    devices; elsewhere (other layers, calls those paths refuse) XLA
    gathers what each query needs.

    Args:
        device_mesh: a ``keras.distribution.DeviceMesh`` holding both
            axes.
        sequence_dim_name: the mesh axis of the sequence.
        batch_dim_name: the mesh axis of the batch (None: no batch
            split, e.g. a mesh with the sequence axis only).
        layout_map: the weights' layouts (default: all replicated).
        auto_shard_dataset: as ``keras.distribution.ModelParallel``.
    """

    def __init__(self, device_mesh, sequence_dim_name="sequence", batch_dim_name="batch",
                 layout_map=None, auto_shard_dataset=True):
        if not isinstance(device_mesh, keras.distribution.DeviceMesh):
            raise TypeError(
                "`device_mesh` must be a keras.distribution.DeviceMesh. "
                f"Received: device_mesh={device_mesh!r}")
        names = tuple(device_mesh.axis_names)
        if sequence_dim_name not in names:
            raise ValueError(
                f"`sequence_dim_name` must name an axis of the mesh {names}. "
                f"Received: sequence_dim_name={sequence_dim_name!r}")
        if batch_dim_name is not None and batch_dim_name not in names:
            raise ValueError(
                f"`batch_dim_name` must name an axis of the mesh {names} or be None. "
                f"Received: batch_dim_name={batch_dim_name!r}")
        if batch_dim_name == sequence_dim_name:
            raise ValueError(
                "`batch_dim_name` and `sequence_dim_name` must be different axes. "
                f"Received: both {batch_dim_name!r}")
        if layout_map is None:
            layout_map = keras.distribution.LayoutMap(device_mesh)
        elif layout_map.device_mesh is not device_mesh:
            raise ValueError("`layout_map` must be built on `device_mesh`.")
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name,
                         auto_shard_dataset=auto_shard_dataset)
        # ModelParallel falls back to the mesh's first axis.
        self._batch_dim_name = batch_dim_name
        self.sequence_dim_name = sequence_dim_name

    def get_data_layout(self, data_shape):
        spec = [None] * len(data_shape)
        if spec:
            spec[0] = self.batch_dim_name
        if len(spec) >= 2:
            spec[1] = self.sequence_dim_name
        return keras.distribution.TensorLayout(spec, self.device_mesh)
