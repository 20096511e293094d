// The reductions an RL trainer runs over its logits to score a token, bitwise, in one pass per row and without
// the [rows, vocab] temporaries the eager ops write: TRL's `selective_log_softmax` takes
// `logit - torch.logsumexp(logits)` for fp32 logits and `torch.log_softmax(logits).gather(token)` for bf16.
//
// fp32, `trainer_logsumexp` [rows, vocab] -> [rows, 1] (the eager op writes and re-reads a [rows, vocab]
// fp32 temporary). ATen's logsumexp (ReduceOps.cpp) is: maxes = amax(x,
// -1, keepdim); maxes.masked_fill_(|maxes| == inf, 0); sum((x - maxes).exp_(), -1).log_().add_(maxes).
// Done here the same way, operation by operation:
// - amax: exact in any order; NaN if the row holds one (ATen's max propagates NaN);
// - x - max: one IEEE subtraction (the masked max: a row of only -inf gives exp(-inf) = 0, a log of
//   -inf; a row with +inf gives inf);
// - exp_: ATen's fp32 exp runs MKL's vmsExp (VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE) over each
//   contiguous run of the tensor, and vmsExp's value for an element depends on that element alone, not on
//   the run's length or its place in it (checked against torch.exp on runs cut 1, 5, 8, 2,048 and all
//   elements long). So one call per row gives ATen's values. The symbol is looked up at run time in the
//   loaded libtorch_cpu: a torch built without MKL has none, and then `trainer_logsumexp_available()`
//   says so and the caller keeps torch's op;
// - sum: ATen's order (aten_sum.h);
// - log_: vmsLn over the rows' sums (ATen's log on a contiguous tensor), then one IEEE add.
//
// bf16, `trainer_log_softmax_at` (logits [rows, vocab], tokens [rows]) -> [rows]: each row's log_softmax at
// its token, without writing the row's other log-probabilities. ATen's (LogSoftmaxKernelImpl.h,
// serial_vec_log_softmax_lastdim_range) per row: the max (bf16, exact); the sum of exp(x - max) over the
// row widened to fp32, by map_reduce_all: two 8-float accumulators over each 16-value bf16 vector, the
// last partial vector's lanes blended in, the two added, then VecReduceAllSIMD's lane tree (halves,
// pairs, neighbours); exp and log are Vectorized<float>'s, Sleef_expf8_u10 and Sleef_logf8_u10 (exported
// by libtorch_cpu); the sum is stored as bf16 (rounded), its log computed in fp32 and rounded to bf16;
// the output is bf16((x - max) - log), two fp32 subtractions. That is ATen's AVX2 kernel: AVX-512 CPUs
// run 16-float vectors and another lane tree, which this file does not copy (nothing here tests it against
// that kernel), so only AVX2 builds register the form and elsewhere the caller keeps torch's op.
//
// The caller also checks each op against torch's once per process (engine/kernels/trainer_reductions.py),
// and sends what ATen reduces another way to torch's op: a single fp32 row long enough for ATen to split
// its sum over threads, and rows shorter than one vector.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "aten_sum.h"
#include "lanes.h"

