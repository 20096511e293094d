// 16 fp32 lanes, written once for both vector widths (the attention and the sampler share them).
//
// It is written once against `Lanes`, 16 fp32 lanes: one AVX-512 register, or two AVX2 ones (CPUs
// without AVX-512). Every operation is lane by lane (IEEE add, mul, max, fused
// multiply-add) or a fixed tree over the lanes, so both widths compute the same values: an AVX2 machine
// and an AVX-512 one give a token bitwise the same attention output.
//
// Each including file uses these inside its own code as `using namespace autobucket_lanes;`. Only the
// vector builds (AVX-512, or AVX2 with FMA) define them: AUTOBUCKET_LANES says which.

#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define AUTOBUCKET_LANES 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace autobucket_lanes {

// 8 bf16 -> fp32, exactly (each one's bits shifted up 16); AVX2, which both vector builds have
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
};
using LaneMask = __mmask16;

inline Lanes splat(float x) { return {_mm512_set1_ps(x)}; }
inline Lanes zeros() { return {_mm512_setzero_ps()}; }
inline Lanes load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Lanes load16(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exactly: each one's bits shifted up 16
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
}
inline Lanes load_aligned(const float* p) { return {_mm512_load_ps(p)}; }
inline void store_aligned(float* p, Lanes x) { _mm512_store_ps(p, x.v); }
inline Lanes operator+(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Lanes max(Lanes a, Lanes b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Lanes fmadd(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c, one rounding
inline Lanes fnmadd(Lanes a, Lanes b, Lanes c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b, one rounding
inline LaneMask lanes_below(int64_t n) { return n >= 16 ? LaneMask(0xFFFF) : LaneMask((1u << n) - 1u); }
// lanes under the mask from p (64-byte aligned), the others from `rest` / zero
inline Lanes load_aligned_or(Lanes rest, LaneMask live, const float* p) { return {_mm512_mask_load_ps(rest.v, live, p)}; }
inline Lanes load_aligned_or_zero(LaneMask live, const float* p) { return {_mm512_maskz_load_ps(live, p)}; }
inline Lanes keep(LaneMask live, Lanes x) { return {_mm512_maskz_mov_ps(live, x.v)}; }
// lanes under the mask from p (any alignment), the others from `rest`
inline Lanes load_or(Lanes rest, LaneMask live, const float* p) { return {_mm512_mask_loadu_ps(rest.v, live, p)}; }
inline LaneMask above(Lanes a, Lanes b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }  // a > b, false on NaN
inline LaneMask unordered(Lanes x) { return _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q); }     // x is NaN
inline LaneMask no_lanes() { return LaneMask(0); }
inline LaneMask either(LaneMask a, LaneMask b) { return LaneMask(a | b); }
inline bool any_lane(LaneMask m) { return m != 0; }
// exponent bits: round each lane to an integer (nearest), shift it to the exponent field and add it to p's bits
inline Lanes add_exponents(Lanes p, Lanes n) {
  const __m512i exponent = _mm512_slli_epi32(_mm512_cvtps_epi32(n.v), 23);
  return {_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p.v), exponent))};
}
inline float first_lane(Lanes x) { return _mm512_cvtss_f32(x.v); }
// lanes l + 8 and l for l < 8 (the first step of every tree over the lanes), as 8 lanes
inline __m256 fold_halves_add(Lanes x) {
  return _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)), _mm512_castps512_ps256(x.v));
}
inline __m256 fold_halves_max(Lanes x) {
  return _mm256_max_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)), _mm512_castps512_ps256(x.v));
}
#else
struct alignas(64) Lanes {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct LaneMask {
  __m256i lo, hi;  // all ones in a live lane
};

inline Lanes splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes load16(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
inline Lanes load_aligned(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void store_aligned(float* p, Lanes x) { _mm256_store_ps(p, x.lo), _mm256_store_ps(p + 8, x.hi); }
inline Lanes operator+(Lanes a, Lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes operator-(Lanes a, Lanes b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Lanes max(Lanes a, Lanes b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Lanes fmadd(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes fnmadd(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline LaneMask lanes_below(int64_t n) {
  const __m256i count = _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 16)));
  return {_mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline Lanes load_aligned_or(Lanes rest, LaneMask live, const float* p) {
  return {_mm256_blendv_ps(rest.lo, _mm256_maskload_ps(p, live.lo), _mm256_castsi256_ps(live.lo)),
          _mm256_blendv_ps(rest.hi, _mm256_maskload_ps(p + 8, live.hi), _mm256_castsi256_ps(live.hi))};
}
inline Lanes load_aligned_or_zero(LaneMask live, const float* p) {
  return {_mm256_maskload_ps(p, live.lo), _mm256_maskload_ps(p + 8, live.hi)};
}
inline Lanes keep(LaneMask live, Lanes x) {
  return {_mm256_and_ps(x.lo, _mm256_castsi256_ps(live.lo)), _mm256_and_ps(x.hi, _mm256_castsi256_ps(live.hi))};
}
inline Lanes load_or(Lanes rest, LaneMask live, const float* p) { return load_aligned_or(rest, live, p); }  // maskload: any alignment
inline LaneMask above(Lanes a, Lanes b) {
  return {_mm256_castps_si256(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ)), _mm256_castps_si256(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ))};
}
inline LaneMask unordered(Lanes x) {
  return {_mm256_castps_si256(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q)), _mm256_castps_si256(_mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q))};
}
inline LaneMask no_lanes() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline LaneMask either(LaneMask a, LaneMask b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline bool any_lane(LaneMask m) { return !_mm256_testz_si256(_mm256_or_si256(m.lo, m.hi), _mm256_or_si256(m.lo, m.hi)); }
inline Lanes add_exponents(Lanes p, Lanes n) {
  const auto add = [](__m256 pv, __m256 nv) {
    const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(nv), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(pv), exponent));
  };
  return {add(p.lo, n.lo), add(p.hi, n.hi)};
}
inline float first_lane(Lanes x) { return _mm256_cvtss_f32(x.lo); }
inline __m256 fold_halves_add(Lanes x) { return _mm256_add_ps(x.hi, x.lo); }
inline __m256 fold_halves_max(Lanes x) { return _mm256_max_ps(x.hi, x.lo); }
#endif

// The lanes' sum by a fixed halving tree: l + l+8, l + l+4, l + l+2, l + l+1 (the tree GCC's
// _mm512_reduce_add_ps also uses; written out so no header's choice can change it, and the tiled form
// below forms exactly these sums for 16 keys at once).
inline float sum_lanes(Lanes x) {
  const __m256 eight = fold_halves_add(x);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// The lanes' maximum (any order gives the same value up to the sign of a zero, which no later value sees)
inline float max_lanes(Lanes x) {
  const __m256 eight = fold_halves_max(x);
  const __m128 four = _mm_max_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

// Always inlined: GCC kept it out of line, so every softmax block passed each 16-lane vector through the
// stack and called it, a cost prefill's many blocks pay most. Inlined, it runs the same instructions, so
// the same bits.
__attribute__((always_inline)) inline Lanes exp_nonpositive(Lanes x) {
  x = max(x, splat(-87.0f));
  const Lanes shifter = splat(12582912.0f);  // 1.5 * 2^23: rounds to nearest
  const Lanes n = fmadd(x, splat(1.44269504088896341f), shifter) - shifter;
  const Lanes r = fmadd(n, splat(2.12194440e-4f), fnmadd(n, splat(0.693359375f), x));
  Lanes p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p, r * r, r) + splat(1.0f);
  return add_exponents(p, n);
}

}  // namespace autobucket_lanes

#endif
