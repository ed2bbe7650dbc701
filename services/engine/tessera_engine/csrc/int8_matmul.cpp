// tessera's CPU kernels: the matmul of activation rows with Q4_0 / Q4_1 / Q8_0 weights
// on integer dot products, as llama.cpp computes it: each 32-value block of an activation row
// is quantized to int8 with a float scale per 16 values (x ~ dx * xq), and each half of a weight
// block contributes
//   Q4_0: d dx (sum q xq - 8 sum xq)      Q8_0: d dx (sum q xq)      Q4_1: d dx sum q xq + m dx sum xq
// with q the stored (unsigned 4-bit, or signed 8-bit) quants. The int8 sums run on AVX512-VNNI's
// vpdpbusd (64 byte products an instruction), against weights repacked once at load
// (qrepack_i8): 16 output rows interleaved so that one 64-byte load holds four consecutive quants
// of each of 16 rows, and one broadcast of four activation bytes feeds all 16. A decode step then
// reads each weight byte once and spends a few instructions per 512 weights, instead of
// dequantizing every weight to bfloat16 first (quantized_matmul.cpp), which left a single
// request's step compute-bound at ~2.5x the time its bytes take to stream from memory.
// Many rows (batch invariance runs every batch size here) go 8 at a time through a row group
// (the last 1-7 in one tile of their own):
// each weight vector, unpacked once, feeds 16 independent chains of vpdpbusd, and each row's
// block ends in a few float multiply-adds (its two scales, the weight block's d and m). The
// activations are quantized 16 values an instruction sequence (scalar code there had cost a
// quarter of a 64-row step).
//
// Not bit-exact with the dequantized weights: the activations lose precision to int8 (the
// same trade llama.cpp makes); the backend plan uses this path only where the plan says so
// (bfloat16 activations) and the float32 path stays exact.
//
// Repacked layout, uint8 [N / 16, blocks * group block bytes]: for row group g and block b,
//   quants  Q4: 4 x 64 bytes, vector i lane r = bytes 4i..4i+3 of row 16g+r's block (low nibbles
//               are weights 4i..4i+3, high nibbles 16+4i..16+4i+3: GGUF's own pairing);
//           Q8: 8 x 64 bytes, vector i lane r = weights 4i..4i+3 of row 16g+r, plus 128 (unsigned)
//   then 16 float16 d, then (Q4_1) 16 float16 m: the same bytes a block as the file's layout.
#include "cpu_kernels.h"
#include "gguf_blocks.h"
#include "vec.h"