namespace {

// MKL VML's single-precision vector functions as libtorch_cpu exports them (LP64: the count is an int)
using VmlFunction = void (*)(int count, const float* in, float* out, long long mode);
constexpr long long kAtenVmlMode = 0x00000002 | 0x00140000 | 0x00000100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

struct Vml {
  VmlFunction exp = nullptr;
  VmlFunction ln = nullptr;
};

const Vml& vml() {
  static const Vml found = [] {
    Vml functions;
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (torch_cpu != nullptr) {
      functions.exp = reinterpret_cast<VmlFunction>(dlsym(torch_cpu, "vmsExp"));
      functions.ln = reinterpret_cast<VmlFunction>(dlsym(torch_cpu, "vmsLn"));
      dlclose(torch_cpu);  // RTLD_NOLOAD took a reference to the already loaded library: give it back
    }
    return functions;
  }();
  return found;
}

bool trainer_logsumexp_available() {
#if defined(__AVX2__)
  return vml().exp != nullptr && vml().ln != nullptr;
#else
  return false;
#endif
}

#if defined(__AVX2__)
// amax of a row, NaN if it holds one: four 8-float accumulators, then their lanes
float row_max(const float* x, int64_t length) {
  __m256 best[4], unordered = _mm256_setzero_ps();
  for (auto& b : best) b = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t k = 0;
  for (; k + 32 <= length; k += 32)
    for (int part = 0; part < 4; ++part) {
      const __m256 v = _mm256_loadu_ps(x + k + 8 * part);
      best[part] = _mm256_max_ps(best[part], v);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  const __m256 lanes = _mm256_max_ps(_mm256_max_ps(best[0], best[1]), _mm256_max_ps(best[2], best[3]));
  alignas(32) float values[8];
  _mm256_store_ps(values, lanes);
  float result = -std::numeric_limits<float>::infinity();
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (float value : values) result = std::max(result, value);
  for (; k < length; ++k) {
    nan = nan || std::isnan(x[k]);
    result = std::max(result, x[k]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : result;
}

// out[k] = x[k] - shift, one IEEE subtraction each
void shifted(const float* x, int64_t length, float shift, float* out) {
  const __m256 by = _mm256_set1_ps(shift);
  int64_t k = 0;
  for (; k + 8 <= length; k += 8) _mm256_storeu_ps(out + k, _mm256_sub_ps(_mm256_loadu_ps(x + k), by));
  for (; k < length; ++k) out[k] = x[k] - shift;
}
#endif

// logits [rows, vocab] fp32 contiguous, vocab >= 8 -> [rows, 1] fp32: each row's logsumexp as ATen's
at::Tensor trainer_logsumexp(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.size(1) >= 8 && logits.size(1) <= std::numeric_limits<int>::max(),
              "trainer_logsumexp takes contiguous fp32 logits [rows, vocab >= 8]");
  TORCH_CHECK(trainer_logsumexp_available(), "trainer_logsumexp needs an AVX2 build and torch's MKL VML");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor result = at::empty({rows, 1}, logits.options());
#if defined(__AVX2__)
  const float* x = logits.data_ptr<float>();
  float* sums = result.data_ptr<float>();
  std::vector<float> maxes(static_cast<size_t>(rows));
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {  // rows among torch's threads
    std::vector<float> exponentials(static_cast<size_t>(vocab));  // one row's exp(x - max), 128 KB at 32,000
    for (int64_t row = first; row < last; ++row) {
      const float* in = x + row * vocab;
      float max = row_max(in, vocab);
      if (std::isinf(max)) max = 0.0f;  // masked_fill_(|maxes| == inf, 0): before the subtraction too
      maxes[row] = max;
      shifted(in, vocab, max, exponentials.data());
      vml().exp(static_cast<int>(vocab), exponentials.data(), exponentials.data(), kAtenVmlMode);
      sums[row] = autobucket_sum::aten_row_sum(
          exponentials.data(), vocab, [](const float* p) { return _mm256_loadu_ps(p); }, [](float value) { return value; });
    }
  });
  if (rows > 0) vml().ln(static_cast<int>(rows), sums, sums, kAtenVmlMode);
  for (int64_t row = 0; row < rows; ++row) sums[row] += maxes[row];
#endif
  return result;
}

// ATen's AVX2 log_softmax kernels (ATen picks them where get_cpu_capability() is AVX2; the caller checks)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AUTOBUCKET_BF16_LOG_SOFTMAX 1
extern "C" __m256 Sleef_expf8_u10(__m256);
extern "C" __m256 Sleef_logf8_u10(__m256);

using autobucket_lanes::widen8;

// `count` < 8 bf16 values widened to fp32 with zeros after, as Vectorized<BFloat16>::loadu(p, count) fills
// a partial vector
inline __m256 widen8(const c10::BFloat16* p, int64_t count) {
  alignas(16) c10::BFloat16 values[8] = {};
  std::memcpy(values, p, static_cast<size_t>(count) * sizeof(c10::BFloat16));
  return widen8(values);
}

// the same loads of a row already widened to fp32 (bf16 values held in fp32: the same vectors)
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const float* p, int64_t count) {
  alignas(32) float values[8] = {};
  std::memcpy(values, p, static_cast<size_t>(count) * sizeof(float));
  return _mm256_load_ps(values);
}

// Vectorized<float>::set(a, b, count): lanes [0, count) from b, the rest from a
inline __m256 blend_first(__m256 a, __m256 b, int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i take = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(take));
}

