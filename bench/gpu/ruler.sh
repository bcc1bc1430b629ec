# On the H200 (device tool), after install.sh and the staging calls of stage-models.sh
# (bench/gpu/README.md): resume the RULER suite of one model for at most SECONDS
# (default 480, so a call stays within 10 minutes), then tar its folder into $OUT.
#   bash bench/gpu/ruler.sh smollm2 [SECONDS] [more camkv eval flags]   4k and 8k
#   bash bench/gpu/ruler.sh gemma [SECONDS] [more camkv eval flags]     4k, 8k and 16k
# Rerun the same line until the printed tables end without "(partial: rerun to
# continue)". Here, join each call's records and redraw the tables:
#   tar xzf ruler-gpu-smollm2.tgz -C /tmp/r && cat /tmp/r/bench/results/ruler-gpu-smollm2/records.jsonl \
#     >> bench/results/ruler-gpu-smollm2/records.jsonl
#   camkv eval --preset gpu-ruler --out bench/results/ruler-gpu-smollm2 --report-only
# Gemma 3 270M is the base model: RULER's plain template (--chat-template off).
set -e
model=${1:?usage: bash bench/gpu/ruler.sh smollm2|gemma [SECONDS] [camkv eval flags]}
seconds=${2:-480}
shift $(( $# >= 2 ? 2 : 1 ))
case $model in
  smollm2) set -- --preset gpu-ruler --model smollm2-135m-instruct --ruler-lengths 4096,8192 \
             --out bench/results/ruler-gpu-smollm2 "$@" ;;
  gemma) set -- --preset gpu-ruler --model gemma-3-270m --chat-template off \
           --ruler-lengths 4096,8192,16384 --out bench/results/ruler-gpu-gemma-3-270m "$@" ;;
  *) echo "bench/gpu/ruler.sh: model must be smollm2 or gemma, got '$model'" >&2; exit 2 ;;
esac
exec bash "$(dirname "$0")/quality.sh" "$seconds" --tasks ruler "$@"
