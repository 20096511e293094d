// The fp32 linear of kernels="invariant": every output is one fused multiply-add chain over k = 0 .. K-1
// in order, then + bias. So a row's output depends on that row and the weight alone: never on how many
// rows ride along, where the row sits, how the rows are tiled, how many threads run, or which vector
// width computes it (a lane of a 16-wide FMA and a scalar std::fma round the same product-sum alike).
// oneDNN's and MKL's GEMMs choose their blocking by M, which is why they needed probes and workarounds.
//
// The weight is packed once per version (packed_linear.py) as panels of 32 output columns,
// [panels, K, 32]: one k step of a panel is two 16-float vectors. A bf16 weight's panels stay bf16 and are
// widened in registers as they are read (a bf16 is its fp32's upper half: exact, the same chains, so the
// same bits as fp32 panels of the widened weight) for half the bytes held and streamed per call
// (benchmarks/kernels/bf16_panels.py). A tile of R rows x 32 columns keeps 2R accumulators in registers
// and broadcasts each row's k-th input from the row itself (AVX-512 has the registers to broadcast from
// rows K apart; AVX2 calls of many rows copy them first: kPackRowsFrom). Loops, outermost first:
// blocks of kRowBlock rows (in L2), panels (split across threads),
// kDepth-long slices of K (a panel slice, 32 KB, stays in L1 for the block's tiles), tiles. Calls of
// many rows take two full panels at a time in 6-row pair tiles (one broadcast feeds 4 FMAs). A tile
// that continues a slice reloads its partial sums from the output: an fp32 store and load are exact, so
// the chain is unbroken. The tiles of a slice prefetch the next panel's slice into L2, spread over their
// k steps (`SpreadPrefetch`).
//
// Its speed against oneDNN and MKL per CPU kind: benchmarks/kernels/fp32_linears.py, docs/kernels.md.
//
// Built with invariant_attention.cpp (same flags: -ffp-contract=off, so the compiler never fuses or
// splits an operation the source did not write).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_vendor.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// The vector form this build runs: AVX-512, AVX2 with FMA, or none (portable std::fma loops). Every form computes the same chains, so the same bits.
#if defined(__AVX512F__)
#define AUTOBUCKET_FIXED_ORDER_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define AUTOBUCKET_FIXED_ORDER_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 32;      // output columns per packed panel
constexpr int64_t kDepth = 256;     // k per slice: a panel slice is 32 KB (L1)
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512)
constexpr int64_t kRowTile = 12;    // rows per tile: 12 x 2 accumulators of the 32 vector registers
#else
// AVX2 has 16 vector registers of 8 floats: a tile runs its panel as two 16-column halves of 6 rows x 2
// accumulators each (the 6 x 16 register block of AVX2 SGEMMs: 12 accumulators, 2 weight vectors, 1
// broadcast). Slices of 256 k, as on AVX-512: a longer slice is fewer partial-sum reloads per panel.
// Neither constant changes a value.
constexpr int64_t kRowTile = 6;
#endif
// AVX2 tiles a block's rows as evenly as they go, since a tile of 2 rows (4 FMA chains) waits on the FMA
// latency, while two tiles of 4 rows do not. AVX-512 keeps full tiles (its FMA chains per tile are twice
// as many).
#if defined(AUTOBUCKET_FIXED_ORDER_AVX2)
constexpr bool kBalancedTiles = true;
#else
constexpr bool kBalancedTiles = false;
#endif
constexpr int64_t kRowBlock = 120;  // rows per block: 10 tiles of 12 (AVX-512), 20 of 6 (AVX2)
// AVX2 calls of at least this many rows copy each block's rows into per-tile micro-panels [K][6] first,
// so a tile broadcasts its six inputs of a k step from one 24-byte run instead of six rows K apart. The
// copy is paid before the panels, so it pays only where many rows share it (few rows: too few panels per
// copy). A block then holds at most kPackedBlockFloats of them (an L2-sized share: 60 rows at K = 1,024).
// No value depends on either choice (benchmarks/kernels/linear_ab.py --op-rows compares them).
constexpr int64_t kPackRowsFrom = 512;
constexpr int64_t kPackedBlockFloats = 65536;
constexpr int64_t kPairRows = 6;    // rows per pair tile: 6 x 4 accumulators
constexpr int64_t kPairMinRows = 33;  // calls of at least this many rows use pair tiles where two panels are full
// (below it, a decode step's rows fill too few pair tiles to beat the 12-row ones)
constexpr int64_t kSmallWeightBytes = int64_t{8} << 20;  // weights this small skip the next-slice prefetch on AMD (below)
constexpr int64_t kStagedStride = 80;  // floats per row of a block's staged outputs (>= 64; not a multiple of 4 KB)

