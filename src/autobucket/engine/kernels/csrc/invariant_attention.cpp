// Batch-invariant attention over any key layout (static cache, padded batch, packed row, chunk + prefix).
//
// The guarantee: the output for one (row, query head, query) depends only on that query vector and on
// the ordered list of keys/values it may see, never on the batch, the other rows, the row's column
// offset, padding, gaps in the cache, or how many queries run at once. So a token gets bitwise the same
// attention output in decode (one query over the static cache), chunked prefill (a chunk over its
// cached prefix), packed or padded prefill, and a trainer's teacher-forced forward.
//
// How: each query walks its own allowed keys in column order (masked columns are skipped and never
// read) in blocks of kBlockKeys counted by rank from its first allowed key. Per block: scores
// q.k (fixed-order dot product: kLanes partial sums over head_dim, then a fixed tree), block max,
// exponentials, the block's sum and its P.V in key order, merged into the running (max, sum, output)
// in block order (online softmax). Nothing in that order depends on anything but the sequence.
// Grouped-query attention reads each K/V head once for all query heads that share it (no repeat_kv).
//
// Two forms of that algorithm, one per build (so one per machine, and a model's every call runs the same
// one): AVX-512 and AVX2 builds with head_dim a multiple of 16 (up to 128) run the vector form (written
// once over 16-lane vectors, so both widths give the same bits); every other build or head_dim runs the
// portable `attend_one`. Each is invariant; the two forms differ from each other in the last bits.
// The vector form has two ways of forming the same scores, bitwise equal by construction (and tested):
// `attend_blocks` for work items of few queries (decode: one dot product per key, the cache read in place;
// also an fp32 cascade prefix's heads on AVX2) and `attend_queries_tiled` for many (prefill, chunks: each
// key list transposed once, 16 keys' scores per vector, the queries of a tile sharing each key block in
// L1). Both end in the same softmax_block and add_values, which run the P.V of several heads together
// without changing any head's sums.
// Their speed against the portable form and SDPA: benchmarks/kernels/decode_attention.py and
// prefill_attention.py, with the figures per CPU kind in docs/kernels.md.
//
// Built at first use by torch.utils.cpp_extension (see invariant_attention.py); no -ffast-math, so the
// compiler never reassociates a sum, and -ffp-contract=off, so it never fuses a multiply and an add
// the source wrote apart (the two score forms must round alike).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "balanced_parallel.h"
#include "cpu_vendor.h"
#include "lanes.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockKeys = 64;  // keys per softmax block, counted from the query's first allowed key
constexpr int kLanes = 16;          // partial sums of a dot product (one AVX-512 or two AVX2 registers)
constexpr int kMaxGroup = 16;       // most query heads sharing one K/V head handled together

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores minus their running max), branch-free so a loop of them vectorizes:
// 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 in two parts, p Cephes' degree-6 polynomial
// (about 1 ulp on [-ln2/2, ln2/2]). Deterministic: the same x gives the same bits on every call.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below, 2^n would leave the normal range: exp is ~1e-38 there anyway
  // round to nearest by the 1.5 * 2^23 trick (exact for |x / ln 2| < 2^22; vectorizes, unlike nearbyint)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// q (fp32, head_dim) . k (head_dim): kLanes partial sums in index order, then a fixed pairwise tree.
template <typename T>
inline float dot(const float* q, const T* k, int64_t head_dim) {
  float lanes[kLanes] = {0.0f};
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += q[d + l] * as_float(k[d + l]);
  }
  for (int l = 0; d < head_dim; ++d, ++l) lanes[l] += q[d] * as_float(k[d]);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}


#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define AUTOBUCKET_ATTENTION_VECTORS 1
// The vector form of the same algorithm (the build's choice, fixed per machine: a model's every call runs
// the same code). head_dim = 16 * C: a dot product is 16 lanes' partial sums, one FMA chain over the C
// chunks each, then a fixed halving tree over the lanes (sum_lanes); the block's exponentials and their
// sum run as 16-lane vectors, unused lanes exactly zero. keys[j] / values[j] point at fp32 vectors, or at
// bf16 ones widened as they are loaded (exact: a bf16 is the top half of its fp32, so both give the
// kernel the same fp32 values and the same bits out). A bf16 cache is read in place by work items of few
// queries (decode) and widened once per key list for many (prefill), see attend_all. head_dim up to 128.
// `Lanes` and its operations (sum_lanes, max_lanes, exp_nonpositive): lanes.h.
using namespace autobucket_lanes;

inline float exp_nonpositive_scalar(float x) { return first_lane(exp_nonpositive(splat(x))); }

// Whether decode forms its scores eight keys at a time (sum_lanes8) rather than key by key; the same bits.
// Eight at once folds eight keys' lane trees together, so fewer horizontal adds per key: every AVX2 build
// (where it pays together with the block-ahead prefetch below, not alone) and AVX-512 builds on Intel CPUs.
// AVX-512 AMD CPUs keep the per-key form, the one benchmarks/kernels/attention_ab.py has compared there.
inline bool eight_scores_at_once() {
#if defined(__AVX512F__)
  static const bool on = cpu_vendor() == CpuVendor::kIntel;
  return on;
#else
  return true;
#endif
}

