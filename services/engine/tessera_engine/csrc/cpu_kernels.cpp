// tessera's CPU kernels: the decode step's memory-bound pieces, fused.
//
// On CPU a decode step spends most of its non-matmul time moving data: paged
// attention gathered K/V into a padded copy, upcast it, then ran tiny batched
// matmuls; RMSNorm, the residual add, SwiGLU and rotary embeddings each took
// several elementwise passes (and allocations). These kernels do each in one
// pass, reading the paged cache in place. They accumulate in float32, and
// round to the tensor's dtype where the torch reference rounds, so results
// match it to float32 rounding.
//
// Built at first use by torch.utils.cpp_extension (tessera_engine/cpu_kernels.py),
// for the CPU it is built on (-march=native). Parallel over rows with
// at::parallel_for (torch's own OpenMP team).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <sched.h>

namespace {

// ---- element conversion (vectorizes: bf16 -> f32 is a 16-bit shift) ----------------
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  // bits moved with memcpy, not through a uint32_t pointer: float and uint32_t may not alias
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void from_float<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  // round to nearest even, as torch's float -> bfloat16 conversion (NaN -> 0x7FC0)
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_srli_epi32(r, 16), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    d[i] = std::isnan(src[i]) ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
  }
}

// dot product with 16 independent partial sums (vectorizes without -ffast-math)
inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) part[k] += a[i + k] * b[i + k];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int k = 0; k < 16; ++k) s += part[k];
  return s;
}

// runs f(T{}) for the cache/model dtypes tessera uses: float32, bfloat16, float16
template <typename F>
void dispatch_dtype(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype ", t);
  }
}

// ---- vector helpers (AVX-512 where the build machine has it) ----------------------------
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The mask of lanes [0, m), 0 <= m <= 16.
inline __mmask16 first_lanes(int64_t m) { return static_cast<__mmask16>((1u << m) - 1); }
// e^x: Cody-Waite range reduction, a degree-7 polynomial on |r| <= ln2/2 (relative
// error ~5e-9), scaled by 2^n (inf past ~88; inputs under -87 give e^-87, not 0)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// softmax of s[0..L) in place (float32)
inline void softmax_inplace(float* s, int64_t L) {
#if defined(__AVX512F__)
  // masked tails: a row's last partial vector costs one exp16, not up to 15 scalar exps
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto tail = [L](int64_t t) { return first_lanes(std::min<int64_t>(16, L - t)); };
  __m512 vm = ninf;
  for (int64_t t = 0; t < L; t += 16) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, tail(t), s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = tail(t);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
    _mm512_mask_storeu_ps(s + t, k, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 k = tail(t);
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), inv));
  }
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  const float inv = 1.f / sum;
  for (int64_t k = 0; k < L; ++k) s[k] *= inv;
#endif
}

// ---- paged decode attention ---------------------------------------------------------
// One query token per sequence. q [N, H, d] (row stride may exceed H * d),
// caches [slots, KVH, d], block_tables [N, max_blocks] (int64), context_lens [N].
// Work item = (sequence, KV head): the g = H / KVH query heads sharing that KV
// head read each K and V row once, straight from its cache block.
// Softmax over positions [skip, L) of a row; the first `skip` get probability 0. A sliding
// window's first position may fall inside a block: the block is read whole, the positions
// before the window weigh nothing.
inline void softmax_window(float* s, int64_t L, int64_t skip) {
  std::fill(s, s + skip, 0.f);
  softmax_inplace(s + skip, L - skip);
}

struct DecodeShape {
  int64_t KVH, g, d, block_size, kv_row;
  float scale;
};

#if defined(__AVX512F__)
// Asks for the next block's rows of heads [h0, h1) while this block is computed: a step's
// K/V reads come from DRAM (the weights pass through the cache between layers), one
// scattered block at a time.
template <typename T, int Hint = _MM_HINT_T0>
inline void prefetch_block(const T* cache, int64_t base, int64_t n, int64_t h0, int64_t h1, const DecodeShape& sh) {
  const int64_t bytes = (h1 - h0) * sh.d * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < n; ++o) {
    const char* row = reinterpret_cast<const char*>(cache + (base + o) * sh.kv_row + h0 * sh.d);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, static_cast<_mm_hint>(Hint));
  }
}

// Lane i of the result = the sum of a[i]'s 16 lanes: four rounds of pairwise shuffles
// and adds (45 instructions for 16 dot products, against ~8 each reduced alone).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a2i, a2i+1, a2i, a2i+1] partials
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per chunk: [a4i, a4i+1, a4i+2, a4i+3] partials
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // chunks: [c2i ch0+ch1, c2i ch2+ch3, c2i+1 ch0+ch1, c2i+1 ch2+ch3]
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query head's row, held in registers, dotted with K rows: 16 partial sums per row,
// for sum_lanes16. bf16 rows with AVX512-BF16 multiply pairs of bf16 straight from the
// cache (exact products, float32 sums); other dtypes convert each K row to float32.
template <typename T, int NV>
struct QueryRow {
  __m512 v[NV];
  explicit QueryRow(const T* q) {
    for (int i = 0; i < NV; ++i) v[i] = load16(q + 16 * i);
  }
  __m512 dot_partial(const T* k) const {
    __m512 a = _mm512_mul_ps(v[0], load16(k));
    for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(v[i], load16(k + 16 * i), a);
    return a;
  }
};

