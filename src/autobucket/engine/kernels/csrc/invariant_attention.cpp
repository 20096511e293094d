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
// one): AVX-512 builds with head_dim a multiple of 16 (up to 128) run `attend_query` (intrinsics, the
// query and output in registers, a bf16 cache widened to fp32 once per work item); every other build or
// head_dim runs the portable `attend_one`. Each is invariant; they differ from each other in the last bits.
// Measured (Intel Xeon, one core, bench-qwen2 fp32 decode step at 32 rows x 512 keys): the vector form 8.1 ms
// per step over 4 layers vs 12.5 ms for the portable one and 12.3 ms for SDPA's flash kernel.
//
// Built at first use by torch.utils.cpp_extension (see invariant_attention.py); no -ffast-math, so the
// compiler never reassociates a sum.

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
#include <vector>

#if defined(__AVX512F__)
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


#if defined(__AVX512F__)
// The AVX-512 form of the same algorithm (the build's choice, fixed per machine: a model's every call runs
// the same code). head_dim = 16 * C: the query and the output accumulator live in C
// registers; a dot product is one FMA chain over the C chunks then _mm512_reduce_add_ps (a fixed tree);
// the block's exponentials and their sum run as 16-lane vectors, unused lanes exactly zero. keys[j] /
// values[j] point at fp32 vectors, or at bf16 ones widened as they are loaded (exact: a bf16 is the top
// half of its fp32, so both give the kernel the same fp32 values and the same bits out). A bf16 cache is
// read in place by work items of few queries (decode) and widened once per item for many (prefill), see
// attend_all. head_dim up to 128 (query_kernel_for).

inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23: rounds to nearest
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), exponent));
}

inline float exp_nonpositive_scalar(float x) { return _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(x))); }

inline __mmask16 lanes_below(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exactly: each one's bits shifted up 16
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// One query's group of heads over its keys; q [group][16 C] fp32 in, out [group][16 C] fp32 (normalized);
// KV: the keys' and values' element type (float, or bf16 read in place).
template <int C, typename KV>
void attend_query(const float* q, int64_t group, const KV* const* keys, const KV* const* values,
                  int64_t count, float scale, float* out) {
  alignas(64) float acc[kMaxGroup][16 * C];
  alignas(64) float scores[kBlockKeys];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    std::fill(acc[g], acc[g] + 16 * C, 0.0f);
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
  for (int64_t first = 0; first < count; first += kBlockKeys) {
    const int64_t n = std::min(kBlockKeys, count - first);
    for (int64_t g = 0; g < group; ++g) {  // the block's keys stay in L1 across the group's heads
      __m512 qv[C], av[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + g * 16 * C + 16 * c);
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const KV* k = keys[first + j];
        __m512 dot = _mm512_mul_ps(qv[0], load16(k));
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), dot);
        scores[j] = _mm512_reduce_add_ps(dot) * scale;
        block_max = std::max(block_max, scores[j]);
      }
      const float new_max = std::max(running_max[g], block_max);
      const float rescale = first == 0 ? 0.0f : exp_nonpositive_scalar(running_max[g] - new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t v = 0; v * 16 < n; ++v) {
        const __mmask16 live = lanes_below(n - v * 16);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + v * 16), _mm512_set1_ps(new_max));
        const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(x));
        _mm512_store_ps(scores + v * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
      running_sum[g] = running_sum[g] * rescale + _mm512_reduce_add_ps(sum);
      running_max[g] = new_max;
      const __m512 rescale_v = _mm512_set1_ps(rescale);
      for (int c = 0; c < C; ++c) av[c] = _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * c), rescale_v);
      for (int64_t j = 0; j < n; ++j) {  // P.V in key order
        const KV* v = values[first + j];
        const __m512 p = _mm512_set1_ps(scores[j]);
        for (int c = 0; c < C; ++c) av[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), av[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_store_ps(acc[g] + 16 * c, av[c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < 16 * C; ++d) out[g * 16 * C + d] = count == 0 ? 0.0f : acc[g][d] / running_sum[g];
  }
}

template <typename KV>
using QueryKernel = void (*)(const float*, int64_t, const KV* const*, const KV* const*, int64_t, float, float*);

template <typename KV>
inline QueryKernel<KV> query_kernel_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_query<1, KV>;
    case 32: return attend_query<2, KV>;
    case 48: return attend_query<3, KV>;
    case 64: return attend_query<4, KV>;
    case 80: return attend_query<5, KV>;
    case 96: return attend_query<6, KV>;
    case 112: return attend_query<7, KV>;
    case 128: return attend_query<8, KV>;
    default: return nullptr;  // the portable loop below
  }
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
};

