// The Llama family's RMSNorm in one pass over each row (fp32, and bf16 computed in fp32 as the module does):
//
//   variance = x.pow(2).mean(-1, keepdim=True);  out = weight * (x * rsqrt(variance + eps))
//
// The eager code makes five passes over the hidden states and writes three temporaries their size; this
// reads a row, keeps it in L1, and writes the output once. Bitwise the eager ops', by doing ATen's
// arithmetic in ATen's order:
// - pow(2) is x * x (ATen squares for the exponent 2);
// - mean over the last dimension is ATen's sum (in its order: aten_sum.h), then a division by the row's
//   length (a float: ATen's true division by a wrapped integer scalar);
// - + eps is one rounded float add (eps rounded to float first, as ATen reads a wrapped scalar), and
//   rsqrt is ATen's 1 / sqrt: a rounded square root, then a rounded division, in its vector lanes
//   (_mm512_div_ps(1, _mm512_sqrt_ps)) and its scalar tails alike (the Python expression `1 / sqrt(v)`
//   is not: torch divides by taking a reciprocal first); the two products are single IEEE operations.
// Tested against the eager module on row lengths with and without vector tails (8 ... 4,096).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "aten_sum.h"

namespace {

#if defined(__AVX2__)
// ATen's sum of x[k]^2 over one contiguous row of `length` floats (aten_sum.h; `pow(2)` is x * x)
float sum_of_squares(const float* x, int64_t length) {
  return autobucket_sum::aten_row_sum(
      x, length,
      [](const float* p) {
        const __m256 v = _mm256_loadu_ps(p);
        return _mm256_mul_ps(v, v);
      },
      [](float value) { return value * value; });
}
#endif

void check_hidden(const at::Tensor& hidden) {
  TORCH_CHECK((hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16) &&
                  hidden.is_contiguous() && hidden.dim() >= 1,
              "rms_norm takes contiguous fp32 or bf16 hidden states [..., H]");
#if !defined(__AVX2__)
  TORCH_CHECK(false, "rms_norm needs an AVX2 build");
#endif
}

inline float widened(float x) { return x; }
inline float widened(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX2__)
// each row's sum of squares of its fp32 values (a bf16 row widened first, exactly, as the module's
// `.to(torch.float32)` does)
template <typename T>
void sums_of_squares(const T* x, int64_t rows, int64_t length, float* out) {
  std::vector<float> row_fp32(std::is_same_v<T, float> ? 0 : static_cast<size_t>(length));
  for (int64_t row = 0; row < rows; ++row) {
    const T* in = x + row * length;
    const float* values = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      values = in;
    } else {
      for (int64_t k = 0; k < length; ++k) row_fp32[k] = widened(in[k]);
      values = row_fp32.data();
    }
    out[row] = sum_of_squares(values, length);
  }
}
#endif

// weight * (hidden * scale) per row, the module's last two products: fp32 throughout, or for bf16 the
// fp32 product rounded to bf16 (`.to(input_dtype)`), then the bf16 weight's product rounded
template <typename T>
void apply_rows(const T* x, const T* w, const float* r, T* y, int64_t rows, int64_t length) {
  for (int64_t row = 0; row < rows; ++row) {
    const T* in = x + row * length;
    T* o = y + row * length;
    for (int64_t k = 0; k < length; ++k) {
      const T normed = static_cast<T>(widened(in[k]) * r[row]);
      o[k] = static_cast<T>(widened(w[k]) * widened(normed));
    }
  }
}

#if defined(__AVX2__)
// Rows [first, end) of the whole forward (`rms_norm`): each row's sum of squares, its scale as the module
// rounds it, then its products.
template <typename T>
void normalize_rows(const T* x, const T* w, T* y, int64_t first, int64_t end, int64_t length, double eps) {
  const float length_fp32 = static_cast<float>(length), epsilon = static_cast<float>(eps);
  std::vector<float> scales(static_cast<size_t>(end - first));
  sums_of_squares(x + first * length, end - first, length, scales.data());
  for (float& scale : scales) scale = 1.0f / std::sqrt(scale / length_fp32 + epsilon);
  apply_rows(x + first * length, w, scales.data(), y + first * length, end - first, length);
}
#else
template <typename T>
void normalize_rows(const T*, const T*, T*, int64_t, int64_t, int64_t, double) {}  // check_hidden refused
#endif

// The whole forward in one call: the sums of squares, then per row the module's three ops on its [..., 1]
// variance as ATen rounds them: `/ H` (true division by the length, a float), `+ eps` (eps rounded to
// float, one rounded add: ATen's fma(eps, 1, v) is the same) and `rsqrt` (ATen's 1 / sqrt, two rounded
// operations, in vector lanes and scalar tails alike); then the products. Saves the three ATen calls
// (and their scalar wrapping) per norm, a fixed cost that dominates a decode step's few rows. Rows are independent, so they
// split among torch's threads (a prefill's thousands of rows) where a call holds more than ATen's grain of
// elements; a decode step's few rows stay on one thread, below the cost of waking the others.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  check_hidden(hidden);
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type() && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == hidden.size(-1),
              "rms_norm takes a weight [H] of the hidden states' dtype");
  at::Tensor out = at::empty_like(hidden);
  const int64_t length = hidden.size(-1), rows = length > 0 ? hidden.numel() / length : 0;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(length, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t end) {
    if (hidden.scalar_type() == at::kFloat)
      normalize_rows(hidden.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), first, end, length, eps);
    else
      normalize_rows(hidden.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                     out.data_ptr<c10::BFloat16>(), first, end, length, eps);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