namespace tessera {
namespace {

constexpr int64_t kRows = 16;  // output rows a group interleaves: one int32 lane each

constexpr bool repackable(int64_t qt) { return qt == kQ4_0 || qt == kQ4_1 || qt == kQ8_0; }

constexpr int64_t quant_bytes(int64_t qt) { return qt == kQ8_0 ? 512 : 256; }  // a group's quants of one block

// bytes of one block of a 16-row group: the quants, d, and (Q4_1) m
constexpr int64_t group_block_bytes(int64_t qt) { return quant_bytes(qt) + 32 + (qt == kQ4_1 ? 32 : 0); }

// Where row r's block (the file's bytes) lies in its group's block of the repacked layout:
// f(group offset, block offset, is a quant) for each of its bytes. qrepack_i8 copies one way,
// qembedding_i8 the other.
template <typename F>
inline void block_in_group(int64_t qt, int64_t r, F&& f) {
  const int64_t qb = quant_bytes(qt), qoff = qt == kQ4_1 ? 4 : 2;  // quants after d (and m)
  for (int64_t i = 0; i < qb / 64; ++i)
    for (int j = 0; j < 4; ++j) f(64 * i + 4 * r + j, qoff + 4 * i + j, true);
  for (int j = 0; j < 2; ++j) f(qb + 2 * r + j, j, false);                        // d
  if (qt == kQ4_1) for (int j = 0; j < 2; ++j) f(qb + 32 + 2 * r + j, 2 + j, false);  // m
}

// A quant byte as the group holds it (Q8_0 signed -> unsigned, + 128) and back: its own inverse.
inline uint8_t group_quant(int64_t qt, uint8_t q) { return qt == kQ8_0 ? static_cast<uint8_t>(q ^ 0x80) : q; }

void check_repacked(const at::Tensor& wp, int64_t qt, int64_t K, const char* what) {
  TORCH_CHECK(repackable(qt), what, ": int8 path for Q4_0, Q4_1, Q8_0 only, got ", q_type_name(qt));
  TORCH_CHECK(wp.dim() == 2 && wp.scalar_type() == at::kByte && wp.is_contiguous(),
              what, ": the repacked weight is a contiguous uint8 [N / 16, group bytes]");
  TORCH_CHECK(K > 0 && K % 32 == 0, what, ": K must be a multiple of 32, got ", K);
  TORCH_CHECK(wp.size(1) == K / 32 * group_block_bytes(qt), what, ": ", wp.size(1),
              " bytes a row group do not hold K = ", K, " weights of ", q_type_name(qt), " (",
              K / 32 * group_block_bytes(qt), " bytes)");
}

// The activations, quantized per 16 values (half a weight block): xq [M, K] int8, and per row
// and half block its scale dx and the sum of its quants (the Q4_0 / Q8_0 offset and the Q4_1
// minimum's term). Half blocks, where llama.cpp scales whole 32-value blocks: a weight block's
// low and high nibbles are two separate sums anyway (the layout above), and the smaller scale
// groups halved the next-token KL divergence that the int8 activations add (default model,
// float32 activations otherwise: 0.0036 -> 0.0020 nats), which in bfloat16 comes on top of
// the activations' own rounding.
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<float> scale;   // [M, K / 16]: dx of each half block
  // [M, K / 32]: dx0 (sum of half 0's quants) + dx1 (half 1's): what a weight block's constant
  // multiplies (Q4_1's minimum)
  std::vector<float> offset;
  // [M, K / 16]: the sum of each half block's quants (Q4_0's and Q8_0's offset of the unsigned
  // quants, taken back out of the integer sums: in float the large sums would cancel)
  std::vector<int32_t> sum;
};

template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t M, int64_t K) {
  const int64_t nh = K / 16;
  QuantizedActivations a{std::vector<int8_t>(M * K), std::vector<float>(M * nh), std::vector<float>(M * nh / 2),
                         std::vector<int32_t>(M * nh)};
  at::parallel_for(0, M, 16, [&](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m) {
      for (int64_t h = 0; h < nh; ++h) {
        int8_t* q = a.q.data() + m * K + 16 * h;
        float d;
        int32_t s;
#if defined(__AVX512F__)
        // the scalar loop below, 16 values at once: the same products, rounded to nearest
        // even as nearbyint does, so both give the same quants
        const __m512 v = load16(x + m * K + 16 * h);
        const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
        d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qi));
        s = _mm512_reduce_add_epi32(qi);
#else
        alignas(64) float v[16];
        to_float(x + m * K + 16 * h, v, 16);
        float amax = 0.f;
        for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(v[j]));
        d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        s = 0;
        for (int j = 0; j < 16; ++j) {
          q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
          s += q[j];
        }
#endif
        a.scale[m * nh + h] = d;
        a.sum[m * nh + h] = s;
        if (h % 2 == 0) a.offset[m * nh / 2 + h / 2] = d * static_cast<float>(s);
        else a.offset[m * nh / 2 + h / 2] += d * static_cast<float>(s);
      }
    }
  });
  return a;
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// y[m, 16g .. 16g + 15] for rows m0 .. m0 + MT - 1: the whole K of one row group. Each row's
// arithmetic is the same whatever MT is (rows never share a sum), so a row's result does not
// depend on how many rows the call has: the batch invariance the backend plan promises.
template <int64_t qt, int MT, typename T>
inline void group_rows(const uint8_t* grp, int64_t nb, const QuantizedActivations& a, int64_t K, int64_t m0,
                       const float* bias, T* y, int64_t N, int64_t g) {
  constexpr int64_t gbb = group_block_bytes(qt), qb = quant_bytes(qt);
  constexpr int32_t off = qt == kQ4_0 ? 8 : qt == kQ8_0 ? 128 : 0;  // the unsigned quants' offset
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = grp + b * gbb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qb)));
    // the MT rows' sums side by side: 2 MT independent chains of multiply-adds in flight
    __m512i s0[MT], s1[MT];
    for (int i = 0; i < MT; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      __m512i w0, w1;  // weights 4k .. 4k + 3 and 16 + 4k .. 16 + 4k + 3 of the 16 rows
      if constexpr (qt == kQ8_0) {
        w0 = _mm512_loadu_si512(blk + 64 * k);
        w1 = _mm512_loadu_si512(blk + 64 * (4 + k));
      } else {
        const __m512i v = _mm512_loadu_si512(blk + 64 * k);
        w0 = _mm512_and_si512(v, low4);
        w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int i = 0; i < MT; ++i) {
        const int8_t* xq = a.q.data() + (m0 + i) * K + 32 * b;
        int32_t x0, x1;
        std::memcpy(&x0, xq + 4 * k, 4);
        std::memcpy(&x1, xq + 16 + 4 * k, 4);
        // weights 0..15 and 16..31: one sum each, for their own scales
        s0[i] = _mm512_dpbusd_epi32(s0[i], w0, _mm512_set1_epi32(x0));
        s1[i] = _mm512_dpbusd_epi32(s1[i], w1, _mm512_set1_epi32(x1));
      }
    }
    __m512 mn = _mm512_setzero_ps();
    if constexpr (qt == kQ4_1) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qb + 32)));
    for (int i = 0; i < MT; ++i) {
      const int64_t m = m0 + i;
      const float* dx = a.scale.data() + (m * nb + b) * 2;
      if constexpr (off != 0) {  // exactly, in the integer sums
        const int32_t* xs = a.sum.data() + (m * nb + b) * 2;
        s0[i] = _mm512_sub_epi32(s0[i], _mm512_set1_epi32(off * xs[0]));
        s1[i] = _mm512_sub_epi32(s1[i], _mm512_set1_epi32(off * xs[1]));
      }
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_set1_ps(dx[1]));
      t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_set1_ps(dx[0]), t);
      acc[i] = _mm512_fmadd_ps(t, d, acc[i]);
      if constexpr (qt == kQ4_1) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.offset[m * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    alignas(64) float res[kRows];
    __m512 r = acc[i];
    if (bias) r = _mm512_add_ps(r, _mm512_loadu_ps(bias + kRows * g));
    _mm512_store_ps(res, r);
    from_float(res, y + (m0 + i) * N + kRows * g, kRows);
  }
}
#endif

}  // namespace

