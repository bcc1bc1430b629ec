# On the H200 (device tool), after install.sh: the cuda equivalence suite, the kernel
# microbenchmark and the end-to-end run, results under $OUT. About 6 minutes.
. bench/gpu/env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_equivalence.py tests/test_rules.py \
  tests/test_jit.py tests/test_query_scoring.py 2>&1 | tee $OUT/pytest-cuda-h200.txt | tail -4
timeout 150 python3 bench/kernels_gpu.py --backend cuda --repeats 20 --ref-repeats 5 --prefill-repeats 1 --out $OUT \
  > $OUT/kernels.log 2>&1
timeout 200 python3 bench/e2e.py --model random-1b --prompt-lengths 1024 8192 16384 32768 --gen-tokens 128 \
  --trials 2 --budgets 512 2048 --out $OUT --tag e2e-h200-random-1b 2>&1 | grep -v "it/s\]" | tail -9