// Prefetches of the next panel slice into L2, spread evenly over a tile's k steps. In a call of one row
// block (a decode step's rows) each tile issues its rows' share of the slice's lines, so the next slice
// arrives beside every tile's FMAs instead of queuing behind the first tile's. Calls of many row blocks
// keep the first tile fetching it all (there the other blocks' tiles already hide the fetch, and spreading
// it costs every tile instructions).
// A hint only: no value depends on it.
struct SpreadPrefetch {
  const char* next;      // the next line to fetch
  int64_t left;          // lines still to fetch
  int64_t period;        // k steps between fetches
  int64_t burst;         // lines per fetch
  int64_t segment_left;  // lines left in this panel's slice before the next panel's
  int64_t segment_lines, panel_bytes;
  int64_t countdown = 0;

  // Lines [first, first + lines) of a pass's next slices: panel i's slice of `segment_lines` lines
  // starts at `slice` + i * `panel_bytes`.
  SpreadPrefetch(const void* slice, int64_t segment_lines, int64_t panel_bytes, int64_t first, int64_t lines,
                 int64_t depth)
      : left(slice != nullptr ? lines : 0), segment_lines(segment_lines), panel_bytes(panel_bytes) {
    const int64_t panel = segment_lines > 0 ? first / segment_lines : 0;
    next = static_cast<const char*>(slice) + panel * panel_bytes + (first - panel * segment_lines) * 64;
    segment_left = segment_lines - (first - panel * segment_lines);
    burst = std::max<int64_t>(1, (lines + depth - 1) / std::max<int64_t>(1, depth));
    const int64_t fetches = (lines + burst - 1) / burst;
    period = std::max<int64_t>(1, depth / std::max<int64_t>(1, fetches));
  }
  // `lines` lines of one contiguous run from `start`
  SpreadPrefetch(const void* start, int64_t lines, int64_t depth) : SpreadPrefetch(start, lines, 0, 0, lines, depth) {}
  __attribute__((always_inline)) inline void step() {
    if (left <= 0 || --countdown > 0) return;
    countdown = period;
    for (int64_t b = 0; b < burst && left > 0; ++b, --left) {
      __builtin_prefetch(next, 0, 2);  // into L2 (prefetcht1)
      next += 64;
      if (--segment_left == 0) {  // on to the next panel's slice
        next += panel_bytes - segment_lines * 64;
        segment_left = segment_lines;
      }
    }
  }
};

// A panel's weights: fp32, or bf16 as its raw bits (widened to fp32 exactly as they are read).
using Bf16Bits = uint16_t;

// `run(weights)` with the weight tensor's data as `const float*` or, bf16, as `const Bf16Bits*`
template <typename Run>
void with_weights(const at::Tensor& weight, Run&& run) {
  if (weight.scalar_type() == at::kBFloat16)
    run(reinterpret_cast<const Bf16Bits*>(weight.data_ptr<at::BFloat16>()));
  else
    run(weight.data_ptr<float>());
}
template <typename W>
constexpr int64_t kLinesPerStep = static_cast<int64_t>(sizeof(W)) * kPanel / 64;  // lines a panel's k step spans