bool int8_matmul_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// A Q4_0 / Q4_1 / Q8_0 weight [N, K] (N a multiple of 16) in the layout qlinear_i8 reads.
at::Tensor qrepack_i8(const at::Tensor& wq, int64_t qt, int64_t K) {
  TORCH_CHECK(repackable(qt), "qrepack_i8: int8 path for Q4_0, Q4_1, Q8_0 only, got ", q_type_name(qt));
  check_quantized(wq, qt, K, "qrepack_i8");
  const int64_t N = wq.size(0), nb = K / 32, bb = q_block_bytes(qt), row_bytes = wq.size(1);
  TORCH_CHECK(N % kRows == 0, "qrepack_i8: N must be a multiple of 16, got ", N);
  const int64_t gbb = group_block_bytes(qt);
  at::Tensor out = at::empty({N / kRows, nb * gbb}, wq.options());
  const uint8_t* src = wq.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kRows, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t g = gb; g < ge; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + g * nb * gbb + b * gbb;
        for (int64_t r = 0; r < kRows; ++r) {
          const uint8_t* blk = src + (g * kRows + r) * row_bytes + b * bb;
          block_in_group(qt, r, [&](int64_t go, int64_t bo, bool quant) {
            o[go] = quant ? group_quant(qt, blk[bo]) : blk[bo];
          });
        }
      }
    }
  });
  return out;
}

