// tessera's CPU kernels: LoRA on a batch whose rows use different adapters (punica's
// "shrink then expand" per adapter slot, as SGMV does on GPUs). For each row t with an adapter
// slot s = slots[t] >= 0, on top of the base layer's output y (in place):
//   h = x[t] A_s^T                       (shrink: in -> R = subs * rank)
//   y[t, o] += scale[s, i] * (h_i B_i^T)[o]   for o in sub-module i, h_i = h[i*rank : (i+1)*rank]
// Fused layers (QKV: 3 sub-modules, gate/up: 2) stack their sub-modules' A's, so one shrink
// serves them all, and each sub-module expands from its own part of h.
//
// Batch invariant: every output (h[j], or y[t, o]) is one float32 chain of fused multiply-adds
// in ascending order of the reduced index (c over `in`, k over `rank`), then y = fma(scale, acc,
// y) rounded once to y's dtype. Nothing depends on the other rows, on how rows are tiled or on
// the thread count: a vector's 16 lanes are 16 outputs, each its own chain, and a reduction is
// never split. The scalar path (builds without AVX-512) runs the same chains with std::fma, so
// it gives the same bits.
//
// Weights float32, or bfloat16 (widened exactly as they are read; the chains stay float32).
//
// Speed: a decode step's adapter weights do not fit the caches, so the kernel is
// mostly bound by reading them from memory, and then by the multiply-adds. Rows are grouped by
// slot (a stable counting sort per call) into groups of up to kGroupRows rows; a group goes
// through a slot's weights a tile of kTileRows rows at a time, each weight vector loaded feeding
// the tile's rows from registers, and the group's other tile reading it from L1, so each weight
// byte comes from memory once per 16 rows. The weights are prefetched ahead by software (the
// hardware prefetchers alone: the step took 1.8x as long). Threads take whole groups when there
// are enough (a batch: shrink then expand, one parallel region), else the shrink's columns of h
// and the expand's of y are shared out too, where there is work enough to wake the team for.
#include "cpu_kernels.h"
#include "tile_queue.h"
#include "vec.h"

namespace tessera {
namespace {

constexpr int kTileRows = 8;  // rows of one slot a tile computes together
constexpr int kTileVecs = 3;  // 16-lane vectors of outputs per tile row: 8 x 3 accumulators fit the 32 registers
// Rows of one slot a work item takes through the weights, a tile at a time: each weight byte comes
// from memory once per 16 rows (a decode step's weights do not fit the caches), the other tiles
// read it from L1.
constexpr int kGroupRows = 16;
constexpr int64_t kBlockC = 64;  // shrink: x's columns (a's rows) all the group's tiles go through at a time
constexpr int64_t kPrefetchC = 2 * kBlockC;  // shrink: a's rows prefetched ahead (measured best of 1-3 blocks)
constexpr int64_t kPrefetchBlocks = 2;  // expand: b's column blocks prefetched ahead (measured best of 0-6)
// Vector multiply-adds a thread's share must have for the team to be worth waking (a fork and
// join costs about a microsecond): a smaller call runs on the calling thread.
constexpr int64_t kTaskFmas = 2048;

// Up to kGroupRows rows of one slot: positions [p0, p0 + n) of the slot-sorted row order.
struct Group {
  int64_t slot, p0;
  int n;
};

// Outputs [o0, o0 + width) of one block, 1 <= width <= 16 * kTileVecs; sub: the sub-module
// (always 0 for the shrink's blocks of h).
struct Block {
  int64_t sub, o0, width;
};

// [0, n) in blocks of at most 16 * vecs, as even as whole vectors allow (64 outputs: 32 + 32,
// not 48 + 16, so neither thread waits on a longer block).
void split_columns(int64_t sub, int64_t o0, int64_t n, int64_t max_vecs, std::vector<Block>& out) {
  const int64_t vecs = (n + 15) / 16, blocks = (vecs + max_vecs - 1) / max_vecs;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t v0 = vecs * i / blocks, v1 = vecs * (i + 1) / blocks;
    out.push_back({sub, o0 + 16 * v0, std::min(n, 16 * v1) - 16 * v0});
  }
}

// f(item, scratch) for item in [0, n) on up to `tasks` threads of the team, each a contiguous run
// of items of about equal cost (cost(item)): neighbouring items write neighbouring columns of the
// same rows, which threads taking items in turn would share cache lines of (measured: a second
// thread sped the expand up 1.26x that way, 1.6x this way). scratch: a buffer of the thread's own.
template <typename Cost, typename F>
void run_items(int64_t n, int64_t tasks, const Cost& cost, const F& f) {
  tasks = std::max<int64_t>(1, std::min(tasks, n));
  std::vector<int64_t> cut(tasks + 1, n);  // task j runs items [cut[j], cut[j + 1])
  cut[0] = 0;
  if (tasks > 1) {
    std::vector<int64_t> sum(n + 1, 0);
    for (int64_t i = 0; i < n; ++i) sum[i + 1] = sum[i] + cost(i);
    for (int64_t j = 1; j < tasks; ++j)
      cut[j] = std::lower_bound(sum.begin(), sum.end(), sum[n] * j / tasks) - sum.begin();
  }
  parallel_rows(0, tasks, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> scratch;
    for (int64_t i = cut[j0]; i < cut[j1]; ++i) f(i, scratch);
  });
}