// Eight keys' scores at once: lane t is sum_lanes of key t's dot product, given as its folded halves
// (fold_halves_add, the tree's first step). The same tree, as vector steps over the eight keys: the
// halves l + l+4 (keys t and t+4 share a vector), then l + l+2, then l + l+1; every lane adds the same
// two values sum_lanes adds, so each score is bitwise its per-key form, with no horizontal sum per key.
inline __m256 sum_lanes8(const __m256* folded) {
  const auto halves = [](__m256 a, __m256 b) {  // [a's l + l+4 | b's l + l+4], l < 4
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x31), _mm256_permute2f128_ps(a, b, 0x20));
  };
  const __m256 k04 = halves(folded[0], folded[4]), k15 = halves(folded[1], folded[5]);
  const __m256 k26 = halves(folded[2], folded[6]), k37 = halves(folded[3], folded[7]);
  const auto pairs = [](__m256 x, __m256 y) {  // per 128-bit half: [x's l + l+2 | y's l + l+2], l < 2
    return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m256 k0145 = pairs(k04, k15), k2367 = pairs(k26, k37);
  // l + l+1: keys 0-3 in the low half, 4-7 in the high half, in key order
  return _mm256_add_ps(_mm256_shuffle_ps(k0145, k2367, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(k0145, k2367, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One head's online-softmax state over its blocks.
template <int C>
struct HeadState {
  alignas(64) float acc[16 * C];
  float max, sum;
  void reset() {
    std::fill(acc, acc + 16 * C, 0.0f);
    max = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  }
};

// Merge one block's scaled scores (scores[0, n), 64-byte aligned) into a head's running max and sum:
// scores become the block's exponentials, and the factor its accumulator must be scaled by is returned.
// Every score form ends here and in add_values, so forms can differ only in how they form q.k, and they
// form it identically.
template <int C>
inline float softmax_block(float* scores, int64_t n, bool first_block, HeadState<C>& head) {
  Lanes maxv = splat(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v * 16 < n; ++v) {  // max is exact: any order gives the same value
    maxv = max(maxv, load_aligned_or(maxv, lanes_below(n - v * 16), scores + v * 16));
  }
  const float new_max = std::max(head.max, max_lanes(maxv));
  const float rescale = first_block ? 0.0f : exp_nonpositive_scalar(head.max - new_max);
  Lanes sum = zeros();
  for (int64_t v = 0; v * 16 < n; ++v) {
    const LaneMask live = lanes_below(n - v * 16);
    const Lanes x = load_aligned_or_zero(live, scores + v * 16) - splat(new_max);
    const Lanes e = keep(live, exp_nonpositive(x));
    store_aligned(scores + v * 16, e);
    sum = sum + e;
  }
  head.sum = head.sum * rescale + sum_lanes(sum);
  head.max = new_max;
  return rescale;
}

// One block's P.V for R heads' rows at once: row r's accumulator times rescale[r], then + p[r][j] * v_j
// for its keys j < n[r] in key order. Each row's sums are exactly those it would get alone; together,
// one load of a value vector feeds R rows and R * C FMA chains run side by side (one row's C chains
// alone wait on the FMA latency). values[j]: key j's value vector (fp32, or bf16 read in place).
template <int C, int R, typename KV>
inline void add_values(const float* const* p, const int64_t* n, const float* rescale, const KV* const* values,
                       HeadState<C>* const* head) {
  Lanes av[R][C];
  for (int r = 0; r < R; ++r) {
    const Lanes scale = splat(rescale[r]);
    for (int c = 0; c < C; ++c) av[r][c] = load_aligned(head[r]->acc + 16 * c) * scale;
  }
  int64_t common = n[0];
  for (int r = 1; r < R; ++r) common = std::min(common, n[r]);
  for (int64_t j = 0; j < common; ++j) {
    const KV* v = values[j];
    for (int c = 0; c < C; ++c) {
      const Lanes x = load16(v + 16 * c);
      for (int r = 0; r < R; ++r) av[r][c] = fmadd(splat(p[r][j]), x, av[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {  // the rows' keys past the shortest one's, each row alone
    for (int64_t j = common; j < n[r]; ++j) {
      const Lanes pj = splat(p[r][j]);
      for (int c = 0; c < C; ++c) av[r][c] = fmadd(pj, load16(values[j] + 16 * c), av[r][c]);
    }
    for (int c = 0; c < C; ++c) store_aligned(head[r]->acc + 16 * c, av[r][c]);
  }
}

// Rows taken together by add_values: enough FMA chains to hide the latency (R * C >= 8), one value load
// shared by several rows, and at most 16 accumulators in registers (more rows would spill them; fewer
// leave the FMA latency exposed at head_dim 128).
#if defined(__AVX512F__)
constexpr int kAccumulatorLanes = 16;  // Lanes accumulators add_values keeps in registers (32 registers)
#else
constexpr int kAccumulatorLanes = 6;   // 12 of AVX2's 16 registers
#endif
constexpr int rows_together(int C) { return std::max(1, std::min(8, kAccumulatorLanes / C)); }

// add_values for `rows` <= rows_together(C) rows (the min only keeps templates of more rows than C
// allows from being built).
template <int C, typename KV>
inline void add_values_of(int rows, const float* const* p, const int64_t* n, const float* rescale,
                          const KV* const* values, HeadState<C>* const* head) {
  switch (rows) {
    case 1: add_values<C, 1>(p, n, rescale, values, head); break;
    case 2: add_values<C, std::min(2, rows_together(C))>(p, n, rescale, values, head); break;
    case 3: add_values<C, std::min(3, rows_together(C))>(p, n, rescale, values, head); break;
    case 4: add_values<C, std::min(4, rows_together(C))>(p, n, rescale, values, head); break;
    case 5: add_values<C, std::min(5, rows_together(C))>(p, n, rescale, values, head); break;
    case 6: add_values<C, std::min(6, rows_together(C))>(p, n, rescale, values, head); break;
    case 7: add_values<C, std::min(7, rows_together(C))>(p, n, rescale, values, head); break;
    default: add_values<C, std::min(8, rows_together(C))>(p, n, rescale, values, head); break;
  }
}

// Rows of one block waiting for their P.V: collected by `add` (up to Capacity, then flushed), run
// rows_together(C) at a time. A row's P.V is the same sums whenever it runs after its own scores.
template <int C, typename KV, int Capacity = rows_together(C)>
struct PendingRows {
  static constexpr int kMax = Capacity;
  alignas(64) float probs[kMax][kBlockKeys];
  const float* p[kMax];
  int64_t n[kMax];
  float rescale[kMax];
  HeadState<C>* head[kMax];
  int count = 0;
  const KV* const* values = nullptr;  // the block's first key's value vector

  PendingRows() {
    for (int r = 0; r < kMax; ++r) p[r] = probs[r];
  }
  // A block's rows: start(the block's first value vector), then per row its scores into next_scores(),
  // then add(the row); flush() once the block's rows are in.
  void start(const KV* const* block_values) { values = block_values; }
  float* next_scores() { return probs[count]; }
  void add(int64_t keys, float factor, HeadState<C>* state) {
    n[count] = keys, rescale[count] = factor, head[count] = state;
    if (++count == kMax) flush();
  }
  void flush() {
    for (int first = 0; first < count; first += rows_together(C)) {
      const int taken = std::min(rows_together(C), count - first);
      add_values_of<C>(taken, p + first, n + first, rescale + first, values, head + first);
    }
    count = 0;
  }
};

template <int C>
inline void write_normalized(const HeadState<C>& head, bool any_keys, float* out) {
  for (int64_t d = 0; d < 16 * C; ++d) out[d] = any_keys ? head.acc[d] / head.sum : 0.0f;
}

// How decode asks for its K/V ahead of use (`attend_query`); a hint only, no value depends on it. A decode
// step's attention streams its cache from DRAM (the weights streamed through the caches just before), so
// the reads' latency is what a fetch ahead hides, most of all each value vector's, read while the scores
// are formed rather than after.
// - kKeysAhead (Intel CPUs): while the first head scores key j, key j + kPrefetchKeys's K and V into L1.
// - kBlockAhead (AMD CPUs): while the first head scores key j, key j's V into L1 (the block's P.V reads
//   it next) and the next block's key j's K into L2 (the next block's scores read it). Keys ahead into L1
//   compete there with the block in use, a block ahead into L2 does not; beside the per-key scores it does
//   not pay, so it runs beside the eight-key form only.
// The speed of each form per CPU kind: benchmarks/kernels/decode_attention.py, docs/kernels.md.
enum class DecodePrefetch { kKeysAhead, kBlockAhead };
constexpr int64_t kPrefetchKeys = 4;  // kKeysAhead's distance (a wide range of distances does alike)

DecodePrefetch decode_prefetch_form() {
  static const DecodePrefetch form = cpu_vendor() == CpuVendor::kIntel ? DecodePrefetch::kKeysAhead : DecodePrefetch::kBlockAhead;
  return form;
}

// Where it pays: Intel CPUs, and AMD ones running the eight-key scores (AVX2 builds; an AVX-512 AMD CPU
// keeps the hardware's prefetch alone). A build that defines AUTOBUCKET_DECODE_PREFETCH (1 on, 0 off) fixes
// the choice whatever the CPU, so the kernel can be built both ways beside the library and the two
// compared bitwise and timed (tests/test_invariant_attention.py, benchmarks/kernels/decode_attention.py).
bool decode_prefetch() {
#if defined(AUTOBUCKET_DECODE_PREFETCH)
  return AUTOBUCKET_DECODE_PREFETCH != 0;
#else
  static const bool on = cpu_vendor() == CpuVendor::kIntel || (cpu_vendor() == CpuVendor::kAmd && eight_scores_at_once());
  return on;
#endif
}

// `bytes` from p into L1 (T0) or L2 (T1), one line at a time.
template <int kHint>
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + byte, static_cast<_mm_hint>(kHint));
}

// Decode's prefetch while the first head scores key `j` of `count` (block of kBlockKeys from `first`).
template <int C, typename KV>
inline void prefetch_for_key(DecodePrefetch form, const KV* const* keys, const KV* const* values, int64_t first,
                             int64_t j, int64_t count) {
  constexpr int64_t kBytes = 16 * C * sizeof(KV);
  const int64_t key = first + j;
  if (form == DecodePrefetch::kKeysAhead) {
    if (key + kPrefetchKeys < count) {
      prefetch_lines<_MM_HINT_T0>(keys[key + kPrefetchKeys], kBytes);
      prefetch_lines<_MM_HINT_T0>(values[key + kPrefetchKeys], kBytes);
    }
    return;
  }
  prefetch_lines<_MM_HINT_T0>(values[key], kBytes);
  if (key + kBlockKeys < count) prefetch_lines<_MM_HINT_T1>(keys[key + kBlockKeys], kBytes);
}

// Heads sharing one key list (a query's group of heads; or, for a cascade's shared prefix, the group's rows'
// heads) over its keys [0, count) in blocks, from the states in heads[0, group): q [group][16 C] fp32;
// fresh: the states are empty (the first block sets them rather than rescales them). KV: the keys' and
// values' element type (float, or bf16 read in place). Each head's arithmetic is its own: how many heads
// share the walk changes the time only.
template <int C, typename KV, int Pending = rows_together(C)>
void attend_blocks(const float* q, int64_t group, const KV* const* keys, const KV* const* values, int64_t count,
                   float scale, HeadState<C>* heads, bool fresh) {
  const bool prefetch_ahead = decode_prefetch();
  const DecodePrefetch form = decode_prefetch_form();
  const bool eight_at_once = eight_scores_at_once();
  PendingRows<C, KV, Pending> pending;
  for (int64_t first = 0; first < count; first += kBlockKeys) {
    const int64_t n = std::min(kBlockKeys, count - first);
    pending.start(values + first);
    for (int64_t g = 0; g < group; ++g) {  // the block's keys stay in L1 across the group's heads
      Lanes qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load16(q + g * 16 * C + 16 * c);
      float* scores = pending.next_scores();
      const bool prefetch = prefetch_ahead && g == 0;  // the first head's pass brings the block in
      const auto dot_of = [&](int64_t j) {  // key first + j's 16 lane sums
        if (prefetch) prefetch_for_key<C>(form, keys, values, first, j, count);
        const KV* k = keys[first + j];
        Lanes dot = qv[0] * load16(k);
        for (int c = 1; c < C; ++c) dot = fmadd(qv[c], load16(k + 16 * c), dot);
        return dot;
      };
      int64_t j = 0;
      if (eight_at_once) {
        for (; j + 8 <= n; j += 8) {  // eight keys' trees at once (scores is 64-byte aligned)
          __m256 folded[8];
          for (int t = 0; t < 8; ++t) folded[t] = fold_halves_add(dot_of(j + t));
          _mm256_store_ps(scores + j, _mm256_mul_ps(sum_lanes8(folded), _mm256_set1_ps(scale)));
        }
      }
      for (; j < n; ++j) scores[j] = sum_lanes(dot_of(j)) * scale;
      pending.add(n, softmax_block<C>(scores, n, first == 0 && fresh, heads[g]), &heads[g]);
    }
    pending.flush();
  }
}

// One query's group of heads over its keys; q [group][16 C] fp32 in, out [group][16 C] fp32 (normalized).
// The form for few queries (decode). `resume`: null, or the group's HeadState<C>s after the keys before
// these (a whole number of blocks: a cascade's shared prefix), to go on from as the same sequence would.
template <int C, typename KV>
void attend_query(const float* q, int64_t group, const KV* const* keys, const KV* const* values,
                  int64_t count, float scale, float* out, const void* resume) {
  const auto* resumed = static_cast<const HeadState<C>*>(resume);
  HeadState<C> heads[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    if (resumed != nullptr) {
      heads[g] = resumed[g];
    } else {
      heads[g].reset();
    }
  }
  attend_blocks<C, KV>(q, group, keys, values, count, scale, heads, resumed == nullptr);
  for (int64_t g = 0; g < group; ++g) write_normalized(heads[g], count > 0 || resumed != nullptr, out + g * 16 * C);
}

// The states of `heads` heads, q [heads][16 C] fp32, after the keys [0, count) of one list read in place
// (a cascade's shared prefix, whole blocks): states_out [heads] HeadState<C>. Up to kPrefixPending heads'
// scores of a block run before their P.V, so the block's keys, then its values, stay in L1 across them
// (P.V right after each head's scores, as decode runs it, evicts the block's keys between heads and
// gives up most of what reading the prefix in place saves over the tiles).
constexpr int kPrefixPending = 32;
template <int C, typename KV>
void prefix_states_in_place(const float* q, int64_t heads, const KV* const* keys, const KV* const* values,
                            int64_t count, float scale, void* states_out) {
  auto* states = static_cast<HeadState<C>*>(states_out);
  for (int64_t h = 0; h < heads; ++h) states[h].reset();
  attend_blocks<C, KV, kPrefixPending>(q, heads, keys, values, count, scale, states, true);
}

// The same for many queries over one key list (prefill, chunks). The keys are transposed once per list
// into tiles of 16 ([tile][head_dim][16 keys] fp32), so 16 keys' scores are formed as vectors, one per
// lane l of attend_query's dot product (vector l holds lane l's partial sum over head_dim's C chunks, in
// the same chunk order, for each of the 16 keys), added by sum_lanes' halving tree as vector adds: no
// horizontal sum per key, and bitwise attend_query's scores. RS rows (query heads) at a time share each
// tile load. lane_sums .. tree_sum evaluate that tree depth first, so few vectors are live at once.
#if defined(__AVX512F__)
constexpr int kScoreRows = 4;
#else
constexpr int kScoreRows = 2;  // AVX2: a Lanes is two registers, so half the rows keep the tree's vectors in registers
#endif

template <int C, int RS>
inline void lane_sums(const float* const* q, const float* tile, int l, Lanes* out) {
  const Lanes first = load16(tile + l * 16);  // tile row d: the 16 keys' element d
  for (int r = 0; r < RS; ++r) out[r] = splat(q[r][l]) * first;
  for (int c = 1; c < C; ++c) {
    const Lanes t = load16(tile + (16 * c + l) * 16);
    for (int r = 0; r < RS; ++r) out[r] = fmadd(splat(q[r][16 * c + l]), t, out[r]);
  }
}

// The sum of lanes l, l + step, l + 2 step, ... below 16, by the tree of sum_lanes (pairs step 8 apart
// first): tree_sum(0, 1) is the whole score.
template <int C, int RS>
inline void tree_sum(const float* const* q, const float* tile, int l, int step, Lanes* out) {
  if (step == 8) {
    Lanes high[RS];
    lane_sums<C, RS>(q, tile, l, out);
    lane_sums<C, RS>(q, tile, l + 8, high);
    for (int r = 0; r < RS; ++r) out[r] = out[r] + high[r];
    return;
  }
  Lanes other[RS];
  tree_sum<C, RS>(q, tile, l, step * 2, out);
  tree_sum<C, RS>(q, tile, l + step, step * 2, other);
  for (int r = 0; r < RS; ++r) out[r] = out[r] + other[r];
}

// RS rows' scaled scores for the block's keys [0, n): scores[r][0, n) (64-byte aligned rows).
template <int C, int RS>
inline void tile_scores(const float* const* q, const float* block_tiles, int64_t n, float scale, float* const* scores) {
  constexpr int64_t kTile = 16 * 16 * C;  // floats per tile
  const Lanes scale_v = splat(scale);
  for (int64_t v = 0; v * 16 < n; ++v) {
    Lanes sums[RS];
    tree_sum<C, RS>(q, block_tiles + v * kTile, 0, 1, sums);
    for (int r = 0; r < RS; ++r) store_aligned(scores[r] + v * 16, sums[r] * scale_v);
  }
}

// q [queries][group][16 C] fp32, counts[queries] (each a prefix of the list), out like q; values: fp32
// value vectors in list order; states: room for queries * group HeadStates; probs: room for queries *
// group rows of kBlockKeys floats (64-byte aligned). The queries take each key block in turn, in three
// passes: every row's scores (the block's keys in L1), their softmax, every row's P.V (the block's
// values in L1); so a block's keys and values are read from L1 by all the queries, not streamed from
// L2 per query. Each row's own arithmetic is unchanged by its neighbours.
template <int C>
void attend_queries_tiled(const float* q, int64_t queries, int64_t group, const float* tile_keys,
                          const float* const* values, const int64_t* counts, float scale, float* out,
                          void* states, float* probs) {
  constexpr int64_t kTile = 16 * 16 * C;
  static_assert(sizeof(HeadState<C>) == 64 * (C + 1), "attend_all sizes the states as C + 1 vectors each");
  HeadState<C>* heads = static_cast<HeadState<C>*>(states);
  const int64_t rows = queries * group;
  for (int64_t r = 0; r < rows; ++r) heads[r].reset();
  std::vector<int64_t> live;  // this block's rows with keys in it
  std::vector<int64_t> n(static_cast<size_t>(rows));
  std::vector<float> rescale(static_cast<size_t>(rows));
  const int64_t longest = *std::max_element(counts, counts + queries);
  for (int64_t first = 0; first < longest; first += kBlockKeys) {
    const float* block_tiles = tile_keys + first / 16 * kTile;
    live.clear();
    for (int64_t r = 0; r < rows; ++r) {
      n[r] = std::min(kBlockKeys, counts[r / group] - first);
      if (n[r] > 0) live.push_back(r);
    }
    const int64_t count = static_cast<int64_t>(live.size());
    for (int64_t i = 0; i < count; i += kScoreRows) {  // scores; a short chunk repeats its first row
      const float* q_rows[kScoreRows];
      float* score_rows[kScoreRows];
      alignas(64) float unused[kScoreRows][kBlockKeys];
      int64_t widest = 0;
      for (int r = 0; r < kScoreRows; ++r) {
        const bool real = i + r < count;
        const int64_t row = live[real ? i + r : i];
        q_rows[r] = q + row * 16 * C;
        score_rows[r] = real ? probs + row * kBlockKeys : unused[r];
        widest = std::max(widest, n[row]);
      }
      tile_scores<C, kScoreRows>(q_rows, block_tiles, widest, scale, score_rows);
    }
    for (const int64_t row : live) rescale[row] = softmax_block<C>(probs + row * kBlockKeys, n[row], first == 0, heads[row]);
    constexpr int kTogether = rows_together(C);
    for (int64_t i = 0; i < count; i += kTogether) {  // P.V, kTogether rows at a time
      const int taken = static_cast<int>(std::min<int64_t>(kTogether, count - i));
      const float* p[kTogether];
      int64_t keys[kTogether];
      float factor[kTogether];
      HeadState<C>* state[kTogether];
      for (int r = 0; r < taken; ++r) {
        const int64_t row = live[i + r];
        p[r] = probs + row * kBlockKeys, keys[r] = n[row], factor[r] = rescale[row], state[r] = &heads[row];
      }
      add_values_of<C>(taken, p, keys, factor, values + first, state);
    }
  }
  for (int64_t r = 0; r < rows; ++r) write_normalized(heads[r], counts[r / group] > 0, out + r * 16 * C);
}

// The vector form's instance for a head_dim: make(std::integral_constant<int, head_dim / 16>{}) for head_dim
// 16, 32, ..., 128, else null (the portable loop). The one place the head sizes the kernels are built for
// are listed.
template <typename Kernel, typename Make>
inline Kernel for_head_dim(int64_t head_dim, Make make) {
  switch (head_dim) {
    case 16: return make(std::integral_constant<int, 1>{});
    case 32: return make(std::integral_constant<int, 2>{});
    case 48: return make(std::integral_constant<int, 3>{});
    case 64: return make(std::integral_constant<int, 4>{});
    case 80: return make(std::integral_constant<int, 5>{});
    case 96: return make(std::integral_constant<int, 6>{});
    case 112: return make(std::integral_constant<int, 7>{});
    case 128: return make(std::integral_constant<int, 8>{});
    default: return nullptr;
  }
}

using TiledKernel = void (*)(const float*, int64_t, int64_t, const float*, const float* const*, const int64_t*, float,
                            float*, void*, float*);

inline TiledKernel tiled_kernel_for(int64_t head_dim) {
  return for_head_dim<TiledKernel>(head_dim, [](auto chunks) -> TiledKernel {
    return attend_queries_tiled<decltype(chunks)::value>;
  });
}

template <typename KV>
using QueryKernel = void (*)(const float*, int64_t, const KV* const*, const KV* const*, int64_t, float, float*,
                             const void*);

template <typename KV>
inline QueryKernel<KV> query_kernel_for(int64_t head_dim) {  // null: the portable loop below
  return for_head_dim<QueryKernel<KV>>(head_dim, [](auto chunks) -> QueryKernel<KV> {
    return attend_query<decltype(chunks)::value, KV>;
  });
}
#endif

struct Strides {
  int64_t row, head, token;  // elements; the last (head_dim) dimension is contiguous
};

inline Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// One (row, K/V head, query): its group of query heads over its keys in order, `keys[j]` / `values[j]`
// pointing at key j's head_dim vector (wherever it lives: the row's own columns, a shared prompt's copy).
template <typename T>
void attend_one(const T* q_base, Strides qs, T* out_base, Strides os, int64_t row, int64_t kv_head,
                int64_t group, int64_t query, const T* const* keys, const T* const* values, int64_t count,
                int64_t head_dim, float scale, std::vector<float>& work) {
  // work: [group][head_dim] query in fp32 | [group][head_dim] output | [group][kBlockKeys] scores
  work.resize(static_cast<size_t>(group) * (2 * head_dim + kBlockKeys));
  float* q = work.data();
  float* acc = q + group * head_dim;
  float* scores = acc + group * head_dim;
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    const T* src = q_base + row * qs.row + (kv_head * group + g) * qs.head + query * qs.token;
    for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = as_float(src[d]);
    std::fill(acc + g * head_dim, acc + (g + 1) * head_dim, 0.0f);
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
  for (int64_t first = 0; first < count; first += kBlockKeys) {
    const int64_t n = std::min(kBlockKeys, count - first);
    for (int64_t j = 0; j < n; ++j) {  // scores of the block: each key read once for the whole group
      const T* k = keys[first + j];
      for (int64_t g = 0; g < group; ++g) scores[g * kBlockKeys + j] = dot(q + g * head_dim, k, head_dim) * scale;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * kBlockKeys;
      float block_max = s[0];
      for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, s[j]);
      const float new_max = std::max(running_max[g], block_max);
      const float rescale = first == 0 ? 0.0f : exp_nonpositive(running_max[g] - new_max);
      float block_sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - new_max);
      for (int64_t j = 0; j < n; ++j) block_sum += s[j];  // in key order
      running_sum[g] = running_sum[g] * rescale + block_sum;
      running_max[g] = new_max;
      float* a = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale;
    }
    for (int64_t j = 0; j < n; ++j) {  // P.V of the block, in key order, each value row read once
      const T* v = values[first + j];
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * kBlockKeys + j];
        float* a = acc + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * as_float(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* dst = out_base + row * os.row + query * os.token + (kv_head * group + g) * os.head;
    const float sum = running_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(count == 0 ? 0.0f : acc[g * head_dim + d] / sum);
  }
}

// Keys read before a row's own (cascade decode): row r of `group` >= 0 sees the first `length[g]` keys of
// shared_key[g] / shared_value[g] ([groups, kv_heads, shared, head_dim]) and then its own allowed columns,
// exactly as if they were one sequence (the same blocks, the same order); empty tensors: none.
struct Shared {
  const at::Tensor* key = nullptr;
  const at::Tensor* value = nullptr;
  const int64_t* length = nullptr;  // [groups]
  const int64_t* group = nullptr;   // [rows], -1: no shared keys
  const at::Tensor* tiles = nullptr;  // shared_prefix_tiles' output for these keys, or null: transposed per call
  // [rows] or null: the shared keys a row does not read, its first ones (a sliding window that ends inside the
  // shared prompt: the row reads keys [skip, length), then its own, the window's keys in their order)
  const int64_t* skip = nullptr;

  int64_t skipped(int64_t row) const { return skip != nullptr ? skip[row] : 0; }
};

// Queries of one (row, K/V head) handled by one work item: a prefill's queries share one transposed copy
// of their keys (attend_queries_tiled), taken in tiles of kQueryTile queries per key block.
constexpr int64_t kQueryChunk = 64;
constexpr int64_t kQueryTile = 16;
// Items of at most this many queries run attend_query on the cache in place (a decode step's one query per
// row: transposing would write and read every key once more for one use).
constexpr int64_t kInPlaceQueries = 4;

#if defined(AUTOBUCKET_LANES)
// rows[i][t] -> rows[t][i] for an 8 x 8 block of floats (moves only: every value kept exactly)
inline void transpose8x8(__m256* rows) {
  __m256 pairs[8], quads[8];
  for (int i = 0; i < 8; i += 2) {
    pairs[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    quads[i] = _mm256_shuffle_ps(pairs[i], pairs[i + 2], 0x44);
    quads[i + 1] = _mm256_shuffle_ps(pairs[i], pairs[i + 2], 0xEE);
    quads[i + 2] = _mm256_shuffle_ps(pairs[i + 1], pairs[i + 3], 0x44);
    quads[i + 3] = _mm256_shuffle_ps(pairs[i + 1], pairs[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x20);
    rows[i + 4] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x31);
  }
}
#endif

// keys[j][0, head_dim) -> tiles [ceil(n / 16)][head_dim][16] fp32, lanes past n zero. A bf16 list's whole
// runs of 8 keys are widened and transposed 8 x 8 in registers where the CPU has AVX2 (bitwise the
// key-by-key scatter; it pays on bf16 prefill and on the cascade, which re-tiles each group's shared keys
// in every layer). fp32 lists keep the scatter: with no widening to share the pass, it did not pay there.
template <typename T>
void transpose_into_tiles(const T* const* keys, int64_t n, int64_t head_dim, float* tiles) {
  int64_t j = 0;
#if defined(AUTOBUCKET_LANES)
  if constexpr (!std::is_same_v<T, float>)
    for (; head_dim % 8 == 0 && j + 8 <= n; j += 8) {
      float* dst = tiles + (j / 16) * 16 * head_dim + j % 16;  // runs of 8 start at lane 0 or 8 of a tile
      for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 block[8];
        for (int i = 0; i < 8; ++i) block[i] = widen8(keys[j + i] + d);
        transpose8x8(block);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (d + i) * 16, block[i]);
      }
    }
#endif
  for (; j < n; ++j) {
    float* dst = tiles + (j / 16) * 16 * head_dim + j % 16;
    for (int64_t d = 0; d < head_dim; ++d) dst[d * 16] = as_float(keys[j][d]);
  }
  if (n % 16 != 0) {  // the last tile's lanes past n
    float* last = tiles + (n / 16) * 16 * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) std::fill(last + d * 16 + n % 16, last + d * 16 + 16, 0.0f);
  }
}

// One key list transposed for attend_queries_tiled: tiles [ceil(count / 16)][head_dim][16] fp32 (lanes past
// count zero), and the values as fp32 vectors in list order (a bf16 list widened, exactly, into `widened`).
template <typename T>
struct TiledList {
  std::vector<const T*> keys, values;  // the list the tiles hold
  int64_t count = -1;                  // -1: none yet
  std::vector<float> tiles, widened;
  std::vector<const float*> value_fp32;

  // Does a query whose own list is (keys, values)[0, n) read a prefix of this one? Then its blocks are
  // this list's first blocks, counted from the same first key.
  bool holds_prefix(const std::vector<const T*>& k, const std::vector<const T*>& v, int64_t n) const {
    return n <= count && std::equal(k.begin(), k.begin() + n, keys.begin()) &&
           std::equal(v.begin(), v.begin() + n, values.begin());
  }

  void take(std::vector<const T*>& k, std::vector<const T*>& v, int64_t n, int64_t head_dim) {
    std::swap(keys, k), std::swap(values, v);
    count = n;
    const int64_t tile_count = (n + 15) / 16;
    tiles.resize(static_cast<size_t>(tile_count * 16 * head_dim));
    transpose_into_tiles(keys.data(), n, head_dim, tiles.data());
    value_fp32.resize(static_cast<size_t>(n));
    if constexpr (std::is_same_v<T, float>) {
      std::copy(values.begin(), values.begin() + n, value_fp32.begin());
    } else {
      widened.resize(static_cast<size_t>(n * head_dim));
      for (int64_t j = 0; j < n; ++j) {
        float* dst = widened.data() + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(values[j][d]);
        value_fp32[j] = dst;
      }
    }
  }
};

#if defined(AUTOBUCKET_ATTENTION_VECTORS)
// Query `qi` of `row`: the group of heads sharing K/V head `kv_head`, as fp32 [group][head_dim] into fp32.
template <typename T>
inline void load_query_group(const T* q, Strides qs, int64_t row, int64_t kv_head, int64_t group, int64_t qi,
                             int64_t head_dim, float* fp32) {
  for (int64_t h = 0; h < group; ++h) {
    const T* src = q + row * qs.row + (kv_head * group + h) * qs.head + qi * qs.token;
    for (int64_t d = 0; d < head_dim; ++d) fp32[h * head_dim + d] = as_float(src[d]);
  }
}

// Cascade decode's shared prefix as one tile. A decode step's rows that share a prompt copy (`Shared`) all
// read its keys first, in the same blocks: the prefix's whole blocks are the same work for every row of the
// group but its query. So the group's queries take them together in attend_queries_tiled (16 keys' scores
// per vector, each key block read from L1 by all of them), and each row goes on from its states
// (attend_query's `resume`) over the prefix's last partial block and its own keys: the same blocks in the
// same order, so bitwise the per-row result. It saves the per-row walk's repeated score work; the keys'
// reads it saves less, since the group's rows already find the shared keys in L2. Groups with fewer rows
// in the call than this keep the per-row form.
constexpr int64_t kCascadeMinRows = 2;
// AVX2 builds take an fp32 prefix in place instead (prefix_states_in_place): the group's heads walk the
// cache's keys block by block with decode's eight-key scores, all of a block's scores before its P.V
// (each K and V block read from L1 by every head), and no transposed copy. The same scores, softmax and
// P.V, so the same bits, without writing and reading the transposed copy. A bf16 prefix keeps the tiles
// (in place it would widen every key once per head rather than once), and AVX-512 builds keep them (the
// form benchmarks/kernels/attention_ab.py has compared there).
#if defined(__AVX512F__)
constexpr bool kCascadePrefixInPlace = false;
#else
constexpr bool kCascadePrefixInPlace = true;
#endif

// Per (row, K/V head): the group's HeadStates after the row's shared prefix's whole blocks.
struct PrefixStates {
  int64_t lanes_per_head = 0;       // a HeadState<C> is C + 1 Lanes
  std::vector<int64_t> keys;        // [rows]: the shared keys the states cover; 0: none (the per-row form)
  std::vector<Lanes> states;        // [rows][kv_heads][group] HeadState<C>

  const void* of(int64_t row, int64_t kv_head, int64_t kv_heads, int64_t group) const {
    return states.data() + ((row * kv_heads + kv_head) * group) * lanes_per_head;
  }
};

template <typename KV>
using PrefixKernel = void (*)(const float*, int64_t, const KV* const*, const KV* const*, int64_t, float, void*);

template <typename KV>
inline PrefixKernel<KV> prefix_kernel_for(int64_t head_dim) {
  return for_head_dim<PrefixKernel<KV>>(head_dim, [](auto chunks) -> PrefixKernel<KV> {
    return prefix_states_in_place<decltype(chunks)::value, KV>;
  });
}

template <typename T>
PrefixStates shared_prefix_states(const T* q, Strides qs, const Shared& shared, int64_t rows, int64_t kv_heads,
                                  int64_t group, int64_t head_dim, TiledKernel tiled, float scale) {
  const bool fp32_in_place = kCascadePrefixInPlace && std::is_same_v<T, float>;
  const PrefixKernel<T> in_place = fp32_in_place ? prefix_kernel_for<T>(head_dim) : nullptr;  // else the tiles
  PrefixStates out;
  out.lanes_per_head = head_dim / 16 + 1;
  out.keys.assign(static_cast<size_t>(rows), 0);
  std::vector<std::vector<int64_t>> members(static_cast<size_t>(shared.key->size(0)));
  for (int64_t r = 0; r < rows; ++r)  // a row whose window starts inside the prefix reads its blocks on its own
    if (shared.group[r] >= 0 && shared.skipped(r) == 0) members[shared.group[r]].push_back(r);
  std::vector<int64_t> taken;  // groups run as tiles
  for (int64_t g = 0; g < static_cast<int64_t>(members.size()); ++g) {
    const int64_t whole = shared.length[g] / kBlockKeys * kBlockKeys;
    if (whole == 0 || static_cast<int64_t>(members[g].size()) < kCascadeMinRows) continue;
    taken.push_back(g);
    for (const int64_t r : members[g]) out.keys[r] = whole;
  }
  if (taken.empty()) return out;
  out.states.resize(static_cast<size_t>(rows * kv_heads * group * out.lanes_per_head));
  const Strides sks = strides_of(*shared.key), svs = strides_of(*shared.value);
  const int64_t per_head = out.lanes_per_head;
  const bool cached = in_place == nullptr && shared.tiles != nullptr && shared.tiles->numel() > 0;
  const float* cached_tiles = cached ? shared.tiles->data_ptr<float>() : nullptr;
  const int64_t cached_stride = cached ? shared.tiles->size(2) : 0;  // floats per (group, K/V head)
  // Items: (group, K/V head, slice of the group's rows). One slice per group, unless the threads outnumber
  // the (group, K/V head) pairs (one prompt's samples on a many-core trainer): then each group's rows are
  // cut into as many slices as it takes to give every thread an item, each slice transposing the keys
  // for itself. A row's states do not depend on the other rows of its tile (each query's own blocks in
  // the same order), so the slicing changes the time only.
  const int64_t pairs = static_cast<int64_t>(taken.size()) * kv_heads;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t slices = std::clamp<int64_t>((threads + pairs - 1) / pairs, 1, kQueryTile);
  // slice `slice` of a group of `count` rows: rows [count * slice / slices, count * (slice + 1) / slices)
  const auto slice_bounds = [&](int64_t count, int64_t slice) {
    return std::pair<int64_t, int64_t>{count * slice / slices, count * (slice + 1) / slices};
  };
  // an item's work: its rows' queries over the prefix's whole blocks
  const auto cost = [&](int64_t item) {
    const std::vector<int64_t>& group_rows = members[taken[item / (kv_heads * slices)]];
    const auto [first, end] = slice_bounds(static_cast<int64_t>(group_rows.size()), item % slices);
    return out.keys[group_rows[0]] * (end - first);
  };
  autobucket_parallel::parallel_for_balanced(pairs * slices, cost, [&](int64_t begin, int64_t end) {
    TiledList<T> list;
    std::vector<const T*> key_ptrs, value_ptrs;
    std::vector<const float*> cached_values(  // a bf16 list's widened values in the kept tiles' tensor
        static_cast<size_t>(cached_tiles != nullptr && !std::is_same_v<T, float> ? shared.key->size(2) : 0));
    std::vector<float> tile_q(static_cast<size_t>(kQueryTile * group * head_dim)), tile_out(tile_q.size());
    std::vector<int64_t> counts(kQueryTile);
    std::vector<Lanes> states(static_cast<size_t>(kQueryTile * group * per_head));
    std::vector<Lanes> probs(static_cast<size_t>(kQueryTile * group * kBlockKeys / 16));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = taken[item / (kv_heads * slices)], kv_head = (item / slices) % kv_heads;
      const std::vector<int64_t>& group_rows = members[g];
      const auto [slice_first, slice_end] = slice_bounds(static_cast<int64_t>(group_rows.size()), item % slices);
      if (slice_first == slice_end) continue;  // more slices than the group has rows
      const int64_t whole = out.keys[group_rows[0]];
      const T* sk = shared.key->data_ptr<T>() + g * sks.row + kv_head * sks.head;
      const T* sv = shared.value->data_ptr<T>() + g * svs.row + kv_head * svs.head;
      key_ptrs.resize(static_cast<size_t>(whole)), value_ptrs.resize(static_cast<size_t>(whole));
      for (int64_t j = 0; j < whole; ++j) key_ptrs[j] = sk + j * sks.token, value_ptrs[j] = sv + j * svs.token;
      if (in_place != nullptr) {
        for (int64_t first = slice_first; first < slice_end; first += kQueryTile) {  // rows whose heads walk together
          const int64_t n = std::min<int64_t>(kQueryTile, slice_end - first);
          for (int64_t t = 0; t < n; ++t)
            load_query_group(q, qs, group_rows[first + t], kv_head, group, 0, head_dim, tile_q.data() + t * group * head_dim);
          in_place(tile_q.data(), n * group, key_ptrs.data(), value_ptrs.data(), whole, scale, states.data());
          for (int64_t t = 0; t < n; ++t) {
            const int64_t row = group_rows[first + t];
            const Lanes* from = states.data() + t * group * per_head;
            std::copy(from, from + group * per_head, out.states.begin() + ((row * kv_heads + kv_head) * group) * per_head);
          }
        }
        continue;
      }
      const float* tiles = nullptr;
      const float* const* value_fp32 = nullptr;
      if (cached_tiles != nullptr) {  // the tiles (and bf16 values widened) made once for these keys
        tiles = cached_tiles + (g * kv_heads + kv_head) * cached_stride;
        if constexpr (std::is_same_v<T, float>) {
          value_fp32 = value_ptrs.data();  // fp32 values are read where they are
        } else {
          for (int64_t j = 0; j < whole; ++j) cached_values[j] = tiles + shared.key->size(2) * head_dim + j * head_dim;
          value_fp32 = cached_values.data();
        }
      } else {
        list.take(key_ptrs, value_ptrs, whole, head_dim);
        tiles = list.tiles.data(), value_fp32 = list.value_fp32.data();
      }
      for (int64_t first = slice_first; first < slice_end; first += kQueryTile) {
        const int64_t n = std::min<int64_t>(kQueryTile, slice_end - first);
        for (int64_t t = 0; t < n; ++t) {  // each row's one query
          load_query_group(q, qs, group_rows[first + t], kv_head, group, 0, head_dim, tile_q.data() + t * group * head_dim);
          counts[t] = whole;
        }
        tiled(tile_q.data(), n, group, tiles, value_fp32, counts.data(), scale,
              tile_out.data(), states.data(), reinterpret_cast<float*>(probs.data()));
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = group_rows[first + t];
          const Lanes* from = states.data() + t * group * per_head;
          std::copy(from, from + group * per_head, out.states.begin() + ((row * kv_heads + kv_head) * group) * per_head);
        }
      }
    }
  });
  return out;
}
#endif

// The tiles shared_prefix_states makes of each (group, K/V head)'s shared keys, made once for a decode
// call's steps instead of in every step and layer (the keys stay the same while the groups do):
// [groups, kv_heads, shared * head_dim] fp32, per pair the whole blocks' keys transposed into tiles
// (transpose_into_tiles); bf16 keys [groups, kv_heads, 2 * shared * head_dim], the tiles followed by the
// values widened to fp32 vectors (exact; fp32 values are read in place); unused space zero. The same
// values the per-step copy holds, so the same bits (tested). Empty where this build walks the prefix in
// place or has no vector form, where no tiles are read.
at::Tensor shared_prefix_tiles(const at::Tensor& shared_key, const at::Tensor& shared_value,
                               const at::Tensor& shared_length) {
  TORCH_CHECK(shared_key.dim() == 4 && shared_key.sizes() == shared_value.sizes() && shared_key.stride(3) == 1 &&
                  shared_value.stride(3) == 1 && shared_key.scalar_type() == shared_value.scalar_type(),
              "shared_key and shared_value must be [groups, kv_heads, shared, head_dim] alike");
  TORCH_CHECK(shared_length.scalar_type() == at::kLong && shared_length.is_contiguous() &&
                  shared_length.numel() == shared_key.size(0), "shared_length must be [groups] int64");
  const int64_t groups = shared_key.size(0), kv_heads = shared_key.size(1), shared = shared_key.size(2);
  const int64_t head_dim = shared_key.size(3);
  const auto empty = at::empty({0}, shared_key.options().dtype(at::kFloat));
#if defined(AUTOBUCKET_ATTENTION_VECTORS)
  const bool fp32 = shared_key.scalar_type() == at::kFloat;
  if ((kCascadePrefixInPlace && fp32) || tiled_kernel_for(head_dim) == nullptr) return empty;
  const int64_t per_pair = (fp32 ? 1 : 2) * shared * head_dim;
  auto tiles = at::zeros({groups, kv_heads, per_pair}, shared_key.options().dtype(at::kFloat));
  const int64_t* lengths = shared_length.data_ptr<int64_t>();
  const auto fill = [&](auto typed) {
    using T = decltype(typed);
    const Strides sks = strides_of(shared_key), svs = strides_of(shared_value);
    std::vector<const T*> keys(static_cast<size_t>(shared));
    for (int64_t g = 0; g < groups; ++g) {
      TORCH_CHECK(lengths[g] >= 0 && lengths[g] <= shared, "shared_length out of range");
      const int64_t whole = lengths[g] / kBlockKeys * kBlockKeys;
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* pair = tiles.data_ptr<float>() + (g * kv_heads + h) * per_pair;
        const T* sk = shared_key.data_ptr<T>() + g * sks.row + h * sks.head;
        const T* sv = shared_value.data_ptr<T>() + g * svs.row + h * svs.head;
        for (int64_t j = 0; j < whole; ++j) keys[j] = sk + j * sks.token;
        if (whole > 0) transpose_into_tiles(keys.data(), whole, head_dim, pair);
        if constexpr (!std::is_same_v<T, float>)
          for (int64_t j = 0; j < whole; ++j)
            for (int64_t d = 0; d < head_dim; ++d) pair[shared * head_dim + j * head_dim + d] = as_float(sv[j * svs.token + d]);
      }
    }
  };
  if (fp32) {
    fill(float{});
  } else {
    TORCH_CHECK(shared_key.scalar_type() == at::kBFloat16, "shared_prefix_tiles supports float32 and bfloat16");
    fill(c10::BFloat16{});
  }
  return tiles;
#else
  (void)groups, (void)kv_heads, (void)shared, (void)head_dim;
  return empty;
#endif
}

