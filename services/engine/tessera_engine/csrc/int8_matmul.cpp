// tessera's CPU kernels: the matmul of activation rows with Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K /
// Q6_K weights on integer dot products, as llama.cpp computes it: each 32-value block of an activation row
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
// Every weight type is repacked into one of six block layouts (layout_of), each 32 weights of a
// row exactly the file's weights (the int8 activations are the only approximation):
//   Q4_0, Q4_1, Q8_0  the file's blocks as they are;
//   Q5_0 -> Q5_0X     the file's 22 bytes a block: its nibbles as Q4_0's, the fifth bits regrouped
//                     so that one shift and mask puts them on top of the nibbles (q5_0x_weight),
//                     the same float16 d; q - 16 as Q4_0's q - 8 (as Q8_0's signed bytes it would
//                     read 34 bytes a block);
//   Q4_K -> Q4_1F     Q4_1 with float32 fields: each 32-weight sub-block's d * sc and -(dmin * m),
//                     the reference's own float32 products (as Q4_1's float16 fields they would be
//                     off by 6.7e-4 of the weights' rms on Gemma 3 270M's file: benchmarks/
//                     quantized_accuracy.py --layout-error; float32 costs 4 bytes a 32 weights);
//   Q6_K -> Q8_0S     the quant q - 32 as a signed byte and two float32 scales a block, d * sc of
//                     each 16-weight sub-block (Q6_K's scales do not fit one per 32 weights; the
//                     kernel's two half-block sums take one each: d0 dx0 sum0 + d1 dx1 sum1, where
//                     requantizing to Q8_0 would be off by 5.6e-3 of the weights' rms).
// Its block of one row, before interleaving: the scale fields (d; d, m; d0, d1), then the quants.
//
// Repacked layout, uint8 [N / 16, blocks * group block bytes]: for row group g and block b,
//   quants  Q4: 4 x 64 bytes, vector i lane r = bytes 4i..4i+3 of row 16g+r's block (low nibbles
//               are weights 4i..4i+3, high nibbles 16+4i..16+4i+3: GGUF's own pairing);
//           Q8: 8 x 64 bytes, vector i lane r = weights 4i..4i+3 of row 16g+r, plus 128 (unsigned)
//           Q5_0X: Q4's 4 x 64 bytes, then 64 bytes of fifth bits, lane r = row 16g+r's 4 bytes
//   then each scale field for the 16 rows (16 float16 d, then (Q4_1) 16 float16 m; float32 for
//   Q4_1F and Q8_0S): for Q4_0 / Q4_1 / Q8_0 the same bytes a block as the file's layout.
// The repacked weight keeps the file's type number: the kernels map it to its layout.
#include "cpu_kernels.h"
#include "gguf_blocks.h"
#include "tile_queue.h"
#include "vec.h"

