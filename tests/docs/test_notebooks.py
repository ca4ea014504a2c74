"""The notebooks of notebooks/ as committed: parameters, no outputs, asserts.

These read the notebook files only (no kernel, no Keras), so they run in
every per-backend unit run.
"""

import ast
import json
import re
from pathlib import Path

import pytest

from keras_longattn import reproduce

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(
    p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.startswith(("_", "."))
)


def _load(path):
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def _source(cell):
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _code_cells(notebook):
    return [c for c in notebook["cells"] if c.get("cell_type") == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.fixture(params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def notebook_path(request):
    return request.param


def test_valid_nbformat(notebook_path):
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.read(str(notebook_path), as_version=4))


def test_exactly_one_parameters_cell(notebook_path):
    notebook = _load(notebook_path)
    tagged = [
        c for c in notebook["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])
    ]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged 'parameters'"
    assert tagged[0]["cell_type"] == "code"


def test_papermill_parses_the_parameters_cell(notebook_path, caplog):
    """papermill reads the parameters cell line by line and warns ("Unable
    to parse line N") on a line with two '=', e.g. one in a comment: every
    line of the cell must parse, so that no run prints that warning."""
    nbformat = pytest.importorskip("nbformat")
    translators = pytest.importorskip("papermill.translators")
    notebook = nbformat.read(str(notebook_path), as_version=4)
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    with caplog.at_level("WARNING", logger="papermill"):
        found = translators.PythonTranslator.inspect(cell)
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    assert {p.name for p in found} == set(reproduce.notebook_parameters(_load(notebook_path)))


def test_no_outputs_committed(notebook_path):
    notebook = _load(notebook_path)
    for index, cell in enumerate(_code_cells(notebook)):
        assert cell.get("outputs", []) == [], f"code cell {index} has outputs"
        assert cell.get("execution_count") is None, f"code cell {index} has an execution count"
    for cell in notebook["cells"]:
        assert "papermill" not in cell.get("metadata", {}), "papermill metadata committed"
        assert "injected-parameters" not in cell.get("metadata", {}).get("tags", [])
    assert "papermill" not in notebook.get("metadata", {})


def test_has_an_assert_cell(notebook_path):
    notebook = _load(notebook_path)
    asserting = [
        cell for cell in _code_cells(notebook)
        if any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(_source(cell))))
    ]
    assert asserting, "no code cell with an assert statement"


def test_every_code_cell_parses(notebook_path):
    for cell in _code_cells(_load(notebook_path)):
        ast.parse(_source(cell))


def test_parameters_and_full_size(notebook_path):
    notebook = _load(notebook_path)
    defaults = reproduce.notebook_parameters(notebook)
    assert {"backend", "results_path"} <= set(defaults)
    assert defaults["backend"] in reproduce.BACKENDS
    # None: the notebook resolves build/notebooks/<slug>.json of the checkout
    # itself, whatever the working directory (keras_longattn.reproductions).
    assert defaults["results_path"] in (None, f"build/notebooks/{notebook_path.stem}.json")
    meta = reproduce.notebook_metadata(notebook)
    full = meta.get("full_parameters")
    assert full, "metadata['keras_longattn']['full_parameters'] is missing"
    assert set(full) <= set(defaults), set(full) - set(defaults)
    assert any(defaults[k] != v for k, v in full.items()), "the full size equals the CI size"
    assert meta.get("title")
    # The full size is documented beside the defaults, in the parameters cell.
    cell = next(c for c in notebook["cells"]
                if "parameters" in c.get("metadata", {}).get("tags", []))
    documented = {}
    for line in _source(cell).splitlines():
        match = re.match(r"\s*(\w+)\s*=.*#\s*full:\s*(\S+)", line)
        if match:
            documented[match.group(1)] = ast.literal_eval(match.group(2))
    for name, value in full.items():
        if value != defaults[name]:
            assert documented.get(name) == value, (
                f"{name}: the parameters cell should say '# full: {value}'")


def test_backend_set_before_keras_import(notebook_path):
    notebook = _load(notebook_path)
    code = "\n".join(_source(c) for c in _code_cells(notebook))
    set_at = code.find('os.environ["KERAS_BACKEND"] = backend')
    import_at = min(
        (i for i in (code.find("import keras\n"), code.find("import keras_longattn"),
                     code.find("from keras")) if i >= 0),
        default=len(code),
    )
    assert 0 <= set_at < import_at


def test_kernel_is_python3(notebook_path):
    notebook = _load(notebook_path)
    assert notebook["metadata"]["kernelspec"]["name"] == reproduce.KERNEL_NAME


def test_in_docs_nav(notebook_path):
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert f"notebooks/{notebook_path.stem}.ipynb" in nav, "add the notebook to the nav of mkdocs.yml"
