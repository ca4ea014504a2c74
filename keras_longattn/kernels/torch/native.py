"""The C++ kernels in ``csrc/``, compiled for this machine on first use.

:func:`band_ops` builds ``csrc/band_attention.cpp`` with
``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~10-20 s once) and
returns its operators, ``torch.ops.keras_longattn_band.forward`` /
``.backward``. Where the build is impossible (no compiler, no ninja, not
x86-64 Linux) it warns once and returns None, and the callers keep their
portable torch paths: the results are the same, only slower.

**Build folder.** The build lives in its own folder under
``TORCH_EXTENSIONS_DIR`` (default: torch's ``~/.cache/torch_extensions``),
named ``keras_longattn_band_<key>``, where the key (:func:`build_key`) is a
hash of the C++ source text, the torch and Python versions, the compiler
(``CXX``, default ``c++``, and its ``--version`` text), the compile and link
flags and the CPU's instruction sets (the build uses ``-march=native``): two
checkouts, environments or machines sharing the cache never build over each
other or load each other's kernel. A build that completes writes
``complete.json`` into its folder; a process that finds it loads the
library directly, without a lock or a call to the build tools.

**Lock.** Otherwise the process builds under an exclusive ``flock`` on
``keras_longattn_band_<key>.lock`` beside the folder. The operating system
releases that lock when its holder exits or is killed, so a killed build
never leaves a lock behind: whoever takes the lock next finds no
``complete.json``, empties the folder (partial objects, torch's own ``lock``
file) and builds again. A process waits for the lock at most
``KERAS_LONGATTN_NATIVE_BUILD_TIMEOUT`` seconds (default
:data:`DEFAULT_BUILD_TIMEOUT`); then it warns, as for a failed build, and
keeps the portable paths.

``KERAS_LONGATTN_NATIVE=0`` turns the compiled kernels off (the flash-kernel
paths of :mod:`keras_longattn.kernels.torch.band` run instead);
:func:`use_native` does the same for one block of code (tests compare both).
:func:`native_status` says whether the compiled kernel is loaded and in use.
"""

import contextlib
import errno
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings

import torch

#: Environment variable: "0" (or "off", "false") disables the compiled kernels.
ENV_SWITCH = "KERAS_LONGATTN_NATIVE"
#: Environment variable: the seconds a process waits for another process's
#: build of the kernel (its lock) before it gives up and warns.
ENV_BUILD_TIMEOUT = "KERAS_LONGATTN_NATIVE_BUILD_TIMEOUT"
#: The wait, in seconds, when :data:`ENV_BUILD_TIMEOUT` is not set.
DEFAULT_BUILD_TIMEOUT = 300.0

#: The layers whose torch paths use the compiled kernel (named in the warning).
LAYERS = ("LocalAttention", "SparseAttention", "LongformerAttention")

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "band_attention.cpp")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LDFLAGS = ["-lmvec"]
_PREFIX = "keras_longattn_band"
#: Written into the build folder, last, by a build that completed.
COMPLETE = "complete.json"
#: How often a waiting process tries the lock again, in seconds.
_POLL = 0.2
_state = {"loaded": False, "ops": None, "override": None, "error": None}


def _switched_on():
    if _state["override"] is not None:
        return _state["override"]
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def _machine_tag():
    """A short tag of the CPU's instruction sets: the build uses
    ``-march=native``, so a cache shared by different machines keeps one
    build per kind of CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:8]


def _compiler_identity():
    """The C++ compiler torch builds with (``CXX``, default ``c++``) and
    what its ``--version`` prints, or why it could not run."""
    compiler = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                timeout=60, check=False)
        version = result.stdout.strip() or result.stderr.strip()
    except (OSError, subprocess.SubprocessError) as error:
        version = f"unavailable ({type(error).__name__})"
    return f"{compiler}: {version}"


def build_key(source_text, torch_version, python_version, compiler, flags, machine):
    """The 16-hex-digit key of a build: a hash of the C++ source text, the
    torch and Python versions, the compiler's identity, the compile and link
    flags (a sequence of strings) and the CPU tag. Any change to one of them
    changes the key, so the build lands in another folder."""
    parts = {
        "source": hashlib.sha256(source_text.encode()).hexdigest(),
        "torch": str(torch_version),
        "python": str(python_version),
        "compiler": str(compiler),
        "flags": [str(flag) for flag in flags],
        "machine": str(machine),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _build_root():
    """``TORCH_EXTENSIONS_DIR``, else torch's default extension root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils import cpp_extension

        root = cpp_extension.get_default_build_root()
    return root


def build_target():
    """``(name, folder, description)`` of this environment's build: the
    extension's name (``keras_longattn_band_<key>``), its folder under the
    extension root and the key's parts (written into ``complete.json``)."""
    with open(_SOURCE, encoding="utf-8") as f:
        source_text = f.read()
    description = {
        "source_sha256": hashlib.sha256(source_text.encode()).hexdigest(),
        "torch": torch.__version__,
        "python": sys.implementation.cache_tag,
        "compiler": _compiler_identity(),
        "flags": _FLAGS + _LDFLAGS,
        "machine": _machine_tag(),
    }
    key = build_key(source_text, description["torch"], description["python"],
                    description["compiler"], description["flags"], description["machine"])
    name = f"{_PREFIX}_{key}"
    return name, os.path.join(_build_root(), name), description


