// camkv._ext: attention over quantized rows read as stored, on the CPU (docs/algorithm.md
// section 12). MLX's CPU quantized matrix product runs a decode step's two small
// products (each query against every row's codes, the weights against the values' codes)
// as general loops, several times slower than attention over unquantized rows; the rows
// are bounded, so one pass that reads each row's codes once for the query heads sharing
// its KV head does the step's work in a fraction of that.

#include <cmath>
#include <cstdint>
#include <limits>

#include "camkv_cpu_support.h"
#include "camkv_primitive.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "camkv reads MLX's packed codes byte by byte, which assumes a little-endian CPU"
#endif

namespace camkv {

namespace {

// A 4-D input read in place through its strides (MLX's, in elements), or through a
// row-major copy when its last axis is not contiguous (then one row is one run).
template <typename T>
class Strided {
 public:
  explicit Strided(const mx::array& a) {
    bool rows_contiguous = a.strides()[3] == 1 || a.shape(3) == 1;
    if (rows_contiguous) {
      data_ = a.data<T>();
      for (int i = 0; i < 4; ++i) stride_[i] = a.strides()[i];
      return;
    }
    copy_ = contiguous_bytes(a);
    data_ = (const T*)copy_.data();
    stride_[3] = 1;
    for (int i = 2; i >= 0; --i) stride_[i] = stride_[i + 1] * a.shape(i + 1);
  }

  const T* row(int i0, int i1, int i2) const { return data_ + i0 * stride_[0] + i1 * stride_[1] + i2 * stride_[2]; }
  int64_t last_stride() const { return stride_[3]; }

 private:
  const T* data_;
  int64_t stride_[4];
  std::vector<char> copy_;
};

struct Shape {
  int B, Hq, H, L, N, Dk, Dv, group_size;
  bool mask_per_head;  // mask [B, H, L, N]; else [B, 1, L, N]
  int G() const { return Hq / H; }
};

// Codes of one row as floats: bits 8 is one byte a channel, bits 4 two channels a byte,
// the low nibble first (mx.quantize packs channel i at bit i * bits of its word).
template <int BITS>
inline void decode_row(const uint32_t* words, int D, float* out) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
  if constexpr (BITS == 8) {
    for (int d = 0; d < D; ++d) out[d] = (float)bytes[d];
  } else {
    for (int i = 0; i < D / 2; ++i) {
      out[2 * i] = (float)(bytes[i] & 15u);
      out[2 * i + 1] = (float)(bytes[i] >> 4);
    }
  }
}

// Eight running sums, so the compiler can keep them in vector registers without
// reassociating one sum (group sizes are multiples of 32).
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int d = 0; d < n; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T>
struct Inputs {
  Strided<T> queries;
  Strided<uint32_t> key_codes;
  Strided<T> key_scales, key_biases;
  Strided<uint32_t> value_codes;
  Strided<T> value_scales, value_biases;
  const float* mask;  // null: none
  int64_t mask_stride[4];
};

// A worker thread's buffers, kept across units and steps: a decode step runs B * H
// units, and allocating seven vectors for each cost more than small units compute.
struct Scratch {
  std::vector<float> q, q_sums, weights, row, acc, bias_acc, totals;

  void fit(const Shape& s) {
    int G = s.G();
    q.resize((size_t)G * s.Dk);
    q_sums.resize((size_t)G * (s.Dk / s.group_size));
    weights.resize((size_t)G * s.N);
    row.resize(std::max(s.Dk, s.Dv));
    acc.resize((size_t)G * s.Dv);
    bias_acc.resize((size_t)G * (s.Dv / s.group_size));
    totals.resize(G);
  }
};

// One work unit: query position l of batch b for the G query heads of KV head h.
template <typename T, int BITS>
class Unit {
 public:
  Unit(const Inputs<T>& in, const Shape& s, float scale, Scratch& scratch)
      : in_(in), s_(s), scale_(scale), q_(scratch.q), q_sums_(scratch.q_sums), weights_(scratch.weights),
        row_(scratch.row), acc_(scratch.acc), bias_acc_(scratch.bias_acc), totals_(scratch.totals) {
    scratch.fit(s);
  }