namespace tessera {
namespace {

constexpr int64_t kRows = 16;  // output rows a group interleaves: one int32 lane each
// qlinear_i8 hands out work in tiles of whole row groups, as many groups as reach this many
// multiply-adds (one group when it has more)
constexpr int64_t kTileMacs = 1 << 16;
// How far ahead of the block it computes group_rows asks for the weights: at one row the hardware
// prefetchers alone left a large layer's stream well below the memory's speed (on an Intel Xeon:
// benchmarks/README, kernel_steps.py --quantized llama1b). About what one thread has in flight at
// the memory's latency: on that Xeon, where the default model's step (96 MB of weights) streams
// mostly from a large L3, 4 KB took a step's one-row matmuls from 4.05 to 3.33 ms against 1 KB
// (2 KB 3.64, 8 and 16 KB as 4); a layer from DRAM (llama1b) and 64 rows were level.
constexpr int64_t kPrefetchBytes = 4096;

// the layouts of their own (no ggml type has these numbers): Q4_1 and Q8_0 with float32 fields,
// Q5_0 with its fifth bits where the kernel reads them
constexpr int64_t kQ4_1F = 1001, kQ8_0S = 1002, kQ5_0X = 1003;

#define TESSERA_INT8_TYPES "Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K"

constexpr bool repackable(int64_t qt) {
  return qt == kQ4_0 || qt == kQ4_1 || qt == kQ5_0 || qt == kQ8_0 || qt == kQ4_K || qt == kQ6_K;
}

// the layout a (repackable) file type's blocks take
constexpr int64_t layout_of(int64_t qt) { return qt == kQ5_0 ? kQ5_0X : qt == kQ4_K ? kQ4_1F : qt == kQ6_K ? kQ8_0S : qt; }

constexpr bool q8_quants(int64_t lt) { return lt == kQ8_0 || lt == kQ8_0S; }  // signed bytes, else nibbles
constexpr bool has_min(int64_t lt) { return lt == kQ4_1 || lt == kQ4_1F; }
constexpr int64_t scale_bytes(int64_t lt) { return lt == kQ4_1F || lt == kQ8_0S ? 4 : 2; }   // float32 or float16
constexpr int64_t scale_fields(int64_t lt) { return has_min(lt) || lt == kQ8_0S ? 2 : 1; }  // d (, m or d1)

// the unsigned quants' offset (the file's signed value is q - off), and whether it is taken off as
// a minimum of -off d in float (one weight scale a block) rather than out of the integer sums
// (Q8_0S: two scales a block make no one minimum)
constexpr int32_t unsigned_offset(int64_t lt) { return lt == kQ4_0 ? 8 : lt == kQ5_0X ? 16 : q8_quants(lt) ? 128 : 0; }
constexpr bool offset_as_min(int64_t lt) { return unsigned_offset(lt) != 0 && lt != kQ8_0S; }
// what quantize_activations multiplies each block's activation term by (QuantizedActivations::offset)
constexpr float offset_factor(int64_t lt) { return offset_as_min(lt) ? -static_cast<float>(unsigned_offset(lt)) : 1.f; }

// a group's quants of one block (Q5_0X: the nibbles, then a vector of fifth bits)
constexpr int64_t quant_bytes(int64_t lt) { return q8_quants(lt) ? 512 : lt == kQ5_0X ? 320 : 256; }

// bytes of one block of a 16-row group: the quants, then each scale field of the 16 rows
constexpr int64_t group_block_bytes(int64_t lt) { return quant_bytes(lt) + kRows * scale_fields(lt) * scale_bytes(lt); }

// Q5_0X's fifth bits: byte j (< 4) of a row's 4 bytes holds, at bit i, the fifth bit of the weight
// that byte j of the row's lane in nibble vector i (< 4: low nibbles, else high) holds: weight
// 4i + j, or 16 + 4 (i - 4) + j. Shifted by 4 - i (a left shift for i < 4) it lands on bit 4 of
// the very byte whose nibble it tops.
inline int q5_0x_weight(int i, int j) { return i < 4 ? 4 * i + j : 16 + 4 * (i - 4) + j; }

// bytes of one row's block in the layout, before interleaving (at most 40)
constexpr int64_t layout_block_bytes(int64_t lt) { return scale_fields(lt) * scale_bytes(lt) + quant_bytes(lt) / kRows; }

// Where row r's block (in the layout, before interleaving) lies in its group's block of the
// repacked layout: f(group offset, block offset, is a quant) for each of its bytes. qrepack_i8
// copies one way, qembedding_i8 the other.
template <typename F>
inline void block_in_group(int64_t lt, int64_t r, F&& f) {
  const int64_t qb = quant_bytes(lt), sb = scale_bytes(lt), nf = scale_fields(lt), qoff = nf * sb;
  for (int64_t i = 0; i < qb / 64; ++i)
    for (int j = 0; j < 4; ++j) f(64 * i + 4 * r + j, qoff + 4 * i + j, true);
  for (int64_t s = 0; s < nf; ++s)  // d (and m, or d1)
    for (int64_t j = 0; j < sb; ++j) f(qb + kRows * sb * s + sb * r + j, sb * s + j, false);
}

// A quant byte as the group holds it (signed -> unsigned, + 128) and back: its own inverse.
inline uint8_t group_quant(int64_t lt, uint8_t q) { return q8_quants(lt) ? static_cast<uint8_t>(q ^ 0x80) : q; }

inline void put_float(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
inline float get_float(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Block b (32 weights) of a file row of type qt, in its layout (layout_block_bytes bytes).
void to_layout_block(const uint8_t* row, int64_t qt, int64_t b, uint8_t* out) {
  if (qt == kQ4_0 || qt == kQ4_1 || qt == kQ8_0) {
    std::memcpy(out, row + b * q_block_bytes(qt), q_block_bytes(qt));
    return;
  }
  if (qt == kQ5_0) {  // d, the 16 nibble bytes as they are, then the fifth bits regrouped
    const uint8_t* blk = row + b * q_block_bytes(qt);
    out[0] = blk[0], out[1] = blk[1];
    std::memcpy(out + 2, blk + 6, 16);
    for (int j = 0; j < 4; ++j) {
      int bits = 0;
      for (int i = 0; i < 8; ++i) bits |= (q5_0_quant(blk, q5_0x_weight(i, j)) >> 4) << i;
      out[18 + j] = static_cast<uint8_t>(bits);
    }
    return;
  }
  const uint8_t* sblk = row + b / 8 * q_block_bytes(qt);  // its super-block
  const int s = static_cast<int>(b % 8);                  // and its 32 weights' place there
  if (qt == kQ4_K) {
    const KQuantHead h(sblk, qt);
    put_float(out, h.scale(s));
    put_float(out + 4, -h.min(s));
    const uint8_t* qs = h.qs + 32 * (s / 2);
    const int sh = 4 * (s & 1);
    for (int j = 0; j < 16; ++j)
      out[8 + j] = static_cast<uint8_t>(((qs[j] >> sh) & 15) | (((qs[j + 16] >> sh) & 15) << 4));
    return;
  }
  TORCH_CHECK(qt == kQ6_K, "int8 layout: unsupported ggml type ", q_type_name(qt));
  const int8_t* sc = reinterpret_cast<const int8_t*>(sblk + 192);
  const float d = half_to_float(sblk + 208);
  for (int h = 0; h < 2; ++h) put_float(out + 4 * h, d * static_cast<float>(sc[2 * s + h]));
  for (int l = 0; l < 32; ++l) out[8 + l] = static_cast<uint8_t>(static_cast<int8_t>(q6_k_quant(sblk, 32 * s + l) - 32));
}

// One row's block in layout lt -> 32 float32, as the reference dequantizes the file's block:
// the same products in the same order (Q4_1F: d * q + m with m = -(dmin * mn) is d * q - dmin * mn).
__attribute__((noinline, optimize("fp-contract=off")))
void dequant_layout_block(const uint8_t* blk, int64_t lt, float* out) {
  if (lt == kQ4_1F) {
    const float d = get_float(blk), m = get_float(blk + 4);
    for (int j = 0; j < 16; ++j) {
      const float lo = d * static_cast<float>(blk[8 + j] & 15), hi = d * static_cast<float>(blk[8 + j] >> 4);
      out[j] = lo + m;
      out[j + 16] = hi + m;
    }
  } else if (lt == kQ8_0S) {
    for (int j = 0; j < 32; ++j) out[j] = get_float(blk + 4 * (j / 16)) * static_cast<float>(static_cast<int8_t>(blk[8 + j]));
  } else if (lt == kQ5_0X) {  // as Q5_0: d * (q - 16)
    const float d = half_to_float(blk);
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) {
        const int w = q5_0x_weight(i, j);
        const int q = ((blk[2 + (w & 15)] >> (4 * (w >> 4))) & 15) | (((blk[18 + j] >> i) & 1) << 4);
        out[w] = d * static_cast<float>(q - 16);
      }
  } else {
    dequant_block_scalar(blk, lt, out);
  }
}

void check_repacked(const at::Tensor& wp, int64_t qt, int64_t K, const char* what) {
  TORCH_CHECK(repackable(qt), what, ": int8 path for " TESSERA_INT8_TYPES " only, got ", q_type_name(qt));
  TORCH_CHECK(wp.dim() == 2 && wp.scalar_type() == at::kByte && wp.is_contiguous(),
              what, ": the repacked weight is a contiguous uint8 [N / 16, group bytes]");
  TORCH_CHECK(K > 0 && K % 32 == 0, what, ": K must be a multiple of 32, got ", K);
  const int64_t gbb = group_block_bytes(layout_of(qt));
  TORCH_CHECK(wp.size(1) == K / 32 * gbb, what, ": ", wp.size(1), " bytes a row group do not hold K = ", K,
              " weights of ", q_type_name(qt), " (", K / 32 * gbb, " bytes)");
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
  // [M, K / 32]: c (dx0 (sum of half 0's quants) + dx1 (half 1's)): what a weight block's
  // constant multiplies. c = 1 for Q4_1's minimum (m c); c = -off for the unsigned quants' offset,
  // which then joins the half sums before their one multiply by d (offset_factor)
  std::vector<float> offset;
  // [M, K / 16]: the sum of each half block's quants (Q8_0S's offset of the unsigned quants,
  // taken back out of the integer sums: its two weight scales a block make no one minimum)
  std::vector<int32_t> sum;
};

template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t M, int64_t K, float factor) {
  const int64_t nh = K / 16;
  QuantizedActivations a{std::vector<int8_t>(M * K), std::vector<float>(M * nh), std::vector<float>(M * nh / 2),
                         std::vector<int32_t>(M * nh)};
  parallel_rows(0, M, 16, [&](int64_t mb, int64_t me) {
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
        else a.offset[m * nh / 2 + h / 2] = factor * (a.offset[m * nh / 2 + h / 2] + d * static_cast<float>(s));
      }
    }
  });
  return a;
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// y[m, 16g .. 16g + 15] for rows m0 .. m0 + MT - 1: the whole K of one row group. Each row's
// arithmetic is the same whatever MT is (rows never share a sum), so a row's result does not
// depend on how many rows the call has: the batch invariance the backend plan promises.
// qt here is the layout (layout_of).
template <int64_t qt, int MT, typename T>
inline void group_rows(const uint8_t* grp, int64_t nb, const QuantizedActivations& a, int64_t K, int64_t m0,
                       const float* bias, T* y, int64_t N, int64_t g) {
  constexpr int64_t gbb = group_block_bytes(qt), qb = quant_bytes(qt);
  constexpr int32_t off = unsigned_offset(qt);
  // With one weight scale a block, the offset is a minimum of -off d: the activations' offset
  // term, already times -off, starts the row's float sum of the two halves, which d then scales
  // (it had its own multiply-add: one in six of a row's block epilogue).
  // Taking off xs out of both integer sums cost four vector instructions a row (Q8_0S's two
  // scales keep the integer way). The half sums are up to 16 x 255 x 127: exact in float32
  // (< 2^24), and the cancellation's rounding (~1e-7 of them) is far below the int8 rounding.
  constexpr bool off_as_min = offset_as_min(qt);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = grp + b * gbb;
    // the weight stream's lines kPrefetchBytes ahead (past a group's end: the next group's, which
    // follows it in memory), asked for while this block computes
    for (int64_t l = 0; l < gbb; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + l), _MM_HINT_T0);
    __m512 d;
    if constexpr (scale_bytes(qt) == 4) d = _mm512_loadu_ps(blk + qb);
    else d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qb)));
    __m512i fifth = _mm512_setzero_si512();
    if constexpr (qt == kQ5_0X) fifth = _mm512_loadu_si512(blk + 256);
    // the MT rows' sums side by side: 2 MT independent chains of multiply-adds in flight
    __m512i s0[MT], s1[MT];
    for (int i = 0; i < MT; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      __m512i w0, w1;  // weights 4k .. 4k + 3 and 16 + 4k .. 16 + 4k + 3 of the 16 rows
      if constexpr (q8_quants(qt)) {
        w0 = _mm512_loadu_si512(blk + 64 * k);
        w1 = _mm512_loadu_si512(blk + 64 * (4 + k));
      } else {
        const __m512i v = _mm512_loadu_si512(blk + 64 * k);
        w0 = _mm512_and_si512(v, low4);
        w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (qt == kQ5_0X) {  // bit k (low nibbles) and 4 + k (high) of each byte, to bit 4
          const __m512i bit4 = _mm512_set1_epi8(0x10);
          w0 = _mm512_or_si512(w0, _mm512_and_si512(_mm512_slli_epi16(fifth, 4 - k), bit4));
          w1 = _mm512_or_si512(w1, _mm512_and_si512(_mm512_srli_epi16(fifth, k), bit4));
        }
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
    __m512 mn = _mm512_setzero_ps();  // the second field: the minimum (Q4_1, Q4_1F) or d1 (Q8_0S)
    if constexpr (qt == kQ4_1) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + qb + 32)));
    if constexpr (qt == kQ4_1F || qt == kQ8_0S) mn = _mm512_loadu_ps(blk + qb + 64);
    for (int i = 0; i < MT; ++i) {
      const int64_t m = m0 + i;
      const float* dx = a.scale.data() + (m * nb + b) * 2;
      if constexpr (off != 0 && !off_as_min) {  // exactly, in the integer sums
        const int32_t* xs = a.sum.data() + (m * nb + b) * 2;
        s0[i] = _mm512_sub_epi32(s0[i], _mm512_set1_epi32(off * xs[0]));
        s1[i] = _mm512_sub_epi32(s1[i], _mm512_set1_epi32(off * xs[1]));
      }
      if constexpr (qt == kQ8_0S) {  // each half its own weight scale
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_set1_ps(dx[0])), d, acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_set1_ps(dx[1])), mn, acc[i]);
      } else if constexpr (off_as_min) {  // d (dx0 s0 + dx1 s1 - off c)
        __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_set1_ps(dx[1]), _mm512_set1_ps(a.offset[m * nb + b]));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_set1_ps(dx[0]), t);
        acc[i] = _mm512_fmadd_ps(t, d, acc[i]);
      } else {
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_set1_ps(dx[1]));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_set1_ps(dx[0]), t);
        acc[i] = _mm512_fmadd_ps(t, d, acc[i]);
      }
      if constexpr (has_min(qt)) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.offset[m * nb + b]), acc[i]);
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

