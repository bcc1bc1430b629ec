# On the H200 (device tool), after install.sh and after the parts of stage-models.sh were
# copied to /root/parts by earlier calls: unpack them once (models and texts into
# /root/ckv, llama.cpp's gguf package into /tmp/site; once also where calls run side by
# side), resume a quality sweep for at most $1 seconds (default 420) with the `camkv eval`
# flags that follow (default: the gpu preset), and tar the output folder (the value of --out, default
# bench/results/quality-gpu) into $OUT to join its records here:
#   tar xzf quality-gpu.tgz -C /tmp/q && cat /tmp/q/OUTFOLDER/records.jsonl >> OUTFOLDER/records.jsonl
#   camkv eval ... --out OUTFOLDER --report-only
# Calls back to back on a warm machine resume from the records the last one wrote (kept
# under /root/kept, as the tree a call brings lacks them); a fresh machine resumes from
# the tree's, so join the records here before a call that starts one.
# SPLIT='FLAGS;FLAGS' runs one sweep a group of flags side by side (see below), e.g.
#   SPLIT='--methods h2o-causal --budgets 10%;--methods snapkv --budgets 10%' bash bench/gpu/quality.sh ...
set -e
. bench/gpu/env.sh
unpack_parts() {  # the staged parts, once: models and texts into ckv, gguf into the site folder
  ls "$device_root"/parts/part_* >/dev/null 2>&1 || return 0
  mkdir -p "$device_root/ckv" "$device_site"
  cat "$device_root"/parts/part_* | tar x -C "$device_root/ckv"
  rm "$device_root"/parts/part_*
  rm -rf "$device_site/gguf" && mv "$device_root/ckv/gguf" "$device_site/"
}
# Calls side by side (two models' sweeps in one device call) unpack once: the first takes
# the lock (a folder: mkdir is atomic), the others wait and then find no parts.
# A lock left by a call killed while unpacking is not waited for past UNPACK_WAIT_S
# seconds (default 600): the call stops, naming the folder to remove.
mkdir -p "$device_root"
waited=0
until mkdir "$device_root/unpacking" 2>/dev/null; do
  if [ "$waited" -ge "${UNPACK_WAIT_S:-600}" ]; then
    echo "quality.sh: $device_root/unpacking (the unpacking lock) is still held after $waited s; if no call is" \
         "unpacking, a killed one left it: remove it and run again" >&2
    exit 1
  fi
  sleep 1
  waited=$((waited + 1))
done
trap 'rmdir "$device_root/unpacking" 2>/dev/null || true' EXIT
unpack_parts
rmdir "$device_root/unpacking" && trap - EXIT
seconds=${1:-420}
shift || true
if [ $# -eq 0 ]; then set -- --preset gpu; fi
# The sweep's flags without --out (each sweep below names its own folder once).
out=bench/results/quality-gpu
flags=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--out" ] && [ $# -gt 1 ]; then out=$2; shift 2; else flags+=("$1"); shift; fi
done
set -- "${flags[@]}"
# Each call brings the working tree again, without what the last call on this (still
# warm) machine added: resume from that call's records where the tree's are their start.
resume_from_kept() {  # OUTFOLDER KEPTFOLDER
  local out=$1 kept=$2 have=0 more
  [ -f "$kept/records.jsonl" ] || return 0
  if [ -f "$out/records.jsonl" ]; then have=$(wc -l < "$out/records.jsonl"); fi
  more=$(( $(wc -l < "$kept/records.jsonl") - have ))
  [ "$more" -gt 0 ] || return 0
  if [ "$have" -gt 0 ] && ! head -n "$have" "$kept/records.jsonl" | cmp -s - "$out/records.jsonl"; then
    return 0
  fi
  mkdir -p "$out" && cp "$kept/records.jsonl" "$out/records.jsonl"
  echo "quality.sh: resuming after the $more records a previous call on this machine added"
}
kept=$device_root/kept/$(basename "$out")
resume_from_kept "$out" "$kept"
sweep() {  # FOLDER [more flags]: one sweep into FOLDER, cut at $seconds
  local folder=$1; shift
  timeout $(( seconds + 40 )) python3 -m camkv eval --offline "$@" --out "$folder" --time-budget "$seconds" \
    --no-progress 2>&1 | tail -3 || true
}
if [ -z "${SPLIT:-}" ]; then
  sweep "$out" "$@"
else
  # SPLIT='FLAGS;FLAGS;...': one sweep a group, side by side (a small model leaves the GPU
  # mostly idle, so one process uses a fraction of it). Each starts from the folder's
  # records in a copy of its own; their new records are appended after them in group order
  # (the record store counts an arm recorded twice, such as a full-cache answer two groups
  # needed, once). Their seconds are those of sweeps sharing the GPU.
  IFS=';' read -r -a groups <<< "$SPLIT"
  have=0
  mkdir -p "$out"
  if [ -f "$out/records.jsonl" ]; then have=$(wc -l < "$out/records.jsonl"); fi
  split=$device_root/split/$(basename "$out")  # one per folder: two models' sweeps may run side by side
  for k in "${!groups[@]}"; do
    rm -rf "${split:?}/$k" && mkdir -p "$split/$k" && cp -r "$out" "$split/$k/"
    # shellcheck disable=SC2086  # a group is a list of flags without spaces inside them
    sweep "$split/$k/$(basename "$out")" "$@" ${groups[$k]} > "$split/$k.log" &
  done
  wait
  for k in "${!groups[@]}"; do
    echo "group $k: ${groups[$k]}" && cat "$split/$k.log"
    tail -n +$(( have + 1 )) "$split/$k/$(basename "$out")/records.jsonl" >> "$out/records.jsonl"
  done
  cp "$split/0/$(basename "$out")/run.json" "$out/"
fi
mkdir -p "$kept" && cp -r "$out/." "$kept/"
tar czf "$OUT/$(basename "$out").tgz" "$out"