#if defined(__AVX512BF16__)
template <int NV>
struct QueryRow<c10::BFloat16, NV> {
  static_assert(NV % 2 == 0, "bf16 rows are read 32 values at a time");
  __m512bh v[NV / 2];
  explicit QueryRow(const c10::BFloat16* q) {
    for (int i = 0; i < NV / 2; ++i) v[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
  }
  __m512 dot_partial(const c10::BFloat16* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < NV / 2; ++i) a = _mm512_dpbf16_ps(a, v[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return a;
  }
};
#endif

// Heads [h0, h1) of one sequence. NV = d / 16 vectors per row. Blocks outer, heads
// inner: a block's rows are read from memory once for all the heads of the range.
template <typename T, int NV>
void attend_vec(const T* q, int64_t q_head, const T* kc, const T* vc, const int64_t* table, int64_t L,
                int64_t skip, int64_t h0, int64_t h1, const DecodeShape& sh, float* scores, float* acc, T* out,
                int64_t o_head) {
  const int64_t g = sh.g, bs = sh.block_size, nh = h1 - h0;
  const __m512 vscale = _mm512_set1_ps(sh.scale);
  prefetch_block(kc, table[0] * bs, std::min(bs, L), h0, h1, sh);
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t base = table[t0 / bs] * bs;
    const int64_t n = std::min(bs, L - t0);
    if (t0 + bs < L) prefetch_block(kc, table[t0 / bs + 1] * bs, std::min(bs, L - t0 - bs), h0, h1, sh);
    prefetch_block<T, _MM_HINT_T1>(vc, base, n, h0, h1, sh);  // for the V pass, from L2
    for (int64_t h = h0; h < h1; ++h) {
      const T* kb = kc + base * sh.kv_row + h * sh.d;
      for (int64_t j = 0; j < g; ++j) {
        const QueryRow<T, NV> qr(q + (h * g + j) * q_head);
        float* sc = scores + ((h - h0) * g + j) * L + t0;
        for (int64_t o0 = 0; o0 < n; o0 += 16) {  // 16 rows at a time (blocks may hold more)
          const int64_t m = std::min<int64_t>(16, n - o0);
          __m512 part[16];
          for (int64_t o = 0; o < m; ++o) part[o] = qr.dot_partial(kb + (o0 + o) * sh.kv_row);
          for (int64_t o = m; o < 16; ++o) part[o] = _mm512_setzero_ps();
          _mm512_mask_storeu_ps(sc + o0, first_lanes(m), _mm512_mul_ps(sum_lanes16(part), vscale));
        }
      }
    }
  }
  for (int64_t j = 0; j < nh * g; ++j) softmax_window(scores + j * L, L, skip);
  std::fill(acc, acc + nh * g * sh.d, 0.f);
  prefetch_block(vc, table[0] * bs, std::min(bs, L), h0, h1, sh);
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t base = table[t0 / bs] * bs;
    const int64_t n = std::min(bs, L - t0);
    if (t0 + bs < L) prefetch_block(vc, table[t0 / bs + 1] * bs, std::min(bs, L - t0 - bs), h0, h1, sh);
    for (int64_t h = h0; h < h1; ++h) {
      const float* sc = scores + (h - h0) * g * L;
      float* ah = acc + (h - h0) * g * sh.d;
      __m512 av[16][NV];
      for (int64_t j = 0; j < g; ++j)
        for (int v = 0; v < NV; ++v) av[j][v] = _mm512_loadu_ps(ah + j * sh.d + 16 * v);
      const T* vb = vc + base * sh.kv_row + h * sh.d;
      for (int64_t o = 0; o < n; ++o) {
        __m512 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load16(vb + o * sh.kv_row + 16 * v);
        for (int64_t j = 0; j < g; ++j) {
          const __m512 p = _mm512_set1_ps(sc[j * L + t0 + o]);
          for (int v = 0; v < NV; ++v) av[j][v] = _mm512_fmadd_ps(p, vv[v], av[j][v]);
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ah + j * sh.d + 16 * v, av[j][v]);
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j = 0; j < g; ++j)
      from_float(acc + ((h - h0) * g + j) * sh.d, out + (h * g + j) * o_head, sh.d);
}
#endif

template <typename T>
void attend_scalar_head(const T* q, int64_t q_head, const T* kc, const T* vc, const int64_t* table, int64_t L,
                        int64_t skip, int64_t h, const DecodeShape& sh, float* scores, T* out, int64_t o_head) {
  const int64_t g = sh.g, d = sh.d, bs = sh.block_size;
  std::vector<float> qf(g * d), acc(g * d, 0.f), row(d);
  for (int64_t j = 0; j < g; ++j) {
    to_float(q + (h * g + j) * q_head, qf.data() + j * d, d);
    for (int64_t x = 0; x < d; ++x) qf[j * d + x] *= sh.scale;
  }
  for (int64_t t = 0; t < L; ++t) {
    to_float(kc + (table[t / bs] * bs + t % bs) * sh.kv_row + h * d, row.data(), d);
    for (int64_t j = 0; j < g; ++j) scores[j * L + t] = dot(qf.data() + j * d, row.data(), d);
  }
  for (int64_t j = 0; j < g; ++j) softmax_window(scores + j * L, L, skip);
  for (int64_t t = 0; t < L; ++t) {
    to_float(vc + (table[t / bs] * bs + t % bs) * sh.kv_row + h * d, row.data(), d);
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * L + t];
      for (int64_t x = 0; x < d; ++x) acc[j * d + x] += p * row[x];
    }
  }
  for (int64_t j = 0; j < g; ++j) from_float(acc.data() + j * d, out + (h * g + j) * o_head, d);
}

