"""The seam between layers, ops and kernels (issue #30): layers reach the
backends through :mod:`keras_longattn.ops` only (no ``backend_ops()`` and
no import of :mod:`keras_longattn.kernels` outside ``layers/dispatch.py``),
and no kernel imports :mod:`keras_longattn.ops`.

The rules are checked on the source text (comments and docstrings do not
count), so the test runs the same on every backend.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_longattn"


def _modules(folder):
    return sorted((PACKAGE / folder).rglob("*.py"))


def _imports(tree):
    """``(line, imported module)`` of every import statement (``from a
    import b`` counts as ``a`` and ``a.b``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _violations(path, forbidden_prefix, forbid_backend_ops):
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for line, module in _imports(tree):
        if module == forbidden_prefix or module.startswith(forbidden_prefix + "."):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}")
    if forbid_backend_ops:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
                if name in ("backend_ops", "la_backend_ops"):
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: calls {name}()")
    return found


def test_layers_reach_kernels_through_ops_only():
    found = []
    for path in _modules("layers"):
        if path.name == "dispatch.py":
            continue
        found += _violations(path, "keras_longattn.kernels", forbid_backend_ops=True)
        # `from keras_longattn import kernels`
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "keras_longattn":
                if any(alias.name == "kernels" for alias in node.names):
                    found.append(f"{path.name}:{node.lineno}: imports keras_longattn.kernels")
    assert not found, "layers outside dispatch.py reach the kernels:\n" + "\n".join(found)


def test_kernels_import_nothing_from_ops():
    found = []
    for path in _modules("kernels"):
        found += _violations(path, "keras_longattn.ops", forbid_backend_ops=False)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "keras_longattn":
                if any(alias.name == "ops" for alias in node.names):
                    found.append(f"{path.name}:{node.lineno}: imports keras_longattn.ops")
    assert not found, "kernels import keras_longattn.ops:\n" + "\n".join(found)


def test_the_checks_see_a_violation(tmp_path):
    """The checks find an import and a call of the table (so that a pass
    means something)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from keras_longattn.kernels import backend_ops\n"
        "from keras_longattn.ops import patterns\n"
        "def f():\n    return backend_ops().name\n")
    global PACKAGE
    saved = PACKAGE
    PACKAGE = tmp_path / "pkg"
    try:
        bad_rel = tmp_path / "pkg" / "bad.py"
        bad_rel.parent.mkdir()
        bad_rel.write_text(bad.read_text())
        layer_side = _violations(bad_rel, "keras_longattn.kernels", forbid_backend_ops=True)
        kernel_side = _violations(bad_rel, "keras_longattn.ops", forbid_backend_ops=False)
    finally:
        PACKAGE = saved
    assert len(layer_side) == 3  # the module, the imported name, the call
    assert len(kernel_side) == 2


# ----------------------------------------------- paths that say what ran
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ON_TORCH = keras.backend.backend() == "torch"


def _x(T, seed=0):
    return np.random.default_rng(seed).standard_normal((2, T, 16)).astype("float32")


@pytest.mark.skipif(not ON_TORCH, reason="'routed_torch' runs on torch only")
def test_routed_torch_with_balanced_routing_says_it_ran_routed_fused():
    from keras_longattn.layers import RoutingAttention

    x = _x(24)
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3,
                             implementation="routed_torch")
    layer(x, x, use_causal_mask=True)  # token routing: the torch kernel
    assert layer.last_implementation == "routed_torch"
    layer(x, x)  # bidirectional: balanced clusters, the code of "routed_fused"
    assert layer.last_implementation == "routed_torch:routed_fused"
    balanced = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3,
                                causal_routing="balanced", implementation="routed_torch")
    balanced(x, x, use_causal_mask=True)
    assert balanced.last_implementation == "routed_torch:routed_fused"


@pytest.mark.skipif(not ON_TORCH, reason="'band_kernel' runs on torch (CPU) only")
def test_fixed_band_kernel_with_padding_says_it_ran_blocked_fused():
    from keras_longattn.layers import SparseAttention

    x = _x(32)
    mask = np.ones((2, 32), bool)
    mask[1, 27:] = False
    layer = SparseAttention(num_heads=2, key_dim=8, pattern="fixed", block_length=8,
                            implementation="band_kernel")
    layer(x, x, use_causal_mask=True)
    assert layer.last_implementation.split(":")[0] == "band_kernel"
    assert layer.last_implementation != "band_kernel:blocked_fused"
    layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=True)
    assert layer.last_implementation == "band_kernel:blocked_fused"
