// transformers' rotary position embedding (`apply_rotary_pos_emb` of the Llama family) in one pass:
//
//   q_embed = (q * cos) + (rotate_half(q) * sin),   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
//
// and the same for k. The eager code makes six passes over q (two products, a negation, a concatenation,
// a sum, and the unsqueezed cos/sin broadcast into each) and three temporaries the size of q; this reads
// q, cos and sin once and writes the output once. Per element it rounds exactly as the eager code does:
// each product rounded to the dtype, then their sum rounded (-ffp-contract=off: never one fused
// multiply-add), the negation exact; bf16 computes each operation in fp32 and rounds it to nearest even,
// as ATen's bf16 mul and add do. So the outputs are bitwise the model's function's (tested against it),
// whatever the layout, the number of rows or how the work is split.
//
// Layouts: q [B, H, T, D] and k [B, Hk, T, D] with any strides whose last one is 1 (the model's
// `view(...).transpose(1, 2)`); cos, sin [B or 1, T, D], last stride 1 (broadcast over heads, as the
// eager code's `unsqueeze(1)`). The outputs take q's and k's strides (`empty_like`), as the eager
// code's do. Built with the other kernels (same flags).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// a * b rounded to T, as the eager mul rounds it
template <typename T>
inline T product(T a, T b) {
  return static_cast<T>(widen(a) * widen(b));
}

template <typename T>
inline T sum(T a, T b) {
  return static_cast<T>(widen(a) + widen(b));
}

// One head's vector of one token: out = x * c + rotate_half(x) * s, elementwise, D = 2 * half.
template <typename T>
inline void rotate_vector(const T* x, const T* c, const T* s, T* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const T negated = static_cast<T>(-widen(x[i + half]));  // exact: only the sign changes
    out[i] = sum(product(x[i], c[i]), product(negated, s[i]));
  }
  for (int64_t i = half; i < 2 * half; ++i) out[i] = sum(product(x[i], c[i]), product(x[i - half], s[i]));
}

template <typename T>
void rotate_tensor(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), half = x.size(3) / 2;
  const T* x_data = x.data_ptr<T>();
  const T* cos_data = cos.data_ptr<T>();
  const T* sin_data = sin.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t cos_batch_stride = cos.size(0) == 1 ? 0 : cos.stride(0);
  const int64_t sin_batch_stride = sin.size(0) == 1 ? 0 : sin.stride(0);
  const int64_t vectors = batch * heads * tokens;
  at::parallel_for(0, vectors, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (heads * tokens), h = index / tokens % heads, t = index % tokens;
      rotate_vector<T>(x_data + b * x.stride(0) + h * x.stride(1) + t * x.stride(2),
                       cos_data + b * cos_batch_stride + t * cos.stride(1),
                       sin_data + b * sin_batch_stride + t * sin.stride(1),
                       out_data + b * out.stride(0) + h * out.stride(1) + t * out.stride(2), half);
    }
  });
}

void check_operand(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rotary_embedding takes ", name, " [B, heads, T, D] with D even and a contiguous last dimension");
  TORCH_CHECK(x.size(0) == cos.size(0) || cos.size(0) == 1, "rotary_embedding: cos/sin batch must be 1 or ", name, "'s");
  TORCH_CHECK(x.size(2) == cos.size(1) && x.size(3) == cos.size(2), "rotary_embedding: cos/sin must be [B, T, D] of ", name);
  TORCH_CHECK(x.scalar_type() == cos.scalar_type(), "rotary_embedding: ", name, " and cos/sin must share a dtype");
}

at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty_like(x);  // x's strides, as the eager code's output
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat)
    rotate_tensor<float>(x, cos, sin, out);
  else
    rotate_tensor<c10::BFloat16>(x, cos, sin, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "rotary_embedding takes fp32 or bf16 tensors");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.stride(2) == 1 &&
                  cos.scalar_type() == sin.scalar_type(),
              "rotary_embedding takes cos and sin [B, T, D] alike, last dimension contiguous");
  check_operand(q, cos, "q");
  check_operand(k, cos, "k");
  return {rotated(q, cos, sin), rotated(k, cos, sin)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