template <typename T>
void attend_scalar(const T* q, int64_t q_head, const T* kc, const T* vc, const int64_t* table, int64_t L,
                   int64_t skip, int64_t h0, int64_t h1, const DecodeShape& sh, float* scores, float* /*acc*/, T* out,
                   int64_t o_head) {
  for (int64_t h = h0; h < h1; ++h)
    attend_scalar_head(q, q_head, kc, vc, table, L, skip, h, sh, scores, out, o_head);
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           at::Tensor& out, double scale, int64_t block_size, int64_t window) {
  const int64_t N = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t KVH = k_cache.size(1);
  const DecodeShape sh{KVH, H / KVH, d, block_size, KVH * d, static_cast<float>(scale)};
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  using Fn = void (*)(const T*, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                      const DecodeShape&, float*, float*, T*, int64_t);
  Fn fn = &attend_scalar<T>;
#if defined(__AVX512F__)
  if (sh.g <= 16) {
    if (d == 64) fn = &attend_vec<T, 4>;
    else if (d == 128) fn = &attend_vec<T, 8>;
    else if (d == 32) fn = &attend_vec<T, 2>;
    else if (d == 256) fn = &attend_vec<T, 16>;
  }
#endif
  // many sequences: one work item each (all KV heads, each block read once);
  // few: one per (sequence, KV head) so every thread has work
  const int64_t per = N >= 2 * at::get_num_threads() ? KVH : 1;
  const int64_t parts = KVH / per;
  // Work item w: its row (taken from both ends in turn: a prefill chunk's rows have growing
  // contexts, and each thread's contiguous range of w then holds short and long rows alike),
  // its first KV head, and where its context starts (a sliding window attends positions
  // [L - window, L): from that position's block).
  struct Item { int64_t i, h0, first, L; };
  auto item = [&](int64_t w) {
    const int64_t r = w / parts, i = (r & 1) ? N - 1 - r / 2 : r / 2;
    const int64_t first = window > 0 && lens[i] > window ? (lens[i] - window) / block_size : 0;
    return Item{i, (w % parts) * per, first, lens[i] - first * block_size};
  };
  // K blocks of the next item asked for ahead, into L2, while this one computes: its first
  // block would otherwise be a stall on memory (up to kAheadBlocks: measured here, 64 rows of
  // ~100 positions in scattered blocks, 30 layers, 7-13% less time than the first block alone)
  [[maybe_unused]] constexpr int64_t kAheadBlocks = 16;
  at::parallel_for(0, N * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(per * sh.g * d);
    for (int64_t w = begin; w < end; ++w) {
      const Item it = item(w);
#if defined(__AVX512F__)
      if (w + 1 < end) {
        const Item nx = item(w + 1);
        const int64_t* nt = tables + nx.i * max_blocks + nx.first;
        for (int64_t b = 0; b < kAheadBlocks && b * block_size < nx.L; ++b)
          prefetch_block<T, _MM_HINT_T1>(kp, nt[b] * block_size, std::min(block_size, nx.L - b * block_size),
                                         nx.h0, nx.h0 + per, sh);
      }
#endif
      const int64_t skip = window > 0 ? std::max<int64_t>(0, it.L - window) : 0;
      scores.resize(per * sh.g * it.L);
      fn(qp + it.i * q_row, q_head, kp, vp, tables + it.i * max_blocks + it.first, it.L, skip, it.h0,
         it.h0 + per, sh, scores.data(), acc.data(), op + it.i * o_row, o_head);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t block_size, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, H, d] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "context_lens: int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "decode_attention: one block table row and one context length per query");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i)
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= block_tables.size(1) * block_size,
                "decode_attention: context length ", lens[i], " does not fit its block table");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch_dtype(q.scalar_type(), "decode_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, block_size,
                                    window);
  });
  return out;
}

// ---- RMSNorm, optionally after adding the residual ------------------------------------
// HF order: x (in the model's dtype) -> float -> x * rsqrt(mean(x^2) + eps) -> back to the
// dtype -> times the weight (in the weight's dtype, here the model's). With a residual:
// residual += x first (rounded to the dtype, as `residual + x` is), normed from that sum.
// wf: the weight already in float32.
template <typename T>
void rms_norm_row(const T* x, const float* wf, T* out, int64_t n, float eps, float* buf) {
  to_float(x, buf, n);
  const float ss = dot(buf, buf, n);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) buf[k] *= r;
  // round to the dtype before the weight multiply, as the reference does
  from_float(buf, out, n);
  to_float(out, buf, n);
  for (int64_t k = 0; k < n; ++k) buf[k] *= wf[k];
  from_float(buf, out, n);
}

at::Tensor rms_norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps,
                         const char* name) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && (!residual || residual->is_contiguous()),
              name, ": contiguous inputs");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && (!residual || residual->scalar_type() == x.scalar_type()),
              name, ": one dtype for the input, residual and weight");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  TORCH_CHECK(weight.numel() == n, name, ": weight has ", weight.numel(), " elements, rows have ", n);
  TORCH_CHECK(!residual || residual->numel() == x.numel(), name, ": residual and input shapes differ");
  at::Tensor out = at::empty_like(x);
  dispatch_dtype(x.scalar_type(), name, [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      std::vector<float> buf(n), tmp(n), wf(n);
      to_float(wp, wf.data(), n);
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* src = xp + r * n;
        if (rp) {
          to_float(rp + r * n, buf.data(), n);
          to_float(src, tmp.data(), n);
          for (int64_t k = 0; k < n; ++k) buf[k] += tmp[k];
          from_float(buf.data(), rp + r * n, n);
          src = rp + r * n;
        }
        rms_norm_row(src, wf.data(), op + r * n, n, static_cast<float>(eps), buf.data());
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, nullptr, weight, eps, "rms_norm");
}

// residual += x; returns rms_norm(residual)
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, &residual, weight, eps, "add_rms_norm_");
}

// ---- SwiGLU: silu(gate) * up, from the fused [rows, 2 * inter] projection -------------
// Reference: F.silu(gate), rounded to the dtype, times up, rounded.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous(), "silu_and_mul: contiguous input");
  const int64_t two = gate_up.size(-1), inter = two / 2, rows = gate_up.numel() / two;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  dispatch_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      std::vector<float> gf(inter), uf(inter);
      std::vector<scalar_t> sg(inter);
      for (int64_t r = b; r < e; ++r) {
        to_float(gp + r * two, gf.data(), inter);
        to_float(gp + r * two + inter, uf.data(), inter);
        int64_t k = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; k + 16 <= inter; k += 16) {
          const __m512 x = _mm512_loadu_ps(gf.data() + k);
          // e^-x overflows to inf for x < -88, as in torch: silu -> -0
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
          _mm512_storeu_ps(gf.data() + k, _mm512_div_ps(x, _mm512_add_ps(one, e)));
        }
#endif
        for (; k < inter; ++k) gf[k] = gf[k] / (1.f + std::exp(-gf[k]));
        from_float(gf.data(), sg.data(), inter);
        to_float(sg.data(), gf.data(), inter);
        for (k = 0; k < inter; ++k) gf[k] *= uf[k];
        from_float(gf.data(), op + r * inter, inter);
      }
    });
  });
  return out;
}