// Queries of one (row, K/V head) handled by one work item: a bf16 cache's keys are widened to fp32 once
// per item, not once per query (a prefill's queries read the same keys).
constexpr int64_t kQueryChunk = 64;
// Items of at most this many queries read a bf16 cache in place instead (a decode step's one query per
// row: widening would write and read every key once more for one use). bench-qwen2 bf16 decode step at
// 32 rows x 512 keys: 8.9 -> 5.7 ms of attention per step (SDPA flash 6.6), Intel Xeon.
constexpr int64_t kInPlaceQueries = 4;

// A key/value head_dim vector as the AVX-512 kernel reads it: fp32 in place, or bf16 widened (exactly)
// into `scratch`, each cache column at most once per item (slot[c] remembers where).
template <typename T>
struct Widened {
  std::vector<float> scratch;  // [slots][head_dim]
  std::vector<int32_t> slot;   // per column of one source, -1: not widened yet
  int64_t used = 0, head_dim = 0;

  void reset(int64_t columns, int64_t capacity, int64_t dim) {
    if constexpr (std::is_same_v<T, float>) return;  // read in place
    head_dim = dim;
    used = 0;
    slot.assign(static_cast<size_t>(columns), -1);
    scratch.resize(static_cast<size_t>(capacity * dim));
  }
  const float* at(const T* source, int64_t column) {
    if constexpr (std::is_same_v<T, float>) {
      return source;
    } else {
      int32_t& s = slot[static_cast<size_t>(column)];
      if (s < 0) {
        s = static_cast<int32_t>(used++);
        float* dst = scratch.data() + s * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(source[d]);
      }
      return scratch.data() + s * head_dim;
    }
  }
};

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
#if defined(__AVX512F__)
  const QueryKernel<float> simd = query_kernel_for<float>(head_dim);
  const QueryKernel<T> in_place = std::is_same_v<T, float> ? nullptr : query_kernel_for<T>(head_dim);
#else
  const void* simd = nullptr;
  const void* in_place = nullptr;
