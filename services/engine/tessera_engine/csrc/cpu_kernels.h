// tessera's CPU kernels: the decode step's memory-bound pieces, fused.
//
// On CPU a decode step spends most of its non-matmul time moving data: paged
// attention gathered K/V into a padded copy, upcast it, then ran tiny batched
// matmuls; RMSNorm, the residual add, SwiGLU and rotary embeddings each took
// several elementwise passes (and allocations). These kernels do each in one
// pass, reading the paged cache in place. They accumulate in float32, and
// round to the tensor's dtype where the torch reference rounds, so results
// match it to float32 rounding.
//
// Built at first use by torch.utils.cpp_extension (tessera_engine/cpu_kernels.py),
// for the CPU it is built on (-march=native). Parallel over rows and tiles on the
// kernels' own thread pool (tile_queue.h), not torch's OpenMP team.
//
// The kernels are split by family into the .cpp files of this directory, compiled and
// linked into one extension module (cpu_kernels.py builds every .cpp here):
//   vec.h                 helpers the families share: dtype conversion, dot, dtype dispatch,
//                         the AVX-512 loads and exp
//   attention.cpp         paged decode attention
//   elementwise.cpp       RMSNorm (+ residual add), SwiGLU, rotary + K/V cache write, argmax
//   quantized_matmul.cpp  GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K):
//                         matmul, embedding rows, dequantize
//   int8_matmul.cpp       the same matmul for a few rows on int8 dot products (AVX512-VNNI),
//                         activations quantized per block, Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K
//                         weights repacked
//   gguf_blocks.h         the GGUF block types, sizes and exact dequantization both read
//   tile_queue.h          work cut into tiles the team's threads take from shared runs (a
//                         thread takes the rest of a preempted one's run): the matmuls, attention
//   dense_matmul.cpp      bfloat16 matmul on oneDNN's brgemm micro-kernel
//   lora.cpp              batched LoRA (shrink then expand per adapter slot), batch-invariant
//   threads.cpp           binding the OpenMP team's threads to CPUs
//   decoder_stack.cpp     a Llama-family model's decoder layers in one call, on the kernels above
//   bindings.cpp          the Python module (pybind11)
// This header declares the entry points bindings.cpp exposes; each family keeps its own
// helpers in an anonymous namespace of its file.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace tessera {

// attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, int64_t block_size, int64_t window);

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin_signed, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim);
at::Tensor argmax_rows(const at::Tensor& logits);

// quantized_matmul.cpp
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& wq, int64_t qt, const c10::optional<at::Tensor>& bias);
at::Tensor qembedding(const at::Tensor& ids, const at::Tensor& wq, int64_t qt, int64_t K, at::ScalarType dtype);
at::Tensor qdequantize(const at::Tensor& wq, int64_t qt, int64_t K);

// int8_matmul.cpp
bool int8_matmul_available();
at::Tensor qrepack_i8(const at::Tensor& wq, int64_t qt, int64_t K);
at::Tensor qlinear_i8(const at::Tensor& x, const at::Tensor& wp, int64_t qt, const c10::optional<at::Tensor>& bias);
at::Tensor qembedding_i8(const at::Tensor& ids, const at::Tensor& wp, int64_t qt, int64_t K, at::ScalarType dtype);

// dense_matmul.cpp
at::Tensor pack_bf16_weight(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const c10::optional<at::Tensor>& bias);

// lora.cpp
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& slots, const at::Tensor& scales, const at::Tensor& bounds);

// threads.cpp
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus);

// decoder_stack.cpp: the decoder layers of a Llama-family model whose every matmul runs on a
// quantized kernel, held once (8 tensors a layer: input norm, qkv, qkv bias or empty, o, o
// bias or empty, post-attention norm, gate_up, down; a ggml type and int8-or-exact for each of
// the 4 matmuls) and run as the Python forward runs them (models/llama.py), call for call.
class DecoderStack {
 public:
  DecoderStack(std::vector<at::Tensor> weights, std::vector<int64_t> qtypes, std::vector<int64_t> int8,
               at::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale);
  // embeddings [T, hidden] -> the final norm's output [T, hidden]; caches: each layer's K then V
  // cache; the rest is CpuKernelAttention's step metadata (every row attends as a decode)
  at::Tensor forward(const at::Tensor& embeddings, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin_signed, const std::vector<at::Tensor>& caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t block_size, int64_t window) const;
  int64_t num_layers() const { return layers_; }

 private:
  at::Tensor matmul(int64_t layer, int64_t which, const at::Tensor& x) const;
  std::vector<at::Tensor> weights_;
  std::vector<int64_t> qtypes_;
  std::vector<int64_t> int8_;
  at::Tensor final_norm_;
  int64_t layers_ = 0, num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace tessera
