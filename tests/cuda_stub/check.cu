// Instantiates the kernel core under the CUDA prelude for every storage dtype the
// CUDA backend uses, so g++ -fsyntax-only checks the CUDA path (see
// tests/test_ext_metal_syntax.py). The real entry point is generated at run time.
#include "cuda_stub.h"
#include "camkv_prelude.cuh"
#include "camkv_core.h"

struct half_stub {
  half_stub() = default;
  half_stub(float);
  operator float() const;
};

template <typename T>
__global__ void camkv_update_check(CamRowBuffers<T> b, const CamParams* p, camkv_u32 row_id, CamGroup g, int* out) {
  *out = camkv_update_row<T>(b, p, row_id, g);
}

template void camkv_update_check<float>(CamRowBuffers<float>, const CamParams*, camkv_u32, CamGroup, int*);
template void camkv_update_check<half_stub>(CamRowBuffers<half_stub>, const CamParams*, camkv_u32, CamGroup, int*);
