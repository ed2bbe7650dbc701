// tessera's CPU kernels: bfloat16 dense matmul (linear_bf16 and its weight packing) on
// oneDNN's brgemm micro-kernel.
#include "cpu_kernels.h"
#include "tile_queue.h"
#include "vec.h"

#include <ATen/native/CPUBlas.h>

namespace tessera {
namespace {

// ---- bfloat16 dense matmul on oneDNN's brgemm micro-kernel -----------------------------
// The layer is cut into tiles (up to kTileM rows x kPackN columns) that the team's threads
// take from shared runs (tile_queue.h), where oneDNN's own matmul (torch's prepacked linear)
// splits it evenly before it starts. Each tile is one call of oneDNN's brgemm micro-kernel
// (exported by torch as at::native::cpublas::brgemm), accumulating in float32, rounded to
// bfloat16 once.
constexpr int64_t kPackN = 64;   // columns per packed weight block
constexpr int64_t kTileM = 64;   // rows per tile

}  // namespace

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
  parallel_rows(0, NB, 1, [&](int64_t b, int64_t e) {
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
  const int64_t MB = (M + kTileM - 1) / kTileM;
  run_tiles(NB * MB, [&](int64_t me, TileQueue& queue) {
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
  });
  return out;
}

}  // namespace tessera
