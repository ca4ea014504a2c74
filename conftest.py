"""Project-wide pytest set-up.

* ``--run-slow`` (or the environment variable ``KERAS_LONGATTN_RUN_SLOW=1``)
  runs the tests marked ``@pytest.mark.slow``; they are skipped otherwise.
* Hypothesis: the derandomised ``"ci"`` profile by default, the longer
  ``"slow"`` profile under ``--run-slow`` (see
  :mod:`keras_longattn.testing.profiles`; ``HYPOTHESIS_PROFILE`` names
  another registered profile).
* ``@pytest.mark.grid`` marks the extra points of a parameter grid of a
  backend-independent op (written once in ``keras.ops``): the whole grid
  runs on the torch backend (the fastest one on a CPU) and everywhere
  under ``--run-slow``; on jax and tensorflow only the unmarked points run,
  which cover every code path of the op (eager JAX compiles each primitive
  once per new shape, so every extra shape costs seconds there).
* ``@pytest.mark.backend_free`` (usually a module's ``pytestmark``) marks a
  test whose outcome does not depend on Keras' backend: it imports none, or
  its work runs in subprocesses that pick their own (the notebooks' kernels,
  benchmark workers, fingerprints of a recorded backend). It runs in one
  backend's unit tests only, :data:`BACKEND_FREE_BACKEND` (override:
  ``KERAS_LONGATTN_BACKEND_FREE_ON``), and on every backend under
  ``--run-slow``.
* **One backend for portable tests.** The conformance and property suites
  (classes of :mod:`keras_longattn.testing`: efficient paths against the
  dense reference on the same weights, causality by perturbation, padding,
  decoding against the forward pass, serialisation, mixed precision) run on
  every backend. So do the tests of ``tests/kernels`` and ``tests/parallel``
  (backend-specific code), every test with a ``skipif`` marker (it runs where
  its condition lets it), every test whose own source names a backend
  (``keras.backend.backend()``, ``BACKEND``, ``ON_TF``…, ``import jax`` /
  ``tensorflow`` / ``torch``, ``jax.`` / ``tf.``: it branches on one) and
  every test marked ``@pytest.mark.every_backend``. The other tests of the
  library's portable code (written once in ``keras.ops``, through the
  same layers the suites check on every backend) run on
  :data:`PORTABLE_BACKEND` only (torch, the fastest on a CPU; override:
  ``KERAS_LONGATTN_PORTABLE_ON``), and on every backend under ``--run-slow``.
  On JAX each extra test costs seconds of XLA compiling small programs.
* On TensorFlow the property suite's ``test_prop_dynamic_length[eager]``
  (``model.fit`` in a ``tf.function`` without XLA) of a layer that
  supports XLA runs under ``--run-slow`` only: Keras compiles with XLA
  there by default (``jit_compile="auto"``), which ``[jit]`` runs; JAX skips ``[eager]`` and
  torch ``[jit]`` the same way (:mod:`keras_longattn.testing.properties`).
* ``KERAS_LONGATTN_HOST_DEVICES=N`` splits JAX's CPU platform into N
  devices (for ``tests/parallel``).
* Tests listed in a test class's ``known_failures`` are marked
  ``xfail(strict=True)``.
"""

import inspect
import os
import re

import pytest

#: The backend whose unit tests run the ``backend_free`` tests.
BACKEND_FREE_BACKEND = os.environ.get("KERAS_LONGATTN_BACKEND_FREE_ON", "torch")

#: The backend that runs the portable tests outside the suites.
PORTABLE_BACKEND = os.environ.get("KERAS_LONGATTN_PORTABLE_ON", "torch")

#: Test folders (relative to the project root) whose every test runs on every
#: backend: the code they test is backend-specific.
EVERY_BACKEND_FOLDERS = ("tests/kernels", "tests/parallel")

#: Test source that branches on, or imports, a backend.
_NAMES_A_BACKEND = re.compile(
    r"backend\(\)|\bBACKEND\b|\bON_(?:TF|TORCH|JAX)\b|\bimport (?:jax|tensorflow|torch)\b"
    r"|\bfrom (?:jax|tensorflow|torch)\b|\b(?:jax|tf)\.\w"
)

