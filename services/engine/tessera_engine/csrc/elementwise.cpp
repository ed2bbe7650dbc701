// tessera's CPU kernels: the elementwise and row-wise ops of a step: RMSNorm (optionally
// after the residual add), SwiGLU, rotary embedding with the K/V cache write, greedy argmax.
#include "cpu_kernels.h"
#include "tile_queue.h"
#include "vec.h"

namespace tessera {
namespace {

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
    parallel_rows(0, rows, 16, [&](int64_t b, int64_t e) {
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

}  // namespace

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
    parallel_rows(0, rows, 4, [&](int64_t b, int64_t e) {
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
#if defined(__AVX512F__)
// v rounded to the dtype and back (float32: v itself), as from_float then to_float would
inline __m512 round_to(__m512 v, float) { return v; }
inline __m512 round_to(__m512 v, c10::BFloat16) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }

// One token's heads: rotary on q (in place) and k (into the cache row kdst), the scalar loop's
// products and sum rounded alike, 16 values of each half at a time, in registers (the scalar
// loop's ten passes through buffers were 4% of a 64-row decode step). Separate multiplies and
// adds, as the reference: no fused multiply-add in float32.
template <typename T>
__attribute__((noinline, optimize("fp-contract=off")))
void rope_token_vec(T* r, const T* cp, const T* sp, int64_t num_heads, int64_t num_rotated, int64_t d, T* kdst) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < num_rotated; ++h) {
    T* src = r + h * d;
    T* dst = h < num_heads ? src : kdst + (h - num_heads) * d;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 x0 = load16(src + i), x1 = load16(src + half + i);
      // out[i] = x0 cos[i] + x1 sin[i]; out[half + i] = x1 cos[half + i] + x0 sin[half + i]
      const __m512 lo = _mm512_add_ps(round_to(_mm512_mul_ps(x0, load16(cp + i)), T{}),
                                      round_to(_mm512_mul_ps(x1, load16(sp + i)), T{}));
      const __m512 hi = _mm512_add_ps(round_to(_mm512_mul_ps(x1, load16(cp + half + i)), T{}),
                                      round_to(_mm512_mul_ps(x0, load16(sp + half + i)), T{}));
      store16(dst + i, lo);  // the sum rounded to T
      store16(dst + half + i, hi);
    }
  }
}
#endif

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
    parallel_rows(0, T, 4, [&](int64_t b, int64_t e) {
      std::vector<float> c(d), sn(d), x(d), a(d), rb(d);
      std::vector<scalar_t> tmp(d);
#if defined(__AVX512F__)
      // the chunk's cache rows asked for at once: written one token at a time, each a miss
      // (the pool's rows are cold) that had cost more than the rotary arithmetic
      const int64_t kv_bytes = kv_row * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t t = b; t < e; ++t)
        for (int64_t o = 0; o < kv_bytes; o += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + slots[t] * kv_row) + o, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vc + slots[t] * kv_row) + o, _MM_HINT_T0);
        }
#endif
      for (int64_t t = b; t < e; ++t) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
          if (half % 16 == 0) {  // (float16 caches, and other head sizes: the loop below)
            scalar_t* r = xp + t * row;
            rope_token_vec(r, cp + pos[t] * d, sp + pos[t] * d, num_heads, num_heads + num_kv_heads, d,
                           kc + slots[t] * kv_row);
            std::memcpy(vc + slots[t] * kv_row, r + (num_heads + num_kv_heads) * d, kv_row * sizeof(scalar_t));
            continue;
          }
        }
#endif
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
    parallel_rows(0, rows, 1, [&](int64_t b, int64_t e) {
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

}  // namespace tessera
