"""Time to first token of a short request while `camkv serve` prefills a long prompt.

Starts `camkv serve` on a random-weight llama (models.RANDOM_LLAMAS, a byte-level
tokenizer: one token per byte, so a prompt of N characters is about N tokens) and
measures, over HTTP on 127.0.0.1:

- alone: a short streamed request's time to its first token with nothing else running;
- during: the same request sent once a long streamed request has begun its prefill
  (its first keepalive line arrived), and the long request's own time to its first token.

    .venv/bin/python bench/server_ttft.py --long-tokens 16384 --model random-demo
    .venv/bin/python bench/server_ttft.py --long-tokens 16384 --model random-1b   # on a GPU

Extra flags after `--` go to `camkv serve` (e.g. `-- --prefill-step-size 512`).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import byte_tokenizer  # noqa: E402


def save_model_dir(path: Path, name: str, context: int) -> Path:
    """An mlx-lm folder of models.random_llama(name) (float32 on the CPU, bfloat16 on a GPU)
    with a byte tokenizer and a trained context of `context` tokens (max_position_embeddings)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from camkv import models

    model = models.random_llama(name)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: getattr(model.args, k) for k in (
        "model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "vocab_size", "rope_theta", "tie_word_embeddings")}
    config["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(config))
    byte_tokenizer().save_pretrained(str(path))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited early:\n{proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit("the server did not come up")


def streamed(port: int, content: str, max_tokens: int, on_keepalive=None) -> dict:
    """Send one streamed chat request; seconds to its first token and to its end."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(request, timeout=3600) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith(": keepalive") and on_keepalive is not None:
                on_keepalive()
            if first is None and line.startswith("data:") and line != "data: [DONE]":
                first = time.perf_counter() - start
    return {"first_token_s": first, "total_s": time.perf_counter() - start}


def measure(port: int, long_tokens: int, short_tokens: int) -> dict:
    short = "Tell me about the sea. " * max(1, short_tokens // 23)
    long_text = ("The lighthouse keeper wrote down the weather every hour. " * (long_tokens // 57 + 1))[:long_tokens]
    streamed(port, short, 4)  # warm-up: the model loaded, the first compilation done
    alone = streamed(port, short, 4)
    started = threading.Event()
    results = {}

    def run_long():
        results["long"] = streamed(port, long_text, 1, on_keepalive=started.set)

    thread = threading.Thread(target=run_long)
    thread.start()
    if not started.wait(timeout=3600):
        raise SystemExit("the long request never reported prefill progress")
    results["during"] = streamed(port, short, 4)
    thread.join()
    return {"alone": alone, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-demo", choices=("random-demo", "random-1b"),
                        help="a models.RANDOM_LLAMAS preset whose vocabulary holds the byte tokenizer's 258 tokens")
    parser.add_argument("--long-tokens", type=int, default=16384, help="tokens of the long prompt")
    parser.add_argument("--short-tokens", type=int, default=64, help="tokens of the short prompt")
    parser.add_argument("--kv-budget", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args, serve_flags = parser.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model_dir(Path(tmp) / "model", args.model, context=2 * args.long_tokens)
        port = free_port()
        command = [sys.executable, "-m", "camkv", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(port), "--kv-budget", str(args.kv_budget), "--prompt-cache-size", "0",
                   *serve_flags]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until_up(port, proc)
            results = measure(port, args.long_tokens, args.short_tokens)
        finally:
            proc.terminate()
            log = proc.communicate(timeout=60)[1]
    if any(r.get("first_token_s") is None for r in results.values()):
        print("a request got no token; the server's log ends:\n" + "\n".join(log.splitlines()[-30:]), file=sys.stderr)
    results.update(model=args.model, long_tokens=args.long_tokens, serve_flags=serve_flags)
    print(json.dumps(results, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