// allowed: [rows, mask_queries, columns] bool (mask_queries 1 = the same keys for every query), or an
// empty tensor: every column for one query, or causal (query i sees columns < columns - queries + i + 1).
template <typename T>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const at::Tensor& allowed, bool causal, double scale, at::Tensor& out, const Shared& shared) {
  const int64_t rows = query.size(0), heads = query.size(1), queries = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = key.size(1), columns = key.size(2), group = heads / kv_heads;
  const bool has_mask = allowed.numel() > 0;
  const int64_t mask_queries = has_mask ? allowed.size(1) : 0;
  const bool* mask = has_mask ? allowed.data_ptr<bool>() : nullptr;
  const Strides qs = strides_of(query), ks = strides_of(key), vs = strides_of(value);
  const Strides os{out.stride(0), out.stride(2), out.stride(1)};  // out is [rows, queries, heads, head_dim]
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t shared_max = shared.key != nullptr ? shared.key->size(2) : 0;
  const int64_t chunks = (queries + kQueryChunk - 1) / kQueryChunk;
#if defined(AUTOBUCKET_ATTENTION_VECTORS)
  const QueryKernel<T> in_place = query_kernel_for<T>(head_dim);
  const TiledKernel tiled = tiled_kernel_for(head_dim);
  const PrefixStates prefix = shared.key != nullptr && queries == 1 && in_place != nullptr && tiled != nullptr
                                  ? shared_prefix_states<T>(q, qs, shared, rows, kv_heads, group, head_dim, tiled,
                                                            static_cast<float>(scale))
                                  : PrefixStates{};
#endif
  // an item's work: its queries times the keys its last query reads (rows of one call differ by their
  // lengths: a long tail's one long row, a packed row's later causal chunks)
  const auto cost = [&](int64_t item) {
    const int64_t row = item / (kv_heads * chunks), chunk = item % chunks;
    const int64_t first_query = chunk * kQueryChunk, end_query = std::min(queries, first_query + kQueryChunk);
    const int64_t g = shared.group != nullptr ? shared.group[row] : -1;
    int64_t keys = g >= 0 ? shared.length[g] - shared.skipped(row) : 0;
#if defined(AUTOBUCKET_ATTENTION_VECTORS)
    if (!prefix.keys.empty()) keys -= prefix.keys[row];  // already read by the group's tile
#endif
    if (has_mask) {
      const bool* m = mask + (row * mask_queries + (mask_queries == 1 ? 0 : end_query - 1)) * columns;
      keys += std::count(m, m + columns, true);
    } else {
      keys += causal ? std::max<int64_t>(0, columns - queries + end_query) : columns;
    }
    return keys * (end_query - first_query);
  };
  autobucket_parallel::parallel_for_balanced(rows * kv_heads * chunks, cost, [&](int64_t begin, int64_t end) {
    std::vector<const T*> key_ptrs(static_cast<size_t>(shared_max + columns));
    std::vector<const T*> value_ptrs(key_ptrs.size());
    std::vector<float> work, q_fp32(static_cast<size_t>(group * head_dim)), out_fp32(q_fp32.size());
#if defined(AUTOBUCKET_ATTENTION_VECTORS)
    // the tiled form's key list, and a tile's queries, counts, outputs, per-head states (one HeadState<C>:
    // C + 1 vectors) and block probabilities
    TiledList<T> list;
    std::vector<float> tile_q(static_cast<size_t>(kQueryTile * group * head_dim)), tile_out(tile_q.size());
    std::vector<int64_t> tile_queries, tile_counts(kQueryTile);
    std::vector<Lanes> states(tiled ? static_cast<size_t>(kQueryTile * group * (head_dim / 16 + 1)) : 0);
    std::vector<Lanes> probs(tiled ? static_cast<size_t>(kQueryTile * group * kBlockKeys / 16) : 0);
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (kv_heads * chunks);
      const int64_t kv_head = (item / chunks) % kv_heads;
      const int64_t chunk = item % chunks;
      const int64_t g = shared.group != nullptr ? shared.group[row] : -1;
      const int64_t shared_count = g >= 0 ? shared.length[g] : 0;
      const int64_t first_query = chunk * kQueryChunk, end_query = std::min(queries, first_query + kQueryChunk);
      const T* k_row = k + row * ks.row + kv_head * ks.head;
      const T* v_row = v + row * vs.row + kv_head * vs.head;
      const T* sk = nullptr;
      const T* sv = nullptr;
      Strides sks{}, svs{};
      if (g >= 0) {
        sks = strides_of(*shared.key), svs = strides_of(*shared.value);
        sk = shared.key->data_ptr<T>() + g * sks.row + kv_head * sks.head;
        sv = shared.value->data_ptr<T>() + g * svs.row + kv_head * svs.head;
      }
      // query qi's keys in order (a cascade's shared keys first, from shared key `skip` on, or from the
      // row's window's first) into key_ptrs / value_ptrs; their count
      const auto list_keys = [&](int64_t qi, int64_t skip = 0) {
        int64_t count = 0;
        for (int64_t j = std::max(skip, shared.skipped(row)); j < shared_count; ++j, ++count) {
          key_ptrs[count] = sk + j * sks.token;
          value_ptrs[count] = sv + j * svs.token;
        }
        const bool* m = has_mask ? mask + (row * mask_queries + (mask_queries == 1 ? 0 : qi)) * columns : nullptr;
        const int64_t visible = has_mask ? columns : (causal ? columns - queries + qi + 1 : columns);
        for (int64_t c = 0; c < visible; ++c) {
          if (m == nullptr || m[c]) {
            key_ptrs[count] = k_row + c * ks.token;
            value_ptrs[count] = v_row + c * vs.token;
            ++count;
          }
        }
        return count;
      };
#if defined(AUTOBUCKET_ATTENTION_VECTORS)
      if (in_place != nullptr) {
        // query qi's group of heads as fp32 into fp32 [group][head_dim]; its output back from it
        const auto load_query = [&](int64_t qi, float* fp32) {
          load_query_group(q, qs, row, kv_head, group, qi, head_dim, fp32);
        };
        const auto store_output = [&](int64_t qi, const float* fp32) {
          for (int64_t h = 0; h < group; ++h) {
            T* dst = o + row * os.row + qi * os.token + (kv_head * group + h) * os.head;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(fp32[h * head_dim + d]);
          }
        };
        if (end_query - first_query <= kInPlaceQueries) {
          // a row whose shared prefix's whole blocks ran as its group's tile goes on from their states
          const int64_t resumed = prefix.keys.empty() ? 0 : prefix.keys[row];
          const void* resume = resumed > 0 ? prefix.of(row, kv_head, kv_heads, group) : nullptr;
          for (int64_t qi = first_query; qi < end_query; ++qi) {
            const int64_t count = list_keys(qi, resumed);
            load_query(qi, q_fp32.data());
            in_place(q_fp32.data(), group, key_ptrs.data(), value_ptrs.data(), count, static_cast<float>(scale),
                     out_fp32.data(), resume);
            store_output(qi, out_fp32.data());
          }
        } else {
          // Last query first: under a causal mask every earlier query's list is a prefix of a later one's,
          // so the item transposes one list per sequence it holds (a packed row's chunk may hold several),
          // and runs the queries reading a prefix of it in tiles.
          list.count = -1;
          tile_queries.clear();
          const auto run_tile = [&]() {
            const int64_t n = static_cast<int64_t>(tile_queries.size());
            if (n == 0) return;
            for (int64_t t = 0; t < n; ++t) load_query(tile_queries[t], tile_q.data() + t * group * head_dim);
            tiled(tile_q.data(), n, group, list.tiles.data(), list.value_fp32.data(), tile_counts.data(),
                  static_cast<float>(scale), tile_out.data(), states.data(), reinterpret_cast<float*>(probs.data()));
            for (int64_t t = 0; t < n; ++t) store_output(tile_queries[t], tile_out.data() + t * group * head_dim);
            tile_queries.clear();
          };
          // Without a mask every query's list is a prefix of the item's last query's (its shared keys, then
          // its own columns up to its causal limit): that list is built once and the others are counts, not
          // rebuilt and compared key by key (O(L^2) pointer work per item, a large share of a long
          // prefill's kernel time). With a mask of its own per query (a padded causal batch, a trainer's
          // forward), a query reads a prefix of the list held iff its mask row equals the held query's up to
          // its own last allowed column: a comparison of mask bytes, not of key pointers.
          const bool prefixes_of_last = !has_mask;
          const bool* held_row = nullptr;  // the mask row of the query whose list `list` holds
          int64_t held_last = -1;          // its last allowed column
          const auto mask_row = [&](int64_t qi) { return mask + (row * mask_queries + (mask_queries == 1 ? 0 : qi)) * columns; };
          const auto last_allowed = [&](const bool* m) {
            int64_t c = columns - 1;
            while (c >= 0 && !m[c]) --c;
            return c;
          };
          for (int64_t qi = end_query - 1; qi >= first_query; --qi) {
            if (prefixes_of_last && list.count >= 0) {
              tile_counts[tile_queries.size()] =
                  shared_count + (causal ? std::max<int64_t>(0, columns - queries + qi + 1) : columns);
              tile_queries.push_back(qi);
              if (static_cast<int64_t>(tile_queries.size()) == kQueryTile) run_tile();
              continue;
            }
            if (has_mask && list.count >= 0) {
              const bool* m = mask_row(qi);
              const int64_t last = last_allowed(m);
              if (last <= held_last && std::equal(m, m + last + 1, held_row)) {
                tile_counts[tile_queries.size()] = shared_count + std::count(m, m + last + 1, true);
                tile_queries.push_back(qi);
                if (static_cast<int64_t>(tile_queries.size()) == kQueryTile) run_tile();
                continue;
              }
            }
            const int64_t count = list_keys(qi);
            if (!list.holds_prefix(key_ptrs, value_ptrs, count)) {
              run_tile();
              list.take(key_ptrs, value_ptrs, count, head_dim);
              key_ptrs.resize(list.keys.size()), value_ptrs.resize(list.values.size());
              if (has_mask) held_row = mask_row(qi), held_last = last_allowed(held_row);
            }
            tile_counts[tile_queries.size()] = count;
            tile_queries.push_back(qi);
            if (static_cast<int64_t>(tile_queries.size()) == kQueryTile) run_tile();
          }
          run_tile();
        }
        continue;
      }
#endif
      for (int64_t qi = first_query; qi < end_query; ++qi) {
        const int64_t count = list_keys(qi);
        attend_one<T>(q, qs, o, os, row, kv_head, group, qi, key_ptrs.data(), value_ptrs.data(), count, head_dim,
                      static_cast<float>(scale), work);
      }
    }
  });
}

