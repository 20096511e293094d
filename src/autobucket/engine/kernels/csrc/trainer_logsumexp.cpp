// An RL trainer's `torch.logsumexp(logits, dim=-1, keepdim=True)` on fp32 logits [rows, vocab], bitwise,
// in one pass per row and without the [rows, vocab] temporary the eager op writes (8 MB a decode step of
// 64 rows over a 32,000 vocabulary: the op took 4 ms there, mostly writing and re-reading it).
//
// ATen's logsumexp (ReduceOps.cpp) is: maxes = amax(x, -1, keepdim); maxes.masked_fill_(|maxes| == inf, 0);
// sum((x - maxes).exp_(), -1).log_().add_(maxes). Done here the same way, operation by operation:
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
// The caller also checks the whole op against torch's once per process (engine/kernels/trainer_logsumexp.py),
// and sends what ATen reduces another way to torch's op: a single row long enough for ATen to split its
// sum over threads, and rows shorter than one vector.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "aten_sum.h"

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
  std::vector<float> exponentials(static_cast<size_t>(vocab));  // one row's exp(x - max), 128 KB at 32,000
  for (int64_t row = 0; row < rows; ++row) {
    const float* in = x + row * vocab;
    float max = row_max(in, vocab);
    if (std::isinf(max)) max = 0.0f;  // masked_fill_(|maxes| == inf, 0): before the subtraction too
    maxes[row] = max;
    shifted(in, vocab, max, exponentials.data());
    vml().exp(static_cast<int>(vocab), exponentials.data(), exponentials.data(), kAtenVmlMode);
    sums[row] = autobucket_sum::aten_row_sum(
        exponentials.data(), vocab, [](const float* p) { return _mm256_loadu_ps(p); }, [](float value) { return value; });
  }
  if (rows > 0) vml().ln(static_cast<int>(rows), sums, sums, kAtenVmlMode);
  for (int64_t row = 0; row < rows; ++row) sums[row] += maxes[row];
#endif
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("trainer_logsumexp(Tensor logits) -> Tensor");
  m.def("trainer_logsumexp_available() -> bool", &trainer_logsumexp_available);
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) { m.impl("trainer_logsumexp", &trainer_logsumexp); }
