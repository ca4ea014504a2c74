"""One module for layer specs: the benchmark, the LRA-style suite and the
model builders parse and resolve layers through :mod:`keras_longattn.specs`.

* one resolver: ``benchmarks.layer_config`` and ``models._attention_config``
  hold the same function objects, and turn the same spec into layers with
  equal configs (including the forms only one of them took before:
  ``"package.module:Class"`` for the models, a class with its own
  ``from_config`` for the benchmark);
* the models resolve without importing modules, the benchmark and the suite
  import the module a spec names;
* no module of ``lra``, ``models``, ``benchmarks`` or ``specs`` imports an
  underscore name of another subpackage.
"""

import ast
import sys
import types
from pathlib import Path

import keras
import pytest

from keras_longattn import specs
from keras_longattn.benchmarks import command as bench_command
from keras_longattn.benchmarks import config as bench_config
from keras_longattn.benchmarks import layer_config
from keras_longattn.benchmarks import progress as bench_progress
from keras_longattn.benchmarks import registry as bench_registry
from keras_longattn.benchmarks import runner as bench_runner
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.lra import command as lra_command
from keras_longattn.lra import runner as lra_runner
from keras_longattn.models import AttentionSublayer
from keras_longattn.models import _attention_config
from keras_longattn.specs import resolver

PACKAGE = Path(specs.__file__).resolve().parents[1]

LOCAL = {"num_heads": 2, "key_dim": 8, "window": 4}


@keras.saving.register_keras_serializable(package="keras_longattn_spec_tests")
class DerivedKeyAttention(FullAttention):
    """A layer whose config holds a key that its constructor does not take:
    its own ``from_config`` drops it."""

    def get_config(self):
        return {**super().get_config(), "derived": self.num_heads * self.key_dim}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config.pop("derived", None)
        return cls(**config)


def _config(layer):
    return {k: v for k, v in layer.get_config().items() if k != "name"}


# ------------------------------------------------------------ one resolver
def test_the_packages_share_the_same_functions():
    assert layer_config.build_layer is _attention_config.build_layer is specs.build_layer
    assert layer_config.resolve_class is specs.resolve_class
    assert layer_config.check_specs is specs.check_specs
    assert _attention_config.check_capabilities is specs.check_capabilities
    assert _attention_config.library_layers is specs.library_layers
    assert layer_config.resolve_spec is specs.resolve_spec
    assert layer_config.evaluate_placeholder is specs.evaluate_placeholder
    assert bench_registry.register is specs.register
    assert bench_registry.available_layers is specs.available_layers
    assert bench_config.parse_layers is specs.parse_layers
    assert bench_config.parse_option is lra_command.parse_option is specs.parse_option
    assert bench_progress.make_progress is lra_runner.make_progress is specs.make_progress
    assert bench_command.argument_type is lra_command.argument_type is specs.argument_type
    # The suite's argument error is the benchmark's and the parsers' one.
    assert bench_config.BenchmarkArgumentError is specs.ArgumentError
    assert issubclass(lra_runner.SuiteArgumentError, specs.ArgumentError)


@pytest.mark.parametrize(
    "spec",
    [
        {"class_name": "LocalAttention", "config": LOCAL},
        {"class_name": "keras_longattn>LocalAttention", "config": LOCAL},
        {"class_name": "keras_longattn.layers:LocalAttention", "config": LOCAL},
        {"class_name": "MultiHeadAttention", "config": {"num_heads": 2, "key_dim": 8}},
        "serialized",
        "derived",
    ],
    ids=["short", "registered", "import-path", "keras-layer", "serialized", "own-from-config"],
)
def test_benchmark_and_models_build_the_same_layer(spec):
    if spec == "serialized":
        spec = keras.saving.serialize_keras_object(LocalAttention(**LOCAL))
    elif spec == "derived":
        spec = keras.saving.serialize_keras_object(DerivedKeyAttention(2, 8))
    bench = layer_config.build_layer(spec)
    model = _attention_config.deserialize_attention(spec)
    assert type(bench) is type(model)
    assert _config(bench) == _config(model)


def test_models_resolve_every_config_through_the_shared_resolver(monkeypatch):
    calls = []

    def spy(spec, *args, **kwargs):
        calls.append(spec["class_name"])
        return resolver.build_layer(spec, *args, **kwargs)

    monkeypatch.setattr(_attention_config, "build_layer", spy)
    AttentionSublayer({"class_name": "FullAttention", "config": {"num_heads": 2, "key_dim": 8}})
    assert calls == ["FullAttention"]
    layers = _attention_config.make_attention_layers(
        {"class_name": "LocalAttention", "config": {"window": 4}}, 2, dim=16, num_heads=2,
        rotary_max_wavelength=100.0)
    assert [layer.rotary_max_wavelength for layer in layers] == [100.0, 100.0]
    # Each layer: the plain config, then the one with the rotary wavelength.
    assert calls[1:] == ["LocalAttention"] * 4