// ---- rotary embedding on q and k, and the step's K/V written to the cache ---------------
// qkv [T, (H + 2 KVH) * d] (the fused projection); q rotated in place; rotated k and v
// written to the cache rows slot_mapping[t]. cos, sin_signed [max_pos, d] tables in the
// model's dtype (HF's rotate-half layout, the sign of rotate-half folded into sin). Rounds
// as HF's `q * cos + rotate_half(q) * sin` in the model's dtype does.
at::Tensor rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin_signed, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_and_cache_: qkv [T, width] with contiguous rows");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "rope_and_cache_: qkv width");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin_signed.scalar_type() == qkv.scalar_type() &&
              cos.is_contiguous() && sin_signed.is_contiguous() && cos.size(1) == head_dim,
              "rope_and_cache_: [max_pos, head_dim] tables in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
              positions.is_contiguous() && slot_mapping.is_contiguous(), "rope_and_cache_: int64 positions, slots");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
              v_cache.scalar_type() == qkv.scalar_type(), "rope_and_cache_: caches contiguous, same dtype");
  TORCH_CHECK(positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0),
              "rope_and_cache_: one position and one cache slot per token");
  const int64_t T = qkv.size(0), d = head_dim, half = d / 2, row = qkv.stride(0);
  const int64_t kv_row = num_kv_heads * d;
  dispatch_dtype(qkv.scalar_type(), "rope_and_cache_", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = qkv.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin_signed.data_ptr<scalar_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
      std::vector<float> c(d), sn(d), x(d), a(d), rb(d);
      std::vector<scalar_t> tmp(d);
      for (int64_t t = b; t < e; ++t) {
        to_float(cp + pos[t] * d, c.data(), d);
        to_float(sp + pos[t] * d, sn.data(), d);
        scalar_t* r = xp + t * row;
        scalar_t* kdst = kc + slots[t] * kv_row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          scalar_t* src = r + h * d;
          to_float(src, x.data(), d);
          for (int64_t i = 0; i < d; ++i) a[i] = x[i] * c[i];
          for (int64_t i = 0; i < half; ++i) rb[i] = x[i + half] * sn[i];
          for (int64_t i = half; i < d; ++i) rb[i] = x[i - half] * sn[i];
          // round each product, then the sum (the reference's three ops in the dtype)
          from_float(a.data(), tmp.data(), d);
          to_float(tmp.data(), a.data(), d);
          from_float(rb.data(), tmp.data(), d);
          to_float(tmp.data(), rb.data(), d);
          for (int64_t i = 0; i < d; ++i) a[i] += rb[i];
          from_float(a.data(), h < num_heads ? src : kdst + (h - num_heads) * d, d);
        }
        std::memcpy(vc + slots[t] * kv_row, r + (num_heads + num_kv_heads) * d, kv_row * sizeof(scalar_t));
      }
    });
  });
  return qkv;
}

// ---- greedy: the first index of each row's maximum (NaN counts as the maximum, as
// torch.argmax) -----------------------------------------------------------------------
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "argmax_rows: contiguous [rows, V]");
  const int64_t rows = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch_dtype(logits.scalar_type(), "argmax_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      std::vector<float> buf(V);
      for (int64_t r = b; r < e; ++r) {
        to_float(lp + r * V, buf.data(), V);
        const float* x = buf.data();
        float m = -std::numeric_limits<float>::infinity();
        bool nan = false;
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 vm = _mm512_set1_ps(m);
        __mmask16 unord = 0;
        for (; k + 16 <= V; k += 16) {
          const __m512 v = _mm512_loadu_ps(x + k);
          unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          vm = _mm512_max_ps(vm, v);
        }
        m = _mm512_reduce_max_ps(vm);
        nan = unord != 0;
#endif
        for (; k < V; ++k) { nan = nan || std::isnan(x[k]); if (x[k] > m) m = x[k]; }
        int64_t best = 0;
        if (nan) {  // torch's argmax treats NaN as the maximum: the first NaN
          while (!std::isnan(x[best])) ++best;
        } else {
          k = 0;
#if defined(__AVX512F__)
          const __m512 vmax = _mm512_set1_ps(m);
          for (; k + 16 <= V; k += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), vmax, _CMP_EQ_OQ);
            if (hit) break;
          }
#endif
          while (k < V && x[k] != m) ++k;
          best = k < V ? k : 0;
        }
        op[r] = best;
      }
    });
  });
  return out;
}

// ---- GGUF block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), used as they are --
// A quantized weight is llama.cpp's own bytes, uint8 [N, K / block weights * block bytes]:
// each row is a run of blocks. Q4_0 / Q4_1 / Q8_0 blocks hold 32 weights: a float16 scale d
// (and, for Q4_1, a float16 minimum m) and the quants. The K-quants' super-blocks hold 256
// weights (QK_K) in sub-blocks with their own scales: Q4_K / Q5_K (144 / 176 bytes) a float16
// d and dmin and eight 6-bit scales and mins packed in 12 bytes, scaling sub-blocks of 32
// 4-bit (Q5_K: 5-bit, the fifth bit in 32 bytes of its own) quants as (d * sc) * q - (dmin * m);
// Q6_K (210 bytes) 6-bit quants (low 4 bits, high 2 bits), sixteen int8 scales of 16-weight
// sub-blocks and a float16 d last, (d * sc) * (q - 32). Each block is dequantized as gguf-py's
// reference does it, in float32 and in its order (Q4_1: d * q, then + m; no fused
// multiply-add), then rounded to the activations' dtype: the weights the matmul sees are bit
// for bit those of the dequantized-at-load path, and only the summation order differs. A
// thread dequantizes four weight rows at a time into a buffer that stays in L1 and runs every
// activation row against them.
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };  // ggml's type numbers

#define TESSERA_QTYPES_SUPPORTED "(supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)"

constexpr int64_t q_block_bytes(int64_t qt) {
  switch (qt) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: TORCH_CHECK(false, "quantized weight: unsupported ggml type ", qt, " " TESSERA_QTYPES_SUPPORTED);
  }
  return 0;
}

constexpr bool is_kquant(int64_t qt) { return qt == kQ4_K || qt == kQ5_K || qt == kQ6_K; }

