// A minimal stand-in for the CUDA device dialect, only enough for g++ -fsyntax-only
// to parse cuda/camkv_prelude.cuh + csrc/camkv_core.h on machines without nvcc.
// Declarations only; never linked or run.
#pragma once

#include <cmath>

#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__
#define __align__(n) alignas(n)

struct dim3_stub {
  unsigned x, y, z;
};
extern dim3_stub threadIdx, blockIdx, blockDim;
typedef int int32_t;
typedef unsigned int uint32_t;

void __syncthreads();
float __shfl_xor_sync(unsigned mask, float value, int lane_mask);
int __shfl_xor_sync(unsigned mask, int value, int lane_mask);
float __int_as_float(int bits);
float expf(float);
float logf(float);
float __fmul_rn(float, float);
float __fadd_rn(float, float);
float sqrtf(float);
float fmaxf(float, float);
int min(int, int);