  void run(int b, int h, int l, T* out) {
    load_queries(b, h, l);
    logits(b, h, l);
    softmax();
    weighted_values(b, h);
    write(out, b, h, l);
  }

 private:
  void load_queries(int b, int h, int l) {
    int G = s_.G(), gs = s_.group_size, groups = s_.Dk / gs;
    for (int g = 0; g < G; ++g) {
      const T* src = in_.queries.row(b, h * G + g, l);
      int64_t step = in_.queries.last_stride();
      float* q = &q_[(size_t)g * s_.Dk];
      for (int d = 0; d < s_.Dk; ++d) q[d] = static_cast<float>(src[d * step]) * scale_;
      for (int j = 0; j < groups; ++j) {
        float sum = 0.0f;
        for (int d = 0; d < gs; ++d) sum += q[j * gs + d];
        q_sums_[(size_t)g * groups + j] = sum;
      }
    }
  }

  // q . (scale * codes + bias) per group = scale * (q . codes) + bias * sum(q).
  void logits(int b, int h, int l) {
    int G = s_.G(), gs = s_.group_size, groups = s_.Dk / gs;
    const float* mask_row = nullptr;
    if (in_.mask != nullptr) {
      mask_row = in_.mask + b * in_.mask_stride[0] + (s_.mask_per_head ? h : 0) * in_.mask_stride[1] +
                 l * in_.mask_stride[2];
    }
    float* k = row_.data();
    for (int n = 0; n < s_.N; ++n) {
      decode_row<BITS>(in_.key_codes.row(b, h, n), s_.Dk, k);
      const T* scales = in_.key_scales.row(b, h, n);
      const T* biases = in_.key_biases.row(b, h, n);
      float added = mask_row == nullptr ? 0.0f : mask_row[n * in_.mask_stride[3]];
      for (int g = 0; g < G; ++g) {
        const float* q = &q_[(size_t)g * s_.Dk];
        const float* sums = &q_sums_[(size_t)g * groups];
        float x = 0.0f;
        for (int j = 0; j < groups; ++j) {
          x += static_cast<float>(scales[j]) * dot(q + j * gs, k + j * gs, gs) + static_cast<float>(biases[j]) * sums[j];
        }
        weights_[(size_t)g * s_.N + n] = x + added;
      }
    }
  }

  void softmax() {
    for (int g = 0; g < s_.G(); ++g) {
      float* w = &weights_[(size_t)g * s_.N];
      float top = -std::numeric_limits<float>::infinity();
      for (int n = 0; n < s_.N; ++n) top = w[n] > top ? w[n] : top;
      float total = 0.0f;
      for (int n = 0; n < s_.N; ++n) {
        w[n] = std::exp(w[n] - top);
        total += w[n];
      }
      totals_[g] = total;
    }
  }

  // sum_n w_n (scale_n * codes_n + bias_n) per group: the codes' part per channel, the
  // biases' part once a group.
  void weighted_values(int b, int h) {
    int G = s_.G(), gs = s_.group_size, groups = s_.Dv / gs;
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(bias_acc_.begin(), bias_acc_.end(), 0.0f);
    float* v = row_.data();
    for (int n = 0; n < s_.N; ++n) {
      decode_row<BITS>(in_.value_codes.row(b, h, n), s_.Dv, v);
      const T* scales = in_.value_scales.row(b, h, n);
      const T* biases = in_.value_biases.row(b, h, n);
      for (int g = 0; g < G; ++g) {
        float w = weights_[(size_t)g * s_.N + n];
        float* acc = &acc_[(size_t)g * s_.Dv];
        for (int j = 0; j < groups; ++j) {
          float a = w * static_cast<float>(scales[j]);
          for (int d = j * gs; d < (j + 1) * gs; ++d) acc[d] += a * v[d];
          bias_acc_[(size_t)g * groups + j] += w * static_cast<float>(biases[j]);
        }
      }
    }
  }

