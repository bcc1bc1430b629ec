# On the H200 (device tool), after install.sh: the cuda equivalence suite (with the
# amortized-eviction and whole-device compression tests, the cache and mlx-lm tests), the
# compression and decode profiles, the end-to-end run and the peak-memory run, results
# under $OUT. The prefill profile runs the same way:
#   python3 bench/profile_prefill.py --backend cuda --repeats 5 --logit-mb 8 32 128 --out $OUT
. bench/gpu/env.sh
timeout ${PYTEST_S:-150} python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_amortized.py \
  tests/test_equivalence.py tests/test_rules.py tests/test_jit.py tests/test_query_scoring.py tests/test_cache.py \
  tests/test_mlx_lm.py > $OUT/pytest-cuda-h200.txt 2>&1; tail -3 $OUT/pytest-cuda-h200.txt
timeout 120 python3 bench/profile_compress.py --out $OUT 2>&1 | tail -6
timeout 120 python3 bench/decode_parts.py --out $OUT 2>&1 | tail -7
timeout 330 python3 bench/e2e.py --model random-1b --prompt-lengths 1024 4096 8192 16384 32768 --gen-tokens 128 \
  --trials ${TRIALS:-3} --budgets 512 --out $OUT --tag e2e-h200-random-1b 2>&1 | grep -v "it/s\]" | tail -6
timeout 100 python3 bench/peak_memory.py --model random-1b --prompt-lengths 1024 32768 --out $OUT 2>&1 | tail -4