// query [rows, heads, queries, head_dim]; key, value [rows, kv_heads, columns, head_dim] (any strides,
// head_dim contiguous) -> [rows, queries, heads, head_dim], transformers' attention-output layout.
void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& allowed) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "query, key, value must be 4-D");
  TORCH_CHECK(query.device().is_cpu(), "invariant_attention runs on CPU tensors");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value shapes differ");
  TORCH_CHECK(query.size(0) == key.size(0) && query.size(3) == key.size(3), "query and key shapes disagree");
  TORCH_CHECK(query.size(1) % key.size(1) == 0 && query.size(1) / key.size(1) <= kMaxGroup,
              "query heads must be a multiple (at most 16x) of key/value heads");
  TORCH_CHECK(key.size(2) < std::numeric_limits<int32_t>::max(), "too many key columns");
  if (allowed.numel() > 0) {
    TORCH_CHECK(allowed.scalar_type() == at::kBool && allowed.dim() == 3 && allowed.is_contiguous(),
                "allowed must be a contiguous [rows, 1 or queries, columns] bool tensor");
    TORCH_CHECK(allowed.size(0) == query.size(0) && allowed.size(2) == key.size(2) &&
                    (allowed.size(1) == 1 || allowed.size(1) == query.size(2)),
                "allowed's shape disagrees with query and key");
  }
}

