# On the H200 (device tool), after install.sh: the cuda equivalence suite (plus the
# cache and mlx-lm tests, which run the fetch kernel), the decode and prefill profiles
# and the end-to-end run, results under $OUT. About 6 minutes.
. bench/gpu/env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_equivalence.py tests/test_rules.py \
  tests/test_jit.py tests/test_query_scoring.py tests/test_cache.py tests/test_mlx_lm.py 2>&1 \
  | tee $OUT/pytest-cuda-h200.txt | tail -4
python3 bench/profile_decode.py --backend cuda --out $OUT 2>&1 | head -10
python3 bench/profile_prefill.py --backend cuda --repeats 3 --out $OUT 2>&1 | tail -3
timeout 200 python3 bench/e2e.py --model random-1b --prompt-lengths 1024 8192 16384 32768 --gen-tokens 128 \
  --trials 2 --budgets 512 2048 --out $OUT --tag e2e-h200-random-1b 2>&1 | grep -v "it/s\]" | tail -9
