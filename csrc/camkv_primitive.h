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
  CamUpdate(mx::Stream stream, UpdateOptions options, int offset, float scale, bool key_scoring, bool prescored)
      : mx::Primitive(stream), options_(options), offset_(offset), scale_(scale), key_scoring_(key_scoring),
        prescored_(prescored) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CamUpdate"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  UpdateOptions options_;
  int offset_;
  float scale_;
  bool key_scoring_;
  bool prescored_;  // a chunk's mass comes as an input (chunk_mass), not scored by the kernel
};

// Softmax weights of each query row of logits, summed down each column (section 2's
// mass of a chunk from its logits): CPU only.
class CamColumnMass : public mx::Primitive {
 public:
  CamColumnMass(mx::Stream stream, float scale, int n_before, int s_len, float weight)
      : mx::Primitive(stream), scale_(scale), n_before_(n_before), s_len_(s_len), weight_(weight) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CamColumnMass"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int n_before_;
  int s_len_;
  float weight_;
};

// Outputs: keys, values, scores, positions, merges [R] int32 (then the scratch
// buffers the kernel used, which callers drop).
std::vector<mx::array> update(
    const mx::array& keys, const mx::array& values, const mx::array& scores, const mx::array& positions,
    const mx::array& new_keys, const mx::array& new_values, const mx::array& row_ids,
    const std::optional<mx::array>& queries, int offset, float scale, const UpdateOptions& options,
    const std::optional<mx::array>& chunk_mass = std::nullopt, mx::StreamOrDevice s = {});

// logits [R, M, N] float32, M = G x S query rows (row m is chunk token m mod S, which
// sees columns j <= n_before + m mod S): weight x the sum over m of each row's softmax
// of scale x logits, [R, width] float32 (width >= N; columns past N are 0). A NaN or
// infinite logit counts as masked; a row with nothing visible adds nothing.
mx::array column_mass(const mx::array& logits, float scale, int n_before, int s_len, int width, float weight,
                      mx::StreamOrDevice s = {});

}  // namespace camkv
