# The device's folders live under /root (DEVICE_ROOT elsewhere: tests run the scripts in a temporary one).
device_root=${DEVICE_ROOT:-/root}
export PYTHONPATH=/tmp/site:$PWD/python CAMKV_TEST_OFFLINE=1 CAMKV_CACHE_DIR=$device_root/ckv MLX_CUDA_GRAPH_CACHE_SIZE=20000 PYTHONUNBUFFERED=1