inline float widen(float x) { return x; }
inline float widen(Bf16Bits bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

// One tile: out[r, c] (+)= sum_k rows[r][k] * panel[k][c] for R rows, `columns` <= 32 valid columns.
// `rows` starts at the slice's first k of the tile's first row, rows `row_stride` apart; `panel` is a
// [depth][32] slice; `out` row-major with `ld`.
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512)
inline __m512 load_weights16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_weights16(const Bf16Bits* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <int R, typename W>
void tile(const float* rows, int64_t row_stride, const W* panel, int64_t depth, float* out, int64_t ld,
          bool first, const float* bias, int64_t columns, const SpreadPrefetch& next_slices) {
  SpreadPrefetch prefetch = next_slices;
  const __mmask16 low = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 high = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  __m512 left[R], right[R];
  for (int r = 0; r < R; ++r) {
    left[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(low, out + r * ld);
    right[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(high, out + r * ld + 16);
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < depth; ++k) {
    prefetch.step();
    const __m512 w_left = load_weights16(panel + k * kPanel), w_right = load_weights16(panel + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(rows[r * row_stride + k]);
      left[r] = _mm512_fmadd_ps(x, w_left, left[r]);
      right[r] = _mm512_fmadd_ps(x, w_right, right[r]);
    }
  }
  if (bias != nullptr) {
    const __m512 b_left = _mm512_maskz_loadu_ps(low, bias), b_right = _mm512_maskz_loadu_ps(high, bias + 16);
    for (int r = 0; r < R; ++r) {
      left[r] = _mm512_add_ps(left[r], b_left);
      right[r] = _mm512_add_ps(right[r], b_right);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ld, low, left[r]);
    _mm512_mask_storeu_ps(out + r * ld + 16, high, right[r]);
  }
}

// A pair tile: two adjacent full panels (64 columns, 4 vectors a row) for R <= kPairRows rows, so one
// broadcast feeds 4 FMAs instead of 2 (fewer loads per FMA on many-row calls). The same
// chains as `tile`, so the same values.
template <int R, typename W>
void pair_tile(const float* rows, int64_t row_stride, const W* panel, const W* second_panel, int64_t depth,
               float* out, int64_t ld, bool first, const float* bias, const SpreadPrefetch& next_slices) {
  SpreadPrefetch prefetch = next_slices;
  __m512 sums[4][R];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) sums[v][r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * ld + 16 * v);
#pragma GCC unroll 2
  for (int64_t k = 0; k < depth; ++k) {
    prefetch.step();
    const __m512 w[4] = {load_weights16(panel + k * kPanel), load_weights16(panel + k * kPanel + 16),
                         load_weights16(second_panel + k * kPanel), load_weights16(second_panel + k * kPanel + 16)};
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(rows[r * row_stride + k]);
      for (int v = 0; v < 4; ++v) sums[v][r] = _mm512_fmadd_ps(x, w[v], sums[v][r]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * ld + 16 * v, bias != nullptr ? _mm512_add_ps(sums[v][r], b) : sums[v][r]);
  }
}
#elif defined(AUTOBUCKET_FIXED_ORDER_AVX2)
// Lanes [0, valid) of an 8-float vector (valid clamped to 0 .. 8), for masked loads and stores.
inline __m256i lane_mask(int64_t valid) {
  const int32_t n = static_cast<int32_t>(std::clamp<int64_t>(valid, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 floats from / to p: whole vectors where the tile's columns fill them, masked only in a partial
// panel (a masked store is microcoded on AMD CPUs, far slower than a plain one; the same values).
inline __m256 load8(const float* p, bool whole, __m256i live) { return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, live); }
inline void store8(float* p, bool whole, __m256i live, __m256 x) {
  if (whole)
    _mm256_storeu_ps(p, x);
  else
    _mm256_maskstore_ps(p, live, x);
}

inline __m256 load_weights8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_weights8(const Bf16Bits* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The AVX2 tile: R <= 6 rows, the panel's two 16-column halves one after the other (the next slices'
// prefetches ride on the first half's k steps). The same chains as the AVX-512 tile. `kPackedRows`: the
// rows come as a micro-panel, row r's k-th input at rows[6 k + r] (`pack_tile_rows`), else in place.
template <int R, typename W, bool kPackedRows = false>
void tile(const float* rows, int64_t row_stride, const W* panel, int64_t depth, float* out, int64_t ld,
          bool first, const float* bias, int64_t columns, const SpreadPrefetch& next_slices) {
  SpreadPrefetch prefetch = next_slices;
  for (int64_t half = 0; half < 2 && columns > 16 * half; ++half) {
    const int64_t valid = columns - 16 * half;
    const __m256i low = lane_mask(valid), high = lane_mask(valid - 8);
    const bool whole = valid >= 16;
    const W* weights = panel + 16 * half;
    float* target = out + 16 * half;
    __m256 left[R], right[R];
    for (int r = 0; r < R; ++r) {
      left[r] = first ? _mm256_setzero_ps() : load8(target + r * ld, whole, low);
      right[r] = first ? _mm256_setzero_ps() : load8(target + r * ld + 8, whole, high);
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < depth; ++k) {
      if (half == 0) prefetch.step();
      const __m256 w_left = load_weights8(weights + k * kPanel), w_right = load_weights8(weights + k * kPanel + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(kPackedRows ? rows + 6 * k + r : rows + r * row_stride + k);
        left[r] = _mm256_fmadd_ps(x, w_left, left[r]);
        right[r] = _mm256_fmadd_ps(x, w_right, right[r]);
      }
    }
    if (bias != nullptr) {
      const __m256 b_left = load8(bias + 16 * half, whole, low), b_right = load8(bias + 16 * half + 8, whole, high);
      for (int r = 0; r < R; ++r) {
        left[r] = _mm256_add_ps(left[r], b_left);
        right[r] = _mm256_add_ps(right[r], b_right);
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(target + r * ld, whole, low, left[r]);
      store8(target + r * ld + 8, whole, high, right[r]);
    }
  }
}
#else
// The same chains with std::fma on 32 columns at a time; the compiler vectorizes the column loop.
template <int R, typename W>
void tile(const float* rows, int64_t row_stride, const W* panel, int64_t depth, float* out, int64_t ld,
          bool first, const float* bias, int64_t columns, const SpreadPrefetch& /* next_slices */) {
  float sums[R][kPanel];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanel; ++c) sums[r][c] = first || c >= columns ? 0.f : out[r * ld + c];
  for (int64_t k = 0; k < depth; ++k)
    for (int r = 0; r < R; ++r) {
      const float x = rows[r * row_stride + k];
      for (int64_t c = 0; c < kPanel; ++c) sums[r][c] = std::fma(x, widen(panel[k * kPanel + c]), sums[r][c]);
    }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < columns; ++c) out[r * ld + c] = bias != nullptr ? sums[r][c] + bias[c] : sums[r][c];
}
#endif

template <typename W>
using TileFunction = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, bool, const float*,
                             int64_t, const SpreadPrefetch&);
template <typename W>
using PairFunction = void (*)(const float*, int64_t, const W*, const W*, int64_t, float*, int64_t, bool,
                              const float*, const SpreadPrefetch&);

template <typename W, int... R>
constexpr std::array<TileFunction<W>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, W>...};
}
#if defined(AUTOBUCKET_FIXED_ORDER_AVX2)
template <typename W, int... R>
constexpr std::array<TileFunction<W>, sizeof...(R)> packed_tile_table(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, W, true>...};
}
constexpr bool kPackRows = true;
#else
constexpr bool kPackRows = false;  // AVX-512 tiles read their rows in place (the copy is for AVX2's registers)
#endif

