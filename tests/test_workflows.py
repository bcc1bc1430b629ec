"""The CI workflows under .github/workflows: valid for GitHub Actions (the workflow schema
that check-jsonschema carries), every `run:` script valid bash, and every path and module
they name present, so a workflow that never runs here cannot rot unseen."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
CHECKER = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))


def _validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHECKER, "--builtin-schema", "vendor.github-workflows", str(path)],
                          capture_output=True, text=True)


def _run_scripts(path: Path) -> list[str]:
    workflow = yaml.safe_load(path.read_text())
    return [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_the_workflow_is_valid_for_github_actions(path):
    result = _validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_fails_on_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOWS[0].read_text().replace("runs-on:", "runs_on:", 1))
    assert _validate(broken).returncode != 0


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_run_script_is_valid_bash(path):
    for script in _run_scripts(path):
        result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert result.returncode == 0, (script, result.stderr)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_the_paths_and_modules_the_workflow_names_exist(path):
    text = path.read_text()
    for test_path in re.findall(r"\$GITHUB_WORKSPACE/(tests[\w/.]*)", text):
        assert (ROOT / test_path).exists(), test_path
    for module in re.findall(r"python -m (camkv[\w.]*)", text):
        assert importlib.util.find_spec(module) is not None, module
