// camkv._ext: the MLX Primitive around the portable kernel core. eval_cpu runs
// the core under the CPU prelude, rows in parallel; GPUs run the same core compiled
// at run time (camkv.backends.jit), so eval_gpu only refuses.

#include "camkv_primitive.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#include "camkv_cpu_support.h"
#include "camkv_prelude_cpu.h"

// float16 -> float32 through a table: MLX's portable float16 converts with
// branches and bit tricks, which would dominate the kernel's dot products on CPUs
// without native half support. Exact: every entry is MLX's own conversion.
// (With native half arithmetic, as on Apple silicon, the cast is already cheap.)
#ifndef __ARM_FEATURE_FP16_SCALAR_ARITHMETIC
namespace camkv_cpu {
struct HalfTable {
  float value[65536];
  HalfTable() {
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      uint16_t b = (uint16_t)bits;
      mlx::core::float16_t h;
      std::memcpy(&h, &b, sizeof(b));
      value[bits] = static_cast<float>(h);
    }
  }
};
const HalfTable half_table;
}  // namespace camkv_cpu

inline float camkv_float(mlx::core::float16_t x) {
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return camkv_cpu::half_table.value[bits];
}
#endif

#include "camkv_core.h"

namespace camkv {

// ----------------------------------------------------------------------------
// Input validation: every message names the argument, its bad value and what is allowed.

namespace {


void check_head_dim(const char* name, int dim) {
  if (dim < 1 || dim > CAMKV_MAX_HEAD_DIM) {
    std::ostringstream out;
    out << name << " = " << dim << " is not supported: head dimensions must be in [1, " << CAMKV_MAX_HEAD_DIM << "]";
    bad(out.str());
  }
}

// The parameter block from its bytes, refused unless it is a whole CamParams.
CamParams read_params(const std::string& bytes) {
  if (bytes.size() != sizeof(CamParams)) {
    std::ostringstream out;
    out << "params must be struct CamParams's " << sizeof(CamParams) / 4 << " int32 words (" << sizeof(CamParams)
        << " bytes, camkv.backends.params.pack_words), got " << bytes.size() << " bytes";
    bad(out.str());
  }
  CamParams p;
  std::memcpy(&p, bytes.data(), sizeof(CamParams));
  return p;
}

// A rule's state array (votes [R, n], or with n < 0 threshold [R]): float32, given exactly
// when the rule keeps it; a placeholder the kernel never reads otherwise.
mx::array rule_state(const char* name, const std::optional<mx::array>& given, bool kept, int rows, int n, int merge) {
  if (!kept) {
    if (given.has_value()) {
      bad(std::string(name) + " is the state of a rule that keeps it; merge code " + std::to_string(merge) +
          " keeps none (pass None)");
    }
    return mx::array(0.0f);
  }
  if (!given.has_value()) {
    bad(std::string(name) + " is required for merge code " + std::to_string(merge) + " (its rule keeps them)");
  }
  const mx::array& a = *given;
  check_dtype(name, a, mx::float32, "float32");
  if (n < 0) {
    check_ndim(name, a, 1, "[R]");
  } else {
    check_ndim(name, a, 2, "[R, n]");
    check_dim(name, a, 1, n, "tokens");
  }
  check_dim(name, a, 0, rows, "rows");
  // A zero-length state still needs a buffer to point at.
  return a.size() == 0 ? mx::array(0.0f) : a;
}

// A field the arrays determine must say what they say: the core indexes by it.
void check_field(const char* name, int packed, int from_arrays) {
  if (packed != from_arrays) {
    bad(std::string("params.") + name + " = " + std::to_string(packed) + " but the arrays give " +
        std::to_string(from_arrays));
  }
}

}  // namespace

std::vector<mx::array> update(
    const mx::array& keys, const mx::array& values, const mx::array& scores, const mx::array& positions,
    const mx::array& new_keys, const mx::array& new_values, const mx::array& row_ids,
    const std::optional<mx::array>& queries, const std::string& params,
    const std::optional<mx::array>& chunk_mass, const std::optional<mx::array>& votes,
    const std::optional<mx::array>& threshold, mx::StreamOrDevice s) {
  CamParams p = read_params(params);
  check_ndim("keys", keys, 3, "[R, n, Dk]");
  check_ndim("values", values, 3, "[R, n, Dv]");
  check_ndim("scores", scores, 2, "[R, n]");
  check_ndim("positions", positions, 2, "[R, n]");
  check_ndim("new_keys", new_keys, 3, "[R, S, Dk]");
  check_ndim("new_values", new_values, 3, "[R, S, Dv]");
  check_ndim("row_ids", row_ids, 1, "[R]");
  int rows = keys.shape(0), n = keys.shape(1), k_dim = keys.shape(2), v_dim = values.shape(2);
  int s_len = new_keys.shape(1);
  check_float_dtype("keys", keys);
  check_head_dim("Dk", k_dim);
  check_head_dim("Dv", v_dim);
  for (const mx::array* a : {&values, &new_keys, &new_values}) {
    check_dtype(a == &values ? "values" : (a == &new_keys ? "new_keys" : "new_values"), *a, keys.dtype(),
                "equal to the keys' dtype");
  }
  check_dtype("scores", scores, mx::float32, "float32");
  check_dtype("positions", positions, mx::int32, "int32");
  check_dtype("row_ids", row_ids, mx::uint32, "uint32");
  check_dim("values", values, 0, rows, "rows");
  check_dim("values", values, 1, n, "tokens");
  check_dim("scores", scores, 0, rows, "rows");
  check_dim("scores", scores, 1, n, "tokens");
  check_dim("positions", positions, 0, rows, "rows");
  check_dim("positions", positions, 1, n, "tokens");
  check_dim("new_keys", new_keys, 0, rows, "rows");
  check_dim("new_keys", new_keys, 2, k_dim, "key features");
  check_dim("new_values", new_values, 0, rows, "rows");
  check_dim("new_values", new_values, 1, s_len, "tokens");
  check_dim("new_values", new_values, 2, v_dim, "value features");
  check_dim("row_ids", row_ids, 0, rows, "rows");
  if (p.budget < 1 || n > p.budget) {  // the outputs' n_out = min(n + S, budget) rows
    bad("the state holds n=" + std::to_string(n) + " tokens; need 1 <= n <= budget, got budget=" +
        std::to_string(p.budget));
  }

  bool key_scoring = !queries.has_value();
  int groups = 1;
  mx::array query_block = mx::array(0.0f);  // a placeholder the kernel never reads
  if (!key_scoring) {
    const mx::array& q = *queries;
    check_ndim("queries", q, 4, "[R, S, G, Dk]");
    check_dtype("queries", q, mx::float32, "float32");
    check_dim("queries", q, 0, rows, "rows");
    check_dim("queries", q, 1, s_len, "tokens");
    check_dim("queries", q, 3, k_dim, "key features");
    groups = q.shape(2);
    if (groups < 1) {
      bad("queries must hold at least one query per token (G >= 1), got shape " + shape_str(q));
    }
    query_block = q;
  }
  bool prescored = chunk_mass.has_value();
  mx::array mass_block = mx::array(0.0f);  // a placeholder the kernel never reads
  if (prescored) {
    if (!camkv_runs_chunk(p.chunk, s_len)) {
      bad("chunk_mass is a chunk call's mass (chunk=1 and S > 1), got chunk=" + std::to_string(p.chunk) +
          " and S=" + std::to_string(s_len));
    }
    const mx::array& m = *chunk_mass;
    check_ndim("chunk_mass", m, 2, "[R, n + S]");
    check_dtype("chunk_mass", m, mx::float32, "float32");
    check_dim("chunk_mass", m, 0, rows, "rows");
    check_dim("chunk_mass", m, 1, n + s_len, "tokens");
    mass_block = m;
  }
  bool keeps_votes = camkv_keeps_votes(p.merge) != 0, moves_threshold = camkv_moves_threshold(p.merge) != 0;
  mx::array votes_block = rule_state("votes", votes, keeps_votes, rows, n, p.merge);
  mx::array threshold_block = rule_state("threshold", threshold, moves_threshold, rows, -1, p.merge);
  int n_out = std::min(n + s_len, p.budget);
  int f32_stride = camkv_f32_stride(p.chunk, n, s_len, n_out, k_dim);
  int i32_stride = camkv_i32_stride(p.chunk, n, s_len, n_out);
  int store_stride = camkv_store_stride(p.chunk, n, s_len, n_out, k_dim, v_dim);
  check_field("rows", p.rows, rows);
  check_field("n", p.n, n);
  check_field("S", p.S, s_len);
  check_field("Dk", p.Dk, k_dim);
  check_field("Dv", p.Dv, v_dim);
  check_field("G", p.G, groups);
  check_field("n_out", p.n_out, n_out);
  check_field("key_scoring", p.key_scoring, key_scoring ? 1 : 0);
  check_field("prescored", p.prescored, prescored ? 1 : 0);
  check_field("f32_stride", p.f32_stride, f32_stride);
  check_field("i32_stride", p.i32_stride, i32_stride);
  check_field("store_stride", p.store_stride, store_stride);
  p.in_place = 0;  // known when the call runs (eval_cpu)
  std::vector<int32_t> words(sizeof(CamParams) / 4);
  std::memcpy(words.data(), &p, sizeof(CamParams));

  auto stream = mx::to_stream(s);
  return mx::array::make_arrays(
      {{rows, n_out, k_dim}, {rows, n_out, v_dim}, {rows, n_out}, {rows, n_out}, {rows},
       {rows, f32_stride}, {rows, i32_stride}, {rows, store_stride}, {rows, keeps_votes ? n_out : 0},
       {moves_threshold ? rows : 0}},
      {keys.dtype(), keys.dtype(), mx::float32, mx::int32, mx::int32, mx::float32, mx::int32, keys.dtype(),
       mx::float32, mx::float32},
      std::make_shared<CamUpdate>(stream, std::move(words)),
      {keys, values, scores, positions, new_keys, new_values, query_block, row_ids, mass_block, votes_block,
       threshold_block});
}

bool CamUpdate::is_equivalent(const mx::Primitive& other) const {
  return words_ == static_cast<const CamUpdate&>(other).words_;
}

// ----------------------------------------------------------------------------
// Shared by eval_cpu and eval_gpu

namespace {

// CHUNK_MASS last: the Metal entry points take the inputs before it (eval_gpu refuses
// a prescored call).
enum Input {
  IN_KEYS, IN_VALUES, IN_SCORES, IN_POSITIONS, NEW_KEYS, NEW_VALUES, QUERIES, ROW_IDS, CHUNK_MASS, IN_VOTES,
  IN_THRESHOLD
};
enum Output {
  OUT_KEYS, OUT_VALUES, OUT_SCORES, OUT_POSITIONS, MERGES, SCRATCH_F32, SCRATCH_I32, SCRATCH_STORE, OUT_VOTES,
  OUT_THRESHOLD
};

// Every output of a multi-output primitive holds its own copy of the input list,
// so while the siblings keep theirs no input is ever is_donatable(). MLX drops
// these lists right after evaluation anyway (array::detach); dropping the
// siblings' copies a moment earlier lets an unshared stored state be donated.
// `inputs` is the evaluated output's own list, which MLX still reads, so it stays.
// Tracers (inside transforms) keep everything, as MLX itself does.
void release_sibling_inputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (const auto& out : outputs) {
    if (out.is_tracer()) {
      return;
    }
  }
  for (auto& out : outputs) {
    if (&out.inputs() != &inputs) {
      out.inputs().clear();
    }
  }
}

// The exact path can work inside the stored buffers when the row count does not
// change and nothing else holds them: a full decode step then reads the stored
// keys and writes little, instead of copying the whole state.
bool can_update_in_place(const std::vector<mx::array>& inputs, const CamParams& p) {
  if (camkv_runs_chunk(p.chunk, p.S) || p.n_out != p.n || p.n == 0) {
    return false;
  }
  for (int i = IN_KEYS; i <= IN_VOTES; ++i) {
    const mx::array& in = inputs[i];
    if (i > IN_POSITIONS && (i != IN_VOTES || !camkv_keeps_votes(p.merge))) {
      continue;  // the new tokens, and a rule's votes where it keeps none, are not the state
    }
    if (!in.is_donatable() || !in.flags().row_contiguous || in.data_size() != in.size()) {
      return false;
    }
  }
  return true;
}

// The inputs an in-place update works inside (votes: only a rule's that keeps them).
bool shares_input(int output, const CamParams& p) {
  return output <= OUT_POSITIONS || (output == OUT_VOTES && camkv_keeps_votes(p.merge));
}

void allocate_outputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, const CamParams& p) {
  for (int i = 0; i < (int)outputs.size(); ++i) {
    if (p.in_place && shares_input(i, p)) {
      outputs[i].copy_shared_buffer(inputs[i == OUT_VOTES ? IN_VOTES : i]);
    } else {
      outputs[i].set_data(mx::allocator::malloc(std::max<size_t>(outputs[i].nbytes(), 1)));
    }
  }
}

