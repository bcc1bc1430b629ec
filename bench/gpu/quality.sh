# On the H200 (device tool), after install.sh and after the parts of stage-models.sh were
# copied to /root/parts by earlier calls: unpack them once (models and texts into
# /root/ckv, llama.cpp's gguf package into /tmp/site), resume a quality sweep for at
# most $1 seconds (default 420) with the `camkv eval` flags that follow (default: the gpu
# preset), and tar the output folder (the value of --out, default
# bench/results/quality-gpu) into $OUT to join its records here:
#   tar xzf quality-gpu.tgz -C /tmp/q && cat /tmp/q/OUTFOLDER/records.jsonl >> OUTFOLDER/records.jsonl
#   camkv eval ... --out OUTFOLDER --report-only
set -e
. bench/gpu/env.sh
if ls /root/parts/part_* >/dev/null 2>&1; then
  mkdir -p /root/ckv /tmp/site
  cat /root/parts/part_* | tar x -C /root/ckv && rm /root/parts/part_*
  rm -rf /tmp/site/gguf && mv /root/ckv/gguf /tmp/site/
fi
seconds=${1:-420}
shift || true
if [ $# -eq 0 ]; then set -- --preset gpu; fi
out=""
prev=""
for arg in "$@"; do
  if [ "$prev" = "--out" ]; then out=$arg; fi
  prev=$arg
done
if [ -z "$out" ]; then out=bench/results/quality-gpu; set -- "$@" --out "$out"; fi
timeout $(( seconds + 40 )) python3 -m camkv eval --offline "$@" --time-budget "$seconds" --no-progress 2>&1 | tail -3 || true
tar czf "$OUT/$(basename "$out").tgz" "$out"