// weights per block: 32, or QK_K = 256 for the K-quants
constexpr int64_t q_block_weights(int64_t qt) { return is_kquant(qt) ? 256 : 32; }

inline const char* q_type_name(int64_t qt) {
  switch (qt) {
    case kQ4_0: return "Q4_0";
    case kQ4_1: return "Q4_1";
    case kQ8_0: return "Q8_0";
    case kQ4_K: return "Q4_K";
    case kQ5_K: return "Q5_K";
    case kQ6_K: return "Q6_K";
    default: return "?";
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K's 12 bytes of packed 6-bit scales and mins -> sc[8], mn[8] (gguf-py's
// Q4_K.get_scale_min): bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales
// 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales (and mins) 4-7.
inline void kquant_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// The head of a Q4_K / Q5_K super-block, read once for the scalar and vector dequantizers:
// float16 d and dmin, eight 6-bit (scale, min) pairs, and where the fifth bits (Q5_K) and
// the low four bits of the quants start. scale(j) and min(j) are sub-block j's float32
// d * sc and dmin * m, each one rounding, as the reference computes them.
struct KQuantHead {
  float d, dmin;
  uint8_t sc[8], mn[8];
  const uint8_t* qh;
  const uint8_t* qs;
  KQuantHead(const uint8_t* b, int64_t qt)
      : d(half_to_float(b)), dmin(half_to_float(b + 2)), qh(b + 16), qs(b + (qt == kQ5_K ? 48 : 16)) {
    kquant_scale_min(b + 4, sc, mn);
  }
  float scale(int j) const { return d * static_cast<float>(sc[j]); }
  float min(int j) const { return dmin * static_cast<float>(mn[j]); }
};

// One K-quant super-block -> 256 float32, exactly as gguf-py's dequantize_blocks (contraction
// off: d_j * q - m_j is two roundings):
//   Q4_K / Q5_K: sub-block j (32 weights) of d_j = d * sc_j, m_j = dmin * mn_j; w = d_j * q - m_j,
//     q = the low (j even) or high (j odd) nibbles of qs[32 (j / 2) ..][32] (Q5_K: | bit j of
//     qh[l] << 4);
//   Q6_K: weight p = 128 c + 32 t + l (c < 2, t < 4, l < 32) has q = (ql[64 c + 32 (t & 1) + l]
//     >> 4 (t / 2)) & 15 | ((qh[32 c + l] >> 2 t) & 3) << 4; w = (d * scales[p / 16]) * (q - 32).
__attribute__((noinline, optimize("fp-contract=off")))
void dequant_kblock_scalar(const uint8_t* b, int64_t qt, float* out) {
  if (qt == kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int p = 0; p < 256; ++p) {
      const int c = p / 128, t = (p % 128) / 32, l = p % 32;
      const int lo = (ql[64 * c + 32 * (t & 1) + l] >> (4 * (t / 2))) & 15;
      const int hi = (qh[32 * c + l] >> (2 * t)) & 3;
      const float ds = d * static_cast<float>(sc[p / 16]);
      out[p] = ds * static_cast<float>((lo | (hi << 4)) - 32);
    }
    return;
  }
  const KQuantHead h(b, qt);
  for (int j = 0; j < 8; ++j) {
    const float dj = h.scale(j), mj = h.min(j);
    for (int l = 0; l < 32; ++l) {
      int q = (h.qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
      if (qt == kQ5_K) q |= ((h.qh[l] >> j) & 1) << 4;
      const float dq = dj * static_cast<float>(q);
      out[32 * j + l] = dq - mj;
    }
  }
}

// One block -> 32 float32 (a K-quant super-block: 256), exactly as gguf-py's dequantize_blocks.
// Kept out of line with contraction off so that d * q + m is two roundings, as numpy's.
__attribute__((noinline, optimize("fp-contract=off")))
void dequant_block_scalar(const uint8_t* b, int64_t qt, float* out) {
  if (is_kquant(qt)) return dequant_kblock_scalar(b, qt, out);
  const float d = half_to_float(b);
  if (qt == kQ8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(qs[j]) * d;
  } else if (qt == kQ4_0) {
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(static_cast<int>(qs[j] & 15) - 8);
      out[j + 16] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
    }
  } else {
    const float m = half_to_float(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      const float lo = d * static_cast<float>(qs[j] & 15), hi = d * static_cast<float>(qs[j] >> 4);
      out[j] = lo + m;
      out[j + 16] = hi + m;
    }
  }
}

#if defined(__AVX512F__)
// The same in registers: weights 0..15 in lo, 16..31 in hi. The _round_ forms are never
// contracted into a fused multiply-add.
template <int64_t qt>
inline void dequant_block16x2(const uint8_t* b, __m512& lo, __m512& hi) {
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 d = _mm512_set1_ps(half_to_float(b));
  if constexpr (qt == kQ8_0) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    lo = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d, kRn);
    hi = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d, kRn);
    return;
  }
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (qt == kQ4_1 ? 4 : 2)));
  const __m128i nib = _mm_set1_epi8(0x0F);
  __m512i il = _mm512_cvtepu8_epi32(_mm_and_si128(q, nib));
  __m512i ih = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), nib));
  if constexpr (qt == kQ4_0) {
    const __m512i eight = _mm512_set1_epi32(8);
    lo = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(il, eight)), kRn);
    hi = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ih, eight)), kRn);
  } else {
    const __m512 m = _mm512_set1_ps(half_to_float(b + 2));
    lo = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(il), kRn), m, kRn);
    hi = _mm512_add_round_ps(_mm512_mul_round_ps(d, _mm512_cvtepi32_ps(ih), kRn), m, kRn);
  }
}
#endif