// ----------------------------------------------------------------------------
// CPU execution

// Waking helper threads costs tens of microseconds; only worth it for real work. Each
// of a token's G queries dots every row, so a query-scored call's work grows with G.
int threads_for(const CamParams& p) {
  double work = (double)p.rows * (double)(p.n + p.S) * (double)(p.Dk + p.Dv) * (double)std::max(p.S, 1) *
                (double)std::max(p.G, 1);
  return work < 4.0e6 ? 1 : RowPool::instance().size();
}

template <typename T>
void run_cpu(const CamParams p, const T* in_keys, const T* in_values, const float* in_scores,
             const int* in_positions, const T* new_keys, const T* new_values, const float* queries,
             const uint32_t* row_ids, const float* chunk_mass, T* out_keys, T* out_values, float* out_scores, int* out_positions,
             int* merges, float* f32, int* i32, T* store, const float* in_votes, const float* in_threshold,
             float* out_votes, float* out_threshold) {
  std::function<void(int)> body = [&](int row) {
    CamRowBuffers<T> b = camkv_row_buffers<T>(row, &p, in_keys, in_values, in_scores, in_positions, new_keys,
                                              new_values, queries, chunk_mass, out_keys, out_values, out_scores,
                                              out_positions, f32, i32, store, in_votes, in_threshold, out_votes,
                                              out_threshold);
    merges[row] = camkv_update_row<T>(b, &p, row_ids[row], camkv_single_thread_group());
  };
  RowPool::instance().run(p.rows, threads_for(p), body);
}

