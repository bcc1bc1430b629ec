#!/usr/bin/env python3
"""camkv's RULER prompts through kvpress (NVIDIA's KV-compression library for Hugging
Face transformers), as an outside reference for `camkv eval --tasks ruler`.

Runs under PyTorch, without MLX and without camkv's package (whose import needs MLX):

    python3 bench/gpu/kvpress_ruler.py --model HF_FOLDER --prompts PROMPTS.jsonl[.gz] \\
        --out bench/results/ruler-kvpress-smollm2 [--time-budget SECONDS]

- PROMPTS: `camkv eval --tasks ruler ... --export-prompts FILE` (camkv.eval.ruler_export):
  every prompt of the suite's plan, its context and question token ids and texts.
- HF_FOLDER: a Hugging Face model folder. camkv's converter writes one: the folder
  `camkv.models.resolve("smollm2-135m-instruct")` returns (config.json of a
  LlamaForCausalLM, model.safetensors under Hugging Face's tensor names, the tokenizer
  and chat template) loads with transformers' AutoModelForCausalLM as it is.
- Each prompt runs through kvpress's "kv-press-text-generation" pipeline: its forward
  prefills the context under the press (compressed once), then feeds the question and
  decodes greedily up to the task's RULER answer tokens (max_new_tokens of the export).
  --prompt ids (default) hands the pipeline the suite's own token ids, so both engines
  see the same prompt token for token; --prompt text runs the pipeline's own
  preprocessing (chat template, tokenization) on the exported texts instead, and each
  record says whether its ids came out the same.
- Presses (--presses): none (the full cache), snapkv, knorm, streamingllm, expected
  (ExpectedAttentionPress), kvzip (KVzipPress), observed (ObservedAttentionPress, on a
  second copy of the model with eager attention), at --ratios (kvpress's compression
  ratio: 0.9 keeps 10% of the context). A press that raises on the first prompt is
  reported in OUT/press_errors.json and skipped.
- Scores: RULER's string_match_all from camkv's own scorer, the file
  python/camkv/eval/ruler_scoring.py loaded by its path (it imports no MLX).
- Records: OUT/records.jsonl in the shape of camkv's RULER records (task "ruler", the
  suite's sample ids, method kvpress-full / kvpress-PRESS, budget the kept fraction of
  the context, labels "10%", "20%", "50%", full_method kvpress-full, which the report
  pairs them with), so appending them to a camkv RULER folder's records.jsonl and
  running `camkv eval --out FOLDER --report-only` shows them beside camkv's arms.
  Resumable: a rerun skips what the records hold; --time-budget stops before a prompt
  that would overrun it.

kvpress's package imports datasets, fire and requests at its top for presses that fetch
from the Hugging Face hub (DuoAttentionPress, ExpectedAttentionStatsPress, LUKVPress,
QFilterPress), which cannot run without a network anyway: where one of those packages
is missing, an empty module stands in under its name, and anything taken from it raises
at its use, naming the package.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCORING = ROOT / "python" / "camkv" / "eval" / "ruler_scoring.py"
FULL = "kvpress-full"
PRESSES = {  # --presses name -> kvpress class
    "snapkv": "SnapKVPress", "knorm": "KnormPress", "streamingllm": "StreamingLLMPress",
    "expected": "ExpectedAttentionPress", "kvzip": "KVzipPress", "observed": "ObservedAttentionPress",
}
EAGER = {"observed"}  # presses that read the attention weights: eager attention
HUB_ONLY_IMPORTS = ("datasets", "fire", "requests")


def load_scorer():
    """camkv's ruler_score, from its file (camkv's package needs MLX to import)."""
    spec = importlib.util.spec_from_file_location("camkv_ruler_scoring", SCORING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ruler_score


# ---------------------------------------------------------------------------- records


def label_of(ratio: float) -> str:
    """camkv's budget label of a kvpress compression ratio: the kept share, "10%"."""
    return f"{round(100 * (1 - ratio))}%"


def method_of(press: str) -> str:
    return FULL if press == "none" else f"kvpress-{press}"


