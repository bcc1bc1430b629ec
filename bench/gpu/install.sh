# Finish the MLX CUDA install (part b) on the warm machine.
set -e
cp .gpu-wheels/b/* /root/stage/
cd /root/stage && cat part_aa part_ab > "$(cat NAME)" && sha256sum -c SHA256SUMS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site mlx-*.whl mlx_lm-*.whl "$(cat NAME)"
cd - >/dev/null