template <typename T>
void dispatch_cpu(const CamParams& p, const std::vector<const void*>& in, std::vector<mx::array>& outputs) {
  run_cpu<T>(p, (const T*)in[IN_KEYS], (const T*)in[IN_VALUES], (const float*)in[IN_SCORES],
             (const int*)in[IN_POSITIONS], (const T*)in[NEW_KEYS], (const T*)in[NEW_VALUES],
             (const float*)in[QUERIES], (const uint32_t*)in[ROW_IDS], (const float*)in[CHUNK_MASS],
             outputs[OUT_KEYS].data<T>(),
             outputs[OUT_VALUES].data<T>(), outputs[OUT_SCORES].data<float>(),
             outputs[OUT_POSITIONS].data<int>(), outputs[MERGES].data<int>(),
             outputs[SCRATCH_F32].data<float>(), outputs[SCRATCH_I32].data<int>(),
             outputs[SCRATCH_STORE].data<T>(), (const float*)in[IN_VOTES], (const float*)in[IN_THRESHOLD],
             outputs[OUT_VOTES].data<float>(), outputs[OUT_THRESHOLD].data<float>());
}

}  // namespace

void CamUpdate::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  release_sibling_inputs(inputs, outputs);
  CamParams params;
  std::memcpy(&params, words_.data(), sizeof(CamParams));
  params.in_place = can_update_in_place(inputs, params) ? 1 : 0;
  allocate_outputs(inputs, outputs, params);

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  // The task owns references to every array it touches until it has run.
  encoder.dispatch([inputs, outputs, params]() mutable {
    std::vector<std::vector<char>> copies;
    std::vector<const void*> in(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const mx::array& a = inputs[i];
      bool plain = a.flags().row_contiguous && a.data_size() == a.size();
      if (plain || (params.in_place && (i <= IN_POSITIONS || i == IN_VOTES))) {
        in[i] = a.data<void>();
      } else {
        copies.push_back(contiguous_bytes(a));
        in[i] = copies.back().data();
      }
    }
    mx::Dtype dtype = inputs[IN_KEYS].dtype();
    if (dtype == mx::float32) {
      dispatch_cpu<float>(params, in, outputs);
    } else if (dtype == mx::float16) {
      dispatch_cpu<mx::float16_t>(params, in, outputs);
    } else {
      dispatch_cpu<mx::bfloat16_t>(params, in, outputs);
    }
  });
}

