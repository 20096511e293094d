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
// Two forms, one per build, each for the ATen kernels of its width (checked by the caller against
// torch.backends.cpu.get_cpu_capability() and vector_bits()): AVX-512 builds for ATen's AVX-512 kernels
// (16-float vectors, Sleef_expf16_u10, two vectors a step), AVX2 builds for ATen's AVX2 kernels (8-float
// vectors, Sleef_expf8_u10, two vectors a step; bf16 vectors round NaN to 0xffff as ATen's AVX2
// conversion does). Anything else runs the eager code.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);
#define AUTOBUCKET_SILU_VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
#define AUTOBUCKET_SILU_VECTORS 1
#endif

namespace {

#if defined(AUTOBUCKET_SILU_VECTORS)
inline float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }
#endif

// One vector of ATen's width, the operations the two ops need, per build. Each form copies ATen's own
// kernels of that width: neg as a sign flip, exp as Sleef's, IEEE add, div and mul, and fp32 -> bf16 as
// its conversion (round to nearest even; a NaN as 0x7fc0 on AVX-512, 0xffff on AVX2).
#if defined(__AVX512F__)
struct Floats {
  static constexpr int64_t kWidth = 16;
  __m512 v;
  static Floats load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Floats load(const c10::BFloat16* p) {  // exact: a bf16 is the top half of its fp32
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
  }
  void store(c10::BFloat16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits()); }
  Floats silu() const {
    const __m512 negated = _mm512_xor_ps(_mm512_set1_ps(-0.0f), v);  // Vectorized<float>::neg
    return {_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_expf16_u10(negated)))};
  }
  Floats operator*(Floats other) const { return {_mm512_mul_ps(v, other.v)}; }
  __m256i bf16_bits() const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  }
  Floats rounded_to_bf16() const {  // the bf16 nearest each lane, as fp32
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits()), 16))};
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Floats {
  static constexpr int64_t kWidth = 8;
  __m256 v;
  static Floats load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Floats load(const c10::BFloat16* p) {  // exact: a bf16 is the top half of its fp32
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16))};
  }
  void store(c10::BFloat16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }
  Floats silu() const {
    const __m256 negated = _mm256_xor_ps(_mm256_set1_ps(-0.0f), v);  // Vectorized<float>::neg
    return {_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), Sleef_expf8_u10(negated)))};
  }
  Floats operator*(Floats other) const { return {_mm256_mul_ps(v, other.v)}; }
  __m128i bf16_bits() const {  // ATen's AVX2 cvtfp32_bf16
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)), bits), 16);
    rounded = _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), rounded, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8));
  }
  Floats rounded_to_bf16() const {  // the bf16 nearest each lane, as fp32
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits()), 16))};
  }
};
#endif

#if defined(AUTOBUCKET_SILU_VECTORS)
// fp32: out[i] = silu(gate[i]) * up[i] for i in [begin, end), one ATen chunk; ATen's vector loop takes
// two vectors a step, and leaves the last < 2 vectors' elements to its scalar lambda
void silu_and_mul_chunk(const float* gate, const float* up, float* out, int64_t begin, int64_t end) {
  constexpr int64_t kStep = 2 * Floats::kWidth;
  const int64_t count = end - begin;
  gate += begin, up += begin, out += begin;
  int64_t i = 0;
  for (; i <= count - kStep; i += kStep) {
    for (int64_t part = i; part < i + kStep; part += Floats::kWidth)
      (Floats::load(gate + part).silu() * Floats::load(up + part)).store(out + part);
  }
  for (; i < count; ++i) out[i] = silu_scalar(gate[i]) * up[i];
}

// bf16: ATen's reduced-precision silu widens each bf16 vector (two fp32 vectors' worth) to fp32,
// computes as above and rounds to bf16, two such vectors a step; the scalar tail computes in fp32 and
// rounds; the mul of two bf16 is their fp32 product rounded.
void silu_and_mul_chunk(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t begin,
                        int64_t end) {
  constexpr int64_t kStep = 4 * Floats::kWidth;
  const int64_t count = end - begin;
  gate += begin, up += begin, out += begin;
  int64_t i = 0;
  for (; i <= count - kStep; i += kStep) {
    for (int64_t part = i; part < i + kStep; part += Floats::kWidth)
      (Floats::load(gate + part).silu().rounded_to_bf16() * Floats::load(up + part)).store(out + part);
  }
  for (; i < count; ++i) {
    const c10::BFloat16 rounded(silu_scalar(static_cast<float>(gate[i])));
    out[i] = c10::BFloat16(static_cast<float>(rounded) * static_cast<float>(up[i]));
  }
}

// The eager op's chunks, as TensorIterator::for_each -> at::parallel_for (OpenMP) splits the flattened
// elements among the threads: the same chunks, so each element takes the branch (vector lanes or scalar
// tail) it takes there. The chunks' boundaries are what matters to the values; they run on the threads
// too, one chunk a thread as in the eager op.
template <typename T>
void silu_and_mul_as_aten_splits(const T* gate, const T* up, T* out, int64_t count) {
  if (count <= 0) return;
  const int64_t grain = at::internal::GRAIN_SIZE;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t chunks = count > grain && threads > 1 ? std::min(threads, (count + grain - 1) / grain) : 1;
  const int64_t chunk = (count + chunks - 1) / chunks;
  const int64_t chunk_count = (count + chunk - 1) / chunk;  // at most `chunks`
  at::parallel_for(0, chunk_count, 1, [&](int64_t first, int64_t end) {
    for (int64_t c = first; c < end; ++c)
      silu_and_mul_chunk(gate, up, out, c * chunk, std::min(count, (c + 1) * chunk));
  });
}
#endif

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK((gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16) &&
                  up.scalar_type() == gate.scalar_type() && gate.sizes() == up.sizes() && gate.is_contiguous() &&
                  up.is_contiguous(),
              "silu_and_mul takes two contiguous fp32 or bf16 tensors of one shape and dtype");
#if defined(AUTOBUCKET_SILU_VECTORS)
  at::Tensor out = at::empty_like(gate);
  if (gate.scalar_type() == at::kFloat)
    silu_and_mul_as_aten_splits(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), gate.numel());
  else
    silu_and_mul_as_aten_splits(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(),
                                out.data_ptr<c10::BFloat16>(), gate.numel());
  return out;
#else
  TORCH_CHECK(false, "silu_and_mul needs an AVX-512 or AVX2 build");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