// Rows of the next tile of a block: at most `tile_height`, as even as they go where kBalancedTiles (AVX2:
// a 2-row tile's 4 FMA chains would wait on the FMA latency; 32 rows run as 6, 6, 5, 5, 5, 5 instead of
// 6 x 5 + 2).
inline int64_t next_tile_rows(int64_t rows_left, int64_t tiles_left, int64_t tile_height) {
  return kBalancedTiles ? (rows_left + tiles_left - 1) / tiles_left : std::min(tile_height, rows_left);
}

// Rows [block, block_end) of `rows` [*, K] as the micro-panels the packed AVX2 tiles read: tile t's rows
// (tiled as the tile loop tiles them) at micro_panels + t K 6, row r's k-th input at [6 k + r].
void pack_tile_rows(const float* rows, int64_t in_features, int64_t block, int64_t block_end, float* micro_panels) {
  const int64_t block_tiles = (block_end - block + kRowTile - 1) / kRowTile;
  for (int64_t t = 0, start = block; t < block_tiles; ++t) {
    const int64_t tile_rows = next_tile_rows(block_end - start, block_tiles - t, kRowTile);
    float* panel = micro_panels + t * in_features * 6;
    for (int64_t r = 0; r < tile_rows; ++r) {
      const float* row = rows + (start + r) * in_features;
      for (int64_t k = 0; k < in_features; ++k) panel[6 * k + r] = row[k];
    }
    start += tile_rows;
  }
}

// A call's bias as contiguous fp32 [N] (undefined: none), checked; `op` names the kernel in the error.
at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t out_features, const char* op) {
  const at::Tensor values = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!values.defined() || (values.numel() == out_features && values.scalar_type() == at::kFloat), op,
              " takes an fp32 bias [N]");
  return values;
}

// fp32 -> bf16 bits as torch's `.to(torch.bfloat16)` rounds them: to nearest, ties to even, and any NaN
// as 0xFFFF (ATen's vectorized conversion; its scalar one writes 0x7FC0: a NaN either way).
constexpr Bf16Bits kBf16Nan = 0xFFFF;
inline Bf16Bits round_to_bf16(float x) { return std::isnan(x) ? kBf16Nan : c10::BFloat16(x).x; }

#if defined(__AVX2__)
// the same rounding for 8 floats (c10's round to nearest even, vectorized), as 8 32-bit lanes holding the
// bf16 bits
inline __m256i round8_to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(kBf16Nan), nan);
}
#endif

// `count` floats rounded to bf16 bits (round_to_bf16, 16 at a time where AVX2 is there)
void round_to_bf16(const float* from, Bf16Bits* to, int64_t count) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 16 <= count; i += 16) {
    const __m256i low = round8_to_bf16(_mm256_loadu_ps(from + i)), high = round8_to_bf16(_mm256_loadu_ps(from + i + 8));
    // packus interleaves the two inputs' 128-bit halves; the permute puts the 16 values back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i), packed);
  }
#endif
  for (; i < count; ++i) to[i] = round_to_bf16(from[i]);
}