// ----------------------------------------------------------------------------
// A chunk's mass from its logits (CPU): the product that makes the logits is a BLAS
// call away in MLX; the softmax and the column sums are one pass here, where MLX's
// masked softmax took several passes of slow element-wise exponentials.

mx::array column_mass(const mx::array& logits, float scale, int n_before, int s_len, int width, float weight,
                      mx::StreamOrDevice s) {
  check_ndim("logits", logits, 3, "[R, M, N]");
  check_dtype("logits", logits, mx::float32, "float32");
  if (s_len < 1 || logits.shape(1) % s_len != 0) {
    bad("s_len must be >= 1 and divide the logits' M = " + std::to_string(logits.shape(1)) + " query rows, got " +
        std::to_string(s_len));
  }
  if (n_before < 0 || width < logits.shape(2)) {
    bad("need n_before >= 0 and width >= the logits' N = " + std::to_string(logits.shape(2)) + ", got n_before=" +
        std::to_string(n_before) + ", width=" + std::to_string(width));
  }
  return mx::array({logits.shape(0), width}, mx::float32,
                   std::make_shared<CamColumnMass>(mx::to_stream(s), scale, n_before, s_len, weight), {logits});
}

bool CamColumnMass::is_equivalent(const mx::Primitive& other) const {
  const CamColumnMass& o = static_cast<const CamColumnMass&>(other);
  return scale_ == o.scale_ && n_before_ == o.n_before_ && s_len_ == o.s_len_ && weight_ == o.weight_;
}

