#!/usr/bin/env bash
# Stages kvpress's run of camkv's RULER prompts on the H200 (bench/gpu/kvpress_ruler.py,
# run there by bench/gpu/kvpress.sh): the wheels of bench/gpu/kvpress-requirements.txt
# (hash-checked) and SmolLM2-135M-Instruct's RULER prompts exported by camkv with the
# flags of `bench/gpu/ruler.sh smollm2`, in the git-ignored folder .gpu-kvpress/k1 (about
# 20 MB), which the call that runs bench/gpu/kvpress.sh carries. Run here, with registry
# access, after the models and texts were fetched once (bench/gpu/stage-models.sh needs
# the same). The model itself goes there as bench/gpu/stage-models.sh stages it: its GGUF
# file, converted on the H200 by camkv (bench/gpu/kvpress.sh).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu-kvpress/' .git/info/exclude 2>/dev/null || echo '/.gpu-kvpress/' >> .git/info/exclude
python=${PYTHON:-$root/.venv/bin/python}
stage=.gpu-kvpress/k1
rm -rf .gpu-kvpress && mkdir -p "$stage"
# The H200's Python is CPython 3.12 on x86_64 Linux; pip checks each wheel's sha256.
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --require-hashes -r bench/gpu/kvpress-requirements.txt -d "$stage"
cp bench/gpu/kvpress-requirements.txt "$stage/"
# The prompts `bash bench/gpu/ruler.sh smollm2` runs (its flags), every one of the plan.
"$python" -m camkv eval --offline --preset gpu-ruler --model smollm2-135m-instruct \
  --ruler-lengths 4096,8192 --tasks ruler --export-prompts "$stage/prompts-smollm2.jsonl.gz"
(cd "$stage" && sha256sum ./*.whl prompts-smollm2.jsonl.gz > SHA256SUMS)
du -sh "$stage"
echo "staged $stage: carry it ([\"$stage\"]) in the call that runs bench/gpu/kvpress.sh"