// The call's loops over `panel_data` (fp32, or bf16 bits: `W`), the rows, bias and output already checked.
// `rounded_out` (else nullptr): the outputs rounded to bf16 there instead of written to `out_data` in fp32,
// each block of a panel computed in the staging buffer and rounded as it is copied out.
template <typename W>
void run_fixed_order(const float* rows_data, int64_t count, int64_t in_features, const W* panel_data,
                     int64_t weight_bytes, const float* bias_data, float* out_data, int64_t out_features,
                     bool stage_aliased_rows, Bf16Bits* rounded_out = nullptr) {
  static const auto tiles = tile_table<W>(std::make_integer_sequence<int, kRowTile>{});
#if defined(AUTOBUCKET_FIXED_ORDER_AVX2)
  static const auto packed_tiles = packed_tile_table<W>(std::make_integer_sequence<int, kRowTile>{});
#else
  static const auto& packed_tiles = tiles;  // never taken (kPackRows is false)
#endif
  const bool pack_rows = kPackRows && count >= kPackRowsFrom;
  const int64_t row_block =
      pack_rows ? std::clamp<int64_t>(kPackedBlockFloats / in_features / kRowTile * kRowTile, kRowTile, kRowBlock) : kRowBlock;
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512)
  constexpr bool kPairs = true;
  static const std::array<PairFunction<W>, kPairRows> pair_tiles = {&pair_tile<1, W>, &pair_tile<2, W>, &pair_tile<3, W>,
                                                                    &pair_tile<4, W>, &pair_tile<5, W>, &pair_tile<6, W>};
#else
  constexpr bool kPairs = false;  // single-panel tiles only (their values are the pair tile's)
  static const std::array<PairFunction<W>, kPairRows> pair_tiles = {};
#endif
  const int64_t panel_count = (out_features + kPanel - 1) / kPanel;
  // Output rows a multiple of 4 KB apart share L1 sets, so on AMD CPUs a tile's 12 rows evict its own
  // inputs: a block of many rows there computes into a staging buffer and copies out. On Intel CPUs the
  // staging itself costs more than it saves, so only AMD stages. A decode step's few rows store directly
  // (too few to evict, and the copy would be pure cost). Staged or not, every output is the same chain: the choice changes no value.
  const bool staged = rounded_out != nullptr ||
                      (stage_aliased_rows && (out_features * static_cast<int64_t>(sizeof(float))) % 4096 == 0 && count > 64);
  // The next panel's slice is prefetched (SpreadPrefetch) except on AMD CPUs for weights of at most
  // kSmallWeightBytes, where the hardware's own prefetch does better on layers of a few MB; the large
  // output heads still gain from it. Intel CPUs keep it everywhere (it pays from L3 there).
  const bool prefetch_next = cpu_vendor() != CpuVendor::kAmd || weight_bytes > kSmallWeightBytes;
  at::parallel_for(0, panel_count, 1, [&](int64_t first_panel, int64_t end_panel) {
    std::vector<float> staging(staged ? static_cast<size_t>(kRowBlock * kStagedStride) : 0);
    std::vector<float> micro_panels(pack_rows ? static_cast<size_t>((row_block + kRowTile) * in_features) : 0);
    for (int64_t block = 0; block < count; block += row_block) {
      const int64_t block_end = std::min(count, block + row_block);
      if (pack_rows) pack_tile_rows(rows_data, in_features, block, block_end, micro_panels.data());
      for (int64_t p = first_panel; p < end_panel;) {
        const bool pair = kPairs && count >= kPairMinRows && p + 1 < end_panel && out_features - p * kPanel >= 2 * kPanel;
        const int64_t width = pair ? 2 : 1;  // panels this pass covers
        const int64_t columns = std::min(width * kPanel, out_features - p * kPanel);
        const int64_t tile_height = pair ? kPairRows : kRowTile;
        float* target = staged ? staging.data() : out_data + block * out_features + p * kPanel;
        const int64_t ld = staged ? kStagedStride : out_features;
        for (int64_t k0 = 0; k0 < in_features; k0 += kDepth) {
          const int64_t depth = std::min(kDepth, in_features - k0);
          const bool first = k0 == 0, last = k0 + depth == in_features;
          const W* slice = panel_data + (p * in_features + k0) * kPanel;
          const W* next_slice = prefetch_next && p + width < end_panel ? slice + width * in_features * kPanel : nullptr;
          const float* bias_slice = last && bias_data != nullptr ? bias_data + p * kPanel : nullptr;
          // the next pass's slice (`width` panels of `depth` x 32 weights, kLinesPerStep lines a panel's k
          // step), each tile of the block fetching its rows' share of the lines
          const int64_t slice_lines = width * depth * kLinesPerStep<W>, block_rows = block_end - block;
          const bool spread = count <= row_block;
          // the block's rows in tiles of at most tile_height (`next_tile_rows`)
          const int64_t block_tiles = (block_end - block + tile_height - 1) / tile_height;
          for (int64_t t = 0, start = block; t < block_tiles; ++t) {
            const int64_t tile_rows = next_tile_rows(block_end - start, block_tiles - t, tile_height);
            const float* tile_input = pack_rows ? micro_panels.data() + (t * in_features + k0) * 6
                                                : rows_data + start * in_features + k0;
            float* tile_out = target + (start - block) * ld;
            const int64_t first_line = spread ? slice_lines * (start - block) / block_rows : 0;
            const int64_t lines = spread ? slice_lines * (start - block + tile_rows) / block_rows - first_line
                                         : start == block ? slice_lines : 0;
            const SpreadPrefetch prefetch(next_slice, depth * kLinesPerStep<W>,
                                          in_features * kPanel * static_cast<int64_t>(sizeof(W)), first_line, lines, depth);
            if (pair)
              pair_tiles[tile_rows - 1](tile_input, in_features, slice, slice + in_features * kPanel, depth, tile_out, ld,
                                        first, bias_slice, prefetch);
            else
              (pack_rows ? packed_tiles : tiles)[tile_rows - 1](tile_input, in_features, slice, depth, tile_out, ld, first,
                                                                bias_slice, columns, prefetch);
            start += tile_rows;
          }
        }
        if (rounded_out != nullptr)
          for (int64_t r = block; r < block_end; ++r)
            round_to_bf16(staging.data() + (r - block) * kStagedStride, rounded_out + r * out_features + p * kPanel, columns);
        else if (staged)
          for (int64_t r = block; r < block_end; ++r)
            std::copy_n(staging.data() + (r - block) * kStagedStride, columns, out_data + r * out_features + p * kPanel);
        p += width;
      }
    }
  });
}