namespace {

// Row r of the mass: each query row's softmax over the columns it sees, added in.
void column_mass_row(const float* logits, int M, int N, float scale, int n_before, int s_len, float weight,
                     float* column, int width, std::vector<float>& weights) {
  std::fill(column, column + width, 0.0f);
  for (int m = 0; m < M; ++m) {
    const float* row = logits + (size_t)m * N;
    int visible = std::min(N, n_before + m % s_len + 1);
    float top = -CAMKV_INF;
    for (int j = 0; j < visible; ++j) {
      float x = row[j] * scale;
      weights[j] = x - x == 0.0f ? x : -CAMKV_INF;  // a NaN or infinite logit counts as masked
      top = weights[j] > top ? weights[j] : top;
    }
    if (top == -CAMKV_INF) {
      continue;  // nothing visible: the query adds nothing
    }
    float total = 0.0f;
    for (int j = 0; j < visible; ++j) {
      weights[j] = std::exp(weights[j] - top);
      total += weights[j];
    }
    float share = weight / total;
    for (int j = 0; j < visible; ++j) {
      column[j] += weights[j] * share;
    }
  }
}

}  // namespace

void CamColumnMass::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(std::max<size_t>(out.nbytes(), 1)));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  float scale = scale_, weight = weight_;
  int n_before = n_before_, s_len = s_len_;
  encoder.dispatch([logits = inputs[0], out, scale, weight, n_before, s_len]() mutable {
    std::vector<char> copy;
    const float* base = logits.data<float>();
    if (!logits.flags().row_contiguous || logits.data_size() != logits.size()) {
      copy = contiguous_bytes(logits);
      base = (const float*)copy.data();
    }
    int rows = logits.shape(0), M = logits.shape(1), N = logits.shape(2), width = out.shape(1);
    float* mass = out.data<float>();
    std::function<void(int)> body = [&](int r) {
      std::vector<float> weights(N);
      column_mass_row(base + (size_t)r * M * N, M, N, scale, n_before, s_len, weight, mass + (size_t)r * width,
                      width, weights);
    };
    double work = (double)rows * M * N;  // an exponential each
    RowPool::instance().run(rows, work < 2.0e5 ? 1 : RowPool::instance().size(), body);
  });
}

void CamColumnMass::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("camkv._ext.column_mass runs on the CPU only (stream=mx.cpu)");
}

// ----------------------------------------------------------------------------
// GPU execution: none. On a GPU camkv runs the same core compiled at run time by
// mx.fast.metal_kernel / cuda_kernel (camkv.backends.jit); the extension is the CPU's.

void CamUpdate::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "camkv._ext runs on the CPU only (stream=mx.cpu); on a GPU use backend 'auto', 'metal' or 'cuda'");
}

}  // namespace camkv