at::Tensor run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& allowed,
               bool causal, double scale, const Shared& shared) {
  auto out = at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == at::kFloat) {
    attend_all<float>(query, key, value, allowed, causal, scale, out, shared);
  } else if (query.scalar_type() == at::kBFloat16) {
    attend_all<c10::BFloat16>(query, key, value, allowed, causal, scale, out, shared);
  } else {
    TORCH_CHECK(false, "invariant_attention supports float32 and bfloat16, got ", query.scalar_type());
  }
  return out;
}

at::Tensor invariant_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const at::Tensor& allowed, bool causal, double scale) {
  check_inputs(query, key, value, allowed);
  return run(query, key, value, allowed, causal, scale, Shared{});
}

// A windowed cascade's per-row count of shared keys left out (`Shared::skip`): a decode query sees the
// `window` newest keys of [shared | own allowed], so when its own allowed keys (already narrowed to the
// window by the caller's mask) number `own`, it reads the shared prompt's last window - own keys.
std::vector<int64_t> shared_keys_outside_window(const at::Tensor& allowed, int64_t columns, const int64_t* lengths,
                                                const int64_t* groups, int64_t rows, int64_t window) {
  std::vector<int64_t> skip(static_cast<size_t>(rows), 0);
  const bool* mask = allowed.numel() > 0 ? allowed.data_ptr<bool>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    if (groups[r] < 0) continue;
    const int64_t own = mask != nullptr ? std::count(mask + r * columns, mask + (r + 1) * columns, true) : columns;
    TORCH_CHECK(own <= window, "a windowed cascade's row allows ", own, " of its own keys, more than the window of ",
                window, ": narrow its mask to the window first");
    skip[r] = std::max<int64_t>(0, lengths[groups[r]] - (window - own));
  }
  return skip;
}