#if defined(__AVX512F__)
// One K-quant super-block -> 256 float32 with AVX-512, bit for bit dequant_kblock_scalar's:
// the per-sub-block scales are the same scalar float products, and the _round_ forms are
// never contracted into a fused multiply-add.
template <int64_t qt>
inline void dequant_kblock_avx512(const uint8_t* b, float* out) {
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  if constexpr (qt == kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    const __m512i three = _mm512_set1_epi32(3), m32 = _mm512_set1_epi32(32);
    for (int p = 0; p < 256; p += 16) {  // 16 weights of one sub-block
      const int c = p / 128, t = (p % 128) / 32, l = p % 32;
      const __m512i lo = _mm512_and_si512(
          _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 64 * c + 32 * (t & 1) + l))),
                           _mm_cvtsi32_si128(4 * (t / 2))), low4);
      const __m512i hi = _mm512_and_si512(
          _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 32 * c + l))),
                           _mm_cvtsi32_si128(2 * t)), three);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), m32));
      const __m512 ds = _mm512_set1_ps(d * static_cast<float>(sc[p / 16]));
      _mm512_storeu_ps(out + p, _mm512_mul_round_ps(ds, q, kRn));
    }
  } else {
    const KQuantHead kh(b, qt);
    for (int j = 0; j < 8; ++j) {
      const __m512 dj = _mm512_set1_ps(kh.scale(j));
      const __m512 mj = _mm512_set1_ps(kh.min(j));
      for (int h = 0; h < 32; h += 16) {
        __m512i q = _mm512_and_si512(
            _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kh.qs + 32 * (j / 2) + h))),
                             _mm_cvtsi32_si128(4 * (j & 1))), low4);
        if constexpr (qt == kQ5_K) {
          const __m512i bit = _mm512_and_si512(
              _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kh.qh + h))),
                               _mm_cvtsi32_si128(j)), _mm512_set1_epi32(1));
          q = _mm512_or_si512(q, _mm512_slli_epi32(bit, 4));
        }
        _mm512_storeu_ps(out + 32 * j + h,
                         _mm512_sub_round_ps(_mm512_mul_round_ps(dj, _mm512_cvtepi32_ps(q), kRn), mj, kRn));
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__)
inline __m512 bcast_half(const uint8_t* p) { return _mm512_set1_ps(half_to_float(p)); }

// One block -> 32 bfloat16 in a register. A 4-bit block has 16 possible weights: they are
// computed once (as dequant_block16x2 would, then rounded) and looked up by each nibble.
template <int64_t qt>
inline __m512i dequant_block_bf16(const uint8_t* b) {
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  if constexpr (qt == kQ8_0) {
    __m512 lo, hi;
    dequant_block16x2<qt>(b, lo, hi);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 d = bcast_half(b);
  __m512 t;
  if constexpr (qt == kQ4_0) t = _mm512_mul_round_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)), kRn);
  else t = _mm512_add_round_ps(_mm512_mul_round_ps(d, iota, kRn), bcast_half(b + 2), kRn);
  const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (qt == kQ4_1 ? 4 : 2)));
  const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), table);
}

#endif

// A weight row's blocks -> K values of the activations' dtype (float, or bfloat16 bits).
template <typename T, int64_t qt>
inline void dequant_row(const uint8_t* row, int64_t nb, T* out) {
  const int64_t bb = q_block_bytes(qt);
  if constexpr (is_kquant(qt)) {  // 256-weight super-blocks: float32, then rounded to T
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* b = row + j * bb;
      alignas(64) float tmp[256];
      float* o = tmp;
      if constexpr (std::is_same_v<T, float>) o = out + 256 * j;
#if defined(__AVX512F__)
      dequant_kblock_avx512<qt>(b, o);
#else
      dequant_kblock_scalar(b, qt, o);
#endif
      if constexpr (!std::is_same_v<T, float>) from_float(tmp, out + 256 * j, 256);
    }
    return;
  }
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* b = row + j * bb;
#if defined(__AVX512F__)
    __m512 lo, hi;
    if constexpr (std::is_same_v<T, float>) {
      dequant_block16x2<qt>(b, lo, hi);
      _mm512_storeu_ps(out + 32 * j, lo);
      _mm512_storeu_ps(out + 32 * j + 16, hi);
    } else {
#if defined(__AVX512BF16__)
      _mm512_storeu_si512(out + 32 * j, dequant_block_bf16<qt>(b));
      continue;
#endif
      dequant_block16x2<qt>(b, lo, hi);
      float tmp[32];
      _mm512_storeu_ps(tmp, lo);
      _mm512_storeu_ps(tmp + 16, hi);
      from_float(tmp, out + 32 * j, 32);
    }
#else
    float tmp[32];
    dequant_block_scalar(b, qt, tmp);
    if constexpr (std::is_same_v<T, float>) std::memcpy(out + 32 * j, tmp, sizeof(tmp));
    else from_float(tmp, out + 32 * j, 32);
#endif
  }
}

// Whether dot_rows<T> takes its portable path, the one that needs float scratch buffers.
template <typename T>
constexpr bool kPortableDots =
#if defined(__AVX512BF16__)
    false;
#elif defined(__AVX512F__)
    !std::is_same_v<T, float>;
#else
    true;
#endif

// y[m, n0 + r] for r < rows: dots of x's rows with the dequantized rows in w (stride K).
template <typename T>
void dot_rows(const T* x, int64_t M, int64_t K, const T* w, int64_t rows, int64_t N, int64_t n0,
              const float* bias, T* y, float* xbuf, float* wbuf) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* xp = reinterpret_cast<const uint16_t*>(x + m * K);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + k);
        for (int r = 0; r < 4; ++r)
          if (r < rows) acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(wp + r * K + k));
      }
      float res[4];
      for (int64_t r = 0; r < rows; ++r) res[r] = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[n0 + r] : 0.f);
      from_float(res, y + m * N + n0, rows);
    }
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xp = x + m * K;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(xp + k);
        for (int r = 0; r < 4; ++r)
          if (r < rows) acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + r * K + k), acc[r]);
      }
      float res[4];
      for (int64_t r = 0; r < rows; ++r) res[r] = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[n0 + r] : 0.f);
      std::memcpy(y + m * N + n0, res, rows * sizeof(float));
    }
    return;
  }
#endif
  // portable: float32 dots over float copies (the weights already rounded to T)
  for (int64_t r = 0; r < rows; ++r) to_float(w + r * K, wbuf + r * K, K);
  for (int64_t m = 0; m < M; ++m) {
    to_float(x + m * K, xbuf, K);
    float res[4];
    for (int64_t r = 0; r < rows; ++r) res[r] = dot(xbuf, wbuf + r * K, K) + (bias ? bias[n0 + r] : 0.f);
    from_float(res, y + m * N + n0, rows);
  }
}

