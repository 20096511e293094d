// Sampling one token per row by inverse CDF, in two sweeps over the row and nothing written but the answer.
//
// The token is the first whose cumulative weight exceeds the draw u x total, the weights being
// exp(score - row max) and filtered tokens (-inf) weighing exactly 0 (selection.sample_inverse_cdf
// states the contract; its torch form is the fallback). Why a kernel: that torch form runs softmax
// (writing a [rows, vocab] fp32 tensor), 128-entry block sums, a cumulative sum and gathers, each a pass
// over the logits, which in a decode step the head's weight has just pushed out of cache. Here, per row: sweep one, the maximum (and
// whether any score is NaN); sweep two, each 128-entry block's weight sum in 16-lane vectors
// (lanes.h: the same bits on AVX2 and AVX-512); then the block the draw lands in, found over the
// blocks' running sum in double, is recomputed (the same vector code, so the same weights) and scanned
// entry by entry. A row's answer depends on that row and its draw alone.
//
// Rows it cannot sample (a NaN score, a +inf, or every token filtered) come back as token -1, and the
// caller runs the torch form for the call, so such input behaves exactly as it did before this kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "lanes.h"

#if defined(AUTOBUCKET_LANES)

namespace {

using namespace autobucket_lanes;

constexpr int64_t kBlock = 128;  // entries per block: selection.SAMPLE_BLOCK
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct RowMax {
  float value;
  bool nan;
};

// 16 scores from `at`; past the row's end (fewer than 16 left) -inf, as a filtered token. Whole vectors
// are plain loads: a masked load in every step costs far more than the one masked tail it saves.
inline Lanes scores16(const float* at, int64_t left) {
  return left >= 16 ? load16(at) : load_or(splat(kMinusInf), lanes_below(left), at);
}

RowMax row_max(const float* row, int64_t vocab) {
  Lanes best = splat(kMinusInf);
  LaneMask nan = no_lanes();
  for (int64_t i = 0; i < vocab; i += 16) {
    const Lanes x = scores16(row + i, vocab - i);
    nan = either(nan, unordered(x));
    best = max(best, x);
  }
  return {max_lanes(best), any_lane(nan)};
}

// exp(score - row max) for 16 entries from `at`, filtered (-inf) and absent ones exactly 0
inline Lanes weights16(const float* at, int64_t left, Lanes row_max_lanes) {
  const Lanes x = scores16(at, left);
  return keep(above(x, splat(kMinusInf)), exp_nonpositive(x - row_max_lanes));
}

// the weights of entries [start, end) summed as 16 lanes in entry order, then sum_lanes' fixed tree
float block_weight(const float* row, int64_t start, int64_t end, Lanes row_max_lanes) {
  Lanes sum = zeros();
  if (end - start == kBlock) {  // a whole block: a fixed trip count the compiler unrolls
    for (int64_t i = 0; i < kBlock; i += 16) sum = sum + weights16(row + start + i, 16, row_max_lanes);
  } else {
    for (int64_t i = start; i < end; i += 16) sum = sum + weights16(row + i, end - i, row_max_lanes);
  }
  return sum_lanes(sum);
}

struct Sample {
  int64_t token;
  float logprob;
};

Sample sample_row(const float* row, int64_t vocab, double uniform, std::vector<double>& cumulative) {
  const RowMax top = row_max(row, vocab);
  if (top.nan || !std::isfinite(top.value)) return {-1, std::numeric_limits<float>::quiet_NaN()};
  const Lanes row_max_lanes = splat(top.value);
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  cumulative.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_weight(row, b * kBlock, std::min(vocab, (b + 1) * kBlock), row_max_lanes);
    cumulative[b] = total;
  }
  // the draw, kept strictly below the total (u < 1, but u x total may round up to it)
  const double draw = std::min(uniform * total, std::nextafter(total, 0.0));
  const int64_t block = std::min<int64_t>(
      std::upper_bound(cumulative.begin(), cumulative.end(), draw) - cumulative.begin(), blocks - 1);
  const int64_t start = block * kBlock, end = std::min(vocab, start + kBlock);
  alignas(64) float weights[kBlock];
  for (int64_t i = start; i < end; i += 16) store_aligned(weights + (i - start), weights16(row + i, end - i, row_max_lanes));
  double running = block > 0 ? cumulative[block - 1] : 0.0;
  int64_t token = -1, last_kept = -1;
  for (int64_t i = start; i < end; ++i) {
    const float weight = weights[i - start];
    if (weight > 0.0f) last_kept = i;
    running += weight;
    if (running > draw && weight > 0.0f) {
      token = i;
      break;
    }
  }
  // Rounding can leave the block's entry-by-entry sum at or below a draw its lane-wise sum passed: then
  // the block's last token of non-zero weight is the one (a filtered token is never chosen).
  if (token < 0) token = last_kept;
  const double logprob = static_cast<double>(row[token] - top.value) - std::log(total);
  return {token, static_cast<float>(logprob)};
}

// scores [rows, vocab] fp32, uniforms [rows] fp64 in [0, 1) -> (tokens [rows] int64, logprobs [rows] fp32)
std::tuple<at::Tensor, at::Tensor> sample_inverse_cdf(const at::Tensor& scores, const at::Tensor& uniforms) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.size(1) > 0,
              "sample_inverse_cdf takes fp32 scores [rows, vocab] with vocab > 0");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble && uniforms.size(0) == scores.size(0),
              "sample_inverse_cdf takes fp64 uniforms [rows]");
  const at::Tensor rows = scores.contiguous();
  const at::Tensor draws = uniforms.contiguous();
  const int64_t count = rows.size(0), vocab = rows.size(1);
  at::Tensor tokens = at::empty({count}, rows.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({count}, rows.options());
  const float* data = rows.data_ptr<float>();
  const double* u = draws.data_ptr<double>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* logprob_out = logprobs.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    std::vector<double> cumulative;
    for (int64_t r = first; r < last; ++r) {
      const Sample sample = sample_row(data + r * vocab, vocab, u[r], cumulative);
      token_out[r] = sample.token;
      logprob_out[r] = sample.logprob;
    }
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("sample_inverse_cdf(Tensor scores, Tensor uniforms) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) { m.impl("sample_inverse_cdf", &sample_inverse_cdf); }

#endif
