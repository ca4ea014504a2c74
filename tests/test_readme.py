"""The README's quick start is executed as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs(capsys):
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, str(README), "exec"), {})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last in ("blocked", "blocked_fused", "band_kernel")


def test_readme_commands_exist():
    text = README.read_text()
    root = README.parent
    for script in re.findall(r"bash (scripts/\w+\.sh)", text):
        assert (root / script).exists(), script
    assert "bash scripts/test.sh" in (root / ".ci" / "run").read_text()


def test_readme_models_example_runs(capsys):
    text = README.read_text()
    section = text.split("## Models and data", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, str(README), "exec"), {})
    assert int(capsys.readouterr().out.strip().splitlines()[-1]) > 0