// The same, each row first reading its group's shared keys (cascade decode): shared_key, shared_value
// [groups, kv_heads, shared, head_dim], shared_length [groups] and row_group [rows] int64 (-1: none).
// window > 0: the layer attends in a sliding window of that many keys (one decode query per row, its own
// keys' mask already narrowed to the window); each row reads the shared keys its window still covers.
at::Tensor invariant_attention_shared(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& allowed, double scale, const at::Tensor& shared_key,
                                      const at::Tensor& shared_value, const at::Tensor& shared_length,
                                      const at::Tensor& row_group, const c10::optional<at::Tensor>& shared_tiles,
                                      int64_t window) {
  check_inputs(query, key, value, allowed);
  TORCH_CHECK(shared_key.dim() == 4 && shared_key.sizes() == shared_value.sizes() &&
                  shared_key.scalar_type() == query.scalar_type() && shared_value.scalar_type() == query.scalar_type(),
              "shared_key and shared_value must be [groups, kv_heads, shared, head_dim] in the query's dtype");
  TORCH_CHECK(shared_key.size(1) == key.size(1) && shared_key.size(3) == key.size(3) && shared_key.stride(3) == 1 &&
                  shared_value.stride(3) == 1, "shared keys disagree with the keys' heads or head_dim");
  TORCH_CHECK(shared_length.scalar_type() == at::kLong && shared_length.is_contiguous() &&
                  shared_length.numel() == shared_key.size(0), "shared_length must be [groups] int64");
  TORCH_CHECK(row_group.scalar_type() == at::kLong && row_group.is_contiguous() && row_group.numel() == query.size(0),
              "row_group must be [rows] int64");
  const int64_t* lengths = shared_length.data_ptr<int64_t>();
  const int64_t* groups = row_group.data_ptr<int64_t>();
  for (int64_t r = 0; r < row_group.numel(); ++r) {
    TORCH_CHECK(groups[r] < shared_key.size(0), "row_group names a group that does not exist");
    TORCH_CHECK(groups[r] < 0 || (lengths[groups[r]] >= 0 && lengths[groups[r]] <= shared_key.size(2)),
                "shared_length out of range");
  }
  const at::Tensor* tiles = nullptr;
  if (shared_tiles.has_value() && shared_tiles->numel() > 0) {
    TORCH_CHECK(shared_tiles->scalar_type() == at::kFloat && shared_tiles->is_contiguous() && shared_tiles->dim() == 3 &&
                    shared_tiles->size(0) == shared_key.size(0) && shared_tiles->size(1) == shared_key.size(1) &&
                    shared_tiles->size(2) ==
                        (shared_key.scalar_type() == at::kFloat ? 1 : 2) * shared_key.size(2) * shared_key.size(3),
                "shared_tiles must be shared_prefix_tiles' output for these shared keys");
    tiles = &*shared_tiles;
  }
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  std::vector<int64_t> skip;
  if (window > 0) {
    TORCH_CHECK(query.size(2) == 1, "a windowed cascade takes one decode query per row");
    skip = shared_keys_outside_window(allowed, key.size(2), lengths, groups, query.size(0), window);
  }
  return run(query, key, value, allowed, false, scale,
             Shared{&shared_key, &shared_value, lengths, groups, tiles, skip.empty() ? nullptr : skip.data()});
}

