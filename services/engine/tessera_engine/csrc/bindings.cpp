// tessera's CPU kernels: the Python module, one function per kernel (declared in
// cpu_kernels.h, defined in the family's file).
#include <torch/extension.h>

#include "cpu_kernels.h"

using namespace tessera;

// Every kernel runs without the GIL, as torch's own ops do: the engine service's gRPC
// thread (taking in requests, sending the last step's outputs) runs while the core
// thread is inside a kernel instead of waiting for it. Arguments are converted before
// the GIL is released and results after it is taken back; no kernel touches a Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, "paged attention for single-token decodes",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("block_size"),
        pybind11::arg("window") = 0, nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up projection", nogil);
  m.def("rope_and_cache_", &rope_and_cache_, "rotary on q and k in place; k and v written to the cache", nogil);
  m.def("qlinear", &qlinear, "x W^T (+ bias), W block-quantized (GGUF Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)", nogil);
  m.def("qembedding", &qembedding, "rows of a block-quantized embedding table", nogil);
  m.def("qdequantize", &qdequantize, "a block-quantized weight as float32", nogil);
  m.def("int8_matmul_available", &int8_matmul_available, "whether qlinear_i8 runs on this build (AVX512-VNNI)");
  m.def("qrepack_i8", &qrepack_i8, "a Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weight in qlinear_i8's layout", nogil);
  m.def("qlinear_i8", &qlinear_i8, "x W^T (+ bias) on int8 dot products, W repacked by qrepack_i8", nogil);
  m.def("qembedding_i8", &qembedding_i8, "rows of a table repacked by qrepack_i8, exactly dequantized", nogil);
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum", nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; RMSNorm(residual)", nogil);
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bfloat16 [N, K] weight in linear_bf16's layout", nogil);
  m.def("linear_bf16", &linear_bf16, "x W^T (+ bias) in bfloat16 on oneDNN's brgemm micro-kernel",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(), nogil);
  m.def("lora_add", &lora_add, "y += scale * (x A^T) B^T per row's adapter slot, in place (batched LoRA)",
        pybind11::arg("y"), pybind11::arg("x"), pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("slots"),
        pybind11::arg("scales"), pybind11::arg("bounds"), nogil);
  // module_local: each variant's module (cpu_kernels.py may load several in one process) its own type
  pybind11::class_<DecoderStack>(m, "DecoderStack", pybind11::module_local(),
                                 "a Llama-family model's decoder layers in one call")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, at::Tensor, int64_t,
                          int64_t, int64_t, double, double>(),
           pybind11::arg("weights"), pybind11::arg("qtypes"), pybind11::arg("int8"), pybind11::arg("final_norm"),
           pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("scale"))
      .def("forward", &DecoderStack::forward, nogil)
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
  m.def("bind_threads", &bind_threads, "each thread of the calling thread's team bound to one CPU", nogil);
}