// runs f(std::integral_constant<int64_t, QT>{}) for a supported ggml type
template <typename F>
void dispatch_qtype(int64_t qt, F&& f) {
  switch (qt) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: TORCH_CHECK(false, "quantized weight: unsupported ggml type ", qt, " " TESSERA_QTYPES_SUPPORTED);
  }
}

void check_quantized(const at::Tensor& wq, int64_t qt, int64_t K, const char* what) {
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous(),
              what, ": the quantized weight is a contiguous uint8 [N, row bytes]");
  const int64_t bb = q_block_bytes(qt), bw = q_block_weights(qt);  // (an unsupported type fails here)
  TORCH_CHECK(K > 0 && K % bw == 0, what, ": K must be a multiple of ", bw, " (the block size of ",
              q_type_name(qt), "), got ", K);
  TORCH_CHECK(wq.size(1) == K / bw * bb, what, ": ", wq.size(1), " bytes a row do not hold K = ", K,
              " weights of ggml type ", q_type_name(qt), " (", K / bw * bb, " bytes)");
}

// y = x W^T (+ bias) with W block-quantized: x [M, K] float32 or bfloat16 -> [M, N] of x's dtype.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& wq, int64_t qt, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear: contiguous x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0), nb = K / q_block_weights(qt);
  check_quantized(wq, qt, K, "qlinear");
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qlinear: bias [N]");
    at::Tensor bf = bias->to(at::kFloat).contiguous();
    bias_f.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + N);
  }
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  const int64_t row_bytes = wq.size(1);
  auto run = [&](auto tag) { dispatch_qtype(qt, [&](auto qtag) {
    using T = decltype(tag);
    constexpr int64_t QT = decltype(qtag)::value;
    const T* xp = x.data_ptr<T>();
    T* yp = out.data_ptr<T>();
    at::parallel_for(0, (N + 3) / 4, 1, [&](int64_t gb, int64_t ge) {
      std::vector<T> w(4 * K);
      std::vector<float> xbuf(kPortableDots<T> ? K : 0), wbuf(kPortableDots<T> ? 4 * K : 0);
      for (int64_t g = gb; g < ge; ++g) {
        const int64_t n0 = g * 4, rows = std::min<int64_t>(4, N - n0);
        for (int64_t r = 0; r < rows; ++r) dequant_row<T, QT>(wp + (n0 + r) * row_bytes, nb, w.data() + r * K);
        dot_rows(xp, M, K, w.data(), rows, N, n0, bp, yp, xbuf.data(), wbuf.data());
      }
    });
  }); };
  if (x.scalar_type() == at::kFloat) run(float{});
  else if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else TORCH_CHECK(false, "qlinear: activations must be float32 or bfloat16, got ", x.scalar_type());
  return out;
}

// ---- bfloat16 dense matmul on oneDNN's brgemm micro-kernel -----------------------------
// oneDNN's matmul (torch's prepacked linear) splits a layer's work evenly over the OpenMP
// team before it starts; on cores shared with the frontend, tokenizer and clients, one
// preempted thread then holds up the whole layer while the others wait at its end. Here
// the layer is cut into tiles (up to kTileM rows x kPackN columns) that the team's threads
// take from a shared counter, so a thread that runs takes the tiles of one that does not.
// Each tile is one call of oneDNN's brgemm micro-kernel (exported by torch as
// at::native::cpublas::brgemm), accumulating in float32, rounded to bfloat16 once.
constexpr int64_t kPackN = 64;   // columns per packed weight block
constexpr int64_t kTileM = 64;   // rows per tile

// Tiles [0, n) for `threads` threads: one contiguous run of tiles per thread, taken in order
// by its owner (a forward stream through the packed weight, which the hardware prefetchers
// follow: at 64 rows, ~5% faster here than the threads taking alternate tiles), then, when its
// run is done, the last tiles of another's run that its owner has not reached (a thread that
// is preempted, or slow, hands its remaining work over).
class TileQueue {
 public:
  TileQueue(int64_t n, int64_t threads) : runs_(static_cast<size_t>(std::max<int64_t>(threads, 1))) {
    const int64_t k = static_cast<int64_t>(runs_.size());
    for (int64_t i = 0; i < k; ++i) runs_[i].store(pack(n * i / k, n * (i + 1) / k), std::memory_order_relaxed);
  }
  // The next tile for thread `me`, or -1 when none is left.
  int64_t take(int64_t me) {
    const int64_t k = static_cast<int64_t>(runs_.size());
    const int64_t own = take_from(runs_[me], true);
    if (own >= 0) return own;
    for (int64_t j = 1; j < k; ++j) {
      const int64_t stolen = take_from(runs_[(me + j) % k], false);
      if (stolen >= 0) return stolen;
    }
    return -1;
  }

 private:
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(hi); }
  // [lo, hi) of a run: its owner takes lo, others take hi - 1
  static int64_t take_from(std::atomic<uint64_t>& run, bool front) {
    uint64_t cur = run.load(std::memory_order_relaxed);
    while (true) {
      const int64_t lo = static_cast<int64_t>(cur >> 32), hi = static_cast<int64_t>(cur & 0xffffffffu);
      if (lo >= hi) return -1;
      const uint64_t next = front ? pack(lo + 1, hi) : pack(lo, hi - 1);
      if (run.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
    }
  }
  std::vector<std::atomic<uint64_t>> runs_;
};

// W [N, K] (nn.Linear's layout) -> [ceil(N / 64), K / 2, 64, 2]: blocks of 64 output
// columns, each in the pair-interleaved (VNNI) layout the micro-kernel reads: the two
// weights of consecutive k for one column side by side. The last block is zero-padded.
at::Tensor pack_bf16_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16_weight: W must be bfloat16 [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16_weight: K must be even, got ", w.size(1));
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = (N + kPackN - 1) / kPackN;
  at::Tensor out = at::zeros({NB, K / 2, kPackN, 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb) {
      uint16_t* blk = dst + nb * K * kPackN;
      for (int64_t c = 0; c < kPackN && nb * kPackN + c < N; ++c) {
        const uint16_t* row = src + (nb * kPackN + c) * K;
        for (int64_t k = 0; k < K; ++k) blk[(k / 2) * kPackN * 2 + c * 2 + (k & 1)] = row[k];
      }
    }
  });
  return out;
}