def build_timeout():
    """The seconds to wait for another process's build
    (:data:`ENV_BUILD_TIMEOUT`, default :data:`DEFAULT_BUILD_TIMEOUT`)."""
    text = os.environ.get(ENV_BUILD_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_BUILD_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`{ENV_BUILD_TIMEOUT}` must be a finite number of seconds >= 0. "
            f"Received: {ENV_BUILD_TIMEOUT}={text!r}"
        )
    return value


@contextlib.contextmanager
def _exclusive(lock_path, timeout):
    """Holds an exclusive ``flock`` on ``lock_path`` (created if missing)
    for the block; raises TimeoutError when another process holds it for
    ``timeout`` seconds."""
    import fcntl  # POSIX only; the build runs on Linux only

    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"waited {timeout:g} s for the lock at {lock_path}, held by another "
                    f"build of the kernel; set {ENV_BUILD_TIMEOUT}=<seconds> to wait longer"
                )
            time.sleep(min(_POLL, left))
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _load_complete(name, folder):
    """Loads the library of a completed build in ``folder``; False when
    there is none."""
    library = os.path.join(folder, name + ".so")
    if not (os.path.isfile(os.path.join(folder, COMPLETE)) and os.path.isfile(library)):
        return False
    torch.ops.load_library(library)
    return True


def _build(timeout):
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for x86-64 Linux only (this is {sys.platform} "
                           f"{platform.machine()})")
    name, folder, description = build_target()
    if _load_complete(name, folder):
        return torch.ops.keras_longattn_band
    with _exclusive(folder + ".lock", timeout):
        if _load_complete(name, folder):  # built by the process that held the lock
            return torch.ops.keras_longattn_band
        # No other process builds here while this one holds the lock: what
        # the folder holds is left by a build that did not complete
        # (torch's `lock` file, partial objects), and goes.
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
        from torch.utils import cpp_extension

        # ninja may be installed in the interpreter's environment (pip's
        # ninja) without that environment being on PATH.
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bin_dir
        cpp_extension.load(
            name=name,
            sources=[_SOURCE],
            # Copies: torch appends its own libraries to extra_ldflags in
            # place, which would change this process's build key.
            extra_cflags=list(_FLAGS),
            extra_ldflags=list(_LDFLAGS),
            build_directory=folder,
            is_python_module=False,
            verbose=False,
        )
        marker = os.path.join(folder, COMPLETE)
        with open(marker + ".tmp", "w") as f:
            json.dump(description, f, indent=1)
        os.replace(marker + ".tmp", marker)
    return torch.ops.keras_longattn_band


def band_ops():
    """``torch.ops.keras_longattn_band`` (the compiled band kernel), or None
    when it is switched off or cannot be built here."""
    if not _switched_on():
        return None
    if not _state["loaded"]:
        timeout = build_timeout()  # a malformed setting raises its ValueError
        _state["loaded"] = True
        try:
            _state["ops"] = _build(timeout)
        except Exception as error:  # any build failure: keep the portable path
            reason = str(error).strip()
            if not isinstance(error, TimeoutError):
                reason = reason[:300]  # a compiler's output can be long
            _state["error"] = f"{type(error).__name__}: {reason}"
            layers = ", ".join(LAYERS[:-1]) + " and " + LAYERS[-1]
            warnings.warn(
                "keras_longattn: the compiled band-attention kernel could not be built "
                f"({_state['error']}); {layers} use the slower flash-kernel path on "
                f"torch. Set {ENV_SWITCH}=0 to skip the build.",
                RuntimeWarning,
                stacklevel=2,
            )
    return _state["ops"]


def native_status():
    """Whether the compiled kernel runs now: ``"compiled"`` (loaded, and
    :func:`band_ops` returns it), ``"off"`` (switched off by
    :data:`ENV_SWITCH` or :func:`use_native`), ``"unavailable"`` (its build
    or load failed in this process: the warning said why) or ``"not_loaded"``
    (no call has needed it yet). Starts no build."""
    if not _switched_on():
        return "off"
    if not _state["loaded"]:
        return "not_loaded"
    return "compiled" if _state["ops"] is not None else "unavailable"


def ran_compiled():
    """True when :func:`band_ops` returns the compiled kernel now (it is
    switched on and loaded), so the band paths run it; starts no build."""
    return native_status() == "compiled"


@contextlib.contextmanager
def use_native(enabled):
    """Within the block, the compiled kernels are used (``True``, where they
    build) or not (``False``), whatever :data:`ENV_SWITCH` says."""
    before = _state["override"]
    _state["override"] = bool(enabled)
    try:
        yield
    finally:
        _state["override"] = before
