// Metal entry points of the camkv kernel: one threadgroup per row (B * H rows),
// its threads cooperating over the stored rows. Built into camkv.metallib by
// CMake on macOS; the same prelude + core serve mx.fast.metal_kernel.

#include "camkv_prelude.h"
#include "camkv_core.h"

template <typename T>
[[kernel]] void camkv_update(
    const device T* in_keys [[buffer(0)]],
    const device T* in_values [[buffer(1)]],
    const device float* in_scores [[buffer(2)]],
    const device int* in_positions [[buffer(3)]],
    const device T* new_keys [[buffer(4)]],
    const device T* new_values [[buffer(5)]],
    const device float* queries [[buffer(6)]],
    const device uint* row_ids [[buffer(7)]],
    device T* out_keys [[buffer(8)]],
    device T* out_values [[buffer(9)]],
    device float* out_scores [[buffer(10)]],
    device int* out_positions [[buffer(11)]],
    device int* merges [[buffer(12)]],
    device float* f32 [[buffer(13)]],
    device int* i32 [[buffer(14)]],
    device T* store [[buffer(15)]],
    constant CamParams& params [[buffer(16)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint size [[threads_per_threadgroup]]) {
  threadgroup float red_f[CAMKV_SIMD_WIDTH];
  threadgroup int red_i[CAMKV_SIMD_WIDTH];
  CamGroup g;
  g.tid = tid;
  g.size = size;
  g.red_f = red_f;
  g.red_i = red_i;
  CamRowBuffers<T> b = camkv_row_buffers<T>(
      (int)row, &params, in_keys, in_values, in_scores, in_positions, new_keys, new_values, queries,
      queries /* chunk_mass: the extension never prescores */, out_keys, out_values, out_scores, out_positions, f32, i32, store);
  int merged = camkv_update_row<T>(b, &params, row_ids[row], g);
  if (tid == 0) {
    merges[row] = merged;
  }
}

#define CAMKV_INSTANTIATE(name, T) \
  template [[host_name("camkv_update_" #name)]] [[kernel]] decltype(camkv_update<T>) camkv_update<T>;

CAMKV_INSTANTIATE(float32, float)
CAMKV_INSTANTIATE(float16, half)
CAMKV_INSTANTIATE(bfloat16, bfloat)
