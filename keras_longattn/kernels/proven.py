"""Which accelerator paths a device run has proven, per device kind.

``implementation="auto"`` tries an accelerator kind of path (``"pallas"``
on JAX, ``"flex"`` on torch) only on a device kind for which ``proven.json``
(beside this module) holds an entry for that kind whose sources are today's;
elsewhere it keeps the portable paths, and the accelerator path runs only
when named (``implementation="pallas"``). An entry is added from a run of
``scripts/device_check.sh`` on that device in which every case of the path
equalled the reference path, values and gradients, in float32 and
bfloat16 (the ``correct`` stage). It records the package source files the
check imported and one sha256 over their contents: where any of them has
changed since, the proof is stale, ``"auto"`` does not rely on it (and
warns once) until the check is run again.

``KERAS_LONGATTN_TRUSTED_PATHS`` (a comma-separated list of kinds, e.g.
``pallas,flex``) lets ``"auto"`` try those kinds on any accelerator, for
devices nobody has checked yet or proofs gone stale. The kinds are matched
case-insensitively, with surrounding whitespace stripped (``" Pallas ,FLEX"``
names both); a value that names no kind (:data:`KNOWN_KINDS`, e.g. a
misspelt ``palas``) trusts nothing and warns once (a ``UserWarning`` naming
the variable, the value and the kinds accepted), as a stale proof does: the
variable only widens what ``"auto"`` may try, so a bad value is reported,
not raised, and the portable paths keep running.
"""

import functools
import json
import os
import warnings
from pathlib import Path

#: Environment variable listing kinds ``"auto"`` may try on any accelerator.
TRUST_VARIABLE = "KERAS_LONGATTN_TRUSTED_PATHS"
#: The path kinds the trust variable may name: JAX's Pallas kernels and
#: torch's FlexAttention.
KNOWN_KINDS = ("pallas", "flex")
#: The entries, one per (backend, device kind, path kind).
SOURCE = Path(__file__).with_name("proven.json")
#: The folder holding the package (source paths are relative to it).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def _load():
    table = {}
    if SOURCE.is_file():
        for entry in json.loads(SOURCE.read_text(encoding="utf-8")):
            table.setdefault((entry["backend"], entry["device"]), {})[entry["kind"]] = entry
    return table


#: ``{(backend, device kind): {path kind: evidence}}``. The device kind is
#: the device's own name (JAX's ``device_kind``, torch's
#: ``torch.cuda.get_device_name()``).
PROVEN = _load()

_WARNED = set()


def sources_digest(paths, root=PACKAGE_PARENT):
    """One sha256 over the contents of ``paths`` (relative to ``root``), the
    digest :mod:`keras_longattn.reproductions.provenance` records for a run
    ("missing" for a file that is gone)."""
    from keras_longattn.reproductions import provenance

    return provenance.combined_hash({
        name: provenance.file_sha256(Path(root) / name) if (Path(root) / name).is_file()
        else "missing"
        for name in paths})


@functools.lru_cache(maxsize=None)
def _current(paths, sha256):
    return sources_digest(paths) == sha256


def is_current(evidence):
    """Whether the sources a proof ran on are the package's sources now."""
    sources = evidence.get("sources") or {}
    paths, sha256 = sources.get("paths"), sources.get("sha256")
    if not paths or not sha256:
        return False
    return _current(tuple(paths), sha256)


def active_device_kind(backend):
    """The name of the accelerator the backend computes on, or None on a
    CPU."""
    if backend == "jax":
        import jax

        if jax.default_backend() == "cpu":
            return None
        return jax.devices()[0].device_kind
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return None


def trusted_kinds(backend, device_kind):
    """The path kinds ``"auto"`` may try on ``device_kind`` (a set; empty
    on a CPU, ``device_kind`` None): those with a current proof, and those
    the trust variable names."""
    if device_kind is None:
        return frozenset()
    kinds = set()
    for kind, evidence in PROVEN.get((backend, device_kind), {}).items():
        if is_current(evidence):
            kinds.add(kind)
        elif (backend, device_kind, kind) not in _WARNED:
            _WARNED.add((backend, device_kind, kind))
            warnings.warn(
                f"The device check that proved {kind!r} on {device_kind} ran on package "
                f"sources that have changed since (commits {evidence.get('commits')}); "
                f"implementation='auto' does not try {kind!r} until "
                "scripts/device_check.sh runs again on this device. Name the path, or set "
                f"{TRUST_VARIABLE}={kind}, to use it meanwhile.",
                stacklevel=2,
            )
    kinds.update(trusted_by_variable())
    return frozenset(kinds)


def trusted_by_variable():
    """The path kinds :data:`TRUST_VARIABLE` names (a frozenset, lower
    case): its comma-separated values, matched case-insensitively with
    surrounding whitespace stripped (empty values are skipped). A value
    naming no kind of :data:`KNOWN_KINDS` is left out and warned about,
    once per value."""
    kinds = set()
    for item in os.environ.get(TRUST_VARIABLE, "").split(","):
        kind = item.strip().lower()
        if not kind:
            continue
        if kind in KNOWN_KINDS:
            kinds.add(kind)
        elif (TRUST_VARIABLE, kind) not in _WARNED:
            _WARNED.add((TRUST_VARIABLE, kind))
            warnings.warn(
                f"{TRUST_VARIABLE} names an unknown path kind, ignored: "
                f"{item.strip()!r}. Accepted values (comma-separated, any case): "
                f"{', '.join(repr(k) for k in KNOWN_KINDS)}. "
                f"Received: {TRUST_VARIABLE}={os.environ.get(TRUST_VARIABLE)!r}",
                stacklevel=3,
            )
    return frozenset(kinds)


def evidence(backend, device_kind, kind):
    """The record that proved ``kind`` on ``device_kind`` (None: none)."""
    return PROVEN.get((backend, device_kind), {}).get(kind)
