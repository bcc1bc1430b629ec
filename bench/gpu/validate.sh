# On the H200 (device tool), after install.sh, results under $OUT. Two parts, each
# within one device call (at most 10 minutes):
#   bash bench/gpu/validate.sh kernels the kernels against the reference: equivalence,
#                                      the merge engine, merge rules, the JIT backends
#                                      (more than one call: its three parts, one a call:)
#   bash bench/gpu/validate.sh equivalence   tests/test_equivalence.py
#   bash bench/gpu/validate.sh engine        tests/test_merge_ops.py and tests/test_merge_cuda.py
#                                            (about 6 minutes)
#   bash bench/gpu/validate.sh rules         tests/test_rules.py and tests/test_jit.py
#   bash bench/gpu/validate.sh cache   the amortized-eviction, window-scoring and
#                                      whole-device compression tests, the cache, mlx-lm
#                                      and batch tests, and the peak memory of a 1k and a
#                                      32k prompt
#   bash bench/gpu/validate.sh tests   both (more than one call's 10 minutes)
#   bash bench/gpu/validate.sh quantized  quantized rows: camkv's CUDA attention over them
#                                      against the reference, and the cache and hook
#                                      tests of quantized rows on the GPU (about 2 minutes)
#   bash bench/gpu/validate.sh votes   rows weighed by their votes (keepkv): the prompt
#                                      chunks' weighing (tests/test_rule_state.py -k weigh;
#                                      the file's first two tests, caches that
#                                      compress, took over 45 s each on an H100)
#   bash bench/gpu/validate.sh bench   the end-to-end run (defaults), more prefill
#                                      trials at 8k-32k, and the batch run
#   bash bench/gpu/validate.sh decode  a decode step against RotatingKVCache's, paired
#                                      step by step (decode_parts --interleave), then
#                                      the end-to-end run with 256 tokens and 7 trials
# The profiles of the compression, prefill and decode parts go the same way:
#   python3 bench/decode_parts.py --interleave --trials 5 --host-profile rotating camkv --out $OUT
#   python3 bench/profile_compress.py --chunks 65 257 2048 --out $OUT
#   python3 bench/profile_prefill.py --backend cuda --groups 2 --repeats 5 --logit-mb 32 64 128 --out $OUT
. bench/gpu/env.sh
part=${1:-tests}
cuda_tests() {  # NAME FILES...: one part of the CUDA suite, within one device call
  name=$1; shift
  timeout ${PYTEST_S:-540} python3 -m pytest -q -p no:cacheprovider --tb=short "$@" \
    > $OUT/pytest-cuda-h200-$name.txt 2>&1; tail -3 $OUT/pytest-cuda-h200-$name.txt
}
# The kernels part's files, by named part (NAME:FILE,FILE ...).
kernel_parts="equivalence:tests/test_equivalence.py engine:tests/test_merge_ops.py,tests/test_merge_cuda.py rules:tests/test_rules.py,tests/test_jit.py"
# shellcheck disable=SC2046  # every part's files, split on spaces
kernel_tests() { cuda_tests kernels $(for entry in $kernel_parts; do echo "${entry#*:}" | tr , ' '; done); }
cache_tests() {
  cuda_tests cache tests/test_amortized.py tests/test_policy.py tests/test_cache.py tests/test_mlx_lm.py \
    tests/test_query_scoring.py tests/test_batch.py
  timeout 90 python3 bench/peak_memory.py --model random-1b --prompt-lengths 1024 32768 --out $OUT 2>&1 | tail -4
}
kernel_part() {  # NAME: the files of one named part of kernel_tests
  for entry in $kernel_parts; do
    if [ "${entry%%:*}" = "$1" ]; then echo "${entry#*:}" | tr , ' '; fi
  done
}
if [ -n "$(kernel_part "$part")" ]; then
  # shellcheck disable=SC2046  # the part's files, split on spaces
  cuda_tests "$part" $(kernel_part "$part")
elif [ "$part" = kernels ]; then
  kernel_tests
elif [ "$part" = cache ]; then
  cache_tests
elif [ "$part" = quantized ]; then
  cuda_tests quantized tests/test_quantized_cuda.py tests/test_quantized.py tests/test_tier.py tests/test_byte_budget.py
elif [ "$part" = votes ]; then
  cuda_tests votes tests/test_rule_state.py -k weigh
elif [ "$part" = tests ]; then
  kernel_tests; cache_tests
elif [ "$part" = bench ]; then
  timeout 170 python3 bench/e2e.py --model random-1b --prompt-lengths 1024 4096 8192 16384 32768 --gen-tokens 128 \
    --trials ${TRIALS:-3} --budgets 512 --out $OUT --tag e2e-h200-random-1b 2>&1 | grep -v "it/s\]" | tail -6
  timeout 120 python3 bench/e2e.py --model random-1b --prompt-lengths 8192 16384 32768 --gen-tokens 4 \
    --trials 7 --budgets 512 --out $OUT --tag e2e-h200-prefill 2>&1 | grep -v "it/s\]" | tail -4
  timeout 150 python3 bench/batch.py --model random-1b --slack 16 --profile --capacity --out $OUT/batch-h200.json 2>&1 | grep -v Warn | tail -8
elif [ "$part" = decode ]; then
  timeout 200 python3 bench/decode_parts.py --interleave --trials 5 --arms full rotating buffer camkv-key camkv \
    --out $OUT 2>&1 | tail -6
  timeout 330 python3 bench/e2e.py --model random-1b --prompt-lengths 1024 4096 8192 16384 32768 --gen-tokens 256 \
    --trials 7 --budgets 512 --out $OUT --tag e2e-h200-random-1b 2>&1 | grep -v "it/s\]" | tail -6
else
  echo "usage: bash bench/gpu/validate.sh kernels|equivalence|engine|rules|cache|quantized|votes|tests|bench|decode" >&2; exit 2
fi