// y = x W^T (+ bias), W repacked by qrepack_i8; x [M, K] float32 or bfloat16 -> [M, N] of its dtype.
at::Tensor qlinear_i8(const at::Tensor& x, const at::Tensor& wp, int64_t qt, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear_i8: contiguous x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * kRows, nb = K / 32;
  check_repacked(wp, qt, K, "qlinear_i8");
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qlinear_i8: bias [N]");
    at::Tensor bf = bias->to(at::kFloat).contiguous();
    bias_f.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + N);
  }
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  const uint8_t* w = wp.data_ptr<uint8_t>();
  const int64_t gstride = nb * group_block_bytes(qt);
  dispatch_float_bf16(x.scalar_type(), "qlinear_i8: activations", [&](auto tag) {
    using T = decltype(tag);
    const QuantizedActivations a = quantize_activations(x.data_ptr<T>(), M, K);
    T* yp = out.data_ptr<T>();
    auto groups = [&](auto qtag) {
      constexpr int64_t QT = decltype(qtag)::value;
      at::parallel_for(0, N / kRows, 1, [&](int64_t gb, int64_t ge) {
        for (int64_t g = gb; g < ge; ++g) {
          const uint8_t* grp = w + g * gstride;
          int64_t m = 0;
          for (; m + 8 <= M; m += 8) group_rows<QT, 8>(grp, nb, a, K, m, bp, yp, N, g);
          // the rest in one tile: a speculating sample's 1 + k rows take one pass, not two
          switch (M - m) {
            case 7: group_rows<QT, 7>(grp, nb, a, K, m, bp, yp, N, g); break;
            case 6: group_rows<QT, 6>(grp, nb, a, K, m, bp, yp, N, g); break;
            case 5: group_rows<QT, 5>(grp, nb, a, K, m, bp, yp, N, g); break;
            case 4: group_rows<QT, 4>(grp, nb, a, K, m, bp, yp, N, g); break;
            case 3: group_rows<QT, 3>(grp, nb, a, K, m, bp, yp, N, g); break;
            case 2: group_rows<QT, 2>(grp, nb, a, K, m, bp, yp, N, g); break;
            case 1: group_rows<QT, 1>(grp, nb, a, K, m, bp, yp, N, g); break;
            default: break;
          }
        }
      });
    };
    if (qt == kQ4_0) groups(std::integral_constant<int64_t, kQ4_0>{});
    else if (qt == kQ4_1) groups(std::integral_constant<int64_t, kQ4_1>{});
    else groups(std::integral_constant<int64_t, kQ8_0>{});
  });
#else
  TORCH_CHECK(false, "qlinear_i8: this build has no AVX512-VNNI (int8_matmul_available() is false)");
#endif
  return out;
}

// Rows `ids` of a repacked Q4_0 / Q4_1 / Q8_0 table -> [T, K] of `dtype`, each value exactly as
// from the file's layout (the block is put back together, then dequantized as gguf-py does).
at::Tensor qembedding_i8(const at::Tensor& ids, const at::Tensor& wp, int64_t qt, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "qembedding_i8: ids [T] int64");
  check_repacked(wp, qt, K, "qembedding_i8");
  at::Tensor idc = ids.contiguous();
  const int64_t T = idc.size(0), V = wp.size(0) * kRows, nb = K / 32;
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "qembedding_i8: id ", ip[t], " outside [0, ", V, ")");
  at::Tensor out = at::empty({T, K}, ids.options().dtype(dtype));
  const uint8_t* w = wp.data_ptr<uint8_t>();
  const int64_t gbb = group_block_bytes(qt);
  dispatch_float_bf16(dtype, "qembedding_i8: dtype", [&](auto tag) {
    using T_ = decltype(tag);
    T_* op = out.data_ptr<T_>();
    at::parallel_for(0, T, 8, [&](int64_t b0, int64_t e0) {
      uint8_t blk[34];
      float vals[32];
      for (int64_t t = b0; t < e0; ++t) {
        const int64_t g = ip[t] / kRows, r = ip[t] % kRows;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* o = w + g * nb * gbb + b * gbb;
          block_in_group(qt, r, [&](int64_t go, int64_t bo, bool quant) {
            blk[bo] = quant ? group_quant(qt, o[go]) : o[go];
          });
          dequant_block_scalar(blk, qt, vals);
          from_float(vals, op + t * K + 32 * b, 32);
        }
      }
    });
  });
  return out;
}

}  // namespace tessera
