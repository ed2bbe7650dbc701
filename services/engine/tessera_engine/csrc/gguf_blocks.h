// tessera's CPU kernels: GGUF's block-quantized weights as llama.cpp lays them out, for the
// kernel families that read them (quantized_matmul.cpp, int8_matmul.cpp): the types, their
// block sizes, the float16 scales, and each block dequantized exactly as gguf-py's reference.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera {
namespace {

// ---- GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), used as they are --
// A quantized weight is llama.cpp's own bytes, uint8 [N, K / block weights * block bytes]:
// each row is a run of blocks. Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks hold 32 weights: a float16
// scale d (and, for Q4_1, a float16 minimum m) and the quants. Q5_0 (22 bytes): d, then 4 bytes
// holding each weight's fifth bit (bit j of the little-endian uint32: weight j), then 16 bytes of
// low nibbles paired as Q4_0's (byte j: weight j low, weight 16 + j high); w = d * (q - 16).
// The K-quants' super-blocks hold 256 weights (QK_K) in sub-blocks with their own scales:
// Q4_K / Q5_K (144 / 176 bytes) a float16 d and dmin and eight 6-bit scales and mins packed in
// 12 bytes, scaling sub-blocks of 32 4-bit (Q5_K: 5-bit, the fifth bit in 32 bytes of its own)
// quants as (d * sc) * q - (dmin * m);
// Q6_K (210 bytes) 6-bit quants (low 4 bits, high 2 bits), sixteen int8 scales of 16-weight
// sub-blocks and a float16 d last, (d * sc) * (q - 32). dequant_block_scalar computes a block
// as gguf-py's reference does, in float32 and in its order (Q4_1: d * q, then + m; no fused
// multiply-add).
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };  // ggml's type numbers

#define TESSERA_QTYPES_SUPPORTED "(supported: Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)"

constexpr int64_t q_block_bytes(int64_t qt) {
  switch (qt) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
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
    case kQ5_0: return "Q5_0";
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

// Q5_0's quant j (0..31, unsigned: the weight is d * (q - 16)) of block b.
inline int q5_0_quant(const uint8_t* b, int j) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const int lo = (b[6 + (j & 15)] >> (4 * (j >> 4))) & 15;
  return lo | static_cast<int>(((qh >> j) & 1u) << 4);
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

// Q6_K's quant p (0..63, unsigned: the weight is (d * scales[p / 16]) * (q - 32)) of
// super-block b: see dequant_kblock_scalar.
inline int q6_k_quant(const uint8_t* b, int p) {
  const int c = p / 128, t = (p % 128) / 32, l = p % 32;
  const int lo = (b[64 * c + 32 * (t & 1) + l] >> (4 * (t / 2))) & 15;
  const int hi = (b[128 + 32 * c + l] >> (2 * t)) & 3;
  return lo | (hi << 4);
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
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int p = 0; p < 256; ++p) {
      const float ds = d * static_cast<float>(sc[p / 16]);
      out[p] = ds * static_cast<float>(q6_k_quant(b, p) - 32);
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
  } else if (qt == kQ5_0) {
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q5_0_quant(b, j) - 16);
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

void check_quantized(const at::Tensor& wq, int64_t qt, int64_t K, const char* what) {
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous(),
              what, ": the quantized weight is a contiguous uint8 [N, row bytes]");
  const int64_t bb = q_block_bytes(qt), bw = q_block_weights(qt);  // (an unsupported type fails here)
  TORCH_CHECK(K > 0 && K % bw == 0, what, ": K must be a multiple of ", bw, " (the block size of ",
              q_type_name(qt), "), got ", K);
  TORCH_CHECK(wq.size(1) == K / bw * bb, what, ": ", wq.size(1), " bytes a row do not hold K = ", K,
              " weights of ggml type ", q_type_name(qt), " (", K / bw * bb, " bytes)");
}

}  // namespace
}  // namespace tessera