// A Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weight [N, K] (N a multiple of 16) in the layout
// qlinear_i8 reads (its type's layout_of); pass the file's type to the kernels with it.
at::Tensor qrepack_i8(const at::Tensor& wq, int64_t qt, int64_t K) {
  TORCH_CHECK(repackable(qt), "qrepack_i8: int8 path for " TESSERA_INT8_TYPES " only, got ", q_type_name(qt));
  check_quantized(wq, qt, K, "qrepack_i8");
  const int64_t N = wq.size(0), nb = K / 32, row_bytes = wq.size(1), lt = layout_of(qt);
  TORCH_CHECK(N % kRows == 0, "qrepack_i8: N must be a multiple of 16, got ", N);
  const int64_t gbb = group_block_bytes(lt);
  at::Tensor out = at::empty({N / kRows, nb * gbb}, wq.options());
  const uint8_t* src = wq.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  parallel_rows(0, N / kRows, 1, [&](int64_t gb, int64_t ge) {
    uint8_t blk[layout_block_bytes(kQ8_0S)];
    for (int64_t g = gb; g < ge; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + g * nb * gbb + b * gbb;
        for (int64_t r = 0; r < kRows; ++r) {
          to_layout_block(src + (g * kRows + r) * row_bytes, qt, b, blk);
          block_in_group(lt, r, [&](int64_t go, int64_t bo, bool quant) {
            o[go] = quant ? group_quant(lt, blk[bo]) : blk[bo];
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
  const int64_t lt = layout_of(qt), gstride = nb * group_block_bytes(lt);
  dispatch_float_bf16(x.scalar_type(), "qlinear_i8: activations", [&](auto tag) {
    using T = decltype(tag);
    const QuantizedActivations a = quantize_activations(x.data_ptr<T>(), M, K, offset_factor(lt));
    T* yp = out.data_ptr<T>();
    auto groups = [&](auto qtag) {
      constexpr int64_t QT = decltype(qtag)::value;
      // work tiles of `per` row groups (tile_queue.h), enough that a tile's work outweighs taking
      // it (a row group of one row is ~9K multiply-adds at K = 576)
      const int64_t G = N / kRows, per = std::max<int64_t>(1, kTileMacs / std::max<int64_t>(1, M * kRows * K));
      run_tiles((G + per - 1) / per, [&](int64_t me, TileQueue& queue) {
        for (int64_t t = queue.take(me); t >= 0; t = queue.take(me)) {
          for (int64_t g = t * per, ge = std::min(G, g + per); g < ge; ++g) {
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
        }
      });
    };
    switch (lt) {
      case kQ4_0: groups(std::integral_constant<int64_t, kQ4_0>{}); break;
      case kQ4_1: groups(std::integral_constant<int64_t, kQ4_1>{}); break;
      case kQ8_0: groups(std::integral_constant<int64_t, kQ8_0>{}); break;
      case kQ4_1F: groups(std::integral_constant<int64_t, kQ4_1F>{}); break;
      case kQ5_0X: groups(std::integral_constant<int64_t, kQ5_0X>{}); break;
      default: groups(std::integral_constant<int64_t, kQ8_0S>{}); break;
    }
  });
#else
  TORCH_CHECK(false, "qlinear_i8: this build has no AVX512-VNNI (int8_matmul_available() is false)");
#endif
  return out;
}

// Rows `ids` of a repacked table -> [T, K] of `dtype`, each value exactly as gguf-py dequantizes
// the file's (the row's block in its layout is put back together, then dequantized).
at::Tensor qembedding_i8(const at::Tensor& ids, const at::Tensor& wp, int64_t qt, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "qembedding_i8: ids [T] int64");
  check_repacked(wp, qt, K, "qembedding_i8");
  at::Tensor idc = ids.contiguous();
  const int64_t T = idc.size(0), V = wp.size(0) * kRows, nb = K / 32;
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "qembedding_i8: id ", ip[t], " outside [0, ", V, ")");
  at::Tensor out = at::empty({T, K}, ids.options().dtype(dtype));
  const uint8_t* w = wp.data_ptr<uint8_t>();
  const int64_t lt = layout_of(qt), gbb = group_block_bytes(lt);
  dispatch_float_bf16(dtype, "qembedding_i8: dtype", [&](auto tag) {
    using T_ = decltype(tag);
    T_* op = out.data_ptr<T_>();
    parallel_rows(0, T, 8, [&](int64_t b0, int64_t e0) {
      uint8_t blk[layout_block_bytes(kQ8_0S)];
      float vals[32];
      for (int64_t t = b0; t < e0; ++t) {
        const int64_t g = ip[t] / kRows, r = ip[t] % kRows;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* o = w + g * nb * gbb + b * gbb;
          block_in_group(lt, r, [&](int64_t go, int64_t bo, bool quant) {
            blk[bo] = quant ? group_quant(lt, o[go]) : o[go];
          });
          dequant_layout_block(blk, lt, vals);
          from_float(vals, op + t * K + 32 * b, 32);
        }
      }
    });
  });
  return out;
}

}  // namespace tessera
