"""Which accelerator paths a device run has proven, per backend and vendor.

``implementation="auto"`` tries an accelerator kind of path (``"cudnn"``
and ``"pallas"`` on JAX, ``"flex"`` on torch) only on a GPU of a vendor
(``"nvidia"``, ``"amd"``; ``"google"`` for TPUs) for which ``proven.json``
(beside this module) holds a *current* proof of that kind on that backend;
elsewhere it keeps the portable paths, and the accelerator path runs only
when named (``implementation="pallas"``).

A proof is written by ``scripts/device_check.sh`` (through
``python -m keras_longattn.benchmarks.device_report --prove``) from one
complete run on a device of that vendor in which every planned case of the
path equalled the reference path, values and gradients (the ``correct``
stage). It records the path's own sources, :data:`PATH_SOURCES`, each with
the sha256 it had on the device: the kernel files and the modules that
build what the kernel receives (its block layouts, token orders and mask
predicates). A proof is *current* while those files are byte for byte what
the check ran, and it lists exactly the files the path lists today. An
edit to any other file (a docstring of a layer, a decoding method, another
layer, the portable paths) leaves it current; an edit to one of the path's
own sources makes it stale: ``"auto"`` then does not try the path (and
warns once, naming the changed files) until the check runs again.

What the proof does not cover, the CPU tests do: the layers' code that
calls a path (which pattern, extents and scale it passes) is the same on
every device, and the tests run it on the CPU (Pallas interpreted, the
cuDNN path's argument mapping through XLA, FlexAttention's CPU forward)
against the reference path.

A path that ``"auto"`` chose and that fails to compile or launch on a
device falls back to the portable paths with one warning naming the error
(:mod:`keras_longattn.layers.dispatch`): a proof per vendor may meet a GPU
of that vendor the check never ran on.

``KERAS_LONGATTN_TRUSTED_PATHS`` (a comma-separated list of kinds, e.g.
``pallas,flex``) lets ``"auto"`` try those kinds on any accelerator, for
vendors nobody has checked yet or proofs gone stale. The kinds are matched
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

#: The sources of each accelerator path kind (relative to the folder that
#: holds the package), the one list a proof of that kind is checked
#: against: the kernel files, and the modules that compute what the kernel
#: receives. ``"pallas"``: the Pallas kernels (GPU and TPU variants), the
#: layers' entry points that arrange tokens and build block layouts
#: (``ops/block_sparse.py``), the layouts and token orders
#: (``ops/layouts.py``, ``kernels/arrangements.py``), the pattern
#: predicates evaluated inside the kernel (``ops/patterns.py``) and the
#: masked logit (``kernels/constants.py``). ``"flex"``: the FlexAttention
#: module (its ``BlockMask`` and ``mask_mod``), the token orders, and the
#: patterns and layouts its block structure is computed from.
#: ``"cudnn"``: the module mapping a window onto cuDNN's sliding window.
PATH_SOURCES = {
    "pallas": (
        "keras_longattn/kernels/jax/pallas_attention.py",
        "keras_longattn/kernels/jax/pallas_tpu.py",
        "keras_longattn/kernels/arrangements.py",
        "keras_longattn/kernels/constants.py",
        "keras_longattn/ops/block_sparse.py",
        "keras_longattn/ops/layouts.py",
        "keras_longattn/ops/patterns.py",
    ),
    "flex": (
        "keras_longattn/kernels/torch/flex.py",
        "keras_longattn/kernels/arrangements.py",
        "keras_longattn/ops/layouts.py",
        "keras_longattn/ops/patterns.py",
    ),
    "cudnn": (
        "keras_longattn/kernels/jax/cudnn_window.py",
    ),
}
#: The backend each kind runs on.
PATH_BACKENDS = {"pallas": "jax", "flex": "torch", "cudnn": "jax"}
#: The path kinds the trust variable may name (every accelerator kind).
KNOWN_KINDS = tuple(PATH_SOURCES)
#: The proofs, a JSON list of entries (see :func:`proof_problems`).
SOURCE = Path(__file__).with_name("proven.json")
#: The folder holding the package (source paths are relative to it).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def _load(source=SOURCE):
    table = {}
    if Path(source).is_file():
        for entry in json.loads(Path(source).read_text(encoding="utf-8")):
            table.setdefault((entry["backend"], entry["vendor"]), {})[entry["kind"]] = entry
    return table


#: ``{(backend, vendor): {path kind: proof}}``, from :data:`SOURCE`.
PROVEN = _load()

_WARNED = set()


@functools.lru_cache(maxsize=256)
def _file_sha256(path, mtime_ns, size):
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_sha256(path):
    """The sha256 of a file's bytes, "missing" when there is no such file
    (cached per path, modification time and size)."""
    try:
        stat = os.stat(path)
    except OSError:
        return "missing"
    return _file_sha256(str(path), stat.st_mtime_ns, stat.st_size)


def source_hashes(kind, root=None):
    """``{path: sha256}`` of the sources of ``kind`` (:data:`PATH_SOURCES`)
    as they are under ``root`` (default: the package's own folder)."""
    root = Path(root) if root is not None else PACKAGE_PARENT
    return {name: file_sha256(root / name) for name in PATH_SOURCES[kind]}


def changed_sources(kind, evidence, root=None):
    """What keeps ``evidence`` (a proof of ``kind``) from being current: a
    sorted list of ``"path: why"`` (empty: current). A file the path lists
    and the proof does not (or the reverse) counts, as does a file whose
    bytes differ or that is gone."""
    recorded = (evidence or {}).get("sources") or {}
    if not isinstance(recorded, dict):
        return ["sources: not a {path: sha256} mapping"]
    if kind not in PATH_SOURCES:
        return [f"{kind!r}: not an accelerator path kind ({', '.join(KNOWN_KINDS)})"]
    today = source_hashes(kind, root)
    problems = []
    for name in sorted(set(today) | set(recorded)):
        if name not in recorded:
            problems.append(f"{name}: a source of {kind!r} the proof did not cover")
        elif name not in today:
            problems.append(f"{name}: no longer a source of {kind!r}")
        elif today[name] == "missing":
            problems.append(f"{name}: missing")
        elif today[name] != recorded[name]:
            problems.append(f"{name}: changed")
    return problems


def is_current(kind, evidence, root=None):
    """Whether the proof ``evidence`` of ``kind`` ran on the path's sources
    as they are now (:func:`changed_sources` is empty)."""
    return not changed_sources(kind, evidence, root)


def vendor_of(name, platform=None):
    """The vendor of an accelerator from its platform (``"cuda"``,
    ``"rocm"``, ``"tpu"``) or else its name (``"NVIDIA H200"`` ->
    ``"nvidia"``); None for a CPU or an unknown device."""
    platform = (platform or "").lower()
    if "cuda" in platform:
        return "nvidia"
    if "rocm" in platform or "hip" in platform:
        return "amd"
    if "tpu" in platform:
        return "google"
    text = (name or "").lower()
    for word, vendor in (("nvidia", "nvidia"), ("tesla", "nvidia"), ("geforce", "nvidia"),
                         ("amd", "amd"), ("radeon", "amd"), ("instinct", "amd"),
                         ("tpu", "google")):
        if word in text:
            return vendor
    return None


def active_device_kind(backend):
    """The name of the accelerator the backend computes on (JAX's
    ``device_kind``, torch's ``torch.cuda.get_device_name()``), or None on
    a CPU."""
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


def active_vendor(backend):
    """The vendor of the accelerator the backend computes on (the key of
    :data:`PROVEN`), or None on a CPU."""
    name = active_device_kind(backend)
    if name is None:
        return None
    platform = None
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        platform = device.platform
        if platform == "gpu":
            platform = getattr(device.client, "platform_version", "") or ""
    elif backend == "torch":
        import torch

        platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return vendor_of(name, platform) or name.lower()


def trusted_kinds(backend, vendor):
    """The path kinds ``"auto"`` may try on a GPU of ``vendor`` (a set;
    empty on a CPU, ``vendor`` None): those with a current proof on
    ``backend`` for that vendor, and those the trust variable names."""
    if vendor is None:
        return frozenset()
    kinds = set()
    for kind, evidence in PROVEN.get((backend, vendor), {}).items():
        problems = changed_sources(kind, evidence)
        if not problems:
            kinds.add(kind)
        elif (backend, vendor, kind) not in _WARNED:
            _WARNED.add((backend, vendor, kind))
            devices = ", ".join(evidence.get("devices") or []) or "unrecorded devices"
            warnings.warn(
                f"The device check that proved {kind!r} on {vendor} GPUs ({devices}; "
                f"commit {evidence.get('commit')}) ran on sources of that path that are "
                f"not today's ({'; '.join(problems)}); implementation='auto' does not "
                f"try {kind!r} until scripts/device_check.sh runs again on such a "
                f"device. Name the path, or set {TRUST_VARIABLE}={kind}, to use it "
                "meanwhile.",
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


def evidence(backend, vendor, kind):
    """The proof of ``kind`` on ``backend`` for GPUs of ``vendor`` (None:
    none)."""
    return PROVEN.get((backend, vendor), {}).get(kind)


#: Fields every proof holds.
PROOF_FIELDS = ("backend", "vendor", "kind", "devices", "date", "software", "check",
                "cases", "runs", "commit", "sources")


def proof_problems(entry, root=None):
    """What is wrong with one entry of ``proven.json`` as a record (not
    whether it is current): a list of sentences, empty when none. Every
    field of :data:`PROOF_FIELDS`; a known kind on its own backend; every
    source file it names and every run file it cites present under
    ``root`` (default: the checkout holding the package)."""
    root = Path(root) if root is not None else PACKAGE_PARENT
    problems = [f"no {field!r}" for field in PROOF_FIELDS if field not in entry]
    kind = entry.get("kind")
    if kind not in PATH_SOURCES:
        problems.append(f"unknown kind {kind!r} (known: {', '.join(KNOWN_KINDS)})")
    elif entry.get("backend") != PATH_BACKENDS[kind]:
        problems.append(f"{kind!r} runs on {PATH_BACKENDS[kind]}, not {entry.get('backend')}")
    for name in sorted(entry.get("sources") or {}):
        if not (root / name).is_file():
            problems.append(f"names a source file that does not exist: {name}")
    for name in entry.get("runs") or []:
        if not (root / name).is_file():
            problems.append(f"cites a run file that does not exist: {name}")
    return problems