def test_the_benchmark_checks_through_the_shared_resolver(monkeypatch):
    calls = []

    def spy(spec, *args, **kwargs):
        calls.append(spec["class_name"])
        return layer_config.build_layer(spec, *args, **kwargs)

    monkeypatch.setattr(resolver, "build_layer", spy)
    found = bench_runner.check_layer_specs([{"label": "local", "layer_spec": {
        "class_name": "LocalAttention", "config": LOCAL}}], keras.backend.backend(),
        in_process=True)
    assert found[0]["error"] is None
    assert calls == ["LocalAttention"]


def test_models_refuse_an_option_like_the_benchmark():
    spec = {"class_name": "LocalAttention", "config": {**LOCAL, "windw": 8}}
    with pytest.raises(specs.LayerConfigError, match="does not accept the option 'windw'"):
        layer_config.build_layer(spec)
    with pytest.raises(ValueError, match=(
            r"`attention` could not be turned into a layer \(LayerConfigError: .*"
            r"does not accept the option 'windw'; accepted options: .*window")):
        _attention_config.deserialize_attention(spec)


# ------------------------------------------------------- importing modules
PROBE = '''
from keras_longattn.layers import FullAttention


class ProbeAttention(FullAttention):
    """A layer class in a module that nothing imported yet."""
'''


@pytest.fixture
def probe_module(tmp_path, monkeypatch, request):
    name = "keras_longattn_spec_probe_" + request.node.name.replace("[", "_").replace("]", "")
    (tmp_path / f"{name}.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_models_do_not_import_the_module_a_config_names(probe_module):
    spec = {"class_name": f"{probe_module}:ProbeAttention",
            "config": {"num_heads": 2, "key_dim": 8}}
    with pytest.raises(ValueError, match=rf"module '{probe_module}' .* is not imported"):
        _attention_config.deserialize_attention(spec)
    assert probe_module not in sys.modules
    # The benchmark's configs are code: it imports the module ...
    assert type(layer_config.build_layer(spec)).__name__ == "ProbeAttention"
    # ... after which the models find the class too.
    layer = _attention_config.deserialize_attention(spec)
    assert type(layer).__name__ == "ProbeAttention"


def test_the_suite_builds_a_layer_of_a_module_not_imported_yet(probe_module):
    from keras_longattn.lra import worker
    from keras_longattn.lra.tasks import get_task

    task = get_task("listops")
    size = task.size("tiny")
    spec = {"class_name": f"{probe_module}:ProbeAttention",
            "config": {"num_heads": 2, "key_dim": 32}}
    model = worker.build_model(task, types.SimpleNamespace(vocab_size=20), spec, size)
    classes = {type(layer.attention).__name__ for layer in model.layers
               if isinstance(layer, AttentionSublayer)}
    assert classes == {"ProbeAttention"}


# --------------------------------------------------------- private imports
def _imported_names(path: Path, root: Path):
    """``(line, module, name)`` of every import of ``path`` (a file of the
    package at ``root``), with relative imports made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root.parent).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                yield node.lineno, module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None


def _private_imports_from_other_subpackages(path: Path, root: Path = PACKAGE):
    """The imports in ``path`` of a name of another subpackage of ``root``
    (``keras_longattn``) with an underscore-private part."""
    own = path.relative_to(root).parts[0]
    found = []
    for line, module, name in _imported_names(path, root):
        parts = module.split(".") + ([name] if name else [])
        if parts[0] != root.name or len(parts) < 2 or parts[1] == own:
            continue
        if any(part.startswith("_") and not part.startswith("__") for part in parts[1:]):
            found.append(f"{path.relative_to(root.parent).as_posix()}:{line}: "
                         f"{'.'.join(parts)}")
    return found


@pytest.mark.parametrize("subpackage", ["lra", "models", "benchmarks", "specs"])
def test_no_private_import_from_another_subpackage(subpackage):
    files = sorted((PACKAGE / subpackage).glob("*.py"))
    assert files
    found = [hit for path in files for hit in _private_imports_from_other_subpackages(path)]
    assert found == []


@pytest.mark.parametrize("source, found", [
    ("from keras_longattn.benchmarks.command import _argument_type as _convert\n",
     ["keras_longattn.benchmarks.command._argument_type"]),
    ("from keras_longattn.models import _attention_config\n",
     ["keras_longattn.models._attention_config"]),
    ("import keras_longattn.models._attention_config\n",
     ["keras_longattn.models._attention_config"]),
    ("from ..benchmarks.command import _argument_type\n",
     ["keras_longattn.benchmarks.command._argument_type"]),
    ("from . import _helper\nfrom .runner import run_suite\n"
     "from keras_longattn.lra._private import x\nfrom keras.src import _y\n", []),
])
def test_the_private_import_check_finds_them(tmp_path, source, found):
    path = tmp_path / "keras_longattn" / "lra" / "command.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    hits = _private_imports_from_other_subpackages(path, root=tmp_path / "keras_longattn")
    assert [hit.partition(": ")[2] for hit in hits] == found
