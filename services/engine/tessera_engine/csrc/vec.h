// tessera's CPU kernels: the helpers the kernel families share (dtype conversion, dot,
// dtype dispatch, AVX-512 loads, stores and exp). Each file that includes this gets its own
// internal copy (an anonymous namespace), as when all the kernels were one file.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

namespace tessera {
namespace {

// ---- element conversion (vectorizes: bf16 -> f32 is a 16-bit shift) ----------------
#if defined(__AVX512F__)
// 16 floats rounded to bfloat16 as torch rounds them (to nearest even, NaN -> 0x7FC0): the
// bits, in the low half of each 32-bit lane
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_srli_epi32(r, 16),
                                 _mm512_set1_epi32(0x7FC0));
}
#endif

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
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(bf16_bits16(_mm512_loadu_ps(src + i))));
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

// f(float{}) or f(c10::BFloat16{}): the quantized matmuls' activation dtypes, and only those
template <typename F>
void dispatch_float_bf16(at::ScalarType t, const char* what, F&& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kBFloat16) f(c10::BFloat16{});
  else TORCH_CHECK(false, what, " must be float32 or bfloat16, got ", t);
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
// 16 floats stored in the dtype, rounded as from_float rounds
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
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

}  // namespace
}  // namespace tessera
