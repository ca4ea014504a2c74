"""The build of the compiled torch band kernel (``kernels/torch/native.py``):
a lock left by a killed build never makes a later process wait, a build
held by a live process makes a waiter give up after
``KERAS_LONGATTN_NATIVE_BUILD_TIMEOUT`` seconds with a warning that says why
(and the layers compute the same values on the portable path), a completed
build loads without the lock, and the build folder is keyed by the source,
the torch and Python versions, the compiler, the flags and the CPU.

The kernel is torch's by nature: every test here runs the torch module,
and the processes it starts run with ``KERAS_BACKEND=torch``, whatever the
backend of this pytest process. The kernel is compiled once, by the first
test's subprocess (~10-40 s); the test of a completed build copies its
folder."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

pytest.importorskip("torch")
if os.environ.get("KERAS_BACKEND", "") != "torch":
    # The build and its subprocesses are the same whatever the backend:
    # one lane (torch) runs them, compiling the kernel once.
    pytest.skip("the torch lane runs the kernel build tests (KERAS_BACKEND=torch)",
                allow_module_level=True)

from keras_longattn.kernels.torch import native  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A subprocess that builds the kernel must finish within this many seconds
#: (a hanging build never does).
BUILD_LIMIT_S = 600
#: A subprocess that builds nothing must finish within this many seconds.
RUN_LIMIT_S = 300
CAN_BUILD = (shutil.which(os.environ.get("CXX", "c++")) is not None
             and (shutil.which("ninja") is not None
                  or os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja"))))

#: Run in a fresh process: loads the kernel (or not) through band_ops() and
#: prints what happened as one JSON line; with LAYER=1, also runs a causal
#: LocalAttention through its "band_kernel" path and through "reference"
#: with the same weights.
PROBE = textwrap.dedent("""
    import json, os, warnings
    import numpy as np
    from keras_longattn.kernels.torch import native

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        native.band_ops()
        report = {"status": native.native_status()}
        if os.environ.get("LAYER") == "1":
            import keras
            from keras_longattn.layers import LocalAttention

            x = np.random.default_rng(0).standard_normal((2, 70, 16)).astype("float32")
            kwargs = {"num_heads": 2, "key_dim": 8, "window": 12}
            layer = LocalAttention(implementation="band_kernel", **kwargs)
            ref = LocalAttention(implementation="reference", **kwargs)
            out = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
            ref(x, x, use_causal_mask=True)
            ref.set_weights(layer.get_weights())
            expected = keras.ops.convert_to_numpy(ref(x, x, use_causal_mask=True))
            report["last_implementation"] = layer.last_implementation
            report["max_error"] = float(np.max(np.abs(out - expected)))
    report["warnings"] = [str(w.message) for w in caught
                          if issubclass(w.category, RuntimeWarning)]
    print(json.dumps(report))
""")


def probe(root, limit_s, *, build_timeout=None, layer=False):
    """Runs :data:`PROBE` with ``TORCH_EXTENSIONS_DIR=root``; its report.
    ``subprocess.TimeoutExpired`` (a failure) when it runs past ``limit_s``."""
    env = dict(os.environ, KERAS_BACKEND="torch", TORCH_EXTENSIONS_DIR=str(root),
               LAYER="1" if layer else "0")
    env[native.ENV_SWITCH] = "1"
    env.pop(native.ENV_BUILD_TIMEOUT, None)
    if build_timeout is not None:
        env[native.ENV_BUILD_TIMEOUT] = str(build_timeout)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=limit_s, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def lock_held_by_another_process(path):
    """A live subprocess holds an exclusive ``flock`` on ``path`` for the
    block."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys\n"
         "f = open(sys.argv[1], 'a')\n"
         "fcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\n"
         "sys.stdin.read()\n",
         str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_build_leaves_the_build_key_unchanged(tmp_path, monkeypatch):
    """The key of this process's build does not change when a build runs in
    it (torch appends its libraries to ``extra_ldflags`` in place: the
    flags given to it must be copies)."""
    before = native.build_target()[0]
    calls = []

    def fake_load(**kwargs):
        kwargs["extra_ldflags"].append("-lsomething")
        kwargs["extra_cflags"].append("-DSOMETHING")
        calls.append(kwargs["name"])

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(native, "_build_root", lambda: str(tmp_path))
    monkeypatch.setattr(native.torch.ops, "keras_longattn_band", object(), raising=False)
    native._build(timeout=0)
    assert calls == [before]
    assert native.build_target()[0] == before


