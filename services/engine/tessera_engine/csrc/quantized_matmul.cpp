// tessera's CPU kernels: GGUF block-quantized weights used as they are: the matmul
// (qlinear), embedding rows (qembedding) and whole-weight dequantization (qdequantize).
// Each block is dequantized as gguf-py's reference does it (gguf_blocks.h), then rounded to
// the activations' dtype: the weights the matmul sees are bit for bit those of the
// dequantized-at-load path, and only the summation order differs. A thread dequantizes four
// weight rows at a time into a buffer that stays in L1 and runs every activation row against
// them. (int8_matmul.cpp is the faster, not bit-exact, path for bfloat16 activations.)
#include "cpu_kernels.h"
#include "tile_queue.h"
#include "gguf_blocks.h"
#include "vec.h"

namespace tessera {
namespace {

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
  if constexpr (qt == kQ5_0) {  // nibbles as Q4_0's, bit j of the uint32 at b + 2 on top: q - 16
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1), sixteen = _mm512_set1_epi32(16);
    const __m512i bl = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(qh)), iota), one);
    const __m512i bh = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(qh >> 16)), iota), one);
    const __m512i il = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_and_si128(q, nib)), _mm512_slli_epi32(bl, 4));
    const __m512i ih = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), nib)),
                                       _mm512_slli_epi32(bh, 4));
    lo = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(il, sixteen)), kRn);
    hi = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ih, sixteen)), kRn);
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
  if constexpr (qt == kQ8_0 || qt == kQ5_0) {  // 32 (or 64) possible weights: no table
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
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: TORCH_CHECK(false, "quantized weight: unsupported ggml type ", qt, " " TESSERA_QTYPES_SUPPORTED);
  }
}

}  // namespace

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
    parallel_rows(0, (N + 3) / 4, 1, [&](int64_t gb, int64_t ge) {
      std::vector<T> w(4 * K);
      std::vector<float> xbuf(kPortableDots<T> ? K : 0), wbuf(kPortableDots<T> ? 4 * K : 0);
      for (int64_t g = gb; g < ge; ++g) {
        const int64_t n0 = g * 4, rows = std::min<int64_t>(4, N - n0);
        for (int64_t r = 0; r < rows; ++r) dequant_row<T, QT>(wp + (n0 + r) * row_bytes, nb, w.data() + r * K);
        dot_rows(xp, M, K, w.data(), rows, N, n0, bp, yp, xbuf.data(), wbuf.data());
      }
    });
  }); };
  dispatch_float_bf16(x.scalar_type(), "qlinear: activations", run);
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
    parallel_rows(0, T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) dequant_row<T_, QT>(wp + ip[t] * row_bytes, nb, op + t * K);
    });
  }); };
  dispatch_float_bf16(dtype, "qembedding: dtype", run);
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
    parallel_rows(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) dequant_row<float, QT>(wp + n * row_bytes, nb, op + n * K);
    });
  });
  return out;
}

}  // namespace tessera
