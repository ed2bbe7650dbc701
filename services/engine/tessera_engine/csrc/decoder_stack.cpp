// tessera's CPU kernels: a Llama-family model's decoder layers in one call (DecoderStack).
//
// The Python forward makes ~9 kernel calls a layer (~280 a step of the default model), and
// for a step of a few rows the interpreter, pybind11 and the module code between them cost
// ~1.5 ms of a ~6 ms step. DecoderStack holds each layer's weights and makes the very same
// calls, in the same order, on the same arguments, from C++: its results are bit for bit the
// Python forward's (which stays the path for everything it does not cover: LoRA, Qwen3's q/k
// norms, per-layer windows, KV copies, batches past the quantized matmul's rows, dense weights).
#include "cpu_kernels.h"

namespace tessera {

namespace {
constexpr int64_t kPerLayer = 8;  // input norm, qkv, qkv bias, o, o bias, post norm, gate_up, down
constexpr int64_t kMatmuls = 4;   // qkv, o, gate_up, down
// each matmul's weight, and (qkv, o) its bias, among a layer's kPerLayer tensors
constexpr int64_t kWeightAt[kMatmuls] = {1, 3, 6, 7}, kBiasAt[2] = {2, 4};
}  // namespace

DecoderStack::DecoderStack(std::vector<at::Tensor> weights, std::vector<int64_t> qtypes, std::vector<int64_t> int8,
                           at::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           double eps, double scale)
    : weights_(std::move(weights)), qtypes_(std::move(qtypes)), int8_(std::move(int8)),
      final_norm_(std::move(final_norm)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), eps_(eps), scale_(scale) {
  TORCH_CHECK(!weights_.empty() && weights_.size() % kPerLayer == 0,
              "DecoderStack: ", kPerLayer, " tensors a layer (an empty tensor for a missing bias)");
  layers_ = static_cast<int64_t>(weights_.size()) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(qtypes_.size()) == layers_ * kMatmuls &&
                  static_cast<int64_t>(int8_.size()) == layers_ * kMatmuls,
              "DecoderStack: a ggml type and a kernel choice for each of a layer's ", kMatmuls, " matmuls");
}

at::Tensor DecoderStack::matmul(int64_t layer, int64_t which, const at::Tensor& x) const {
  const at::Tensor& w = weights_[layer * kPerLayer + kWeightAt[which]];
  c10::optional<at::Tensor> bias;
  if (which < 2) {
    const at::Tensor& b = weights_[layer * kPerLayer + kBiasAt[which]];
    if (b.defined() && b.numel() > 0) bias = b;  // an empty tensor: no bias
  }
  const int64_t i = layer * kMatmuls + which;
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  return int8_[i] ? qlinear_i8(xc, w, qtypes_[i], bias) : qlinear(xc, w, qtypes_[i], bias);
}

at::Tensor DecoderStack::forward(const at::Tensor& embeddings, const at::Tensor& positions, const at::Tensor& cos,
                                 const at::Tensor& sin_signed, const std::vector<at::Tensor>& caches,
                                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, int64_t block_size, int64_t window) const {
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * layers_, "DecoderStack: a K and a V cache a layer");
  const int64_t T = embeddings.size(0), q_width = num_heads_ * head_dim_;
  at::Tensor x = embeddings, residual;
  for (int64_t l = 0; l < layers_; ++l) {
    const at::Tensor* w = weights_.data() + l * kPerLayer;
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, w[0], eps_);
    } else {
      h = add_rms_norm_(x, residual, w[0], eps_);
    }
    at::Tensor qkv = matmul(l, 0, h);
    at::Tensor k_cache = caches[2 * l], v_cache = caches[2 * l + 1];
    rope_and_cache_(qkv, positions, cos, sin_signed, k_cache, v_cache, slot_mapping, num_heads_, num_kv_heads_,
                    head_dim_);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({T, num_heads_, head_dim_});
    const at::Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale_, block_size,
                                             window);
    h = add_rms_norm_(matmul(l, 1, attn.view({T, q_width})), residual, w[5], eps_);
    x = matmul(l, 3, silu_and_mul(matmul(l, 2, h)));
  }
  return add_rms_norm_(x, residual, final_norm_, eps_);
}

}  // namespace tessera