// VecReduceAllSIMD<float> (AVX2): add the halves, then the pairs, then the neighbours; lane 0
inline float lane_tree_sum(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// fp32 -> bf16 as ATen's AVX2 vector conversion rounds (to nearest even; NaN as 0xffff)
inline c10::BFloat16 bf16_as_aten_vectors(float value) {
  if (std::isnan(value)) return c10::BFloat16(0xffff, c10::BFloat16::from_bits());
  return c10::BFloat16(value);
}

// the max of a bf16 row as fp32, NaN if it holds one (reduce_all with vec::maximum); `T`: the row as
// bf16, or widened to fp32
template <typename T>
float bf16_row_max(const T* x, int64_t length) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), unordered = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= length; k += 8) {
    const __m256 v = widen8(x + k);
    best = _mm256_max_ps(best, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float result = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (; k < length; ++k) {
    const float value = static_cast<float>(x[k]);
    nan = nan || std::isnan(value);
    result = std::max(result, value);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : result;
}

// map_reduce_all's sum of exp(x - max) over a bf16 row of length >= 16 (see the file's comment)
template <typename T>
float bf16_row_sum_of_exp(const T* x, int64_t length, float max) {
  const __m256 shift = _mm256_set1_ps(max);
  const auto term = [shift](__m256 v) { return Sleef_expf8_u10(_mm256_sub_ps(v, shift)); };
  __m256 low = term(widen8(x)), high = term(widen8(x + 8));
  int64_t d = 16;
  for (; d < length - length % 16; d += 16) {
    low = _mm256_add_ps(low, term(widen8(x + d)));
    high = _mm256_add_ps(high, term(widen8(x + d + 8)));
  }
  const int64_t rest = length - d;
  if (rest > 8) {
    low = _mm256_add_ps(low, term(widen8(x + d)));
    high = blend_first(high, _mm256_add_ps(high, term(widen8(x + d + 8, rest - 8))), rest - 8);
  } else if (rest > 0) {
    low = blend_first(low, _mm256_add_ps(low, term(widen8(x + d, rest))), rest);
  }
  return lane_tree_sum(_mm256_add_ps(low, high));
}
#endif

bool trainer_log_softmax_at_available() {
#if defined(AUTOBUCKET_BF16_LOG_SOFTMAX)
  return true;
#else
  return false;
#endif
}

// Each row's log_softmax at its token from `x` [rows, vocab] (`T`: bf16, or bf16 values widened to fp32)
// into `out` [rows], checked.
template <typename T>
void log_softmax_at_rows(const T* x, int64_t rows, int64_t vocab, const int64_t* token, c10::BFloat16* out) {
#if defined(AUTOBUCKET_BF16_LOG_SOFTMAX)
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {  // rows among torch's threads
    for (int64_t row = first; row < last; ++row) {
      const T* in = x + row * vocab;
      const float max = static_cast<float>(c10::BFloat16(bf16_row_max(in, vocab)));  // stored as bf16: exact
      const float sum = static_cast<float>(c10::BFloat16(bf16_row_sum_of_exp(in, vocab, max)));  // stored as bf16
      const float log_sum =
          static_cast<float>(bf16_as_aten_vectors(_mm256_cvtss_f32(Sleef_logf8_u10(_mm256_set1_ps(sum)))));
      out[row] = bf16_as_aten_vectors((static_cast<float>(in[token[row]]) - max) - log_sum);
    }
  });
#endif
}

// logits [rows, vocab >= 16] contiguous, bf16 (or, `widened`, fp32 holding bf16 values), tokens [rows] long
// -> bf16 [rows]: log_softmax(logits as bf16)[row, token]
at::Tensor log_softmax_at_checked(const at::Tensor& logits, const at::Tensor& tokens, bool widened) {
  const auto dtype = widened ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(logits.scalar_type() == dtype && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) >= 16,
              widened ? "trainer_log_softmax_at_widened takes contiguous fp32 logits [rows, vocab >= 16]"
                      : "trainer_log_softmax_at takes contiguous bf16 logits [rows, vocab >= 16]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.size(0) == logits.size(0),
              "trainer_log_softmax_at takes one long token per row");
  TORCH_CHECK(trainer_log_softmax_at_available(), "trainer_log_softmax_at needs an AVX2 (not AVX-512) build");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor result = at::empty({rows}, logits.options().dtype(at::kBFloat16));
  const at::Tensor token_values = tokens.contiguous();
  const int64_t* token = token_values.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row)
    TORCH_CHECK(token[row] >= 0 && token[row] < vocab, "trainer_log_softmax_at: token ", token[row], " of row ", row,
                " is outside the vocabulary [0, ", vocab, ")");
  c10::BFloat16* out = result.data_ptr<c10::BFloat16>();
  if (widened)
    log_softmax_at_rows(logits.data_ptr<float>(), rows, vocab, token, out);
  else
    log_softmax_at_rows(logits.data_ptr<c10::BFloat16>(), rows, vocab, token, out);
  return result;
}

at::Tensor trainer_log_softmax_at(const at::Tensor& logits, const at::Tensor& tokens) {
  return log_softmax_at_checked(logits, tokens, false);
}

// A bf16 model's decode logits as the runner holds them, widened to fp32 (every value a bf16): bitwise
// `trainer_log_softmax_at(logits.to(torch.bfloat16), tokens)` without the narrowed copy. Values that are
// not bf16 get other results: the caller promises them.
at::Tensor trainer_log_softmax_at_widened(const at::Tensor& logits, const at::Tensor& tokens) {
  return log_softmax_at_checked(logits, tokens, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("trainer_logsumexp(Tensor logits) -> Tensor");
  m.def("trainer_logsumexp_available() -> bool", &trainer_logsumexp_available);
  m.def("trainer_log_softmax_at(Tensor logits, Tensor tokens) -> Tensor");
  m.def("trainer_log_softmax_at_widened(Tensor logits, Tensor tokens) -> Tensor");
  m.def("trainer_log_softmax_at_available() -> bool", &trainer_log_softmax_at_available);
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) {
  m.impl("trainer_logsumexp", &trainer_logsumexp);
  m.impl("trainer_log_softmax_at", &trainer_log_softmax_at);
  m.impl("trainer_log_softmax_at_widened", &trainer_log_softmax_at_widened);
}
