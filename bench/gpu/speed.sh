# On the H200 (device tool), after install.sh: the speed runs of the merge rules, the
# quantized rows and the decode step, side by side in each run, JSON under $OUT. Name the
# parts to run (each within one 10-minute call unless noted):
#   bash bench/gpu/speed.sh merges    every rule's prefill and decode step against drop's and
#                                     RotatingKVCache's (random-1b 8k @ 512, random-8b 16k @ 2048;
#                                     merges1b and merges8b run one of the two), mean and keepkv
#                                     also as before the merge kernels and keepkv's CUDA decode
#                                     attention (mean/ops, keepkv/ops), keepkv/sdpa: its
#                                     decode attention alone as before, every rule with its
#                                     decode compressions on the merge engine as before
#                                     (RULE/engine), and keepkv's in the kernel core (keepkv/core);
#                                     then one prompt of drop, mean and keepkv under cProfile
#   bash bench/gpu/speed.sh graphs    drop's, window's, mean's and keepkv's prompts (random-8b 16k @
#                                     2048), mean and keepkv also with their nearest search's product
#                                     left inside its compression's graph (RULE/unfenced, as before the
#                                     fence) and without a product (RULE/direct),
#                                     under MLX's CUDA graph settings: as installed, MLX_USE_CUDA_GRAPHS=0,
#                                     as installed again (then random-1b 8k @ 512 as installed), and
#                                     MLX_MAX_OPS_PER_BUFFER=1 (about 7 minutes)
#   bash bench/gpu/speed.sh fence     every rule's prompt and decode step against drop's and
#                                     RotatingKVCache's, each rule with a nearest search also with its
#                                     product left in its compression's graph (RULE/unfenced: before
#                                     and after the fence in one run; random-8b 16k @ 2048, then
#                                     random-1b 8k @ 512; about 3 minutes)
#   bash bench/gpu/speed.sh calls     what each call of a decode step costs the host and a pipelined
#                                     step: MLX's attention, slice writes, views, a copy, a trivial
#                                     custom kernel, camkv's quantized write and attention, and both
#                                     in the one launch of a quantized decode step, the last two also
#                                     with 8 warps a head's work group and with their text inline
#                                     (by default in a file the source includes) (1B shape:
#                                     512 rows, 8 KV heads of 64; 8B shape: 2048 rows of 128; about
#                                     1 minute)
#   bash bench/gpu/speed.sh engine    one compression of each rule by the MLX engines on
#                                     llama-3-8B's shape (2048 rows + a 2048-token chunk), in
#                                     turn with drop's and with the one-launch drop, mean, keepkv
#                                     and d2o also without the kernels, then part by part; then
#                                     part by part at the 1B shape (512 rows + 2048, head dim 64;
#                                     about 3 minutes)
#   bash bench/gpu/speed.sh decode8b  camkv's decode step paired with RotatingKVCache's on
#                                     llama-3-8B's shape at 64k and 128k tokens, budget 2048,
#                                     with and without the hook's short way for decode steps
#                                     (no clocks around the caches' calls: a clock is a call
#                                     more per layer for each of camkv's three; about 6 minutes)
#   bash bench/gpu/speed.sh decodehost the caches' own host work per step and layer (clocked
#                                     calls) at 64k, the same arms (about 3 minutes)
#   bash bench/gpu/speed.sh qstep     a quantized decode step against bfloat16 rows' and
#                                     RotatingKVCache's as mlx_lm.generate runs them (random-1b
#                                     at 4k, budget 512; random-8b at 32k, budget 2048), then
#                                     one trial of each camkv arm under cProfile: the host work
#                                     of a step by function, custom kernels' calls included
#                                     (about 4 minutes)
#   bash bench/gpu/speed.sh qfused    quantized decode steps written and attended apart and in one
#                                     launch (camkv-q8-fused, camkv-q4-fused), side by side with
#                                     RotatingKVCache's (random-1b at 4k, random-8b at 32k; about
#                                     4 minutes)
#   bash bench/gpu/speed.sh qfusedwf  the one-launch 8-bit step with the kernels' text inline, with
#                                     8 warps a head (text inline), with the text by file (the
#                                     default) and with both (camkv-q8-fused-inline, -w8, -file,
#                                     -w8-file), beside RotatingKVCache's and the 4-bit step
#                                     (random-1b at 4k; about 3 minutes)
#   bash bench/gpu/speed.sh qprefill  prefill and generation of bfloat16, 8-bit and 4-bit rows and
#                                     RotatingKVCache (random-1b at 4k and 32k, budget 512; about
#                                     2 minutes; with BEFORE=... once for each checkout)
#   bash bench/gpu/speed.sh keepkvblock keepkv's prompt with its chunks weighed by the values'
#                                     votes (the default) and by a mask (keepkv/masked), beside
#                                     drop's and RotatingKVCache's (random-8b 16k @ 2048, then
#                                     random-1b 8k @ 512; about 3 minutes)
#   bash bench/gpu/speed.sh quant     bytes, generation and prefill at 8 and 4 bits (random-1b
#                                     4k-32k, random-8b 32k; about 5 minutes)
#   bash bench/gpu/speed.sh qattn     one layer's decode attention over quantized rows: MLX's,
#                                     dequantized first, unquantized and camkv's CUDA pass
#                                     (512 and 2048 rows, head dim 64 and 128; about 1 minute)
#   bash bench/gpu/speed.sh capacity  16k-token requests admitted into 2 GiB: BatchKVCache,
#                                     camkv and camkv with 4-bit rows (admitting stops at
#                                     72, so a count of 72 is a lower bound: about 3 minutes)
#   bash bench/gpu/speed.sh batchstep a BatchGenerator's decode call with 4 and 16 requests of
#                                     16k tokens decoding, bfloat16 and 4-bit rows (random-1b,
#                                     budget 512; about 2 minutes)
# e.g. `bash bench/gpu/speed.sh merges1b decode8b` (about 9 minutes). With BEFORE=FOLDER (a
# camkv package's parent: `git archive OLD python csrc cuda metal | tar -x -C before` and
# BEFORE=before/python, the kernels' text beside the package), each part runs
# first with that camkv, then with this one, JSON under $OUT/before and $OUT/after (twice
# the time).
. bench/gpu/env.sh
mkdir -p "$OUT"
# The merge rules the command line lists (camkv.merges' registry), dropping aside.
RULES=$(python3 -c "from camkv import merges; print(*(r for r in merges.offered() if r != 'drop'))")
# Those of them with a nearest search (its product fenced on CUDA).
NEAREST=$(python3 -c "from camkv import merges; print(*(r for r in merges.offered() if merges.rule(r).kind == merges.NEAREST))")
step() {  # SECONDS COMMAND...: one run, cut at SECONDS, its last lines printed
  local seconds=$1; shift
  timeout "$seconds" "$@" 2>&1 | grep -v "it/s\]\|Warn" | tail -${TAIL:-14}
}
run_part() {  # PART: one part's runs, JSON under $OUT
  local part=$1
  case $part in
    merges|merges1b|merges8b)
      [ $part = merges8b ] || TAIL=70 step 280 python3 bench/merge_speed.py --model random-1b --prompt-length 8192 \
        --budget 512 --steps 160 --rounds 3 --ops-arms mean keepkv --engine-arms $RULES --core-arms keepkv \
        --profile drop mean keepkv --out "$OUT/merge-speed-random-1b-8k.json"
      [ $part = merges1b ] || TAIL=70 step 420 python3 bench/merge_speed.py --model random-8b --prompt-length 16384 \
        --budget 2048 --steps 64 --rounds 2 --ops-arms mean keepkv --engine-arms $RULES --core-arms keepkv \
        --profile drop mean keepkv --out "$OUT/merge-speed-random-8b-16k.json" ;;
    graphs)
      local i=0 setting arms="--rules window mean keepkv --unfenced-arms mean keepkv --direct-arms mean keepkv"
      for setting in "" MLX_USE_CUDA_GRAPHS=0 "" MLX_MAX_OPS_PER_BUFFER=1; do
        i=$((i + 1))
        echo "-- MLX settings: ${setting:-as installed}"
        TAIL=11 step 120 env $setting python3 bench/merge_speed.py --model random-8b --prompt-length 16384 \
          --budget 2048 --steps 16 --rounds 1 $arms --out "$OUT/graphs-random-8b-$i.json"
        if [ $i = 3 ]; then
          TAIL=11 step 150 python3 bench/merge_speed.py --model random-1b --prompt-length 8192 --budget 512 \
            --steps 64 --rounds 2 $arms --out "$OUT/graphs-random-1b.json"
        fi
      done ;;
    fence)
      TAIL=18 step 240 python3 bench/merge_speed.py --model random-8b --prompt-length 16384 --budget 2048 --steps 16 \
        --rounds 1 --unfenced-arms $NEAREST --out "$OUT/fence-random-8b-16k.json"
      TAIL=18 step 150 python3 bench/merge_speed.py --model random-1b --prompt-length 8192 --budget 512 --steps 64 \
        --rounds 2 --unfenced-arms $NEAREST --out "$OUT/fence-random-1b-8k.json" ;;
    calls)
      step 60 python3 bench/step_calls.py --out "$OUT/step-calls-1b-shape.json"
      step 60 python3 bench/step_calls.py --rows 2048 --head-dim 128 --layers 32 --out "$OUT/step-calls-8b-shape.json" ;;
    engine)
      step 200 python3 bench/profile_merge_engine.py --rows 8 --head-dim 128 --queries-per-kv 4 --budget 2048 \
        --chunk 2048 --repeats 5 --stages --ops-arms mean keepkv d2o --out "$OUT/merge-engine-8b-shape.json"
      step 120 python3 bench/profile_merge_engine.py --rows 8 --head-dim 64 --queries-per-kv 4 --budget 512 \
        --chunk 2048 --repeats 5 --stages --out "$OUT/merge-engine-1b-shape.json" ;;
    decode8b)
      for length in 65536 131072; do
        step $((length / 1024 + 100)) python3 bench/decode_parts.py --model random-8b --prompt-length $length --budget 2048 \
          --arms rotating camkv camkv-fullhook --interleave --trials 2 --steps 64 --out "$OUT/decode8b-$length"
      done ;;
    decodehost)
      step 200 python3 bench/decode_parts.py --model random-8b --prompt-length 65536 --budget 2048 \
        --arms rotating camkv camkv-fullhook --interleave --cache-host --trials 1 --steps 64 --out "$OUT/decodehost-65536" ;;
    qstep)
      step 120 python3 bench/decode_parts.py --model random-1b --prompt-length 4096 --budget 512 \
        --arms rotating camkv camkv-q8 camkv-q4 --pipelined 16 --trials 2 --steps 64 \
        --host-profile camkv camkv-q8 --out "$OUT/qstep-random-1b-4096"
      step 150 python3 bench/decode_parts.py --model random-8b --prompt-length 32768 --budget 2048 \
        --arms rotating camkv camkv-q8 camkv-q4 --pipelined 16 --trials 1 --steps 48 \
        --host-profile camkv-q8 --out "$OUT/qstep-random-8b-32768" ;;
    qfused)
      step 150 python3 bench/decode_parts.py --model random-1b --prompt-length 4096 --budget 512 \
        --arms rotating camkv-q8 camkv-q8-fused camkv-q4 camkv-q4-fused --pipelined 16 --trials 2 --steps 64 \
        --out "$OUT/qfused-random-1b-4096"
      step 200 python3 bench/decode_parts.py --model random-8b --prompt-length 32768 --budget 2048 \
        --arms rotating camkv-q8 camkv-q8-fused --pipelined 16 --trials 1 --steps 48 \
        --out "$OUT/qfused-random-8b-32768" ;;
    qfusedwf)
      step 200 python3 bench/decode_parts.py --model random-1b --prompt-length 4096 --budget 512 \
        --arms rotating camkv-q8-fused-inline camkv-q8-fused-w8 camkv-q8-fused-file camkv-q8-fused-w8-file camkv-q4-fused \
        --pipelined 16 --trials 2 --steps 64 --out "$OUT/qfusedwf-random-1b-4096" ;;
    qprefill)
      step 150 python3 bench/quant.py --model random-1b --prompt-lengths 4096 32768 --budgets 512 --gen-tokens 16 \
        --trials 3 --out "$OUT" --tag qprefill-random-1b ;;
    keepkvblock)
      TAIL=11 step 150 python3 bench/merge_speed.py --model random-8b --prompt-length 16384 --budget 2048 --steps 16 \
        --rounds 1 --rules keepkv --masked-arms keepkv --out "$OUT/keepkv-block-random-8b-16k.json"
      TAIL=11 step 120 python3 bench/merge_speed.py --model random-1b --prompt-length 8192 --budget 512 --steps 64 \
        --rounds 2 --rules keepkv --masked-arms keepkv --out "$OUT/keepkv-block-random-1b-8k.json" ;;
    quant)
      step 200 python3 bench/quant.py --model random-1b --prompt-lengths 4096 8192 16384 32768 --budgets 512 \
        --equal-bytes --out "$OUT" --tag quant-h200-random-1b
      step 120 python3 bench/quant.py --model random-8b --prompt-lengths 32768 --budgets 2048 --out "$OUT" \
        --tag quant-h200-random-8b ;;
    qattn)
      step 150 python3 bench/quantized_attention.py --rows 512 2048 --head-dim 64 128 --bits 4 8 --group-size 32 64 \
        --repeats 100 --out "$OUT/quantized-attention-h200.json" ;;
    capacity)
      step 540 python3 bench/batch.py --model random-1b --capacity-only --capacity --kv-bits 4 --max-n 72 \
        --out "$OUT/batch-h200-quant.json" ;;
    batchstep)
      step 300 python3 bench/batch_decode_step.py --model random-1b --context 16384 --rows 4 16 --warm 40 --steps 40 \
        --out "$OUT/batch-decode-step-h200.json" ;;
    *) echo "bench/gpu/speed.sh: parts are merges, merges1b, merges8b, graphs, fence, calls, engine, decode8b, decodehost, qstep, qfused, qfusedwf, qprefill, keepkvblock, quant, qattn, capacity, batchstep; got '$part'" >&2; exit 2 ;;
  esac
}
if [ -z "${BEFORE:-}" ]; then
  for part in "$@"; do run_part "$part"; done
else  # each part with the camkv at $BEFORE (e.g. an older checkout's python/ folder), then with this one
  [ -d "$BEFORE/camkv" ] || { echo "bench/gpu/speed.sh: BEFORE=$BEFORE holds no camkv package" >&2; exit 2; }
  [ -d "$BEFORE/camkv/kernels" ] || [ -d "$BEFORE/../cuda" ] || {
    echo "bench/gpu/speed.sh: BEFORE=$BEFORE has no kernel sources beside it (unpack csrc, cuda and metal next to python/)" >&2; exit 2; }
  after_path=$PYTHONPATH after_out=$OUT
  for part in "$@"; do
    for tag in before after; do
      echo "== $part, $tag"
      if [ $tag = before ]; then export PYTHONPATH=/tmp/site:$(cd "$BEFORE" && pwd); else export PYTHONPATH=$after_path; fi
      OUT=$after_out/$tag; mkdir -p "$OUT"
      run_part "$part"
    done
  done
  export PYTHONPATH=$after_path; OUT=$after_out
fi
