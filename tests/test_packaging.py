"""What ``pyproject.toml`` declares: the version is written once (as
``keras_longattn.__version__``), the extras ask for compatible ranges (the
exact torch pin lives in ``constraints.txt``), and ``[docs]`` holds what
``mkdocs build`` needs."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import keras_longattn

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _names(requirements):
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower(): r for r in requirements}


def test_the_version_is_written_once():
    data = _pyproject()
    assert "version" not in data["project"]
    assert "version" in data["project"]["dynamic"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "keras_longattn.__version__"}
    assert not re.search(r'(?m)^\s*version\s*=\s*"', (ROOT / "pyproject.toml").read_text())
    assert importlib.metadata.version("keras-longattn") == keras_longattn.__version__


def test_setuptools_reads_the_version_without_importing_keras():
    code = (
        "import sys\n"
        "from setuptools.config.expand import read_attr\n"
        "print(read_attr('keras_longattn.__version__', root_dir=sys.argv[1]))\n"
        "print(sorted(m for m in ('keras', 'jax', 'tensorflow', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout.splitlines()
    assert out == [keras_longattn.__version__, "[]"]


def test_extras_are_ranges_and_docs_can_build():
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        for requirement in requirements:
            assert "==" not in requirement, (extra, requirement)
    assert "torch" in _names(extras["torch"])
    assert "ninja" in _names(extras["torch"])
    docs = _names(extras["docs"])
    # The hook draws the figures with matplotlib on the jax backend.
    assert "matplotlib" in docs
    assert docs.get("keras-longattn") == "keras-longattn[jax]"
    assert "torch==" in (ROOT / "constraints.txt").read_text()
