// Fused CPU kernels of deepspeed_dgc (OpenMP), the Python module; the stages' files are listed in cpu_common.h. The PyTorch reference in
// deepspeed_dgc/codec/reference.py is the oracle: for the same inputs and sample these functions give
// the same selection, the same payload bytes and the same residual bits.
//
// compress_bucket: one read of every gradient and residual element and one write of the new
//   residual (residual += grad, threshold compare, compaction of the kept elements; a tensor sent
//   whole is coded in the same pass); then, on the kept elements only (about density * n), group
//   scales, codes, bit packing, varint index gaps, the payload of every owner row and the residual's
//   quantization error.
// decode_add: parse one payload body and scatter-add its dequantized values into a dense
//   fp32 partition.
// topk_threshold: DGC's sampled top-k threshold (Lin et al., ICLR 2018, section 3 and appendix).
#include <torch/csrc/utils/pybind.h>  // pybind11 and the Tensor casters: half the compile of torch/python.h, a third of torch/extension.h's

#include "cpu_common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed_dgc fused CPU kernels (compress_bucket, decode_add, quantize_weights, dequantize_weights, topk_threshold)";
  // the calling convention of these functions; op_builder/dgc.py rebuilds a prebuilt module of another one
  m.attr("ABI") = 4;
  m.def("compress_bucket", &dgc_cpu::compress_bucket, "fused residual add, top-k selection, quantize (any value format) and pack per owner row",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_add", &dgc_cpu::decode_add, "decode one payload body and scatter-add it into a dense fp32 partition",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_weights", &dgc_cpu::quantize_weights, "group-wise absmax INT8/FP8/INT4 codes and scales of a weight shard",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_weights", &dgc_cpu::dequantize_weights, "decode a weight shard's codes into a float tensor in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("topk_threshold", &dgc_cpu::topk_threshold, "DGC's sampled top-k threshold of a 1-D fp32 magnitude tensor",
        py::call_guard<py::gil_scoped_release>());
  m.def("release_residual_cache", &dgc_cpu::release_residual_cache,
        "free the residual buffers of 32 MB or more kept for reuse; returns their bytes");
  m.def("avx2_paths", &dgc_cpu::avx2_paths);  // whether the hand-written AVX2 passes run here
  m.def("simd_info", []() {  // the widest vectors the element passes run with here
#if defined(__AVX512F__)
    return std::string("avx512");
#elif defined(__AVX2__)
    return std::string("avx2");
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    return std::string(__builtin_cpu_supports("avx2") ? "avx2 (target_clones)" : "baseline (target_clones)");
#else
    return std::string("baseline");
#endif
  });
}
