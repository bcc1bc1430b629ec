#!/usr/bin/env bash
# Starts bench/gpu/sharded.py on every rank with mlx.launch: camkv on a random llama
# sharded by mlx-lm's tensor parallelism, checked against an unsharded run and timed
# against mlx-lm's caches (see sharded.py's --help for what runs and its options).
#
#   bash bench/gpu/sharded.sh [--backend nccl|ring] [--ranks N] [--port P] [--timeout S] [sharded.py options]
#
#   --backend nccl  (default) one rank per GPU of this host over MLX's NCCL backend, NVLink
#                   multicast off (NCCL_NVLS_ENABLE=0); needs N GPUs and MLX's CUDA build
#   --backend ring  a dry run: N CPU ranks on this host over MLX's ring backend (loopback)
#   --ranks N       ranks (default 2); they must divide the model's KV heads
#   --port P        the ring's first port (default 32323, one per rank) or NCCL's rendezvous port
#                   (default 12345)
#   --timeout S     end the job after S seconds (default 3600): a rank that hangs is not
#                   stopped by mlx.launch
# Every other argument goes to sharded.py. Rank 0 writes the JSON (--out; default
# bench/results/sharded-nccl.json, or $TMPDIR/camkv-sharded-ring.json for a dry run).
# Exit status: 0 every check passed; 1 a check failed or no rank wrote a result (the
# launcher itself exits 0 when a rank fails); 2 a bad option. $PYTHON picks the Python
# (default python3); mlx.launch runs as that Python's module, so no script needs to be on PATH.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
backend=nccl ranks=2 port="" timeout_s=3600 out=""
args=()

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "sharded.sh: error: $*" >&2; exit 2; }
is_count() { [[ $1 =~ ^[0-9]+$ ]] && [ "$1" -ge "$2" ]; }

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0;;
    --backend|--ranks|--port|--timeout|--out)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --backend) backend=$2;; --ranks) ranks=$2;; --port) port=$2;;
        --timeout) timeout_s=$2;; --out) out=$2;;
      esac
      shift 2;;
    *) args+=("$1"); shift;;
  esac
done
case "$backend" in nccl|ring) ;; *) die "--backend must be nccl or ring, got '$backend'";; esac
is_count "$ranks" 1 || die "--ranks must be an integer >= 1, got '$ranks'"
[ -z "$port" ] || { is_count "$port" 1 && [ "$port" -le 65535 ]; } || die "--port must be a port number 1-65535, got '$port'"
is_count "$timeout_s" 1 || die "--timeout must be a number of seconds >= 1, got '$timeout_s'"
if [ -z "$out" ]; then
  if [ "$backend" = ring ]; then out=${TMPDIR:-/tmp}/camkv-sharded-ring.json; else out=bench/results/sharded-nccl.json; fi
fi
rank_args=(--backend "$backend" --ranks "$ranks" --out "$out")
[ "$backend" = ring ] && rank_args+=(--device cpu)  # before the user's: a later --device wins

# Bad values end here with sharded.py's message and status 2, before any rank starts.
"$python" "$here/sharded.py" "${rank_args[@]}" "${args[@]}" --check-only || exit $?

launch=("$python" -c 'import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = "mlx.launch"; sys.exit(main())')
if [ "$backend" = nccl ]; then
  gpus=$("$python" -c 'import mlx.core as mx; print(mx.device_count(mx.gpu) if mx.cuda.is_available() else 0)') || exit 1
  [ "$gpus" -ge "$ranks" ] || die "--backend nccl --ranks $ranks needs $ranks CUDA GPUs, this host has $gpus (--backend ring runs CPU ranks)"
  export NCCL_NVLS_ENABLE=0  # the ranks get it from --env too; here for the launcher's own process
  launcher_args=(--backend nccl -n "$ranks" --env NCCL_NVLS_ENABLE=0 ${port:+--nccl-port "$port"})
else
  launcher_args=(--backend ring -n "$ranks" ${port:+-p "$port"})
fi
"$python" -c 'import mlx._distributed_utils.launch' 2>/dev/null \
  || { echo "sharded.sh: MLX's launcher (mlx._distributed_utils.launch) is not importable by $python" >&2; exit 1; }
command=(mlx.launch "${launcher_args[@]}" -- "$python" "$here/sharded.py" "${rank_args[@]}" "${args[@]}")
export CAMKV_SHARDED_LAUNCH="bash bench/gpu/sharded.sh --backend $backend --ranks $ranks${port:+ --port $port} --out $out ${args[*]}"
echo "sharded.sh: ${command[*]}"
rm -f "$out"
timeout --kill-after=10 "$timeout_s" "${launch[@]}" "${launcher_args[@]}" -- \
  "$python" "$here/sharded.py" "${rank_args[@]}" "${args[@]}"
status=$?
[ "$status" -ne 124 ] || echo "sharded.sh: the job ran past --timeout $timeout_s s and was ended" >&2
if [ ! -f "$out" ]; then
  echo "sharded.sh: no result in $out: a rank failed (its error is above)" >&2
  exit 1
fi
"$python" - "$out" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
failed = [name for name, ok in result["checks"]["verdicts"].items() if not ok]
gathered = result["checks"].get("camkv_gather_kv_bytes", {"ok": False, "error": "the job ended before it ran"})
if not gathered["ok"]:
    failed.append(f"camkv_gather_kv_bytes ({gathered.get('error', 'other bytes')})")
print(f"sharded.sh: {sys.argv[1]}: " + ("every check passed" if not failed else "FAILED: " + ", ".join(failed)))
sys.exit(1 if failed else 0)
EOF