def record(prompt: dict, press: str, ratio: float | None, answer: str, score, **extra) -> dict:
    """One answer as a camkv RULER record (camkv.eval.ruler._record's fields)."""
    return {
        "task": "ruler", "sample": prompt["sample"], "method": method_of(press),
        "budget": None if ratio is None else round(1 - ratio, 4),
        "labels": [] if ratio is None else [label_of(ratio)], "ruler_task": prompt["ruler_task"],
        "length": prompt["length"], "prompt_tokens": len(prompt["context_ids"]) + len(prompt["question_ids"]),
        "context_tokens": len(prompt["context_ids"]), "depths": prompt["depths"],
        "expected": prompt["expected"], "answer": answer,
        "score": score(answer, prompt["expected"]), "full_method": FULL,
        "compression_ratio": ratio, **extra,
    }


def key(r: dict) -> tuple:
    return (r["sample"], r["method"], r["budget"])


def read_records(out: Path) -> list[dict]:
    path = out / "records.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def read_prompts(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def arms(presses: list[str], ratios: list[float]) -> list[tuple[str, float | None]]:
    return [(p, None) for p in presses if p == "none"] + \
        [(p, r) for p in presses if p != "none" for r in ratios]


def select(prompts: list[dict], tasks, lengths, limit) -> list[dict]:
    chosen = [p for p in prompts if (not tasks or p["ruler_task"] in tasks)
              and (not lengths or p["length"] in lengths)]
    return chosen[:limit] if limit else chosen


# ---------------------------------------------------------------------------- kvpress


def absent_module(name: str) -> types.ModuleType:
    """A stand-in for a package kvpress imports but this run never uses (see the top)."""
    module = types.ModuleType(name)

    def attribute(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr}: the package {name} is not installed here (kvpress "
                               "imports it for presses that fetch from the Hugging Face hub)")
        return refuse

    module.__getattr__ = attribute
    return module


def import_kvpress():
    for name in HUB_ONLY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = absent_module(name)
    import kvpress

    return kvpress


class Engine:
    """The model(s), kvpress's pipeline on each, and the presses."""

    def __init__(self, opts):
        import torch
        import transformers

        self.torch, self.opts = torch, opts
        transformers.utils.logging.disable_progress_bar()  # one bar a model load floods the log
        self.kvpress = import_kvpress()
        self.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, opts.dtype)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model)
        self._pipes: dict[str, object] = {}
        self.versions = {"kvpress": _version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__, "device": self.device, "dtype": opts.dtype}

    def pipe(self, press: str):
        attention = "eager" if press in EAGER else "sdpa"
        if attention not in self._pipes:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(
                self.opts.model, dtype=self.dtype, attn_implementation=attention).to(self.device).eval()
            self._pipes[attention] = transformers.pipeline(
                "kv-press-text-generation", model=model, tokenizer=self.tokenizer, device=self.device)
        return self._pipes[attention]

    def make_press(self, press: str, ratio: float | None):
        if press == "none":
            return None
        return getattr(self.kvpress, PRESSES[press])(compression_ratio=ratio)

    def inputs(self, pipe, prompt: dict) -> tuple[dict, bool]:
        """The pipeline's model inputs and whether their ids are the suite's."""
        torch = self.torch
        if self.opts.prompt == "text":
            made = pipe.preprocess(prompt["context"], [prompt["question"]], prompt["answer_prefix"],
                                   max_context_length=10**10)
            same = (made["context_ids"][0].tolist() == prompt["context_ids"]
                    and made["questions_ids"][0][0].tolist() == prompt["question_ids"])
            return made, same
        return {"context_ids": torch.tensor([prompt["context_ids"]]),
                "questions_ids": [torch.tensor([prompt["question_ids"]])]}, True

    def answer(self, prompt: dict, press: str, ratio: float | None) -> tuple[str, dict]:
        pipe = self.pipe(press)
        made, same = self.inputs(pipe, prompt)
        kv_press = self.make_press(press, ratio)
        started = time.perf_counter()
        with self.torch.inference_mode():
            text = pipe._forward(made, max_new_tokens=prompt["max_new_tokens"], press=kv_press)[0]
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        return text, {"seconds": round(time.perf_counter() - started, 3), "prompt_mode": self.opts.prompt,
                      "same_ids": same, "press_repr": repr(kv_press) if kv_press else None}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------- the run


def write_run_json(out: Path, opts, versions: dict) -> None:
    """OUT/run.json: what `camkv eval --report-only` reads (budgets) and what ran."""
    path = out / "run.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(budgets=",".join(label_of(r) for r in sorted(opts.ratios, reverse=True)),
                  tasks="ruler", methods=",".join(method_of(p) for p in opts.presses),
                  model=str(opts.model), prompts=str(opts.prompts), kvpress=versions)
    path.write_text(json.dumps(config, indent=1))


