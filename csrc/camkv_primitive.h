// camkv._ext: the fused per-layer update as an MLX custom Primitive.

#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace camkv {

namespace mx = mlx::core;

// The knobs of CaMConfig the kernel reads (merge is a rule's code in camkv_merges.h).
struct UpdateOptions {
  int budget;
  int n_sink;
  int recent;
  int window;
  int merge;
  bool merge_keys;
  bool gate;
  bool chunk;
  uint32_t seed;
  bool recency = false;        // eviction "recency": the oldest candidate goes first
  int observation_window = 0;  // a chunk's last queries that score it; 0: every query
  int pool = 1;                // max-pooling width of a chunk's mass (odd; 1: none)
};

class CamUpdate : public mx::Primitive {
 public:
  CamUpdate(mx::Stream stream, UpdateOptions options, int offset, float scale, bool key_scoring)
      : mx::Primitive(stream), options_(options), offset_(offset), scale_(scale), key_scoring_(key_scoring) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CamUpdate"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  UpdateOptions options_;
  int offset_;
  float scale_;
  bool key_scoring_;
};

// Outputs: keys, values, scores, positions, merges [R] int32 (then the scratch
// buffers the kernel used, which callers drop).
std::vector<mx::array> update(
    const mx::array& keys, const mx::array& values, const mx::array& scores, const mx::array& positions,
    const mx::array& new_keys, const mx::array& new_values, const mx::array& row_ids,
    const std::optional<mx::array>& queries, int offset, float scale, const UpdateOptions& options,
    mx::StreamOrDevice s = {});

}  // namespace camkv