_ROOT = os.path.dirname(os.path.abspath(__file__))

# Simulated devices for the distributed tests (tests/parallel): JAX's CPU
# platform splits into this many devices when the flag is set before JAX
# creates its CPU client.
if os.environ.get("KERAS_LONGATTN_HOST_DEVICES"):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count="
        + os.environ["KERAS_LONGATTN_HOST_DEVICES"]
    ).strip()


def _run_slow(config):
    if config.getoption("--run-slow", default=False):
        return True
    return os.environ.get("KERAS_LONGATTN_RUN_SLOW", "") not in ("", "0")


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="run tests marked slow and the long Hypothesis profile "
        "(also: KERAS_LONGATTN_RUN_SLOW=1)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: long-running tests, skipped unless --run-slow is given"
    )
    config.addinivalue_line(
        "markers", "grid: an extra grid point, run on torch and with --run-slow only"
    )
    config.addinivalue_line(
        "markers", "backend_free: an outcome no backend changes, run on one backend only"
    )
    config.addinivalue_line(
        "markers", "every_backend: a portable test that runs on every backend all the same"
    )
    try:
        from keras_longattn.testing import profiles
    except ImportError:  # hypothesis not installed: the property tests fail to import
        return
    profiles.load_profile(_run_slow(config))


def pytest_collection_modifyitems(config, items):
    if not _run_slow(config):
        skip = pytest.mark.skip(
            reason="slow test: pass --run-slow or set KERAS_LONGATTN_RUN_SLOW=1"
        )
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(skip)
        if os.environ.get("KERAS_BACKEND", "tensorflow") != "torch":
            skip_grid = pytest.mark.skip(
                reason="extra grid point: runs on torch, or with --run-slow"
            )
            for item in items:
                if item.get_closest_marker("grid") is not None:
                    item.add_marker(skip_grid)
        if os.environ.get("KERAS_BACKEND", "tensorflow") != BACKEND_FREE_BACKEND:
            skip_free = pytest.mark.skip(
                reason=f"backend-independent: runs with KERAS_BACKEND={BACKEND_FREE_BACKEND}, "
                "or with --run-slow"
            )
            for item in items:
                if item.get_closest_marker("backend_free") is not None:
                    item.add_marker(skip_free)
        if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
            skip_graph = pytest.mark.skip(
                reason="tf.function without XLA: Keras' default on TensorFlow is XLA "
                "([jit]); runs with --run-slow"
            )
            for item in items:
                if item.name == "test_prop_dynamic_length[eager]" and \
                        getattr(item.cls, "supports_jit", False):
                    item.add_marker(skip_graph)
        if os.environ.get("KERAS_BACKEND", "tensorflow") != PORTABLE_BACKEND:
            skip_portable = pytest.mark.skip(
                reason=f"portable test outside the conformance and property suites: runs "
                f"with KERAS_BACKEND={PORTABLE_BACKEND}, or with --run-slow"
            )
            for item in items:
                if not runs_on_every_backend(item):
                    item.add_marker(skip_portable)
    try:
        from keras_longattn.testing.profiles import apply_known_failures
    except ImportError:
        return
    apply_known_failures(items)


def _suite_classes():
    try:
        from keras_longattn.testing.model_properties import CausalModelDecodingProperties
        from keras_longattn.testing.decoding import DecodingProperties
    except ImportError:
        return ()
    return (DecodingProperties, CausalModelDecodingProperties)


def runs_on_every_backend(item):
    """Whether ``item`` runs on every backend (see the module docstring)."""
    path = os.path.relpath(str(item.fspath), _ROOT).replace(os.sep, "/")
    if not path.startswith("tests/") or path.startswith(EVERY_BACKEND_FOLDERS):
        return True
    if item.get_closest_marker("every_backend") or item.get_closest_marker("skipif"):
        return True
    cls = getattr(item, "cls", None)
    if cls is not None and issubclass(cls, _suite_classes()):
        return True
    function = getattr(item, "function", None)
    if function is None:
        return True
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return True
    return _NAMES_A_BACKEND.search(source) is not None
