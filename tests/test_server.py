"""`camkv serve`: mlx-lm's OpenAI-compatible server with camkv caches, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


from conftest import subprocess_env
from tiny_models import save_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("server did not come up within 60 s")


def test_chat_request_is_answered_with_camkv_caches(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    port = _free_port()
    env = subprocess_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "camkv", "serve", "--kv-budget", "64", "--kv-recent", "8",
         "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        _wait_until_up(port, proc)
        body = json.dumps({
            "model": str(model_dir),
            "messages": [{"role": "user", "content": "Say something long. " * 20}],
            "max_tokens": 12, "temperature": 0.0,
        }).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] > 0
        assert reply["usage"]["prompt_tokens"] > 64  # longer than the budget: evictions happened
    finally:
        proc.terminate()
        log = proc.communicate(timeout=20)[1]
    assert "camkv: request cache has 2/2 CaMKVCache layers (budget=64" in log, log
    # The default scores with the model's queries: the hook is in, nothing falls back to keys.
    assert "scoring=query)" in log and "QueryScoringWarning" not in log, log


def _chat(port: int, model_dir, content: str, max_tokens: int, stream: bool) -> str:
    """One greedy chat completion's text (streamed or not)."""
    body = json.dumps({
        "model": str(model_dir), "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
    }).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        if not stream:
            return json.loads(response.read())["choices"][0]["message"]["content"]
        text = []
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                delta = json.loads(line[5:])["choices"][0].get("delta", {})
                text.append(delta.get("content") or "")
        return "".join(text)


def test_concurrent_requests_are_batched_bounded_and_answer_as_one_at_a_time(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "camkv", "serve", "--kv-budget", "64", "--kv-recent", "8",
         "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
         "--decode-concurrency", "8", "--prompt-concurrency", "8", "--prompt-cache-size", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=subprocess_env(),
    )
    # Different lengths, all longer than the budget; different answer lengths so rows
    # leave the batch at different steps.
    jobs = [(f"Request {i}: " + "tell me more. " * (6 + 3 * i), 40 + 4 * i, i % 2 == 0) for i in range(8)]
    try:
        _wait_until_up(port, proc)
        # With the prompt cache off, each answer depends only on its own request.
        alone = [_chat(port, model_dir, *job) for job in jobs]
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: _chat(port, model_dir, *job), jobs))
    finally:
        proc.terminate()
        log = proc.communicate(timeout=20)[1]
    assert together == alone and all(alone), log
    done = [line for line in log.splitlines() if line.startswith("camkv: request ") and " done " in line]
    assert len(done) == 16, log
    # tiny llama: 2 layers, 2 KV heads of dim 16, float32: budget + slack (64 + 8) rows of
    # (16 + 16) * 4 bytes of keys and values plus 8 of score and position.
    bound = 2 * 2 * (64 + 8) * ((16 + 16) * 4 + 8)
    rows_seen = 0
    for line in done:
        kv = int(line.split(" KV ")[1].split()[0])
        batch_kv = int(line.split("batch KV ")[1].split()[0])
        rows = int(line.split(" in ")[-1].split()[0])
        assert f"(bound {bound})" in line and 0 < kv <= bound, line
        assert batch_kv <= rows * bound, line
        rows_seen = max(rows_seen, rows)
    assert rows_seen >= 2, log  # requests shared a batch
