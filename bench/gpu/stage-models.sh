#!/usr/bin/env bash
# Stages what the quality sweep needs on the H200 (no registry there): both packaged
# models' GGUF files, the cached texts and llama.cpp's `gguf` package (Gemma 3's
# K-quant tensors need it), as one tar split into git-ignored folders .gpu-stage/m1,
# m2, ..., each small enough to travel in one device call beside the working tree (a
# call carries at most 64 MiB: the tree's files, git-tracked or not ignored, and the
# folder carried; each part is 64 MiB less the tree and 2 MiB to spare, 8 MiB at least).
# Run on a machine that has fetched the models once (camkv.models.load).
#
# On the device, one call per folder, back to back (the machine forgets between cold calls):
#   call k (carry [".gpu-stage/mk"]):  mkdir -p /root/parts && cp .gpu-stage/mk/* /root/parts/
# then bench/gpu/quality.sh joins and unpacks them (/root/ckv, gguf into /tmp/site).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu-stage/' .git/info/exclude 2>/dev/null || echo '/.gpu-stage/' >> .git/info/exclude
cache=${CAMKV_CACHE_DIR:-$HOME/.cache/camkv}
case ${1:-all} in
  all) models="downloads/SmolLM2-135M-Instruct.Q4_1.gguf downloads/gemma-3-270m-q4_k_m.gguf" ;;
  smollm2) models=downloads/SmolLM2-135M-Instruct.Q4_1.gguf ;;
  gemma) models=downloads/gemma-3-270m-q4_k_m.gguf ;;
  *) echo "bench/gpu/stage-models.sh: stage 'all' (the default), 'smollm2' or 'gemma', got '$1'" >&2; exit 2 ;;
esac
# The parts' size: what a call's 64 MiB leave beside the working tree as it travels.
tree=$(git ls-files -z --cached --others --exclude-standard | { du -cb --files0-from=- 2>/dev/null || true; } | awk 'END {print $1 + 0}')
size=$(( (64 << 20) - tree - (2 << 20) ))
if [ "$size" -lt $((8 << 20)) ]; then
  echo "bench/gpu/stage-models.sh: the working tree is $tree bytes, leaving less than 8 MiB of a call's 64 MiB for a part" >&2
  exit 1
fi
gguf_parent=$(python3 -c 'import gguf, os; print(os.path.dirname(os.path.dirname(gguf.__file__)))')
rm -rf .gpu-stage && mkdir -p .gpu-stage
# shellcheck disable=SC2086  # models is a list of paths without spaces
tar cf .gpu-stage/bundle.tar -C "$cache" $models texts -C "$gguf_parent" gguf
split -b "$size" -d -a 2 .gpu-stage/bundle.tar .gpu-stage/part_
rm .gpu-stage/bundle.tar
n=0
for part in .gpu-stage/part_*; do
  n=$((n + 1))
  mkdir -p ".gpu-stage/m$n" && mv "$part" ".gpu-stage/m$n/"
done
echo "staged $n folders of at most $size bytes beside a tree of $tree: .gpu-stage/m1 .. m$n (carry one per call, in order)"
