"""Behaviour fingerprints of the layers and models a reproduction ran.

A *subject* (:mod:`keras_longattn.reproductions.recording`) is a layer or
model as a run built it: its serialized config and the arguments of its
first call. Its *fingerprint* is what the code does with it now, on fixed
inputs:

1. ``keras.utils.set_random_seed(seed)``; the layer is rebuilt from its
   config and built by a first call (``training=False``), so its weights are
   those of its own initialisers under that seed;
2. inputs of the recorded shapes and dtypes (a batch of at most
   :data:`MAX_BATCH`): floats drawn from a seeded normal distribution,
   integers uniform below the recorded ``high`` (2 when unknown), booleans
   all ``True``; other arguments as recorded (``training`` included);
3. one call, and the gradients of ``sum(output * R)`` (``R`` a fixed random
   tensor) with respect to every trainable weight and every float input.

Each output, gradient and non-trainable variable after the call (state
updates such as k-means centroids) is summarised by its shape, its L2 norm
and :data:`PROJECTIONS` dot products with fixed random vectors; the
fingerprint also lists ``last_implementation`` of every attention layer in
the subject (the path that ran). :func:`compare` says whether two
fingerprints agree within a relative tolerance (:data:`RTOL` of each
tensor's norm, and a floor of :data:`FLOOR` times the fingerprint's largest
norm for the float32 rounding of tensors that are zero in exact
arithmetic): a refactor that changes no behaviour agrees, a changed
default, initialiser, path or kernel does not.

The file is self-contained (Keras, NumPy and the backend's own library), so
it can fingerprint the package of another checkout: ``python behaviour.py
SUBJECTS.json OUT.json`` with that checkout first on ``PYTHONPATH`` and
``KERAS_BACKEND`` set (what :func:`keras_longattn.reproductions.provenance.
fingerprint_subjects` runs).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["FLOOR", "MAX_BATCH", "PROJECTIONS", "RTOL", "compare", "fingerprint", "fingerprints",
           "subject_key"]

#: The largest batch a fingerprint runs (the recorded batch is cut to it).
MAX_BATCH = 2
#: Random projections kept per tensor.
PROJECTIONS = 3
#: Two summaries agree when they differ by at most RTOL times the tensor's
#: norm plus the larger of ATOL and FLOOR times the largest norm of the
#: recorded fingerprint: float32 reassociation (another CPU, another XLA
#: build) moves a tensor by ~1e-6 of its norm, and a tensor that is zero in
#: exact arithmetic (the gradient of a key bias, which softmax ignores) by
#: up to ~2e-6 of the largest magnitudes around it, all of its own norm.
RTOL = 1e-3
ATOL = 1e-6
FLOOR = 1e-5
SEED = 0
#: Version of the fingerprint's layout and inputs.
SCHEMA = 1


def subject_key(subject: Mapping[str, Any]) -> str:
    """A short stable key of a subject (sha256 of its canonical JSON)."""
    text = json.dumps(subject, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _inputs(subject, np):
    """``(arguments, float_names)``: the call's arguments built from the
    record, and the names of the float tensors among them."""
    recorded = subject["arguments"]
    tensors = [value for value in recorded.values()
               if isinstance(value, dict) and "tensor" in value]
    batch = tensors[0]["tensor"][0] if tensors and tensors[0]["tensor"] else None
    arguments, floats = {}, []
    for index, (name, value) in enumerate(recorded.items()):
        if not (isinstance(value, dict) and "tensor" in value):
            arguments[name] = value
            continue
        shape = list(value["tensor"])
        for axis, size in enumerate(shape):
            if size is None or (axis == 0 and size == batch):
                shape[axis] = MAX_BATCH if size is None else min(size, MAX_BATCH)
        dtype = value["dtype"]
        rng = np.random.RandomState(1000 + index)
        if dtype == "bool":
            array = np.ones(shape, dtype=bool)
        elif dtype.startswith(("int", "uint")):
            array = rng.randint(0, max(1, int(value.get("high") or 2)), size=shape).astype(dtype)
        else:
            array = rng.normal(size=shape).astype(dtype)
            floats.append(name)
        arguments[name] = array
    return arguments, floats


def _register_factories(module) -> None:
    """Calls the class factories of ``module``: its module-level functions
    named ``_..._class`` or ``_..._classes`` that are ``functools.lru_cache``
    wrappers taking no argument (the paper modules define the layers of a
    planted variant or a recording arm inside such a function, and Keras
    learns their names only when it first runs)."""
    import inspect

    for name, value in sorted(vars(module).items()):
        if not (name.endswith(("_class", "_classes")) and hasattr(value, "cache_info")):
            continue
        try:
            required = [p for p in inspect.signature(value).parameters.values()
                        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        if not required:
            value()


def _import_modules(config, classes=None) -> dict[str, Any]:
    """Imports every module a serialized object names (its classes register
    themselves with Keras when imported, or when a class factory of the
    module runs: :func:`_register_factories`), and returns ``{class name:
    class}`` of the package's classes it names by module and class name
    (for a class defined at a paper module's top level that never registers
    itself with Keras: a planted variant)."""
    import importlib

    classes = {} if classes is None else classes
    if isinstance(config, dict):
        module, name = config.get("module"), config.get("class_name")
        if isinstance(module, str) and module.split(".")[0] == "keras_longattn":
            imported = importlib.import_module(module)
            _register_factories(imported)
            value = getattr(imported, name, None) if isinstance(name, str) else None
            if isinstance(value, type):
                classes.setdefault(name, value)
        for value in config.values():
            _import_modules(value, classes)
    elif isinstance(config, list):
        for value in config:
            _import_modules(value, classes)
    return classes


def _summary(array, np) -> dict[str, Any]:
    array = np.asarray(array, dtype=np.float64)
    flat = array.ravel()
    rng = np.random.RandomState(7 + flat.size % 100003)
    projections = rng.normal(size=(PROJECTIONS, flat.size)) if flat.size else np.zeros((PROJECTIONS, 0))
    finite = bool(np.all(np.isfinite(flat)))
    return {
        "shape": list(array.shape),
        "norm": float(np.linalg.norm(flat)) if finite else None,
        "proj": [float(v) for v in projections @ flat] if finite else None,
    }


def _flat(keras, outputs) -> list:
    """The output tensors (a ``None`` in a tuple of outputs left out)."""
    return [t for t in keras.tree.flatten(outputs) if t is not None]


def _implementations(layer) -> list[str]:
    names = []
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        implementation = getattr(sub, "last_implementation", None)
        if isinstance(implementation, str):
            names.append(f"{type(sub).__name__}:{implementation}")
    return names


def _gradients(keras, layer, arguments, floats):
    """``(outputs, gradients)`` as NumPy arrays on the current backend."""
    backend = keras.backend.backend()
    import numpy as np

    def loss_of(outputs):
        total = 0.0
        for index, output in enumerate(_flat(keras, outputs)):
            if not keras.backend.standardize_dtype(output.dtype).startswith(("float", "bfloat")):
                continue
            r = np.random.RandomState(500 + index).normal(size=tuple(output.shape))
            total = total + keras.ops.sum(keras.ops.cast(output, "float32")
                                          * keras.ops.convert_to_tensor(r.astype("float32")))
        return total

    trainable = list(layer.trainable_variables)
    if backend == "jax":
        import jax

        non_trainable = [v.value for v in layer.non_trainable_variables]

        def run(values, inputs):
            call = dict(arguments, **inputs)
            outputs, updated = layer.stateless_call(values, non_trainable, **call)
            return loss_of(outputs), (outputs, updated)

        inputs = {name: jax.numpy.asarray(arguments[name]) for name in floats}
        step = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))
        (_, (outputs, updated)), grads = step([v.value for v in trainable], inputs)
        for variable, value in zip(layer.non_trainable_variables, updated):
            variable.assign(value)
        gradients = list(grads[0]) + [grads[1][name] for name in floats]
        return outputs, gradients
    if backend == "tensorflow":
        import tensorflow as tf

        call = dict(arguments)
        for name in floats:
            call[name] = tf.convert_to_tensor(arguments[name])
        with tf.GradientTape() as tape:
            for name in floats:
                tape.watch(call[name])
            outputs = layer(**call)
            loss = loss_of(outputs)
        gradients = tape.gradient(loss, [v.value for v in trainable] + [call[n] for n in floats],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return outputs, gradients
    if backend == "torch":
        import torch

        call = dict(arguments)
        for name in floats:
            call[name] = torch.tensor(arguments[name], requires_grad=True)
        for variable in trainable:
            variable.value.grad = None
        outputs = layer(**call)
        loss = loss_of(outputs)
        leaves = [v.value for v in trainable] + [call[n] for n in floats]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad \
            else [None] * len(leaves)
        gradients = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
        return outputs, [g.detach().cpu().numpy() for g in gradients]
    raise ValueError(f"no fingerprint for the backend {backend!r}")


def fingerprint(subject: Mapping[str, Any], seed: int = SEED) -> dict[str, Any]:
    """The fingerprint of one subject on the current backend (see the
    module's docstring); ``{"error": ...}`` when it cannot be computed."""
    import keras
    import numpy as np

    try:
        keras.utils.set_random_seed(seed)
        subject = json.loads(json.dumps(subject))  # deserializing may edit the config
        with keras.saving.custom_object_scope(_import_modules(subject["layer"])):
            layer = keras.saving.deserialize_keras_object(subject["layer"])
        arguments, floats = _inputs(subject, np)
        build = dict(arguments)
        build["training"] = False
        layer(**build)
        keras.utils.set_random_seed(seed + 1)
        outputs, gradients = _gradients(keras, layer, arguments, floats)
        tensors = [_summary(keras.ops.convert_to_numpy(t), np) for t in _flat(keras, outputs)]
        tensors += [_summary(keras.ops.convert_to_numpy(g), np) for g in gradients]
        tensors += [_summary(keras.ops.convert_to_numpy(v.value), np)
                    for v in layer.non_trainable_variables]
        return {"tensors": tensors, "implementations": _implementations(layer)}
    except Exception as error:  # recorded: a subject that no longer builds is a change
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def fingerprints(subjects: Iterable[Mapping[str, Any]], seed: int = SEED) -> dict[str, Any]:
    """``{subject_key: fingerprint}`` of every subject."""
    return {subject_key(subject): fingerprint(subject, seed) for subject in subjects}


def compare(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """How ``current`` differs from ``recorded`` (one fingerprint each); an
    empty list when they agree."""
    if "error" in recorded or "error" in current:
        if recorded.get("error") and recorded.get("error") == current.get("error"):
            return []
        return [f"was {recorded.get('error') or 'computed'}, now {current.get('error') or 'computed'}"]
    differences = []
    if recorded.get("implementations") != current.get("implementations"):
        differences.append(f"paths {recorded.get('implementations')} -> "
                           f"{current.get('implementations')}")
    a, b = recorded["tensors"], current["tensors"]
    if len(a) != len(b):
        return differences + [f"{len(a)} tensors -> {len(b)}"]
    norms = [t["norm"] for t in a if t["norm"] is not None]
    floor = max(ATOL, FLOOR * max(norms, default=0.0))
    for index, (x, y) in enumerate(zip(a, b)):
        if x["shape"] != y["shape"]:
            differences.append(f"tensor {index}: shape {x['shape']} -> {y['shape']}")
            continue
        if (x["norm"] is None) != (y["norm"] is None):
            differences.append(f"tensor {index}: finite -> not finite"
                               if y["norm"] is None else f"tensor {index}: not finite -> finite")
            continue
        if x["norm"] is None:
            continue
        scale = max(x["norm"], y["norm"])
        if abs(x["norm"] - y["norm"]) > RTOL * scale + floor or any(
                abs(p - q) > RTOL * scale + floor for p, q in zip(x["proj"], y["proj"])):
            differences.append(f"tensor {index} {x['shape']}: norm {x['norm']:.6g} -> "
                               f"{y['norm']:.6g}")
    return differences


def main(argv: Sequence[str] | None = None) -> int:
    """``python behaviour.py SUBJECTS.json OUT.json``: fingerprints the
    subjects (a JSON list) on ``KERAS_BACKEND`` into ``OUT.json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python behaviour.py SUBJECTS.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as stream:
        subjects = json.load(stream)
    result = fingerprints(subjects)
    with open(argv[1], "w", encoding="utf-8") as stream:
        json.dump(result, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
