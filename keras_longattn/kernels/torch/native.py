"""The C++ kernels in ``csrc/``, compiled for this machine on first use.

:func:`band_ops` builds ``csrc/band_attention.cpp`` with
``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~10-20 s once, then
cached by torch under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) and returns its operators,
``torch.ops.keras_longattn_band.forward`` / ``.backward``. Where the build
is impossible (no compiler, no ninja, not x86-64 Linux) it warns once and
returns None, and the callers keep their portable torch paths: the results
are the same, only slower.

``KERAS_LONGATTN_NATIVE=0`` turns the compiled kernels off (the flash-kernel
paths of :mod:`keras_longattn.kernels.torch.band` run instead);
:func:`use_native` does the same for one block of code (tests compare both).
"""

import contextlib
import hashlib
import os
import platform
import sys
import warnings

import torch

#: Environment variable: "0" (or "off", "false") disables the compiled kernels.
ENV_SWITCH = "KERAS_LONGATTN_NATIVE"

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "band_attention.cpp")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_state = {"loaded": False, "ops": None, "override": None}


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


def _build():
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for x86-64 Linux only (this is {sys.platform} "
                           f"{platform.machine()})")
    from torch.utils import cpp_extension

    # ninja may be installed in the interpreter's environment (pip's ninja)
    # without that environment being on PATH.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bin_dir
    cpp_extension.load(
        name=f"keras_longattn_band_{_machine_tag()}",
        sources=[_SOURCE],
        extra_cflags=_FLAGS,
        extra_ldflags=["-lmvec"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.keras_longattn_band


def band_ops():
    """``torch.ops.keras_longattn_band`` (the compiled band kernel), or None
    when it is switched off or cannot be built here."""
    if not _switched_on():
        return None
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            _state["ops"] = _build()
        except Exception as error:  # any build failure: keep the portable path
            warnings.warn(
                "keras_longattn: the compiled band-attention kernel could not be built "
                f"({type(error).__name__}: {str(error).strip()[:300]}); LocalAttention and "
                "SparseAttention use the slower flash-kernel path on torch. Set "
                f"{ENV_SWITCH}=0 to skip the build.",
                RuntimeWarning,
                stacklevel=2,
            )
    return _state["ops"]


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