@pytest.fixture(scope="module")
def name():
    """The extension's name here (``keras_longattn_band_<key>``)."""
    return native.build_target()[0]


@pytest.fixture(scope="module")
def stale_build(tmp_path_factory, name):
    """An extension root holding what a killed build leaves behind: torch's
    ``lock`` file, a partial object and library but no ``complete.json`` in
    the build folder, and the lock file beside it with no process holding
    it. A fresh process loads the kernel there (the one build of this
    module); returns the root and that process's report."""
    root = tmp_path_factory.mktemp("stale_extensions")
    folder = root / name
    folder.mkdir()
    (folder / "lock").write_text("")
    (folder / "band_attention.o").write_bytes(b"\x7fELF partial")
    (folder / f"{name}.so").write_bytes(b"\x7fELF partial")
    (root / f"{name}.lock").write_text("")
    return root, probe(root, BUILD_LIMIT_S)


def test_stale_locks_of_a_killed_build_do_not_hang(stale_build, name):
    """The process finishes within BUILD_LIMIT_S, and builds the kernel
    (where a compiler and ninja exist) or warns."""
    root, report = stale_build
    if CAN_BUILD:
        assert report["status"] == "compiled", report
        assert report["warnings"] == []
        assert not (root / name / "lock").exists()
        assert (root / name / native.COMPLETE).is_file()
    else:
        assert report["status"] == "unavailable", report
        assert "could not be built" in report["warnings"][0]


def test_a_completed_build_loads_without_the_lock(stale_build, name, tmp_path):
    """A folder with ``complete.json`` is loaded directly: neither torch's
    ``lock`` file in it nor our lock held by a live process make the
    process wait (it is given no time to wait)."""
    root, report = stale_build
    if report["status"] != "compiled":
        pytest.skip("the kernel does not build here")
    copy = tmp_path / "extensions"
    shutil.copytree(root / name, copy / name)
    (copy / name / "lock").write_text("")
    with lock_held_by_another_process(copy / f"{name}.lock"):
        report = probe(copy, RUN_LIMIT_S, build_timeout=0)
    assert report == {"status": "compiled", "warnings": []}


def test_a_build_held_by_a_live_process_times_out_to_the_portable_path(tmp_path, name):
    """Another live process holds the build lock: a process with a 1 s
    timeout gives up (within RUN_LIMIT_S), warns why, and LocalAttention
    computes the reference values on the portable band path."""
    lock = tmp_path / f"{name}.lock"
    with lock_held_by_another_process(lock):
        report = probe(tmp_path, RUN_LIMIT_S, build_timeout=1, layer=True)
    assert report["status"] == "unavailable", report
    assert len(report["warnings"]) == 1, report
    message = report["warnings"][0]
    assert f"waited 1 s for the lock at {lock}, held by another build" in message
    assert native.ENV_BUILD_TIMEOUT in message and native.ENV_SWITCH in message
    for layer in ("LocalAttention", "SparseAttention", "LongformerAttention"):
        assert layer in message
    # The band path ran (its flash-kernel form: the layers may say so, as
    # "band_kernel:flash").
    assert report["last_implementation"].split(":")[0] == "band_kernel"
    assert report["max_error"] < 1e-5
    assert not (tmp_path / name).exists()  # nothing was built