  void write(T* out, int b, int h, int l) {
    int G = s_.G(), gs = s_.group_size, groups = s_.Dv / gs;
    for (int g = 0; g < G; ++g) {
      T* dst = out + (((size_t)b * s_.Hq + h * G + g) * s_.L + l) * s_.Dv;
      const float* acc = &acc_[(size_t)g * s_.Dv];
      for (int d = 0; d < s_.Dv; ++d) {
        dst[d] = static_cast<T>((acc[d] + bias_acc_[(size_t)g * groups + d / gs]) / totals_[g]);
      }
    }
  }

  const Inputs<T>& in_;
  const Shape& s_;
  float scale_;
  std::vector<float>&q_, &q_sums_, &weights_, &row_, &acc_, &bias_acc_, &totals_;
};

template <typename T, int BITS>
void attend(const Inputs<T>& in, const Shape& s, float scale, T* out) {
  int units = s.B * s.H * s.L;
  std::function<void(int)> body = [&](int unit) {
    thread_local Scratch scratch;
    Unit<T, BITS> work(in, s, scale, scratch);
    int l = unit % s.L, h = (unit / s.L) % s.H, b = unit / (s.L * s.H);
    work.run(b, h, l, out);
  };
  // Waking the pool's helpers costs tens of microseconds: worth it past ~1M products.
  double products = (double)units * s.G() * s.N * (s.Dk + s.Dv);
  RowPool::instance().run(units, products < 2.0e5 ? 1 : RowPool::instance().size(), body);
}

template <typename T>
void attend_bits(const Inputs<T>& in, const Shape& s, float scale, int bits, T* out) {
  if (bits == 8) {
    attend<T, 8>(in, s, scale, out);
  } else {
    attend<T, 4>(in, s, scale, out);
  }
}

template <typename T>
void run_typed(const std::vector<mx::array>& inputs, mx::array& out, const Shape& s, float scale, int bits) {
  Inputs<T> in{Strided<T>(inputs[0]), Strided<uint32_t>(inputs[1]), Strided<T>(inputs[2]), Strided<T>(inputs[3]),
               Strided<uint32_t>(inputs[4]), Strided<T>(inputs[5]), Strided<T>(inputs[6]), nullptr, {0, 0, 0, 0}};
  if (inputs.size() > 7) {
    const mx::array& mask = inputs[7];
    in.mask = mask.data<float>();
    for (int i = 0; i < 4; ++i) in.mask_stride[i] = mask.strides()[i];
  }
  attend_bits<T>(in, s, scale, bits, out.data<T>());
}

void check_quantized(const char* name, const mx::array& codes, const mx::array& scales, const mx::array& biases,
                     const mx::array& queries, int B, int H, int N, int bits, int group_size, int* dim) {
  std::string base(name);
  check_dtype((base + " codes").c_str(), codes, mx::uint32, "uint32 (mx.quantize's packed codes)");
  *dim = codes.shape(3) * 32 / bits;
  for (const mx::array* part : {&scales, &biases}) {
    const char* what = part == &scales ? " scales" : " biases";
    check_ndim((base + what).c_str(), *part, 4, "[B, H, N, D / group_size]");
    if (part->dtype() != queries.dtype()) {
      std::ostringstream out;
      out << base << what << " must have the queries' dtype " << queries.dtype() << ", got " << part->dtype();
      bad(out.str());
    }
    check_dim((base + what).c_str(), *part, 3, *dim / group_size, "groups");
  }
  const mx::array* all[3] = {&codes, &scales, &biases};
  for (const mx::array* a : all) {
    check_dim(name, *a, 0, B, "batch entries");
    check_dim(name, *a, 1, H, "KV heads");
    check_dim(name, *a, 2, N, "rows");
  }
}

}  // namespace

