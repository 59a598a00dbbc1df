"""The README's two set-up commands and CI agree: ``.ci/run`` runs the README's test command."""

from __future__ import annotations

import pathlib
import re
import tomllib

from packaging.specifiers import SpecifierSet

REPO = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    """The commands of the README's first code block, comments stripped."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_starts_with_the_main_job_and_the_tests():
    main_job, tests = _readme_commands()[:2]
    assert main_job.startswith("pip install -e .") and "jaxserve demo" in main_job
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    tests = _readme_commands()[1]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert tests in ci, f"{tests!r} is not a line of .ci/run"


def test_python_version_file_meets_requires_python():
    """``.python-version`` (pyenv's pick in the repository) is a Python pip accepts, and CI's."""
    pinned = (REPO / ".python-version").read_text().strip()
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert re.fullmatch(r"3\.\d+", pinned), pinned
    assert SpecifierSet(requires).contains(f"{pinned}.0"), (pinned, requires)
    assert f"python{pinned} -m venv" in (REPO / ".ci" / "run").read_text()


def test_one_step_implementation():
    """Only the worker's model runner merges the model into a step: no second step to drift."""
    merges = sorted(
        str(path.relative_to(REPO)) for folder in ("jaxserve", "benchmarks", "tests")
        for path in (REPO / folder).rglob("*.py")
        if re.search(r"\bgraphdef\.merge\(", path.read_text()))
    assert merges == ["jaxserve/worker/model_runner.py"], merges
    assert not (REPO / "jaxserve" / "model" / "forward.py").exists()