#if defined(__AVX512F__)
using Acc = __m512;
#else
struct Acc {
  float v[16];
};
#endif

// 16 weights (the first `m` lanes) as float32: float32 as they are, bfloat16 widened exactly (the
// engine keeps an adapter in bfloat16 when it computes in bfloat16: half the bytes to read, and a
// decode step's adapter weights come from memory)
inline float w_at(const float* p) { return *p; }
inline float w_at(const c10::BFloat16* p) { return static_cast<float>(*p); }
#if defined(__AVX512F__)
inline __m512 load_w(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_w(const c10::BFloat16* p, __mmask16 m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
#else
  alignas(64) float r[16] = {0};
  for (int l = 0; l < 16; ++l)
    if ((m >> l) & 1) r[l] = static_cast<float>(p[l]);
  return _mm512_load_ps(r);
#endif
}
#endif

// epi(i, v, acc) for each tile row i < MT and vector v < NV: acc (outputs 16v .. 16v + 15) =
// init[i * init_stride + 16v + lane] (0 where init is null) + the sum over k in [0, K) ascending
// of in[i * in_stride + k] * w[k * w_stride + 16v + lane], one fma each. Lanes past `last` of the
// last vector read nothing. A chain split in two calls, the first's acc stored as init of the
// second, is the one chain (float32 either way). w's rows k with (k & pf_mask) == pf_phase are
// prefetched pf elements ahead (0: none): a group's two tiles take turns, so its weights are
// fetched at an even pace while both run.
template <int MT, int NV, typename W, typename Epilogue>
inline void tile_dot(const float* in, int64_t in_stride, int64_t K, const W* w, int64_t w_stride, int last,
                     const float* init, int64_t init_stride, int64_t pf, int64_t pf_mask, int64_t pf_phase,
                     Epilogue&& epi) {
#if defined(__AVX512F__)
  // The loops over i and v are unrolled by force: an accumulator indexed by a loop that gcc
  // keeps is one it stores back to the stack every k (measured: 2x slower at 8 x 3).
  const __mmask16 tail = first_lanes(last);
  __m512 c[MT][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      c[i][v] = init ? _mm512_maskz_loadu_ps(v + 1 < NV ? 0xFFFF : tail, init + i * init_stride + 16 * v)
                     : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * w_stride;
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      wv[v] = load_w(wk + 16 * v, v + 1 < NV ? static_cast<__mmask16>(0xFFFF) : tail);
      if (pf && (k & pf_mask) == pf_phase) _mm_prefetch(reinterpret_cast<const char*>(wk + pf + 16 * v), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512 xi = _mm512_set1_ps(in[i * in_stride + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[i][v] = _mm512_fmadd_ps(xi, wv[v], c[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) epi(i, v, c[i][v]);
#else
  (void)pf, (void)pf_mask, (void)pf_phase;
  Acc c[MT][NV] = {};
  for (int i = 0; i < MT && init; ++i)
    for (int v = 0; v < NV; ++v)
      std::copy(init + i * init_stride + 16 * v, init + i * init_stride + 16 * v + (v + 1 < NV ? 16 : last), c[i][v].v);
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * w_stride;
    for (int i = 0; i < MT; ++i) {
      const float xi = in[i * in_stride + k];
      for (int v = 0; v < NV; ++v) {
        const int lanes = v + 1 < NV ? 16 : last;
        for (int l = 0; l < lanes; ++l) c[i][v].v[l] = std::fma(xi, w_at(wk + 16 * v + l), c[i][v].v[l]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < NV; ++v) epi(i, v, c[i][v]);
#endif
}

inline void store(float* dst, const Acc& a, int n) {
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(dst, first_lanes(n), a);
#else
  std::copy(a.v, a.v + n, dst);
#endif
}

// y[0, n) = y + scale * a (one fma, rounded to T once)
template <typename T>
inline void add_scaled(T* y, const Acc& a, float scale, int n) {
#if defined(__AVX512F__)
  const __mmask16 m = first_lanes(n);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(y, m, _mm512_fmadd_ps(_mm512_set1_ps(scale), a, _mm512_maskz_loadu_ps(m, y)));
    return;
  }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // in registers, vec.h's from_float rounding: to nearest even, NaN -> 0x7FC0 (through a
    // float buffer and from_float, the bfloat16 expand took 13% longer on two threads)
    const __m256i yh = _mm256_maskz_loadu_epi16(m, y);
    const __m512 yv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(yh), 16));
    const __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(scale), a, yv);
    _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(bf16_bits16(v)));
    return;
  }
#endif
  alignas(64) float r[16] = {0};
  if (n == 16) _mm512_store_ps(r, load16(y));
  else to_float(y, r, n);
  _mm512_store_ps(r, _mm512_fmadd_ps(_mm512_set1_ps(scale), a, _mm512_load_ps(r)));
#else
  float r[16];
  to_float(y, r, n);
  for (int l = 0; l < n; ++l) r[l] = std::fma(scale, a.v[l], r[l]);
#endif
  from_float(r, y, n);  // bfloat16: round to nearest even
}

// f(integral_constant MT, integral_constant NV) for 1 <= mt <= kTileRows, 1 <= nv <= kTileVecs
template <typename F>
void with_tile_shape(int mt, int64_t nv, F&& f) {
  auto vecs = [&](auto MT) {
    switch (nv) {
      case 1: f(MT, std::integral_constant<int, 1>{}); break;
      case 2: f(MT, std::integral_constant<int, 2>{}); break;
      default: f(MT, std::integral_constant<int, 3>{}); break;
    }
  };
  static_assert(kTileRows == 8 && kTileVecs == 3, "with_tile_shape's cases");
  static_assert(kGroupRows == 2 * kTileRows, "a group's tiles take turns at prefetching by k's parity");
  switch (mt) {
    case 1: vecs(std::integral_constant<int, 1>{}); break;
    case 2: vecs(std::integral_constant<int, 2>{}); break;
    case 3: vecs(std::integral_constant<int, 3>{}); break;
    case 4: vecs(std::integral_constant<int, 4>{}); break;
    case 5: vecs(std::integral_constant<int, 5>{}); break;
    case 6: vecs(std::integral_constant<int, 6>{}); break;
    case 7: vecs(std::integral_constant<int, 7>{}); break;
    default: vecs(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace

// y[t] += scale * LoRA_{slots[t]}(x[t]) for the rows with a slot (see the top of this file).
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& slots, const at::Tensor& scales, const at::Tensor& bounds) {
  const std::pair<const at::Tensor*, const char*> args[] = {
      {&y, "y"}, {&x, "x"}, {&a, "a"}, {&b, "b"}, {&slots, "slots"}, {&scales, "scales"}, {&bounds, "bounds"}};
  for (const auto& [t, name] : args) TORCH_CHECK(t->device().is_cpu(), "lora_add: ", name, " must be on the CPU");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "lora_add: y must be a contiguous [T, out], got ", y.sizes());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == y.size(0),
              "lora_add: x must be a contiguous [T, in] with y's T = ", y.size(0), ", got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add: x and y must have one dtype, got ", x.scalar_type(),
              " and ", y.scalar_type());
  const int64_t T = y.size(0), out = y.size(1), in = x.size(1);
  TORCH_CHECK(a.dim() == 3 && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                  a.is_contiguous() && a.size(1) == in,
              "lora_add: a must be a contiguous float32 or bfloat16 [S, in = ", in, ", R], got ", a.scalar_type(), " ",
              a.sizes());
  const int64_t S = a.size(0), R = a.size(2);
  TORCH_CHECK(bounds.dim() == 1 && bounds.scalar_type() == at::kLong && bounds.size(0) >= 2,
              "lora_add: bounds must be an int64 [subs + 1], subs >= 1, got ", bounds.scalar_type(), " ",
              bounds.sizes());
  const at::Tensor bc = bounds.contiguous();
  const int64_t* bd = bc.data_ptr<int64_t>();
  const int64_t subs = bounds.size(0) - 1;
  const c10::IntArrayRef bv(bd, subs + 1);
  TORCH_CHECK(bd[0] == 0 && bd[subs] == out, "lora_add: bounds must run from 0 to out = ", out, ", got ", bv);
  for (int64_t i = 0; i < subs; ++i)
    TORCH_CHECK(bd[i] <= bd[i + 1], "lora_add: bounds must not decrease, got ", bv);
  TORCH_CHECK(R % subs == 0 && R / subs > 0 && (R / subs) % 16 == 0, "lora_add: a's R = ", R, " must be subs = ",
              subs, " times a rank that is a positive multiple of 16");
  const int64_t rank = R / subs;
  TORCH_CHECK(b.dim() == 3 && b.scalar_type() == a.scalar_type() && b.is_contiguous() && b.size(0) == S &&
                  b.size(1) == rank && b.size(2) == out,
              "lora_add: b must be a contiguous [S = ", S, ", rank = ", rank, ", out = ", out, "] of a's dtype, got ",
              b.scalar_type(), " ", b.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kInt && slots.size(0) == T,
              "lora_add: slots must be an int32 [T = ", T, "], got ", slots.scalar_type(), " ", slots.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.size(0) == S &&
                  scales.size(1) == subs,
              "lora_add: scales must be a float32 [S = ", S, ", subs = ", subs, "], got ", scales.scalar_type(), " ",
              scales.sizes());
  const at::Tensor sl = slots.contiguous(), sc = scales.contiguous();
  const int32_t* sp = sl.data_ptr<int32_t>();
  const float* scp = sc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < S, "lora_add: slots[", t, "] = ", sp[t], " is outside [-1, S = ", S, ")");

  // Rows with a slot, grouped by slot (a stable counting sort), cut into groups.
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t t = 0; t < T; ++t)
    if (sp[t] >= 0) ++start[sp[t] + 1];
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  const int64_t active = start[S];
  if (active == 0) return;
  std::vector<int64_t> order(active);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      if (sp[t] >= 0) order[next[sp[t]]++] = t;
  }
  std::vector<Group> groups;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t p = start[s]; p < start[s + 1]; p += kGroupRows)
      groups.push_back({s, p, static_cast<int>(std::min<int64_t>(kGroupRows, start[s + 1] - p))});
  const int64_t ngroups = static_cast<int64_t>(groups.size());
  const int64_t threads = at::get_num_threads();
  auto tasks = [&](int64_t fmas) { return std::min(threads, fmas / kTaskFmas); };
  // Enough groups for every thread (a batch): each thread takes whole groups, shrink then expand,
  // in one parallel region (the expand reads only its group's h). Few groups: the shrink and the
  // expand each cut in columns too, in two regions.
  const bool by_group = ngroups >= 2 * threads;

  // The shrink's blocks of h: the vectors a tile row keeps in registers, narrower where that
  // gives the threads too few items (a few rows: their chains side by side on both cores)
  int64_t hvecs = kTileVecs;
  if (!by_group && tasks(active * in * R / 16) > 1)
    while (hvecs > 1 && ngroups * ((R / 16 + hvecs - 1) / hvecs) < 2 * threads) --hvecs;
  std::vector<Block> hblocks, yblocks;  // the shrink's blocks of h, the expand's of y
  split_columns(0, 0, R, hvecs, hblocks);
  for (int64_t i = 0; i < subs; ++i)
    if (bd[i + 1] > bd[i]) split_columns(i, bd[i], bd[i + 1] - bd[i], kTileVecs, yblocks);
  const int64_t nh = static_cast<int64_t>(hblocks.size()), ny = static_cast<int64_t>(yblocks.size());

  std::vector<float> h(active * R);  // row order[p]'s h at h[p * R]
  dispatch_float_bf16(a.scalar_type(), "lora_add: a and b", [&](auto wtag) {
  using W = decltype(wtag);
  const W* ap = a.data_ptr<W>();
  const W* bp = b.data_ptr<W>();
  dispatch_float_bf16(y.scalar_type(), "lora_add: x and y", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    T_* yp = y.data_ptr<T_>();

    // shrink: h of group g's rows, blocks [hb0, hb1) of it. x's columns in blocks of kBlockC,
    // each block through every tile of the group while its rows of a are in L1; a tile's sums
    // carry over in h.
    auto shrink = [&](const Group& g, int64_t hb0, int64_t hb1, std::vector<float>& xt) {
      // the group's rows of x in float32, block by block: block c0's rows side by side at xt[c0 * n]
      xt.resize(g.n * in);
      for (int64_t c0 = 0; c0 < in; c0 += kBlockC) {
        const int64_t len = std::min(kBlockC, in - c0);
        for (int r = 0; r < g.n; ++r) to_float(xp + order[g.p0 + r] * in + c0, xt.data() + c0 * g.n + r * len, len);
      }
      for (int64_t hb = hb0; hb < hb1; ++hb) {
        const Block& bk = hblocks[hb];
        const W* as = ap + g.slot * in * R + bk.o0;
        float* hg = h.data() + g.p0 * R + bk.o0;
        for (int64_t c0 = 0; c0 == 0 || c0 < in; c0 += kBlockC) {
          const int64_t len = std::min(kBlockC, in - c0);
          for (int t0 = 0; t0 < g.n; t0 += kTileRows) {
            with_tile_shape(std::min(kTileRows, g.n - t0), (bk.width + 15) / 16, [&](auto MT, auto NV) {
              constexpr int mt = decltype(MT)::value, nv = decltype(NV)::value;
              const int last = static_cast<int>(bk.width - 16 * (nv - 1));
              float* ht = hg + t0 * R;
              tile_dot<mt, nv>(xt.data() + c0 * g.n + t0 * len, len, len, as + c0 * R, R, last, c0 ? ht : nullptr, R,
                               kPrefetchC * R, g.n > kTileRows, t0 / kTileRows,
                               [&](int i, int v, const Acc& acc) { store(ht + i * R + 16 * v, acc, v + 1 < nv ? 16 : last); });
            });
          }
        }
      }
    };

    // expand: group g's rows of y, output block yb (within one sub-module); the block's rows of
    // b in L1 for the tiles after the first
    auto expand = [&](const Group& g, int64_t yb) {
      const Block& bk = yblocks[yb];
      const float scale = scp[g.slot * subs + bk.sub];
      for (int t0 = 0; t0 < g.n; t0 += kTileRows) {
        with_tile_shape(std::min(kTileRows, g.n - t0), (bk.width + 15) / 16, [&](auto MT, auto NV) {
          constexpr int mt = decltype(MT)::value, nv = decltype(NV)::value;
          const int last = static_cast<int>(bk.width - 16 * (nv - 1));
          T_* rows[mt];
          for (int i = 0; i < mt; ++i) rows[i] = yp + order[g.p0 + t0 + i] * out + bk.o0;
          tile_dot<mt, nv>(h.data() + (g.p0 + t0) * R + bk.sub * rank, R, rank, bp + g.slot * rank * out + bk.o0, out,
                           last, nullptr, 0, kPrefetchBlocks * 16 * kTileVecs, g.n > kTileRows, t0 / kTileRows,
                           [&](int i, int v, const Acc& acc) {
                             add_scaled(rows[i] + 16 * v, acc, scale, v + 1 < nv ? 16 : last);
                           });
        });
      }
    };

    const int64_t fmas = active * (in * R + rank * out) / 16;
    if (by_group) {
      run_items(ngroups, tasks(fmas), [&](int64_t i) { return groups[i].n + 1; },
                [&](int64_t i, std::vector<float>& xt) {
                  shrink(groups[i], 0, nh, xt);
                  for (int64_t yb = 0; yb < ny; ++yb) expand(groups[i], yb);
                });
      return;
    }
    // an item's cost: its vector multiply-adds, and a tile's worth for its fixed costs
    auto cost = [&](const std::vector<Block>& blocks) {
      return [&](int64_t item) {
        const int64_t n = static_cast<int64_t>(blocks.size());
        return (groups[item / n].n + 1) * ((blocks[item % n].width + 15) / 16);
      };
    };
    run_items(ngroups * nh, tasks(active * in * R / 16), cost(hblocks), [&](int64_t item, std::vector<float>& xt) {
      shrink(groups[item / nh], item % nh, item % nh + 1, xt);
    });
    run_items(ngroups * ny, tasks(active * rank * out / 16), cost(yblocks),
              [&](int64_t item, std::vector<float>&) { expand(groups[item / ny], item % ny); });
  });
  });
}

}  // namespace tessera