KEY = {
    "source_text": "// kernel\nint f() { return 1; }\n",
    "torch_version": "2.5.0+cpu",
    "python_version": "cpython-311",
    "compiler": "c++: c++ (GCC) 12.2.0",
    "flags": ["-O3", "-march=native"],
    "machine": "0123abcd",
}


@pytest.mark.parametrize("part, other", [
    ("source_text", "// kernel\nint f() { return 2; }\n"),
    ("torch_version", "2.6.0+cpu"),
    ("python_version", "cpython-312"),
    ("compiler", "c++: c++ (GCC) 13.1.0"),
    ("flags", ["-O2", "-march=native"]),
    ("machine", "4567ef01"),
])
def test_build_key_changes_with_each_part(part, other):
    key = native.build_key(**KEY)
    assert key == native.build_key(**KEY)
    assert len(key) == 16 and int(key, 16) >= 0
    assert native.build_key(**dict(KEY, **{part: other})) != key


def test_build_folder_is_keyed_by_the_source_and_the_compiler(tmp_path, monkeypatch):
    """The folder lies under TORCH_EXTENSIONS_DIR; another source text or
    another ``CXX`` gives another folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    name, folder, description = native.build_target()
    assert folder == os.path.join(str(tmp_path), name)
    assert name.startswith("keras_longattn_band_")
    assert description["torch"] == native.torch.__version__
    source = tmp_path / "band_attention.cpp"
    with open(native._SOURCE, encoding="utf-8") as f:
        source.write_text(f.read() + "\n// another version\n")
    with monkeypatch.context() as patch:
        patch.setattr(native, "_SOURCE", str(source))
        assert native.build_target()[0] != name
    with monkeypatch.context() as patch:
        patch.setenv("CXX", "keras-longattn-no-such-compiler")
        assert native.build_target()[0] != name
    assert native.build_target()[0] == name


@pytest.fixture
def fresh_state(monkeypatch):
    """native's once-per-process state as before any call, restored after."""
    monkeypatch.setitem(native._state, "loaded", False)
    monkeypatch.setitem(native._state, "ops", None)
    monkeypatch.setitem(native._state, "error", None)
    monkeypatch.setitem(native._state, "override", True)


def test_the_warning_names_every_layer_of_the_kernel(fresh_state, tmp_path, monkeypatch):
    """A failed build (here: no source) warns once, naming the error and
    the three layers that use the kernel, and nothing is loaded."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_SOURCE", str(tmp_path / "missing.cpp"))
    assert native.native_status() == "not_loaded"
    with pytest.warns(RuntimeWarning, match="could not be built") as record:
        assert native.band_ops() is None
    message = str(record[0].message)
    assert "FileNotFoundError" in message
    assert "LocalAttention, SparseAttention and LongformerAttention" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.band_ops() is None  # once only
    assert native.native_status() == "unavailable"
    assert not native.ran_compiled()
    with native.use_native(False):
        assert native.native_status() == "off"


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_malformed_build_timeout_is_refused_with_the_value(value, fresh_state, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD_TIMEOUT, value)
    message = (f"`{native.ENV_BUILD_TIMEOUT}` must be a finite number of seconds >= 0. "
               f"Received: {native.ENV_BUILD_TIMEOUT}='{value}'")
    with pytest.raises(ValueError) as info:
        native.build_timeout()
    assert str(info.value) == message
    with pytest.raises(ValueError, match="must be a finite number"):
        native.band_ops()
    assert native.native_status() == "not_loaded"


def test_build_timeout_default_and_setting(monkeypatch):
    monkeypatch.delenv(native.ENV_BUILD_TIMEOUT, raising=False)
    assert native.build_timeout() == native.DEFAULT_BUILD_TIMEOUT
    monkeypatch.setenv(native.ENV_BUILD_TIMEOUT, " 2.5 ")
    assert native.build_timeout() == 2.5
    monkeypatch.setenv(native.ENV_BUILD_TIMEOUT, "0")
    assert native.build_timeout() == 0