// rows [M, K] through oneDNN's packed linear in calls of exactly `block` rows (the last zero-padded), so
// every call has one shape: the bf16 GEMM picks its kernel by the row count (packed_linear.py). The loop
// lives here, not in Python, because a prefill of 2,000 tokens makes ~60 calls per linear.
at::Tensor blocked_linear(const at::Tensor& rows, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t block) {
  TORCH_CHECK(rows.dim() == 2 && block > 0, "blocked_linear takes [rows, in_features] and a positive block");
  static const c10::OperatorHandle linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const auto one_block = [&](const at::Tensor& input) {
    torch::jit::Stack stack{input, packed, bias, c10::IValue(std::string("none")),
                            c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string(""))};
    linear.callBoxed(&stack);
    return stack[0].toTensor();
  };
  const int64_t count = rows.size(0);
  const int64_t padded = (count + block - 1) / block * block;
  at::Tensor input = rows.contiguous();
  if (padded != count) input = at::cat({input, at::zeros({padded - count, rows.size(1)}, rows.options())});
  if (padded == block) {  // one block: no copy of the output
    const at::Tensor part = one_block(input);
    return padded == count ? part : part.narrow(0, 0, count);
  }
  at::Tensor out;
  for (int64_t first = 0; first < padded; first += block) {
    const at::Tensor part = one_block(input.narrow(0, first, block));
    if (!out.defined()) out = at::empty({padded, part.size(1)}, part.options());
    out.narrow(0, first, block).copy_(part);
  }
  return padded == count ? out : out.narrow(0, 0, count);
}