// x [M, K] @ W^T (+ bias) -> [M, N] bfloat16, W packed by pack_bf16_weight.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "linear_bf16: x must be bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(2) == kPackN && packed.size(3) == 2, "linear_bf16: W must come from pack_bf16_weight");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), lda = M == 1 ? K : x.stride(0);
  TORCH_CHECK(lda >= K, "linear_bf16: x's rows overlap");
  TORCH_CHECK(packed.size(1) * 2 == K, "linear_bf16: x has K=", K, ", the packed weight ", packed.size(1) * 2);
  TORCH_CHECK(N > (NB - 1) * kPackN && N <= NB * kPackN, "linear_bf16: N=", N, " does not fit the packed weight");
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16: bias must have N elements");
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    bias_f.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + N);
  }
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  at::Tensor out = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return out;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = out.data_ptr<c10::BFloat16>();
  const int64_t MB = (M + kTileM - 1) / kTileM, tiles = NB * MB;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  TileQueue queue(tiles, threads);
  auto work = [&](int64_t me) {
    alignas(64) float tile[kTileM * kPackN];
    for (int64_t t = queue.take(me); t >= 0; t = queue.take(me)) {
      // column block major: a block's row tiles one after another, while it is in cache
      const int64_t nb = t / MB, m0 = (t % MB) * kTileM, rows = std::min(kTileM, M - m0);
      at::native::cpublas::brgemm(rows, kPackN, K, lda, kPackN, kPackN, false, xp + m0 * lda,
                                  wp + nb * K * kPackN, tile, true);
      const int64_t n0 = nb * kPackN, cols = std::min(kPackN, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        c10::BFloat16* y = yp + (m0 + r) * N + n0;
        const float* acc = tile + r * kPackN;
        if (bp) for (int64_t c = 0; c < cols; ++c) y[c] = c10::BFloat16(acc[c] + bp[n0 + c]);
        else for (int64_t c = 0; c < cols; ++c) y[c] = c10::BFloat16(acc[c]);
      }
    }
    at::native::cpublas::brgemm_release(true);
  };
  if (threads <= 1) work(0);
  else at::parallel_for(0, threads, 1, [&](int64_t b, int64_t) { work(b); });
  return out;
}

// Rows `ids` of a block-quantized embedding table -> [T, K] of `dtype` (float32 or bfloat16).
at::Tensor qembedding(const at::Tensor& ids, const at::Tensor& wq, int64_t qt, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "qembedding: ids [T] int64");
  check_quantized(wq, qt, K, "qembedding");
  at::Tensor idc = ids.contiguous();
  const int64_t T = idc.size(0), V = wq.size(0), nb = K / q_block_weights(qt), row_bytes = wq.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "qembedding: id ", ip[t], " outside [0, ", V, ")");
  at::Tensor out = at::empty({T, K}, ids.options().dtype(dtype));
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  auto run = [&](auto tag) { dispatch_qtype(qt, [&](auto qtag) {
    using T_ = decltype(tag);
    constexpr int64_t QT = decltype(qtag)::value;
    T_* op = out.data_ptr<T_>();
    at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) dequant_row<T_, QT>(wp + ip[t] * row_bytes, nb, op + t * K);
    });
  }); };
  if (dtype == at::kFloat) run(float{});
  else if (dtype == at::kBFloat16) run(c10::BFloat16{});
  else TORCH_CHECK(false, "qembedding: dtype must be float32 or bfloat16, got ", dtype);
  return out;
}

// A whole block-quantized weight -> float32 [N, K] (for tests: gguf-py's values bit for bit).
at::Tensor qdequantize(const at::Tensor& wq, int64_t qt, int64_t K) {
  check_quantized(wq, qt, K, "qdequantize");
  const int64_t N = wq.size(0), nb = K / q_block_weights(qt), row_bytes = wq.size(1);
  at::Tensor out = at::empty({N, K}, wq.options().dtype(at::kFloat));
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  dispatch_qtype(qt, [&](auto qtag) {
    constexpr int64_t QT = decltype(qtag)::value;
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) dequant_row<float, QT>(wp + n * row_bytes, nb, op + n * K);
    });
  });
  return out;
}

// Binds the threads of the calling thread's team one to a CPU each: thread i of the team to
// cpus[i % cpus.size()]. Returns the CPU each thread got (-1 where the call failed).
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> got(n, -1);
  if (cpus.empty()) return got;
  // one index per thread: with a grain of 1 and n indices, thread i runs index i
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t cpu = cpus[i % cpus.size()];
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpu), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) got[at::get_thread_num()] = cpu;
    }
  });
  return got;
}

}  // namespace

// Every kernel runs without the GIL, as torch's own ops do: the engine service's gRPC
// thread (taking in requests, sending the last step's outputs) runs while the core
// thread is inside a kernel instead of waiting for it. Arguments are converted before
// the GIL is released and results after it is taken back; no kernel touches a Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, "paged attention for single-token decodes",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("block_size"),
        pybind11::arg("window") = 0, nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up projection", nogil);
  m.def("rope_and_cache_", &rope_and_cache_, "rotary on q and k in place; k and v written to the cache", nogil);
  m.def("qlinear", &qlinear, "x W^T (+ bias), W block-quantized (GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)", nogil);
  m.def("qembedding", &qembedding, "rows of a block-quantized embedding table", nogil);
  m.def("qdequantize", &qdequantize, "a block-quantized weight as float32", nogil);
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum", nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; RMSNorm(residual)", nogil);
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bfloat16 [N, K] weight in linear_bf16's layout", nogil);
  m.def("linear_bf16", &linear_bf16, "x W^T (+ bias) in bfloat16 on oneDNN's brgemm micro-kernel",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(), nogil);
  m.def("bind_threads", &bind_threads, "each thread of the calling thread's team bound to one CPU", nogil);
}
