// camkv._ext: the fused per-layer update as an MLX custom Primitive.

#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace camkv {

namespace mx = mlx::core;

// The kernel core's struct CamParams travels as its int32 words (camkv_core.h is
// compiled under a prelude, so this header does not include it): packed once by
// camkv.backends.params, checked against the arrays by update(), copied into the
// struct when the call runs.
class CamUpdate : public mx::Primitive {
 public:
  CamUpdate(mx::Stream stream, std::vector<int32_t> words) : mx::Primitive(stream), words_(std::move(words)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CamUpdate"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<int32_t> words_;  // in_place 0: set when the call runs
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

// params: struct CamParams's bytes (sizeof(CamParams)); its shape, scoring and stride
// fields must agree with the arrays. votes [R, n] and threshold [R] (float32): the state
// of a rule that keeps it (camkv_merges.h), required for that rule and refused for the
// others. Outputs: keys, values, scores, positions, merges [R] int32, then the scratch
// buffers the kernel used (which callers drop), then votes [R, n_out] and threshold [R]
// (empty for a rule that keeps none).
std::vector<mx::array> update(
    const mx::array& keys, const mx::array& values, const mx::array& scores, const mx::array& positions,
    const mx::array& new_keys, const mx::array& new_values, const mx::array& row_ids,
    const std::optional<mx::array>& queries, const std::string& params,
    const std::optional<mx::array>& chunk_mass = std::nullopt, const std::optional<mx::array>& votes = std::nullopt,
    const std::optional<mx::array>& threshold = std::nullopt, mx::StreamOrDevice s = {});

// logits [R, M, N] float32, M = G x S query rows (row m is chunk token m mod S, which
// sees columns j <= n_before + m mod S): weight x the sum over m of each row's softmax
// of scale x logits, [R, width] float32 (width >= N; columns past N are 0). A NaN or
// infinite logit counts as masked; a row with nothing visible adds nothing.
mx::array column_mass(const mx::array& logits, float scale, int n_before, int s_len, int width, float weight,
                      mx::StreamOrDevice s = {});

// Attention of queries over quantized rows read as stored (docs/algorithm.md section
// 12): queries [B, Hq, L, D]; keys and values as mx.quantize's triples (codes uint32
// [B, H, N, D * bits / 32], scales and biases [B, H, N, D / group_size] in the queries'
// dtype), Hq a multiple of H (query head h * Hq / H + g reads KV head h); mask None or an
// additive float32 [B, 1 or H, L, N]. softmax(scale q k^T + mask) v per query, in
// float32, the output [B, Hq, L, Dv] in the queries' dtype. CPU only; bits 4 or 8.
class CamQuantizedAttention : public mx::Primitive {
 public:
  CamQuantizedAttention(mx::Stream stream, float scale, int bits, int group_size)
      : mx::Primitive(stream), scale_(scale), bits_(bits), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CamQuantizedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int bits_;
  int group_size_;
};

mx::array quantized_attention(const mx::array& queries, const mx::array& key_codes, const mx::array& key_scales,
                              const mx::array& key_biases, const mx::array& value_codes,
                              const mx::array& value_scales, const mx::array& value_biases,
                              const std::optional<mx::array>& mask, float scale, int bits, int group_size,
                              mx::StreamOrDevice s = {});

}  // namespace camkv
