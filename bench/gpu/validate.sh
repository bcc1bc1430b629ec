# On the H200 (device tool), after install.sh: the cuda equivalence suite (with the
# amortized-eviction and whole-device compression tests, the cache and mlx-lm tests), the
# end-to-end run, the decode, compression and prefill profiles and the batch run,
# results under $OUT. The peak-memory run goes the same way:
#   python3 bench/peak_memory.py --model random-1b --prompt-lengths 1024 32768 --out $OUT
. bench/gpu/env.sh
timeout ${PYTEST_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_amortized.py tests/test_policy.py \
  tests/test_cache.py tests/test_mlx_lm.py tests/test_equivalence.py tests/test_query_scoring.py tests/test_rules.py \
  tests/test_jit.py > $OUT/pytest-cuda-h200.txt 2>&1; tail -3 $OUT/pytest-cuda-h200.txt
timeout 130 python3 bench/e2e.py --model random-1b --prompt-lengths 1024 4096 8192 16384 32768 --gen-tokens 128 \
  --trials ${TRIALS:-3} --budgets 512 --prefill-scorings causal --out $OUT --tag e2e-h200-random-1b 2>&1 | grep -v "it/s\]" | tail -6
timeout 60 python3 bench/decode_parts.py --out $OUT 2>&1 | tail -7
timeout 40 python3 bench/profile_compress.py --chunks 65 257 2048 --out $OUT 2>&1 | tail -5
timeout 40 python3 bench/profile_prefill.py --backend cuda --groups 2 --repeats 5 --logit-mb 32 64 128 --out $OUT \
  2>&1 | tail -3
timeout 100 python3 bench/batch.py --model random-1b --slack 16 --profile --capacity --out $OUT/batch-h200.json 2>&1 | grep -v Warn | tail -7