// The checked call: fp32 outputs, or (`round_bf16`) bf16 ones, each the fp32 output rounded as torch
// rounds it. `stage_aliased_rows`: whether a call of many rows whose output rows are a multiple of 4 KB
// apart computes through a staging buffer (`fixed_order_linear` chooses by the CPU; the same values).
at::Tensor fixed_order_call(const at::Tensor& input, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, bool stage_aliased_rows, bool round_bf16) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat, "fixed_order_linear takes fp32 rows [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == input.size(1) && panels.size(2) == kPanel &&
                  panels.size(0) * kPanel >= out_features && panels.is_contiguous() &&
                  (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "fixed_order_linear takes fp32 or bf16 panels [ceil(N / 32), K, 32]");
  const at::Tensor rows = input.contiguous();
  const int64_t count = rows.size(0), in_features = rows.size(1);
  at::Tensor out = at::empty({count, out_features}, rows.options().dtype(round_bf16 ? at::kBFloat16 : at::kFloat));
  if (count == 0 || out_features == 0) return out;
  const at::Tensor bias_values = checked_bias(bias, out_features, "fixed_order_linear");
  if (in_features == 0)  // a fresh tensor (never a view of the bias), rounded by torch where bf16
    return bias_values.defined() ? out.copy_(bias_values.expand({count, out_features})) : out.zero_();
  const float* rows_data = rows.data_ptr<float>();
  const float* bias_data = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* out_data = round_bf16 ? nullptr : out.data_ptr<float>();
  Bf16Bits* rounded_out = round_bf16 ? reinterpret_cast<Bf16Bits*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t weight_bytes = panels.numel() * panels.element_size();
  with_weights(panels, [&](const auto* weights) {
    run_fixed_order(rows_data, count, in_features, weights, weight_bytes, bias_data, out_data, out_features,
                    stage_aliased_rows, rounded_out);
  });
  return out;
}

at::Tensor fixed_order_linear_staging(const at::Tensor& input, const at::Tensor& panels,
                                      const c10::optional<at::Tensor>& bias, int64_t out_features,
                                      bool stage_aliased_rows) {
  return fixed_order_call(input, panels, bias, out_features, stage_aliased_rows, false);
}

// The linear of a bf16 model's layer where it runs on the fixed-order kernel: bitwise
// `fixed_order_linear(...).to(torch.bfloat16)`, without the fp32 output (written and read again) between.
at::Tensor fixed_order_linear_bf16(const at::Tensor& input, const at::Tensor& panels,
                                   const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return fixed_order_call(input, panels, bias, out_features, true, true);
}

at::Tensor fixed_order_linear(const at::Tensor& input, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  // staged everywhere but on Intel CPUs, where it costs (above)
  static const bool stage_aliased_rows = cpu_vendor() != CpuVendor::kIntel;
  return fixed_order_linear_staging(input, panels, bias, out_features, stage_aliased_rows);
}

