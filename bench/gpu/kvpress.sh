# On the H200 (device tool): camkv's RULER prompts of SmolLM2-135M-Instruct through kvpress
# (bench/gpu/kvpress_ruler.py) for at most SECONDS (default 480), resumable, then the output
# folder tarred into $OUT. Carry .gpu-kvpress/k1 (bench/gpu/kvpress-stage.sh) in the call.
# The model: the Hugging Face folder camkv's converter writes from the GGUF file. `bash
# bench/gpu/ruler.sh smollm2` leaves it in /root/ckv/models (run this in the same warm
# session); otherwise, with MLX installed (install.sh) and the parts of stage-models.sh
# unpacked into /root/ckv (quality.sh), camkv converts it here first.
#   bash bench/gpu/kvpress.sh [SECONDS] [kvpress_ruler.py flags, e.g. --lengths 4096]
# Here, join each call's records and draw the tables beside camkv's arms:
#   tar xzf ruler-kvpress-smollm2.tgz -C /tmp/k && cat /tmp/k/bench/results/ruler-kvpress-smollm2/records.jsonl \
#     >> bench/results/ruler-kvpress-smollm2/records.jsonl
#   cat bench/results/ruler-kvpress-smollm2/records.jsonl >> bench/results/ruler-gpu-smollm2/records.jsonl
#   camkv eval --preset gpu-ruler --out bench/results/ruler-gpu-smollm2 --report-only
set -e
seconds=${1:-480}
shift || true
stage=.gpu-kvpress/k1
out=bench/results/ruler-kvpress-smollm2
model=/root/ckv/models/smollm2-135m-instruct-float32
(cd "$stage" && sha256sum -c --quiet SHA256SUMS)
if [ ! -f /tmp/kvp-site/kvpress/__init__.py ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --require-hashes --find-links "$stage" \
    --target /tmp/kvp-site -r "$stage/kvpress-requirements.txt"
fi
if [ ! -f "$model/config.json" ]; then
  if [ ! -f /root/ckv/downloads/SmolLM2-135M-Instruct.Q4_1.gguf ] || [ ! -d /tmp/site/mlx ]; then
    echo "bench/gpu/kvpress.sh: no $model, and no GGUF file and MLX to convert it from: install MLX" \
      "(install.sh) and unpack the parts of stage-models.sh (quality.sh, ruler.sh) first" >&2
    exit 2
  fi
  (. bench/gpu/env.sh && python3 -c 'from camkv.models import resolve; print(resolve("smollm2-135m-instruct"))')
fi
# kvpress's transformers and tokenizers before the machine's; camkv's package is not needed.
PYTHONPATH=/tmp/kvp-site PYTHONUNBUFFERED=1 timeout $(( seconds + 90 )) python3 bench/gpu/kvpress_ruler.py \
  --model "$model" --prompts "$stage/prompts-smollm2.jsonl.gz" --out "$out" --time-budget "$seconds" "$@" \
  2>&1 | grep -v "Loading weights" | tail -20 || true
tar czf "$OUT/$(basename "$out").tgz" "$out"
