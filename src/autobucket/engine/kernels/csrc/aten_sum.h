// ATen's sum of one contiguous row of fp32 values, in ATen's order, for kernels whose output must equal an
// eager op's bitwise (rms_norm.cpp's sum of squares, trainer_logsumexp.cpp's sum of exponentials).
//
// ATen's sum over a contiguous last dimension (SumKernel.cpp's cascade_sum -> vectorized_inner_sum) adds
// 8-float vectors (its sum kernel has no AVX-512 variant, so AVX-512 CPUs run the AVX2 one: found by
// comparing against torch, 16-float vectors differ) into 4 interleaved accumulators, with a cascade of
// levels once there are more than 16 groups of 4 vectors; the leftover vectors go into the first
// accumulator, the 4 accumulators are added in order, the elements past the last whole vector are added to
// a scalar starting at 0, and then the 8 lanes in order. Rows shorter than one vector take ATen's scalar
// path (scalar_inner_sum), which no test compares this with: the logsumexp sends them to the eager op.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>

namespace autobucket_sum {

constexpr int kIlp = 4;     // ATen's row_sum: accumulators interleaved over consecutive vectors
constexpr int kLevels = 4;  // ATen's multi_row_sum: cascade levels
constexpr int kWidth = 8;   // floats per vector of ATen's (AVX2) sum kernel

inline int64_t ceil_log2(int64_t n) {
  int64_t log = 0;
  while ((int64_t{1} << log) < n) ++log;
  return log;
}

// The sum of term(x[k]) over a row of `length` >= kWidth floats, in ATen's order: `vector_term(x + k)`
// gives 8 terms as one vector, `scalar_term(x[k])` one term of the tail (the same value as its lane).
template <typename VectorTerm, typename ScalarTerm>
float aten_row_sum(const float* x, int64_t length, VectorTerm vector_term, ScalarTerm scalar_term) {
  const int64_t vectors = length / kWidth, groups = vectors / kIlp;
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], vector_term(x + (i * kIlp + k) * kWidth));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], vector_term(x + (i * kIlp + k) * kWidth));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  __m256 total = acc[0][0];
  for (int64_t v = groups * kIlp; v < vectors; ++v) total = _mm256_add_ps(total, vector_term(x + v * kWidth));
  for (int k = 1; k < kIlp; ++k) total = _mm256_add_ps(total, acc[0][k]);
  float result = 0.0f;
  for (int64_t k = vectors * kWidth; k < length; ++k) result += scalar_term(x[k]);
  alignas(32) float lanes[kWidth];
  _mm256_store_ps(lanes, total);
  for (float lane : lanes) result += lane;
  return result;
}

}  // namespace autobucket_sum
#endif
