"""Records the layer and model configurations a run builds (its *subjects*).

A reproduction's results depend on the behaviour of the library code its
notebook runs. :mod:`keras_longattn.reproductions.behaviour` captures that
behaviour as fingerprints of *subjects*: every instance of a Keras layer
(attention layers, blocks, models) whose class is defined in
``keras_longattn``, as the run built it. This module collects them.

:func:`start` wraps ``keras.layers.Layer._maybe_build`` (run by every
``Layer.__call__``) once Keras is imported: on the first call of each layer
instance whose class lives in ``keras_longattn``, it records a subject.

Layers first called from inside another package layer's call (an attention
layer inside its block, a block inside its model) are left out: the outer
subject's fingerprint runs them. For each subject it records

* ``layer``: ``keras.saving.serialize_keras_object(layer)`` (class, module,
  registered name and config);
* ``arguments``: the call's arguments: a tensor as ``{"tensor": shape,
  "dtype": ..., "high": ...}`` (``high``: one more than the largest value of
  an integer tensor whose values are known, the ids' range), other values
  as they are when JSON can hold them.

A call whose arguments cannot be described (nested tensors such as a
decoding cache, objects) or a layer without a config is left out and
counted in :func:`skipped`. Recording costs one dictionary lookup per layer
call after the first.

``keras-longattn reproduce`` starts the recording in the notebook's kernel
before the first cell runs (``reproduce.kernel_arguments``), which loads this
file by path, without importing the package: the notebook still chooses the
Keras backend. :func:`keras_longattn.reproductions.provenance.write_results`
reads the subjects through :func:`active` (``sys.modules``), so a run that
did not record writes no behaviour record. Only the standard library is
imported here.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

__all__ = ["MODULE_NAME", "active", "start", "subjects", "skipped"]

#: The name this module is registered under in ``sys.modules``.
MODULE_NAME = "keras_longattn.reproductions.recording"
#: When set, the subjects are also written to this file as they are recorded
#: (a run of another checkout, whose ``write_results`` does not store them).
RECORD_TO_ENV_VAR = "KERAS_LONGATTN_RECORD_TO"
#: The package whose layer classes are recorded.
PACKAGE_PREFIX = "keras_longattn"

#: subjects: {canonical JSON: ids of the live recorded instances holding it};
#: instances: {id: its subject's key}; covered_keys: subjects dropped as a
#: recorded model's sublayers (not recorded again).
_state: dict[str, Any] = {"started": False, "patched": False, "subjects": {}, "skipped": {},
                          "instances": {}, "covered_keys": set()}
_seen: "weakref.WeakSet[Any]" = weakref.WeakSet()
_seen_ids: set[int] = set()


def active():
    """The recording module of this process when a recording was started
    (``None`` otherwise)."""
    module = sys.modules.get(MODULE_NAME)
    if module is None or not getattr(module, "_state", {}).get("started"):
        return None
    return module


def subjects() -> list[dict[str, Any]]:
    """The recorded subjects, in the order they were first called, without
    repeats (two instances with the same config and arguments are one)."""
    return [json.loads(key) for key in _state["subjects"]]


def skipped() -> dict[str, int]:
    """``{reason: count}`` of the layer calls that could not be recorded."""
    return dict(_state["skipped"])


def start() -> None:
    """Starts recording: now when Keras is imported, else when it is."""
    if _state["started"]:
        return
    _state["started"] = True
    if "keras" in sys.modules and hasattr(sys.modules["keras"], "layers"):
        _patch()
    else:
        sys.meta_path.insert(0, _KerasImportHook())


class _KerasImportHook(importlib.abc.MetaPathFinder):
    """Patches Keras right after ``import keras`` has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "keras" or _state["patched"]:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch()

        loader.exec_module = exec_module
        return spec


def _patch() -> None:
    if _state["patched"]:
        return
    from keras.src.layers.layer import Layer

    original = Layer._maybe_build

    def _maybe_build(self, call_spec):
        try:
            _record(self, call_spec)
        except Exception as error:  # recording must never break a run
            _skip(f"recording failed: {type(error).__name__}")
        return original(self, call_spec)

    Layer._maybe_build = _maybe_build
    _state["patched"] = True


def _skip(reason: str) -> None:
    _state["skipped"][reason] = _state["skipped"].get(reason, 0) + 1


def _first_call(layer) -> bool:
    try:
        if layer in _seen:
            return False
        _seen.add(layer)
    except TypeError:
        if id(layer) in _seen_ids:
            return False
        _seen_ids.add(id(layer))
    return True


def _record(layer, call_spec) -> None:
    if not _in_package(layer) or not _first_call(layer):
        return
    if _inside_package_layer(layer):
        return  # its outer layer's fingerprint runs it
    import keras

    arguments = {}
    for name, value in call_spec.user_arguments_dict.items():
        described = _describe(keras, value)
        if described is _UNDESCRIBABLE:
            _skip(f"{type(layer).__name__}: argument {name!r} cannot be described")
            return
        arguments[name] = described
    try:
        serialized = keras.saving.serialize_keras_object(layer)
        key = json.dumps({"layer": serialized, "arguments": arguments}, sort_keys=True)
    except Exception:
        _skip(f"{type(layer).__name__}: no JSON config")
        return
    _drop_covered(layer)
    _state["subjects"].setdefault(key, set()).add(id(layer))
    _state["instances"][id(layer)] = key
    weakref.finalize(layer, _forget, id(layer))
    target = os.environ.get(RECORD_TO_ENV_VAR)
    if target:  # kept on disk as it grows: the run may be of another checkout
        Path(target).write_text(json.dumps(subjects()), encoding="utf-8")


def _forget(instance_id: int) -> None:
    _state["instances"].pop(instance_id, None)


def _drop_covered(layer) -> None:
    """Drops the subjects recorded for sublayers of ``layer`` (built by a
    functional graph before the model that holds them was called): the
    model's fingerprint runs them. A subject stays while another recorded
    instance that is no sublayer holds it."""
    try:
        inner = layer._flatten_layers(include_self=False, recursive=True)
    except Exception:
        return
    for sub in inner:
        key = _state["instances"].pop(id(sub), None)
        if key is None:
            continue
        holders = _state["subjects"].get(key)
        if holders is not None:
            holders.discard(id(sub))
            if not holders:
                del _state["subjects"][key]
                _state["covered_keys"].add(key)


def _in_package(layer) -> bool:
    module = type(layer).__module__ or ""
    return module == PACKAGE_PREFIX or module.startswith(PACKAGE_PREFIX + ".")


def _inside_package_layer(layer) -> bool:
    """Whether ``layer`` is called from inside the call of a layer of the
    package (Keras' call context names the outermost layer being called)."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    entry = getattr(context, "entry_layer", None)
    return entry is not None and entry is not layer and _in_package(entry)


_UNDESCRIBABLE = object()


def _describe(keras, value):
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if keras.ops.is_tensor(value) or isinstance(value, keras.KerasTensor) or _is_array(value):
        shape = [None if d is None else int(d) for d in value.shape]
        dtype = keras.backend.standardize_dtype(value.dtype)
        record = {"tensor": shape, "dtype": dtype}
        if dtype.startswith(("int", "uint")) and not isinstance(value, keras.KerasTensor):
            try:
                record["high"] = int(keras.ops.convert_to_numpy(keras.ops.max(value))) + 1
            except Exception:  # a traced tensor: its values are not known
                pass
        return record
    return _UNDESCRIBABLE


def _is_array(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "shape") and hasattr(value, "dtype")
