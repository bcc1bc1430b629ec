# The device's folders live under /root (DEVICE_ROOT elsewhere: tests run the scripts in a temporary one).
device_root=${DEVICE_ROOT:-/root}
device_site=${DEVICE_SITE:-/tmp/site}  # the wheels' install folder (install.sh's --target)
export PYTHONPATH=$device_site:$PWD/python CAMKV_TEST_OFFLINE=1 CAMKV_CACHE_DIR=$device_root/ckv MLX_CUDA_GRAPH_CACHE_SIZE=20000 PYTHONUNBUFFERED=1