// The same chains from the weight as the model holds it, [N, K] row-major, with no packed copy: for a
// `PackedLinears` whose memory budget (`RolloutConfig(packed_weights_mb=...)`) leaves a weight unpacked.
// The roles of the two operands swap: the rows are transposed once per call into [K][M] (one vector of
// rows at a time), each output's weight at step k is broadcast, and an accumulator vector holds one
// output for a vector of rows. fma(x, w, acc) and fma(w, x, acc) round alike, so every output is still
// one FMA chain over k = 0 .. K-1 in order, then + bias: bitwise `fixed_order_linear` on the weight's
// panels (tested). Slower than the panels at most shapes (docs/benchmarks.md), far faster
// than making the panels for each call. A bf16 weight is read as it is, each value widened as it is
// broadcast (no fp32 copy of it per call: the budget bounds what a call holds).
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512) || defined(AUTOBUCKET_FIXED_ORDER_AVX2)
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512)
struct RowVector {  // 16 rows' values of one k (or one output)
  static constexpr int64_t kFloats = 16;
  __m512 v;
  static RowVector zero() { return {_mm512_setzero_ps()}; }
  static RowVector load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static RowVector broadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
  static RowVector broadcast(const Bf16Bits* p) { return {_mm512_set1_ps(widen(*p))}; }
  static RowVector fmadd(RowVector x, RowVector w, RowVector acc) { return {_mm512_fmadd_ps(x.v, w.v, acc.v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#else
struct RowVector {  // 8 rows' values of one k (or one output)
  static constexpr int64_t kFloats = 8;
  __m256 v;
  static RowVector zero() { return {_mm256_setzero_ps()}; }
  static RowVector load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static RowVector broadcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
  static RowVector broadcast(const Bf16Bits* p) { return {_mm256_set1_ps(widen(*p))}; }
  static RowVector fmadd(RowVector x, RowVector w, RowVector acc) { return {_mm256_fmadd_ps(x.v, w.v, acc.v)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};
#endif
constexpr int64_t kRowVector = RowVector::kFloats;
constexpr int64_t kUnpackedChunk = 256;  // rows transposed at a time ([K][256 + 16] floats stay in L2)
constexpr int64_t kUnpackedBlock = 2 * kRowVector;  // rows per tile: two vectors

// R outputs x V vectors of rows over all K: xt [K][ldx] (the tile's rows from column 0), w the R weight
// rows K apart; sums[r][kRowVector V] out (one output's rows contiguous). Prefetches `next_lines` lines
// from `next` (the next tile's weight rows) spread over the k steps.
template <int R, int V, typename W>
void unpacked_tile(const float* xt, int64_t ldx, const W* w, int64_t in_features, float* sums,
                   const SpreadPrefetch& next_rows) {
  SpreadPrefetch prefetch = next_rows;
  RowVector acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = RowVector::zero();
#pragma GCC unroll 2
  for (int64_t k = 0; k < in_features; ++k) {
    prefetch.step();
    RowVector x[V];
    for (int v = 0; v < V; ++v) x[v] = RowVector::load(xt + k * ldx + kRowVector * v);
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const RowVector weight = RowVector::broadcast(w + r * in_features + k);
      for (int v = 0; v < V; ++v) acc[r][v] = RowVector::fmadd(x[v], weight, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v].store(sums + r * kRowVector * V + kRowVector * v);
}

// Outputs per tile, filling the accumulator registers: with two row vectors 12 (AVX-512: 24 of 32
// registers) or 6 (AVX2: 12 of 16), with one vector (calls of at most one vector of rows) twice that.
template <int V>
constexpr int unpacked_outputs() { return (kRowVector == 16 ? 12 : 6) * (V == 2 ? 1 : 2); }

// The unpacked call's loops over `weight_data` [N, K] (fp32, or bf16 bits: `W`), everything checked.
template <typename W>
void run_unpacked(const float* rows_data, int64_t count, int64_t in_features, const W* weight_data,
                  const float* bias_data, float* out_data, int64_t out_features) {
  // outputs per tile, fixed for the call: a call of at most one vector of rows takes twice as many (its
  // one vector per output would leave half the accumulators waiting on the loads)
  const bool narrow = count <= kRowVector;
  constexpr int kNarrowOutputs = unpacked_outputs<1>(), kWideOutputs = unpacked_outputs<2>();
  const int64_t outputs = narrow ? kNarrowOutputs : kWideOutputs;
  const int64_t chunk_rows = std::min(kUnpackedChunk, (count + kRowVector - 1) / kRowVector * kRowVector);
  const int64_t ldx = chunk_rows + 16;  // not a multiple of 4 KB apart: the k steps' loads share no L1 set
  std::vector<float> xt(static_cast<size_t>(in_features * ldx));
  std::vector<W> tail_rows;  // the last tile's weight rows, zero-padded to `outputs` rows
  alignas(64) float sums[24 * 32];
  for (int64_t chunk = 0; chunk < count; chunk += kUnpackedChunk) {
    const int64_t chunk_end = std::min(count, chunk + kUnpackedChunk);
    std::fill(xt.begin(), xt.end(), 0.0f);  // rows past the call's are zeros (their sums are never stored)
    for (int64_t m = chunk; m < chunk_end; ++m)
      for (int64_t k = 0; k < in_features; ++k) xt[k * ldx + (m - chunk)] = rows_data[m * in_features + k];
    for (int64_t n0 = 0; n0 < out_features; n0 += outputs) {
      const int64_t tile_outputs = std::min(outputs, out_features - n0);
      const W* w = weight_data + n0 * in_features;
      if (tile_outputs < outputs) {  // the last tile reads a padded copy, never past the weight
        tail_rows.assign(static_cast<size_t>(outputs * in_features), W{0});
        std::copy_n(w, tile_outputs * in_features, tail_rows.data());
        w = tail_rows.data();
      }
      const int64_t next_outputs = std::min(outputs, out_features - n0 - outputs);
      const W* next = next_outputs > 0 ? weight_data + (n0 + outputs) * in_features : nullptr;
      for (int64_t block = chunk; block < chunk_end; block += kUnpackedBlock) {
        const int64_t block_rows = std::min(kUnpackedBlock, chunk_end - block);
        const float* block_xt = xt.data() + (block - chunk);
        const int64_t next_lines =
            block == chunk && next != nullptr ? next_outputs * in_features * static_cast<int64_t>(sizeof(W)) / 64 : 0;
        const SpreadPrefetch prefetch(next, next_lines, in_features);
        const int vectors = narrow || block_rows <= kRowVector ? 1 : 2;
        if (narrow)
          unpacked_tile<kNarrowOutputs, 1>(block_xt, ldx, w, in_features, sums, prefetch);
        else if (vectors == 2)
          unpacked_tile<kWideOutputs, 2>(block_xt, ldx, w, in_features, sums, prefetch);
        else
          unpacked_tile<kWideOutputs, 1>(block_xt, ldx, w, in_features, sums, prefetch);
        const int64_t stride = kRowVector * vectors;  // sums[r][stride]
        for (int64_t m = 0; m < block_rows; ++m) {
          float* out_row = out_data + (block + m) * out_features + n0;
          for (int64_t r = 0; r < tile_outputs; ++r)
            out_row[r] = bias_data != nullptr ? sums[r * stride + m] + bias_data[n0 + r] : sums[r * stride + m];
        }
      }
    }
  }
}

at::Tensor fixed_order_linear_unpacked(const at::Tensor& input, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat, "fixed_order_linear_unpacked takes fp32 rows [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == input.size(1) &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "fixed_order_linear_unpacked takes an fp32 or bf16 weight [N, K]");
  const at::Tensor rows = input.contiguous(), dense = weight.contiguous();
  const int64_t count = rows.size(0), in_features = rows.size(1), out_features = dense.size(0);
  at::Tensor out = at::empty({count, out_features}, rows.options());
  if (count == 0 || out_features == 0) return out;
  const at::Tensor bias_values = checked_bias(bias, out_features, "fixed_order_linear_unpacked");
  if (in_features == 0) return bias_values.defined() ? bias_values.expand({count, out_features}).clone() : out.zero_();
  const float* rows_data = rows.data_ptr<float>();
  const float* bias_data = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  with_weights(dense, [&](const auto* weights) {
    run_unpacked(rows_data, count, in_features, weights, bias_data, out_data, out_features);
  });
  return out;
}
#endif

// Whether this build runs vector tiles, AVX-512 or AVX2 (else the portable ones: the same values, slower).
bool fixed_order_linear_vectorized() {
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512) || defined(AUTOBUCKET_FIXED_ORDER_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(autobucket, m) {
  m.def("fixed_order_linear(Tensor rows, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("fixed_order_linear_staging(Tensor rows, Tensor panels, Tensor? bias, int out_features, bool stage_aliased_rows) -> Tensor");
  m.def("fixed_order_linear_bf16(Tensor rows, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("fixed_order_linear_vectorized() -> bool", &fixed_order_linear_vectorized);
  m.def("fixed_order_linear_unpacked(Tensor rows, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) {
  m.impl("fixed_order_linear", &fixed_order_linear);
  m.impl("fixed_order_linear_staging", &fixed_order_linear_staging);
  m.impl("fixed_order_linear_bf16", &fixed_order_linear_bf16);
#if defined(AUTOBUCKET_FIXED_ORDER_AVX512) || defined(AUTOBUCKET_FIXED_ORDER_AVX2)
  m.impl("fixed_order_linear_unpacked", &fixed_order_linear_unpacked);
#endif
}
