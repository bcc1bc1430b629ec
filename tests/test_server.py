"""`camkv serve`: mlx-lm's OpenAI-compatible server with camkv caches, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path


from conftest import subprocess_env
from tiny_models import save_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _bench_helpers():
    """bench/server_ttft.py, whose free_port and wait_until_up start the server here too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("server_ttft", ROOT / "bench" / "server_ttft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_bench = _bench_helpers()
_free_port = _bench.free_port


def _wait_until_up(port: int, proc: subprocess.Popen) -> None:
    _bench.wait_until_up(port, proc, timeout=60.0)


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


def _post(port: int, raw: bytes) -> tuple[int, dict]:
    """POST raw bytes to /v1/chat/completions: (status, JSON reply)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=raw,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _tiny_model_with_context(path, context: int):
    model_dir = save_tiny_model_dir(path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return model_dir


def _serving(model_dir, *flags):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "camkv", "serve", "--kv-budget", "64", "--kv-recent", "8", "--model",
         str(model_dir), "--host", "127.0.0.1", "--port", str(port), *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=subprocess_env())
    _wait_until_up(port, proc)
    return port, proc


def _chat_body(content: str, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4,
                       "temperature": 0.0, **fields}).encode()


BAD_REQUESTS = {
    "no messages": (json.dumps({"messages": [], "max_tokens": 4}).encode(), ["messages", "non-empty list", "[]"]),
    "messages a string": (json.dumps({"messages": "hello"}).encode(), ["messages", "non-empty list", '"hello"']),
    "a message not an object": (json.dumps({"messages": ["hello"]}).encode(), ["messages[0]", '"role"']),
    "a body not UTF-8": (b'{"messages": "\xff\xfe"}', ["not UTF-8", "byte 14"]),
    "past the context": (_chat_body("x" * 300), ["past the model's context of 256 tokens", "--allow-past-context"]),
}


def test_bad_requests_are_400s_with_a_message_and_the_server_carries_on(tmp_path):
    model_dir = _tiny_model_with_context(tmp_path / "tiny", context=256)
    port, proc = _serving(model_dir)
    try:
        replies = {case: _post(port, raw) for case, (raw, _) in BAD_REQUESTS.items()}
        good = _post(port, _chat_body("hello " * 20))
    finally:
        proc.terminate()
        log = proc.communicate(timeout=20)[1]
    for case, (status, reply) in replies.items():
        assert status == 400, (case, status, reply)
        for word in BAD_REQUESTS[case][1]:
            assert word in reply["error"], (case, word, reply)
    assert good[0] == 200 and good[1]["usage"]["completion_tokens"] > 0, good
    assert "Traceback" not in log, log


def test_a_prompt_past_the_context_is_answered_when_allowed(tmp_path):
    model_dir = _tiny_model_with_context(tmp_path / "tiny", context=256)
    port, proc = _serving(model_dir, "--allow-past-context")
    try:
        status, reply = _post(port, _chat_body("x" * 300))
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    assert status == 200 and reply["usage"]["prompt_tokens"] > 256, reply


ROUND_TOKENS = 64
LONG_TOKENS = 6000


def _long_prompt_progress(responses, uid, progress: list) -> None:
    progress.extend(r.progress[0] for r in responses if r.uid == uid)


def test_a_short_request_waits_at_most_three_bounded_prefill_steps_of_a_long_prompt():
    """While a prompt of many steps prefills, a new short request's first token comes within
    3 scheduling rounds, each prefilling at most ROUND_TOKENS prompt tokens (shared by the
    prompts prefilling): the long prompt advances by at most 3 * ROUND_TOKENS meanwhile."""
    from mlx_lm.generate import BatchGenerator

    import camkv
    from camkv.server import _bounded_batch_generator
    from tiny_models import tiny_llama

    model = tiny_llama()
    camkv.apply(model, budget=64, recent=8)
    try:
        generator = _bounded_batch_generator(BatchGenerator, ROUND_TOKENS)(model, max_tokens=2)
        # Longer than mlx-lm's own prefill step (2048 tokens), which alone would hold the
        # short request up for over 2 * 2048 of its tokens.
        (long_uid,) = generator.insert([[i % 100 + 1 for i in range(LONG_TOKENS)]])
        progress = []
        _long_prompt_progress(generator.next()[0], long_uid, progress)
        (short_uid,) = generator.insert([[5, 6, 7, 8] * 5])
        arrived, rounds = progress[-1], 0
        while True:
            prompt_responses, generation_responses = generator.next()
            rounds += 1
            _long_prompt_progress(prompt_responses, long_uid, progress)
            if any(r.uid == short_uid for r in generation_responses):
                break
            assert rounds < 10, "the short request got no token"
    finally:
        camkv.remove(model)
    steps = [b - a for a, b in zip(progress, progress[1:])]
    assert rounds <= 3 and progress[-1] - arrived <= 3 * ROUND_TOKENS, (rounds, progress)
    assert max(steps) <= ROUND_TOKENS and progress[-1] < LONG_TOKENS, progress