#endif
  at::parallel_for(0, rows * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> key_ptrs(static_cast<size_t>(shared_max + columns));
    std::vector<const T*> value_ptrs(static_cast<size_t>(shared_max + columns));
    std::vector<const float*> key_fp32(simd ? key_ptrs.size() : 0), value_fp32(simd ? value_ptrs.size() : 0);
    std::vector<float> work, q_fp32(static_cast<size_t>(group * head_dim)), out_fp32(q_fp32.size());
    Widened<T> own_keys, own_values, shared_keys, shared_values;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (kv_heads * chunks);
      const int64_t kv_head = (item / chunks) % kv_heads;
      const int64_t chunk = item % chunks;
      const int64_t g = shared.group != nullptr ? shared.group[row] : -1;
      const int64_t shared_count = g >= 0 ? shared.length[g] : 0;
      const int64_t first_query = chunk * kQueryChunk, end_query = std::min(queries, first_query + kQueryChunk);
      const bool widen = simd && !(in_place && end_query - first_query <= kInPlaceQueries);
      if (widen) {
        own_keys.reset(columns, columns, head_dim), own_values.reset(columns, columns, head_dim);
        shared_keys.reset(shared_count, shared_count, head_dim), shared_values.reset(shared_count, shared_count, head_dim);
      }
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
      for (int64_t qi = first_query; qi < end_query; ++qi) {
        int64_t count = 0;
        for (int64_t j = 0; j < shared_count; ++j, ++count) {
          key_ptrs[count] = sk + j * sks.token;
          value_ptrs[count] = sv + j * svs.token;
          if (widen) key_fp32[count] = shared_keys.at(key_ptrs[count], j), value_fp32[count] = shared_values.at(value_ptrs[count], j);
        }
        const bool* m = has_mask ? mask + (row * mask_queries + (mask_queries == 1 ? 0 : qi)) * columns : nullptr;
        const int64_t visible = has_mask ? columns : (causal ? columns - queries + qi + 1 : columns);
        for (int64_t c = 0; c < visible; ++c) {
          if (m == nullptr || m[c]) {
            key_ptrs[count] = k_row + c * ks.token;
            value_ptrs[count] = v_row + c * vs.token;
            if (widen) key_fp32[count] = own_keys.at(key_ptrs[count], c), value_fp32[count] = own_values.at(value_ptrs[count], c);
            ++count;
          }
        }
#if defined(__AVX512F__)
        if (simd) {
          for (int64_t h = 0; h < group; ++h) {
            const T* src = q + row * qs.row + (kv_head * group + h) * qs.head + qi * qs.token;
            for (int64_t d = 0; d < head_dim; ++d) q_fp32[h * head_dim + d] = as_float(src[d]);
          }
          if (widen) {
            simd(q_fp32.data(), group, key_fp32.data(), value_fp32.data(), count, static_cast<float>(scale),
                 out_fp32.data());
          } else if constexpr (std::is_same_v<T, float>) {
            simd(q_fp32.data(), group, key_ptrs.data(), value_ptrs.data(), count, static_cast<float>(scale),
                 out_fp32.data());
          } else {
            in_place(q_fp32.data(), group, key_ptrs.data(), value_ptrs.data(), count, static_cast<float>(scale),
                     out_fp32.data());
          }
          for (int64_t h = 0; h < group; ++h) {
            T* dst = o + row * os.row + qi * os.token + (kv_head * group + h) * os.head;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(out_fp32[h * head_dim + d]);
          }
          continue;
        }
#endif
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

// The same, each row first reading its group's shared keys (cascade decode): shared_key, shared_value
// [groups, kv_heads, shared, head_dim], shared_length [groups] and row_group [rows] int64 (-1: none).
at::Tensor invariant_attention_shared(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& allowed, double scale, const at::Tensor& shared_key,
                                      const at::Tensor& shared_value, const at::Tensor& shared_length,
                                      const at::Tensor& row_group) {
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
  return run(query, key, value, allowed, false, scale, Shared{&shared_key, &shared_value, lengths, groups});
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

}  // namespace

TORCH_LIBRARY(autobucket, m) {
  m.def("invariant_attention(Tensor query, Tensor key, Tensor value, Tensor allowed, bool causal, float scale) -> Tensor");
  m.def("invariant_attention_shared(Tensor query, Tensor key, Tensor value, Tensor allowed, float scale, "
        "Tensor shared_key, Tensor shared_value, Tensor shared_length, Tensor row_group) -> Tensor");
  m.def("blocked_linear(Tensor rows, Tensor packed, Tensor? bias, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(autobucket, CPU, m) {
  m.impl("invariant_attention", &invariant_attention);
  m.impl("invariant_attention_shared", &invariant_attention_shared);
  m.impl("blocked_linear", &blocked_linear);
}

// The packed weight is an opaque oneDNN tensor, so a call dispatches on its MkldnnCPU key.
TORCH_LIBRARY_IMPL(autobucket, MkldnnCPU, m) { m.impl("blocked_linear", &blocked_linear); }
