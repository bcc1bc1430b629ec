"""The record store of a sweep: OUT/records.jsonl (one finished arm a line, so a cut
run resumes), OUT/run.json, and the lock that keeps one run per folder."""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

# Flags that change what a record means: a folder's records must all share them.
IDENTITY_KEYS = ("model", "dtype", "stream_tokens", "stream_prefill", "chunk", "answer_tokens",
                 "n_sink", "recent", "window", "seed", "backend", "prefill_scoring",
                 "observation_window", "pool", "chat_template", "ruler_max_answer")
# What a folder written before an identity key existed ran with.
IDENTITY_BEFORE = {"prefill_scoring": "causal", "observation_window": 32, "pool": 1,
                   "chat_template": "auto", "ruler_max_answer": None}
# Flags that only pick which records to make: they may change between runs into one
# folder (e.g. --methods core first, then --methods all adds the other arms).
SELECTION_KEYS = ("texts", "tasks", "methods", "budgets", "stream_samples", "passkey_lengths",
                  "passkey_placements", "ruler_tasks", "ruler_lengths", "ruler_samples", "arms")



def run_config(opts) -> dict:
    """The options a run writes to OUT/run.json."""
    return {k: getattr(opts, k, IDENTITY_BEFORE.get(k)) for k in IDENTITY_KEYS + SELECTION_KEYS}


class RecordStore:
    """records.jsonl (one finished arm a line, appended as it finishes) and run.json."""

    def __init__(self, out_dir: Path, run_config: dict, fresh: bool):
        self.out_dir = out_dir
        self.records_path = out_dir / "records.jsonl"
        self.config_path = out_dir / "run.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.records_path.unlink(missing_ok=True)
        self._check_same_run(run_config)
        self.config_path.write_text(json.dumps(run_config, indent=1))
        self.records = self.read_records(out_dir)
        self._done = {self.key(r) for r in self.records}

    def _check_same_run(self, run_config: dict) -> None:
        if not (self.records_path.exists() and self.config_path.exists()):
            return
        before = json.loads(self.config_path.read_text())
        before = {**IDENTITY_BEFORE, **before}
        differ = [k for k in IDENTITY_KEYS if before.get(k) != run_config.get(k)]
        if differ:
            details = ", ".join(f"{k}: {before.get(k)!r} -> {run_config.get(k)!r}" for k in differ)
            raise ValueError(
                f"{self.out_dir} holds records of a different run ({details}); pass another "
                "--out, or --fresh to discard them"
            )

    @staticmethod
    def read_records(out_dir: Path) -> list[dict]:
        path = out_dir / "records.jsonl"
        if not path.exists():
            return []
        by_key = {}
        for line in path.read_text().splitlines():
            # A run killed mid-write leaves at most one torn last line; it is redone.
            if line.strip().endswith("}"):
                record = json.loads(line)
                by_key[RecordStore.key(record)] = record  # a redone arm counts once
        return list(by_key.values())

    @staticmethod
    def key(record: dict) -> tuple:
        return (record["task"], record["sample"], record["method"], record["budget"])

    def done(self, task: str, sample: str, method: str, budget) -> bool:
        return (task, sample, method, budget) in self._done

    def add(self, record: dict) -> None:
        with self.records_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        self._done.add(self.key(record))


@contextmanager
def folder_lock(out_dir: Path):
    """One run at a time per folder: two would redo each other's work and interleave records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = out_dir / "run.lock"
    me = f"{socket.gethostname()}:{os.getpid()}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        holder = lock.read_text().strip()
        if _lock_holder_alive(holder):
            raise ValueError(f"{out_dir} is in use by another camkv eval ({holder}); wait for "
                             "it or pass another --out") from None
        lock.unlink(missing_ok=True)  # left by a run that was killed
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, me.encode())
    os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _lock_holder_alive(holder: str) -> bool:
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # a lock carried from another machine is stale here
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
