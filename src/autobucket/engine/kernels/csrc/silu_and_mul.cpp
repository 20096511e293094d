// The gated MLP's `act_fn(gate) * up` for SiLU (`F.silu(gate) * up`, the Llama family's MLP) in one pass:
// the eager code writes silu(gate) and reads it back for the product, two passes over tensors of
// tokens x intermediate floats (8 MB per 2,000 tokens of bench-qwen2) where this makes one.
//
// Bitwise the eager code's, by doing what ATen's kernels do element by element (fp32):
// - silu: where ATen's vector loop computes it, x / (1 + exp(-x)) on 16-float vectors with the same
//   exp, Sleef_expf16_u10 (exported by libtorch_cpu; ATen's AVX-512 Vectorized<float>::exp calls it),
//   the negation a sign flip, the add and the division IEEE-rounded; where ATen's loop leaves a scalar
//   tail, x / (1 + std::exp(-x)) as ATen's scalar lambda (the same libm expf);
// - which elements are a tail: ATen runs a contiguous elementwise op as at::parallel_for over the
//   elements with grain at::internal::GRAIN_SIZE, and each chunk as a loop of two vectors (32 floats) at a
//   time with the last < 32 elements scalar. This runs the same split, so every element takes the same
//   branch it takes in the eager op on the same tensor with the same threads;
// - the product: an IEEE multiply, the same in a vector or a scalar.
// Only for ATen's AVX-512 kernels (torch.backends.cpu.get_cpu_capability() == "AVX512", checked by the
// caller) and AVX-512 builds of this library; anything else runs the eager code.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kPair = 32;  // ATen's vector loop step: two 16-float vectors

inline __m512 silu16(__m512 x) {
  const __m512 negated = _mm512_xor_ps(_mm512_set1_ps(-0.0f), x);  // Vectorized<float>::neg
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_expf16_u10(negated)));
}

inline float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }

// out[i] = silu(gate[i]) * up[i] for i in [begin, end), one ATen chunk
void silu_and_mul_chunk(const float* gate, const float* up, float* out, int64_t begin, int64_t end) {
  const int64_t count = end - begin;
  gate += begin, up += begin, out += begin;
  int64_t i = 0;
  for (; i <= count - kPair; i += kPair) {
    for (int64_t half = 0; half < kPair; half += 16) {
      const __m512 s = silu16(_mm512_loadu_ps(gate + i + half));
      _mm512_storeu_ps(out + i + half, _mm512_mul_ps(s, _mm512_loadu_ps(up + i + half)));
    }
  }
  for (; i < count; ++i) out[i] = silu_scalar(gate[i]) * up[i];
}
#endif

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() &&
                  gate.is_contiguous() && up.is_contiguous(),
              "silu_and_mul takes two contiguous fp32 tensors of one shape");
#if defined(__AVX512F__)
  at::Tensor out = at::empty_like(gate);
  const float* gate_data = gate.data_ptr<float>();
  const float* up_data = up.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  // The eager op's chunks, as TensorIterator::for_each -> at::parallel_for (OpenMP) splits the flattened
  // elements among the threads: run here one after another (this library is built without OpenMP, where
  // at::parallel_for would not split at all), so each element takes the branch it takes there.
  const int64_t count = gate.numel(), grain = at::internal::GRAIN_SIZE;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t chunks = count > grain && threads > 1 ? std::min(threads, (count + grain - 1) / grain) : 1;
  const int64_t chunk = (count + chunks - 1) / chunks;
  for (int64_t begin = 0; begin < count; begin += chunk)
    silu_and_mul_chunk(gate_data, up_data, out_data, begin, std::min(count, begin + chunk));
  return out;
#else
  TORCH_CHECK(false, "silu_and_mul needs an AVX-512 build");
#endif
}

bool silu_and_mul_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_and_mul_available() -> bool", &silu_and_mul_available);
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
