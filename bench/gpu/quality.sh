# On the H200 (device tool), after install.sh and after the GGUF parts and texts were
# copied to /root/ckv/downloads (g.*) and /root/ckv/texts (*.json.gz) by earlier calls
# (bench/gpu/README.md): join the parts once, resume the quality sweep for at most
# $1 seconds (default 420) with the quality.py flags that follow (default --methods all;
# e.g. --tasks stream --methods mass_weighted-nogate-bias-query --budgets 20%), and tar
# the folder into $OUT to join its records here:
#   tar xzf quality-gpu.tgz -C /tmp/q && cp /tmp/q/bench/results/quality-gpu/records.jsonl \
#     bench/results/quality-gpu/ && python bench/quality.py --preset gpu --methods all --report-only
set -e
. bench/gpu/env.sh
model=/root/ckv/downloads/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$model" ]; then
  cat /root/ckv/downloads/g.* > "$model" && rm /root/ckv/downloads/g.*
fi
seconds=${1:-420}
shift || true
if [ $# -eq 0 ]; then set -- --methods all; fi
timeout $(( seconds + 40 )) python3 bench/quality.py --preset gpu --offline "$@" \
  --out bench/results/quality-gpu --time-budget "$seconds" --no-progress 2>&1 | tail -3 || true
tar czf "$OUT/quality-gpu.tgz" bench/results/quality-gpu
