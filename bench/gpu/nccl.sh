#!/usr/bin/env bash
# NCCL for MLX's CUDA build on a GPU host without registry access.
#
# libmlx.so of mlx-cuda-13 needs libnccl.so.2 to load at all, and looks for it first in
# <site>/nvidia/nccl/lib (its RPATH $ORIGIN/../../nvidia/nccl/lib, <site>/mlx beside it),
# then where the system keeps libraries. So a host where `import mlx.core` works has an
# NCCL already; `which` says which one and its version. To run a known one, carry
# nvidia-nccl-cu13 (the wheel mlx-cuda-13 depends on, 305,100,071 bytes, so in 50 MiB
# parts, one device call each, like bench/gpu/stage-models.sh):
#
#   bash bench/gpu/nccl.sh stage      here (registry access): download the wheel, check it
#                                     against the sha256 below, split it into the git-ignored
#                                     folders .gpu-nccl/n1 .. n6
#   bash bench/gpu/nccl.sh receive    there, once per call carrying one .gpu-nccl/nK, in order:
#                                     copy its part to /root/nccl-parts
#   bash bench/gpu/nccl.sh install    there, after the last part: join the parts, check the
#                                     wheel's sha256, unpack libnccl.so.2 into
#                                     <site>/nvidia/nccl/lib (site: where python3 finds mlx)
#   bash bench/gpu/nccl.sh which      the libnccl that `import mlx.core` loads, and its version
set -euo pipefail
VERSION=2.32.3
WHEEL=nvidia_nccl_cu13-$VERSION-py3-none-manylinux_2_27_x86_64.whl
SHA256=1459723080ac889d73a26edfa3e04383a7928ab31ac8f0ec43b3ea9548b04ff3
PARTS=${NCCL_PARTS:-/root/nccl-parts}  # where the parts gather on the GPU host
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)

case "${1:-}" in
  stage)
    root=$(git rev-parse --show-toplevel)
    cd "$root"
    grep -qx '/.gpu-nccl/' .git/info/exclude 2>/dev/null || echo '/.gpu-nccl/' >> .git/info/exclude
    rm -rf .gpu-nccl && mkdir -p .gpu-nccl/dl
    # Only the manylinux_2_27 wheel exists for x86_64; pip matches --platform tags exactly.
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 -d .gpu-nccl/dl "nvidia-nccl-cu13==$VERSION"
    (cd .gpu-nccl/dl && echo "$SHA256  $WHEEL" | sha256sum -c --quiet)
    split -b 50M -d -a 2 ".gpu-nccl/dl/$WHEEL" .gpu-nccl/part_
    rm -rf .gpu-nccl/dl
    n=0
    for part in .gpu-nccl/part_*; do
      n=$((n + 1))
      mkdir -p ".gpu-nccl/n$n" && mv "$part" ".gpu-nccl/n$n/"
    done
    echo "staged $WHEEL in $n folders .gpu-nccl/n1 .. n$n (carry one per call, in order)";;
  receive)
    mkdir -p "$PARTS" && cp .gpu-nccl/n*/part_* "$PARTS/"
    echo "have $(ls "$PARTS" | wc -l) parts in $PARTS";;
  install)
    cat "$PARTS"/part_* > "$PARTS/$WHEEL"
    (cd "$PARTS" && echo "$SHA256  $WHEEL" | sha256sum -c --quiet) \
      || { echo "nccl.sh: $PARTS/$WHEEL does not have the sha256 $SHA256 (a part missing or out of order?)" >&2; exit 1; }
    site=$("$python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("mlx").submodule_search_locations[0]))')
    "$python" - "$PARTS/$WHEEL" "$site" <<'EOF'
import sys, zipfile
from pathlib import Path
wheel, site = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    archive.extract("nvidia/nccl/lib/libnccl.so.2", site)
print(f"installed {site / 'nvidia/nccl/lib/libnccl.so.2'}")
EOF
    rm -f "$PARTS"/part_* "$PARTS/$WHEEL";;
  which)
    "$python" -c 'import sys; sys.path.insert(0, sys.argv[1]); import sharded; print(sharded.nccl_library() or "no libnccl loaded")' "$here";;
  *)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2;;
esac
