// tessera's CPU kernels: paged decode attention (one query token per sequence, K/V read
// in place from the paged cache).
#include "cpu_kernels.h"
#include "tile_queue.h"
#include "vec.h"

namespace tessera {
namespace {

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

// The cache lines of one block's rows of heads [h0, h1), asked for a few at a time from inside
// the compute loops: measured faster, with the caches in DRAM, than asking for each block whole
// before its computation (timings: benchmarks/README.md, kernel_steps.py). Rows of only some of
// the heads are not one range: those are asked for at once.
template <int Hint>
struct LineCursor {
  const char* next = nullptr;
  const char* end = nullptr;
  template <typename T>
  void start(const T* cache, int64_t first_row, int64_t n, int64_t h0, int64_t h1, const DecodeShape& sh) {
    if ((h1 - h0) * sh.d != sh.kv_row) {  // rows of a few heads: not one range, all asked for now
      prefetch_block<T, Hint>(cache, first_row, n, h0, h1, sh);
      next = end = nullptr;
      return;
    }
    next = reinterpret_cast<const char*>(cache + first_row * sh.kv_row);
    end = next + n * sh.kv_row * static_cast<int64_t>(sizeof(T));
  }
  void stop() { next = end = nullptr; }
  inline void step(int count) {
    for (int c = 0; c < count && next < end; ++c, next += 64) _mm_prefetch(next, static_cast<_mm_hint>(Hint));
  }
  void finish() {
    for (; next < end; next += 64) _mm_prefetch(next, static_cast<_mm_hint>(Hint));
  }
};

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

// One KV head's g query heads' float32 sums over one block's n V rows, weighted by their
// probabilities sc[j * L + t0 + o]. G = g known at compile time keeps the G x NV sums in
// registers; G = 0 takes g (up to 16) at run time, its sums in memory (a load and a store
// around every multiply-add).
template <typename T, int NV, int G>
inline void weigh_v_rows(int64_t g, const float* sc, int64_t L, int64_t t0, const T* vb, int64_t kv_row, int64_t n,
                         float* ah, int64_t d, LineCursor<_MM_HINT_T0>& vnext) {
  constexpr int kMax = G > 0 ? G : 16;
  const int64_t gg = G > 0 ? G : g;
  __m512 av[kMax][NV];
  for (int64_t j = 0; j < gg; ++j)
    for (int v = 0; v < NV; ++v) av[j][v] = _mm512_loadu_ps(ah + j * d + 16 * v);
  for (int64_t o = 0; o < n; ++o) {
    vnext.step(2);
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(vb + o * kv_row + 16 * v);
    for (int64_t j = 0; j < gg; ++j) {
      const __m512 p = _mm512_set1_ps(sc[j * L + t0 + o]);
      for (int v = 0; v < NV; ++v) av[j][v] = _mm512_fmadd_ps(p, vv[v], av[j][v]);
    }
  }
  for (int64_t j = 0; j < gg; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ah + j * d + 16 * v, av[j][v]);
}

// Heads [h0, h1) of one sequence. NV = d / 16 vectors per row. Blocks outer, heads
// inner: a block's rows are read from memory once for all the heads of the range.
template <typename T, int NV>
void attend_vec(const T* q, int64_t q_head, const T* kc, const T* vc, const int64_t* table, int64_t L,
                int64_t skip, int64_t h0, int64_t h1, const DecodeShape& sh, float* scores, float* acc, T* out,
                int64_t o_head) {
  const int64_t g = sh.g, bs = sh.block_size, nh = h1 - h0;
  const __m512 vscale = _mm512_set1_ps(sh.scale);
  prefetch_block(kc, table[0] * bs, std::min(bs, L), h0, h1, sh);
  LineCursor<_MM_HINT_T0> knext;
  LineCursor<_MM_HINT_T1> vthis;
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t base = table[t0 / bs] * bs;
    const int64_t n = std::min(bs, L - t0);
    if (t0 + bs < L) knext.start(kc, table[t0 / bs + 1] * bs, std::min(bs, L - t0 - bs), h0, h1, sh);
    else knext.stop();
    vthis.start(vc, base, n, h0, h1, sh);  // for the V pass, from L2
    for (int64_t h = h0; h < h1; ++h) {
      const T* kb = kc + base * sh.kv_row + h * sh.d;
      for (int64_t j = 0; j < g; ++j) {
        const QueryRow<T, NV> qr(q + (h * g + j) * q_head);
        float* sc = scores + ((h - h0) * g + j) * L + t0;
        for (int64_t o0 = 0; o0 < n; o0 += 16) {  // 16 rows at a time (blocks may hold more)
          const int64_t m = std::min<int64_t>(16, n - o0);
          __m512 part[16];
          for (int64_t o = 0; o < m; ++o) {
            part[o] = qr.dot_partial(kb + (o0 + o) * sh.kv_row);
            knext.step(1);
            vthis.step(1);
          }
          for (int64_t o = m; o < 16; ++o) part[o] = _mm512_setzero_ps();
          _mm512_mask_storeu_ps(sc + o0, first_lanes(m), _mm512_mul_ps(sum_lanes16(part), vscale));
        }
      }
    }
    knext.finish();
    vthis.finish();
  }
  for (int64_t j = 0; j < nh * g; ++j) softmax_window(scores + j * L, L, skip);
  std::fill(acc, acc + nh * g * sh.d, 0.f);
  prefetch_block(vc, table[0] * bs, std::min(bs, L), h0, h1, sh);
  LineCursor<_MM_HINT_T0> vnext;
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t base = table[t0 / bs] * bs;
    const int64_t n = std::min(bs, L - t0);
    if (t0 + bs < L) vnext.start(vc, table[t0 / bs + 1] * bs, std::min(bs, L - t0 - bs), h0, h1, sh);
    else vnext.stop();
    for (int64_t h = h0; h < h1; ++h) {
      const float* sc = scores + (h - h0) * g * L;
      float* ah = acc + (h - h0) * g * sh.d;
      const T* vb = vc + base * sh.kv_row + h * sh.d;
      switch (g) {  // the group sizes models have, each with its sums in registers
        case 1: weigh_v_rows<T, NV, 1>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 2: weigh_v_rows<T, NV, 2>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 3: weigh_v_rows<T, NV, 3>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 4: weigh_v_rows<T, NV, 4>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 5: weigh_v_rows<T, NV, 5>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 6: weigh_v_rows<T, NV, 6>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 7: weigh_v_rows<T, NV, 7>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        case 8: weigh_v_rows<T, NV, 8>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
        default: weigh_v_rows<T, NV, 0>(g, sc, L, t0, vb, sh.kv_row, n, ah, sh.d, vnext); break;
      }
    }
    vnext.finish();
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
  // block would otherwise be a stall on memory (up to kAheadBlocks: measured, less time than
  // asking for the first block alone)
  [[maybe_unused]] constexpr int64_t kAheadBlocks = 16;
  // items taken from shared runs (tile_queue.h): a thread that runs takes the items of one
  // that is preempted, or has longer contexts
  const int64_t items = N * parts;
  run_tiles(items, [&](int64_t me, TileQueue& queue) {
    std::vector<float> scores, acc(per * sh.g * d);
    for (int64_t w = queue.take(me); w >= 0; w = queue.take(me)) {
      const Item it = item(w);
#if defined(__AVX512F__)
      if (w + 1 < items) {  // the next item of this thread's run, unless another takes it
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

}  // namespace

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

}  // namespace tessera
