"""What a ``keras-longattn bench`` run measured, added to its reports by the
command line: each row's path (the implementation the layer's selection
takes for that call, :meth:`keras_longattn.layers.BaseAttention.select_implementation`)
and the run's provenance record (:func:`keras_longattn.provenance.collect`,
over the package modules a layer of each row imports on its backend), so
that a committed results file says what ran and ``keras-longattn reproduce
--stale`` can tell when its sources changed.

Both come from one short subprocess per backend that builds every row's
layer from its ``layer_spec`` (no timing: a call at the row's length is not
repeated; one call at ``min(n, 512)`` positions imports the modules its path
uses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

#: Positions of the call that imports a path's modules.
PROBE_LENGTH = 512

_SCRIPT = r"""
import json, sys
import numpy as np
import keras
from keras_longattn.specs.resolver import build_layer

rows = json.loads(sys.argv[1])
paths = []
for row in rows:
    try:
        layer = build_layer(row["layer_spec"], label=row["layer"])
        n, width = int(row["seq_len"]), int(row["num_heads"]) * int(row["head_dim"])
        shape = (int(row["batch"]), n, width)
        layer.build(shape, shape)
        select = getattr(layer, "select_implementation", None)
        if select is None:
            paths.append(None)
            continue
        causal = bool(row.get("causal", True))
        paths.append(select(use_causal_mask=causal, query_length=n, key_length=n))
        m = min(n, %d)
        x = np.zeros((1, m, width), "float32")
        layer(x, x, use_causal_mask=causal)
    except Exception:  # a layer this backend cannot build: no path recorded
        paths.append(None)
modules = sorted(m for m in sys.modules if m.split(".")[0] == "keras_longattn")
print("@@RECORD@@" + json.dumps({"paths": paths, "modules": modules}))
""" % PROBE_LENGTH


def _probe(rows: Sequence[Mapping[str, Any]], backend: str) -> dict[str, Any]:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    result = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(list(rows))],
                            env=env, capture_output=True, text=True, timeout=900)
    for line in result.stdout.splitlines():
        if line.startswith("@@RECORD@@"):
            return json.loads(line[len("@@RECORD@@"):])
    raise RuntimeError(f"recording the paths on {backend} failed: {result.stderr[-2000:]}")


def annotate(rows: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
    """Adds ``implementation`` to every row with a ``layer_spec`` and
    ``provenance`` to ``metadata`` (in place)."""
    import importlib

    from keras_longattn import provenance

    modules: set[str] = set()
    backends = sorted({str(r.get("backend")) for r in rows if r.get("layer_spec")})
    for backend in backends:
        chosen = [r for r in rows if r.get("layer_spec") and str(r.get("backend")) == backend]
        found = _probe(chosen, backend)
        for row, path in zip(chosen, found["paths"]):
            row["implementation"] = path
        modules.update(found["modules"])
    for module in sorted(modules):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a module of another backend's kernels
            continue
    record = provenance.collect()
    record["backend"] = ",".join(backends)
    metadata[provenance.PROVENANCE_KEY] = record


def rewrite(results, paths: Mapping[str, Any]) -> None:
    """Writes the annotated reports over the JSON files the run wrote."""
    from .report import to_json

    text = to_json(results, results.metadata)
    for key in ("json", "latest_json"):
        if key in paths:
            Path(paths[key]).write_text(text, encoding="utf-8")
