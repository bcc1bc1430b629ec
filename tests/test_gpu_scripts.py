"""bench/gpu/quality.sh's side-by-side sweeps (SPLIT), run here on the smoke preset in a
temporary device folder: the folder's records stay first, as they were, and each group's
new records follow, none lost and none of the folder's repeated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the GPU scripts are bash")


def _split_sweep(tmp_path: Path, out: Path, groups: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVICE_ROOT": str(tmp_path / "device"), "OUT": str(tmp_path / "tarred"),
           "SPLIT": ";".join(groups),  # the scripts' python3: this interpreter's
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    (tmp_path / "tarred").mkdir(exist_ok=True)
    return subprocess.run(["bash", "bench/gpu/quality.sh", "120", "--tasks", "ruler", "--preset", "smoke",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _keys(lines: list[str]) -> list[tuple]:
    return [(r["sample"], r["method"], r["budget"]) for r in map(json.loads, lines)]


def test_split_sweeps_append_each_groups_new_records_after_the_folders(tmp_path):
    out = tmp_path / "ruler-smoke"
    first = _split_sweep(tmp_path, out, ["--methods h2o-causal", "--methods snapkv"])
    assert first.returncode == 0, first.stdout + first.stderr
    before = _lines(out / "records.jsonl")
    methods = {m for _, m, _ in _keys(before)}
    assert {"full", "h2o-causal", "snapkv"} <= methods
    second = _split_sweep(tmp_path, out, ["--methods streamingllm", "--methods camkv"])
    assert second.returncode == 0, second.stdout + second.stderr
    after = _lines(out / "records.jsonl")
    assert after[: len(before)] == before  # the folder's records first, unchanged
    added = _keys(after[len(before):])
    assert {m for _, m, _ in added} == {"streamingllm", "camkv"}  # the full cache's answers were there
    assert not set(added) & set(_keys(before)) and len(added) == len(set(added))
    assert (tmp_path / "tarred" / "ruler-smoke.tgz").exists()
