"""bench/gpu/quality.sh's side-by-side sweeps (SPLIT), run here on the smoke preset in a
temporary device folder: the folder's records stay first, as they were, and each group's
new records follow, none lost and none of the folder's repeated."""

from __future__ import annotations

import json
import os
import re
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


def _stand_in_python(bin_dir: Path, calls: Path | None = None) -> None:
    """A python3 in bin_dir standing in for the sweeps: it makes the folder its --out names
    (empty records, a run.json) and, given calls, appends its arguments there."""
    bin_dir.mkdir(exist_ok=True)
    record = "" if calls is None else f'echo "$*" >> {calls}\n'
    stand_in = bin_dir / "python3"
    stand_in.write_text(f"""#!/usr/bin/env bash
{record}while [ $# -gt 0 ]; do
  if [ "$1" = "--out" ]; then mkdir -p "$2" && touch "$2/records.jsonl" && echo {{}} > "$2/run.json"; fi
  shift
done
""")
    stand_in.chmod(0o755)


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


def test_each_sweep_names_its_folder_once(tmp_path):
    """quality.sh hands each sweep the caller's flags without the caller's --out and its
    own folder once (a split sweep's copy, or the folder itself): a stand-in python3
    records every camkv eval it is asked to run."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    _stand_in_python(bin_dir, calls)
    for split in ["", "--methods snapkv;--methods camkv"]:
        calls.unlink(missing_ok=True)
        out = tmp_path / f"folder{len(split)}"
        env = {**os.environ, "DEVICE_ROOT": str(tmp_path / "device"), "OUT": str(tmp_path), "SPLIT": split,
               "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run(["bash", "bench/gpu/quality.sh", "5", "--preset", "smoke", "--out", str(out),
                               "--budgets", "10%"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        runs = calls.read_text().splitlines()
        assert len(runs) == (2 if split else 1), runs
        for run in runs:
            words = run.split()
            assert words.count("--out") == 1 and "--budgets" in words and "--preset" in words, run
            assert words[words.index("--out") + 1].endswith(out.name), run


def test_sweeps_side_by_side_unpack_the_staged_parts_once(tmp_path):
    """Two quality.sh calls started together (two models' sweeps in one device call) find
    the staged parts of one bundle: one unpacks them (texts into the device's ckv folder,
    the gguf package into the site folder) while the other waits, then finds none; both
    sweeps run. A stand-in tar that takes a second makes the two overlap; a stand-in
    python3 stands in for the sweeps."""
    device, site, bin_dir = tmp_path / "device", tmp_path / "site", tmp_path / "bin"
    bundle = tmp_path / "bundle"
    (bundle / "texts").mkdir(parents=True)
    (bundle / "gguf").mkdir()
    (bundle / "texts" / "a.txt").write_text("a text " * 5000)
    (bundle / "gguf" / "__init__.py").write_text("VERSION = 1\n")
    (device / "parts").mkdir(parents=True)
    subprocess.run(f"tar cf - texts gguf | split -b 20000 -d -a 2 - {device / 'parts' / 'part_'}", shell=True,
                   cwd=bundle, check=True)
    assert len(list((device / "parts").iterdir())) >= 2
    _stand_in_python(bin_dir)
    real_tar = shutil.which("tar")
    (bin_dir / "tar").write_text(f"#!/usr/bin/env bash\nsleep 1\nexec {real_tar} \"$@\"\n")
    (bin_dir / "tar").chmod(0o755)
    env = {**os.environ, "DEVICE_ROOT": str(device), "DEVICE_SITE": str(site), "OUT": str(tmp_path), "SPLIT": "",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    runs = [subprocess.Popen(["bash", "bench/gpu/quality.sh", "5", "--preset", "smoke", "--out",
                              str(tmp_path / f"sweep{i}")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert (device / "ckv" / "texts" / "a.txt").read_text() == "a text " * 5000
    assert (site / "gguf" / "__init__.py").read_text() == "VERSION = 1\n"
    assert not list((device / "parts").iterdir()) and not (device / "unpacking").exists()
    assert all((tmp_path / f"sweep{i}.tgz").exists() for i in range(2))


def test_a_lock_left_by_a_killed_call_stops_the_sweep_naming_it(tmp_path):
    """An unpacking lock no call releases (left by a call killed while unpacking) is
    waited for UNPACK_WAIT_S seconds, then the call stops with status 1, naming the
    folder to remove, and runs no sweep."""
    device, bin_dir, calls = tmp_path / "device", tmp_path / "bin", tmp_path / "calls.txt"
    (device / "unpacking").mkdir(parents=True)
    _stand_in_python(bin_dir, calls)
    env = {**os.environ, "DEVICE_ROOT": str(device), "OUT": str(tmp_path), "UNPACK_WAIT_S": "2",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "bench/gpu/quality.sh", "5", "--preset", "smoke", "--out", str(tmp_path / "s")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"{device / 'unpacking'}" in done.stderr and "remove it" in done.stderr
    assert not calls.exists()


def _staging_repo(tmp_path: Path, tree_mib: int) -> tuple[Path, dict]:
    """A git checkout holding stage-models.sh and a tracked file of tree_mib MiB, a cache
    folder with both models' files (12 MiB each, random) and texts, and a python3 that
    names a folder holding a `gguf` package: stage-models.sh's inputs."""
    import numpy as np

    repo = tmp_path / "repo"
    (repo / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "gpu" / "stage-models.sh", repo / "bench" / "gpu")
    (repo / "big.bin").write_bytes(b"\0" * (tree_mib << 20))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    cache = tmp_path / "cache"
    rng = np.random.default_rng(0)
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"):
        (cache / "downloads").mkdir(parents=True, exist_ok=True)
        (cache / "downloads" / name).write_bytes(rng.bytes(12 << 20))
    (cache / "texts").mkdir()
    (cache / "texts" / "austen.txt").write_text("It is a truth universally acknowledged.\n")
    (tmp_path / "site" / "gguf").mkdir(parents=True)
    (tmp_path / "site" / "gguf" / "__init__.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/usr/bin/env bash\necho {tmp_path / 'site'}\n")
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "CAMKV_CACHE_DIR": str(cache), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return repo, env


def test_staged_parts_each_fit_one_call_beside_the_working_tree(tmp_path):
    """stage-models.sh sizes its parts so that each, beside the working tree, stays within
    a call's 64 MiB (with 2 MiB to spare), and the parts joined in order are the whole
    tar; a tree that leaves no room for a part of 8 MiB is refused, naming its size."""
    repo, env = _staging_repo(tmp_path, tree_mib=40)
    done = subprocess.run(["bash", "bench/gpu/stage-models.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted((repo / ".gpu-stage").glob("m*/part_*"), key=lambda p: int(p.parent.name[1:]))
    tree = 40 << 20
    assert len(parts) >= 2 and all(p.stat().st_size + tree <= (62 << 20) for p in parts)
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    listed = subprocess.run(["tar", "tf", str(joined)], capture_output=True, text=True, check=True).stdout.split()
    assert {"downloads/gemma-3-270m-q4_k_m.gguf", "texts/austen.txt", "gguf/__init__.py"} <= set(listed)
    (repo / "big.bin").write_bytes(b"\0" * (60 << 20))
    refused = subprocess.run(["bash", "bench/gpu/stage-models.sh"], cwd=repo, env=env, capture_output=True,
                             text=True, timeout=120)
    named = re.search(r"the working tree is (\d+) bytes", refused.stderr)
    assert refused.returncode == 1 and "less than 8 MiB" in refused.stderr and named, refused.stderr
    assert int(named.group(1)) >= 60 << 20
