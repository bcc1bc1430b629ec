// Test-only: run the kernel core over float32 rows with `threads` CPU threads per
// row (tests/test_threaded_core.py builds this with the system compiler and calls
// it through ctypes). Buffers and the CamParams words are laid out by the GPU
// backends' own host code (camkv.backends.jit), which this checks too.

#include <thread>
#include <vector>

#include "camkv_prelude_threads.h"
#include "camkv_core.h"

extern "C" int camkv_threaded_run(int threads, const CamParams* p, const float* in_keys, const float* in_values,
                                  const float* in_scores, const int* in_positions, const float* new_keys,
                                  const float* new_values, const float* queries, const float* chunk_mass,
                                  const camkv_u32* row_ids, const float* in_votes, const float* in_threshold,
                                  float* out_keys, float* out_values, float* out_scores, int* out_positions,
                                  int* merges, float* f32, int* i32, float* store, float* out_votes,
                                  float* out_threshold) {
  for (int row = 0; row < p->rows; ++row) {
    std::barrier<> sync(threads);
    std::vector<float> red_f(threads);
    std::vector<int> red_i(threads);
    std::vector<std::thread> group;
    for (int t = 0; t < threads; ++t) {
      group.emplace_back([&, t]() {
        CamGroup g{(unsigned)t, (unsigned)threads, &sync, red_f.data(), red_i.data()};
        CamRowBuffers<float> b = camkv_row_buffers<float>(
            row, p, in_keys, in_values, in_scores, in_positions, new_keys, new_values, queries, chunk_mass,
            out_keys, out_values, out_scores, out_positions, f32, i32, store, in_votes, in_threshold, out_votes,
            out_threshold);
        int merged = camkv_update_row<float>(b, p, row_ids[row], g);
        if (t == 0) merges[row] = merged;
      });
    }
    for (auto& thread : group) thread.join();
  }
  return 0;
}