// Turns decode's K/V prefetch on or off for this process (benchmarks/kernels/decode_attention.py) and returns
// whether it was on; portable builds never prefetch. No value depends on it.
// The widest vectors this build of the library was compiled for (-march=native on the machine that built
// it): 512 (AVX-512), 256 (AVX2) or 0. The fused elementwise kernels need 512 (SiLU-and-multiply) or 256
// (RMSNorm's sum); without them the model's own code runs.
int64_t vector_bits() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

// Whether at::parallel_for splits this library's loops among torch's threads: ATen inlines it as an OpenMP
// loop, so it does only in a build with -fopenmp (invariant_attention.py's PARALLEL_FLAGS)
bool splits_among_threads() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(autobucket, m) {
  m.def("invariant_attention(Tensor query, Tensor key, Tensor value, Tensor allowed, bool causal, float scale) -> Tensor");
  m.def("invariant_attention_shared(Tensor query, Tensor key, Tensor value, Tensor allowed, float scale, "
        "Tensor shared_key, Tensor shared_value, Tensor shared_length, Tensor row_group, Tensor? shared_tiles=None, "
        "int window=0) -> Tensor");
  m.def("shared_prefix_tiles(Tensor shared_key, Tensor shared_value, Tensor shared_length) -> Tensor");
  m.def("blocked_linear(Tensor rows, Tensor packed, Tensor? bias, int block) -> Tensor");
  m.def("vector_bits() -> int", &vector_bits);
  m.def("splits_among_threads() -> bool", &splits_among_threads);
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) {
  m.impl("invariant_attention", &invariant_attention);
  m.impl("invariant_attention_shared", &invariant_attention_shared);
  m.impl("shared_prefix_tiles", &shared_prefix_tiles);
  m.impl("blocked_linear", &blocked_linear);
}

// The packed weight is an opaque oneDNN tensor, so a call dispatches on its MkldnnCPU key.
TORCH_LIBRARY_IMPL(autobucket, MkldnnCPU, m) { m.impl("blocked_linear", &blocked_linear); }
