// Greedy selection's argmax over fp32 logits in one vectorized sweep per row: `torch.argmax`'s answer
// (the first index of the row's maximum; the first NaN where the row has one). torch's index-tracking
// reductions do not vectorize on a CPU (a scalar loop over every logit), and the two-pass form in
// selection.py (`amax` per block, then `max` over one block) costs ~8 dispatched ops a step. Here:
// pass one, the row's maximum as 16-lane (AVX-512) or 8-lane (AVX2) vector maxima (plus whether any lane
// saw a NaN); pass two, the first index equal to it. `max` of floats is exact and order-free, and
// -0.0 == 0.0 compares equal, so the first equal index is the first maximal one, as argmax's `>` scan
// keeps it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

int64_t first_nan(const float* row, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    if (std::isnan(row[i])) return i;
  return -1;
}

int64_t row_argmax(const float* row, int64_t count) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (i < count) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), tail, row + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan != 0) return first_nan(row, count);
  const float maximum = _mm512_reduce_max_ps(best);
  const __m512 target = _mm512_set1_ps(maximum);
  for (i = 0; i + 16 <= count; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), target, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  for (; i < count; ++i)
    if (row[i] == maximum) return i;
  return 0;  // unreachable: the maximum is one of the row's values
#elif defined(__AVX2__)
  // the same two passes on 8-lane vectors (the scalar loop below is the portable form's)
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  bool tail_nan = false;
  float maximum = -std::numeric_limits<float>::infinity();
  for (int64_t t = i; t < count; ++t) {
    tail_nan = tail_nan || std::isnan(row[t]);
    maximum = row[t] > maximum ? row[t] : maximum;
  }
  if (tail_nan || _mm256_movemask_ps(nan) != 0) return first_nan(row, count);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  for (const float lane : lanes) maximum = lane > maximum ? lane : maximum;
  const __m256 target = _mm256_set1_ps(maximum);
  for (i = 0; i + 8 <= count; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < count; ++i)
    if (row[i] == maximum) return i;
  return 0;  // unreachable: the maximum is one of the row's values
#else
  const int64_t nan_at = first_nan(row, count);
  if (nan_at >= 0) return nan_at;
  float maximum = row[0];
  for (int64_t i = 1; i < count; ++i) maximum = row[i] > maximum ? row[i] : maximum;
  for (int64_t i = 0; i < count; ++i)
    if (row[i] == maximum) return i;
  return 0;
#endif
}

// [rows, vocab] fp32 -> [rows] int64.
at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "first_argmax takes fp32 logits [rows, vocab] with vocab > 0");
  const at::Tensor rows = logits.contiguous();
  const int64_t count = rows.size(0), vocab = rows.size(1);
  at::Tensor out = at::empty({count}, rows.options().dtype(at::kLong));
  const float* data = rows.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {  // rows among torch's threads
    for (int64_t r = first; r < last; ++r) indices[r] = row_argmax(data + r * vocab, vocab);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) { m.def("first_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(autobucket, CPU, m) { m.impl("first_argmax", &first_argmax); }