def run(opts) -> int:
    score = load_scorer()
    prompts = select(read_prompts(opts.prompts), opts.tasks, opts.lengths, opts.limit)
    opts.out.mkdir(parents=True, exist_ok=True)
    done = {key(r) for r in read_records(opts.out)}
    todo = [(p, press, ratio) for p in prompts for press, ratio in arms(opts.presses, opts.ratios)
            if (p["sample"], method_of(press), None if ratio is None else round(1 - ratio, 4)) not in done]
    print(f"kvpress_ruler: {len(prompts)} prompts x {len(arms(opts.presses, opts.ratios))} arms; "
          f"{len(todo)} answers to go", flush=True)
    if not todo:
        return 0
    engine = Engine(opts)
    write_run_json(opts.out, opts, engine.versions)
    failed = _read_errors(opts.out)
    started, spent = time.monotonic(), []
    with (opts.out / "records.jsonl").open("a") as out:
        for prompt, press, ratio in todo:
            if press in failed:
                continue
            estimate = sum(spent) / len(spent) if spent else 0.0
            if opts.time_budget and time.monotonic() - started + estimate > opts.time_budget:
                print(f"kvpress_ruler: stopped at the time budget ({opts.time_budget:.0f} s); "
                      "rerun the same command to continue", flush=True)
                return 0
            try:
                text, extra = engine.answer(prompt, press, ratio)
            except Exception as err:  # a press this kvpress / transformers pair cannot run
                failed[press] = f"{type(err).__name__}: {err}"
                (opts.out / "press_errors.json").write_text(json.dumps({**failed, **engine.versions},
                                                                       indent=1))
                print(f"kvpress_ruler: {press} fails ({failed[press]}); skipped", flush=True)
                continue
            spent.append(extra["seconds"])
            out.write(json.dumps(record(prompt, press, ratio, text, score, **extra)) + "\n")
            out.flush()
    print(f"kvpress_ruler: done, {len(spent)} answers in {time.monotonic() - started:.0f} s", flush=True)
    return 0


def _read_errors(out: Path) -> dict:
    path = out / "press_errors.json"
    if not path.exists():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if k in PRESSES}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    p.add_argument("--prompts", type=Path, required=True, help="camkv eval --export-prompts file")
    p.add_argument("--out", type=Path, required=True, help="output folder (records.jsonl, run.json)")
    p.add_argument("--presses", default="none,snapkv,knorm,streamingllm,kvzip,expected",
                   help=f"comma-separated: none, {', '.join(PRESSES)} (default %(default)s)")
    p.add_argument("--ratios", default="0.5,0.8,0.9",
                   help="kvpress compression ratios, the share of the context removed (default %(default)s)")
    p.add_argument("--prompt", choices=["ids", "text"], default="ids",
                   help="ids: the suite's token ids; text: kvpress's preprocessing of the exported texts")
    p.add_argument("--tasks", default="", help="comma-separated RULER tasks to run (default: all exported)")
    p.add_argument("--lengths", default="", help="comma-separated lengths to run (default: all exported)")
    p.add_argument("--limit", type=int, default=0, help="first N selected prompts only")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", help="torch device (default cuda when there is one, else cpu)")
    p.add_argument("--time-budget", type=float, help="seconds; stop before an answer that would overrun them")
    opts = p.parse_args(argv)
    opts.presses = [s.strip() for s in opts.presses.split(",") if s.strip()]
    bad = [s for s in opts.presses if s != "none" and s not in PRESSES]
    if bad or not opts.presses:
        p.error(f"--presses: {bad or 'nothing'} not among none, {', '.join(PRESSES)}")
    try:
        opts.ratios = [float(s) for s in opts.ratios.split(",") if s.strip()]
        opts.lengths = {int(s) for s in opts.lengths.split(",") if s.strip()}
    except ValueError as err:
        p.error(f"--ratios / --lengths: {err}")
    if not opts.ratios or not all(0 < r < 1 for r in opts.ratios):
        p.error(f"--ratios must be in (0, 1), got {opts.ratios}")
    opts.tasks = {s.strip() for s in opts.tasks.split(",") if s.strip()}
    if not opts.prompts.is_file():
        p.error(f"--prompts: no file {opts.prompts}")
    return opts


if __name__ == "__main__":
    sys.exit(run(parse_args()))
