// nanobind bindings of camkv._ext. Built against the nanobind ABI of the
// installed mlx (pinned in pyproject.toml) and in MLX's nanobind domain, so
// mx.array objects pass straight through.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "camkv_primitive.h"
#include "camkv_prelude_cpu.h"
#include "camkv_core.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

// The outputs of camkv::update the caller keeps: the state, the merges, then the rule's
// state (None for a rule that keeps none).
using UpdateResult = std::tuple<mx::array, mx::array, mx::array, mx::array, mx::array, std::optional<mx::array>,
                                std::optional<mx::array>>;

UpdateResult update_py(
    const mx::array& keys, const mx::array& values, const mx::array& scores, const mx::array& positions,
    const mx::array& new_keys, const mx::array& new_values, const mx::array& row_ids,
    const std::optional<mx::array>& queries, const nb::bytes& params, const std::optional<mx::array>& chunk_mass,
    const std::optional<mx::array>& votes, const std::optional<mx::array>& threshold, mx::StreamOrDevice stream) {
  std::vector<mx::array> out = camkv::update(keys, values, scores, positions, new_keys, new_values, row_ids,
                                             queries, std::string(params.c_str(), params.size()), chunk_mass,
                                             votes, threshold, stream);
  std::optional<mx::array> out_votes, out_threshold;
  if (votes.has_value()) {
    out_votes = out[8];
  }
  if (threshold.has_value()) {
    out_threshold = out[9];
  }
  return {out[0], out[1], out[2], out[3], out[4], out_votes, out_threshold};
}

nb::list merge_rules() {
  const char* kinds[] = {"drop", "nearest", "window"};  // CAMKV_KIND_* order
  nb::list rules;
#define CAMKV_RULE_TUPLE(name, code, kind, blends, keys, target_share, loser_share) \
  rules.append(nb::make_tuple(#name, code, kinds[CAMKV_KIND_##kind], blends != 0, keys != 0,          \
                              camkv_keeps_votes(code) != 0, camkv_moves_threshold(code) != 0));
  CAMKV_MERGE_RULES(CAMKV_RULE_TUPLE)
#undef CAMKV_RULE_TUPLE
  return rules;
}

nb::list params_layout() {
  nb::list fields;
#define CAMKV_PARAM_LAYOUT(type, name) \
  fields.append(nb::make_tuple(#name, offsetof(CamParams, name), sizeof(CamParams::name)));
  CAMKV_PARAM_FIELDS(CAMKV_PARAM_LAYOUT)
#undef CAMKV_PARAM_LAYOUT
  return fields;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "camkv fused CaM cache update: one MLX primitive per layer per call";
  // The mlx version this binary was compiled against; it only works with that one.
  m.attr("MLX_VERSION") = CAMKV_MLX_VERSION;
  m.attr("MAX_HEAD_DIM") = CAMKV_MAX_HEAD_DIM;
  m.def("scratch_strides", [](bool chunk, int n, int S, int n_out, int Dk, int Dv) {
        return nb::make_tuple(camkv_f32_stride(chunk, n, S, n_out, Dk), camkv_i32_stride(chunk, n, S, n_out),
                              camkv_store_stride(chunk, n, S, n_out, Dk, Dv));
      }, "chunk"_a, "n"_a, "S"_a, "n_out"_a, "Dk"_a, "Dv"_a,
        "Per-row scratch sizes (floats, ints, storage elements) the kernel core needs for a call.");
  m.def("merge_rules", &merge_rules,
        "The kernel's merge rules in code order: (name, code, kind, blends, keys_allowed, keeps_votes, "
        "moving_threshold) each, kind 'drop', 'nearest' or 'window' (csrc/camkv_merges.h).");
  m.def("merge_shares", [](int merge, float cosine, float s_in, float s_target, float norm_in, float norm_target) {
        return nb::make_tuple(camkv_target_share(merge, s_target),
                              camkv_loser_share(merge, cosine, s_in, s_target, norm_in, norm_target));
      }, "merge"_a, "cosine"_a, "s_in"_a, "s_target"_a, "norm_in"_a, "norm_target"_a,
        "Rule `merge`'s shares (A_t, a_e) as the kernel computes them, float32 (csrc/camkv_merges.h).");
  m.def("params_layout", &params_layout,
        "struct CamParams field by field: (name, byte offset, byte size), in declaration order.");
  m.attr("PARAMS_SIZE") = sizeof(CamParams);
  m.def("update", &update_py, "keys"_a, "values"_a, "scores"_a, "positions"_a, "new_keys"_a, "new_values"_a,
        "row_ids"_a, "queries"_a = nb::none(), nb::kw_only(), "params"_a, "chunk_mass"_a = nb::none(),
        "votes"_a = nb::none(), "threshold"_a = nb::none(), "stream"_a = nb::none(),
        R"(Absorb S new tokens per row: score, evict, merge and compact in one launch.

Returns (keys, values, scores, positions, merges, votes, threshold). votes [R, n] and
threshold [R] float32: the state of a rule that keeps it (keepkv's votes, d2o's moving
threshold, NaN before a row's first compression), required for that rule and None for
the others; the returned ones are the state after the call (None where not given).
params: struct CamParams as bytes, PARAMS_SIZE of them (camkv.backends.params.pack_words,
the block the GPU kernels take as int32 words); its shape, scoring and stride fields must
agree with the arrays, and in_place is set when the call runs. chunk_mass: a chunk call's
mass [R, n + S] float32, already pooled and divided by G (column_mass), instead of the
kernel's own scoring (CPU). Raises ValueError naming any argument with a bad shape, dtype
or size, or a field the arrays contradict.)");
  m.def("column_mass", &camkv::column_mass, "logits"_a, nb::kw_only(), "scale"_a, "n_before"_a, "s_len"_a,
        "width"_a, "weight"_a, "stream"_a = nb::none(),
        R"(Softmax weights of each query row of logits [R, M, N] float32 (row m is chunk token
m mod s_len, which sees columns j <= n_before + m mod s_len), summed down each column and
times weight: [R, width] float32, columns past N zero. A NaN or infinite logit counts as
masked; a row with nothing visible adds nothing. CPU only.)");
  m.def("quantized_attention", &camkv::quantized_attention, "queries"_a, "key_codes"_a, "key_scales"_a,
        "key_biases"_a, "value_codes"_a, "value_scales"_a, "value_biases"_a, nb::kw_only(), "mask"_a = nb::none(),
        "scale"_a, "bits"_a, "group_size"_a, "stream"_a = nb::none(),
        R"(softmax(scale * queries @ keys^T + mask) @ values over rows stored as mx.quantize's triples,
read as stored: queries [B, Hq, L, D] (float32, float16 or bfloat16); key and value codes
uint32 [B, H, N, D * bits / 32], their scales and biases [B, H, N, D / group_size] in the
queries' dtype; Hq a multiple of H (query head h * Hq / H + g reads KV head h); mask None
or an additive float32 [B, 1 or H, L, N]. Sums in float32; returns [B, Hq, L, Dv] in the
queries' dtype. bits 4 or 8, group_size 32, 64 or 128. CPU only. Raises ValueError naming
any argument with a bad shape, dtype or value.)");
}