mx::array quantized_attention(const mx::array& queries, const mx::array& key_codes, const mx::array& key_scales,
                              const mx::array& key_biases, const mx::array& value_codes,
                              const mx::array& value_scales, const mx::array& value_biases,
                              const std::optional<mx::array>& mask, float scale, int bits, int group_size,
                              mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) {
    bad("bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    bad("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  check_ndim("queries", queries, 4, "[B, Hq, L, D]");
  check_float_dtype("queries", queries);
  auto dtype = queries.dtype();
  // The codes' rank first: the keys' codes give the rows' shape every other check reads.
  check_ndim("keys codes", key_codes, 4, "[B, H, N, D * bits / 32]");
  check_ndim("values codes", value_codes, 4, "[B, H, N, D * bits / 32]");
  int B = queries.shape(0), Hq = queries.shape(1), L = queries.shape(2);
  int H = key_codes.shape(1), N = key_codes.shape(2);
  int Dk = 0, Dv = 0;
  check_quantized("keys", key_codes, key_scales, key_biases, queries, B, H, N, bits, group_size, &Dk);
  check_quantized("values", value_codes, value_scales, value_biases, queries, B, H, N, bits, group_size, &Dv);
  if (Dk != queries.shape(3)) {
    bad("the keys' codes hold " + std::to_string(Dk) + " channels at bits=" + std::to_string(bits) +
        " but the queries have " + std::to_string(queries.shape(3)));
  }
  if (N < 1) {
    bad("quantized_attention needs at least one row to attend, got keys of shape " + shape_str(key_codes));
  }
  if (H < 1 || Hq % H != 0) {
    bad("the queries' " + std::to_string(Hq) + " heads must be a multiple of the keys' " + std::to_string(H));
  }
  std::vector<mx::array> inputs = {queries, key_codes, key_scales, key_biases, value_codes, value_scales,
                                   value_biases};
  if (mask.has_value()) {
    const mx::array& m = *mask;
    check_ndim("mask", m, 4, "[B, 1 or H, L, N] (additive)");
    check_dtype("mask", m, mx::float32, "float32 (additive)");
    bool heads_ok = m.shape(1) == 1 || m.shape(1) == H;
    if (m.shape(0) != B || !heads_ok || m.shape(2) != L || m.shape(3) != N) {
      bad("mask must be [B, 1 or H, L, N] = [" + std::to_string(B) + ", 1 or " + std::to_string(H) + ", " +
          std::to_string(L) + ", " + std::to_string(N) + "], got shape " + shape_str(m));
    }
    inputs.push_back(m);
  }
  return mx::array({B, Hq, L, Dv}, dtype,
                   std::make_shared<CamQuantizedAttention>(mx::to_stream(s), scale, bits, group_size), inputs);
}

bool CamQuantizedAttention::is_equivalent(const mx::Primitive& other) const {
  const CamQuantizedAttention& o = static_cast<const CamQuantizedAttention&>(other);
  return scale_ == o.scale_ && bits_ == o.bits_ && group_size_ == o.group_size_;
}

void CamQuantizedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(std::max<size_t>(out.nbytes(), 1)));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const mx::array& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const mx::array& q = inputs[0];
  Shape shape{q.shape(0), q.shape(1), inputs[1].shape(1), q.shape(2), inputs[1].shape(2), q.shape(3),
              out.shape(3), group_size_, inputs.size() > 7 && inputs[7].shape(1) > 1};
  float scale = scale_;
  int bits = bits_;
  encoder.dispatch([inputs, out, shape, scale, bits]() mutable {
    switch (out.dtype()) {
      case mx::float32:
        run_typed<float>(inputs, out, shape, scale, bits);
        break;
      case mx::float16:
        run_typed<mx::float16_t>(inputs, out, shape, scale, bits);
        break;
      default:
        run_typed<mx::bfloat16_t>(inputs, out, shape, scale, bits);
    }
  });
}

void CamQuantizedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "camkv._ext.quantized_attention runs on the CPU only (stream=mx.cpu); on a GPU attention reads the rows "
      "through MLX's own kernels");
}

}  // namespace camkv
