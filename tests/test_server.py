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
