# Finish the MLX CUDA install on the warm machine, in the call carrying the wheel's last
# part (.gpu-wheels/b, or .gpu-wheels/c where the wheel travels in three parts).
set -e
for part in b c; do
  if [ -d .gpu-wheels/$part ]; then cp .gpu-wheels/$part/* /root/stage/; fi
done
cd /root/stage && cat part_a? > "$(cat NAME)" && sha256sum -c SHA256SUMS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site mlx-*.whl mlx_lm-*.whl "$(cat NAME)"
cd - >/dev/null
