// Torch binding of the CUDA kernels in dgc_cuda.cu (module dgc_cuda_op). Shapes and dtypes are
// checked here; the Python side (deepspeed_dgc/codec/kernels.py, FusedCUDAOps) does the rest. The caller
// passes the CUDA stream as an integer (torch.cuda.current_stream().cuda_stream), so this file needs
// no c10/cuda header and compiles (syntax check in the tests) against a CPU-only torch too.
#include <torch/extension.h>

#include <cuda_runtime.h>

#include <string>

extern "C" cudaError_t dgc_cuda_accumulate(float* acc_m, int64_t acc_cols, int64_t col, const void* src, int dtype,
                                           int64_t offset, int64_t stride, int64_t n, int64_t c, const int64_t* owners,
                                           int64_t rows, const float* residual, float divisor, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_int4_encode(const float* vals, const float* scales, const int64_t* gid, int64_t k,
                                            uint8_t* nibbles, float* decoded, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_dequant_add(float* out, const int64_t* pos, const uint8_t* packed, const float* scales,
                                            const int64_t* gid, int64_t k, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_values_encode(const float* vals, const float* scales, const int64_t* gid, int64_t k,
                                              int fmt, uint8_t* codes, float* decoded, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_values_decode_add(float* out, const int64_t* pos, const uint8_t* packed,
                                                  const float* scales, const int64_t* gid, const bool* nonzero,
                                                  int64_t k, int fmt, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_weights_encode(const float* x, const float* scales, const int64_t* gid, int64_t n,
                                               int wfmt, uint8_t* codes, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_weights_decode(const uint8_t* codes, const float* scales, const int64_t* gid,
                                               int64_t n, int wfmt, void* out, int dtype, cudaStream_t stream);

namespace {

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "dgc_cuda_op ", what, ": ", cudaGetErrorString(err));
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "dgc_cuda_op: ", name, " must be a contiguous CUDA tensor");
}

}  // namespace

// acc_m (R, C) fp32 gets columns [col, col + c) of one tensor; see dgc_cuda.cu.
void accumulate(at::Tensor acc_m, int64_t col, at::Tensor src, int64_t offset, int64_t stride, int64_t n, int64_t c,
                at::Tensor owners, at::Tensor residual, double divisor, int64_t stream) {
  check_cuda(acc_m, "acc_m");
  check_cuda(src, "src");
  check_cuda(owners, "owners");
  TORCH_CHECK(acc_m.scalar_type() == at::kFloat && acc_m.dim() == 2, "accumulate: acc_m must be 2-D fp32");
  TORCH_CHECK(owners.scalar_type() == at::kLong && owners.numel() == acc_m.size(0), "accumulate: one int64 owner per row");
  int dtype = src.scalar_type() == at::kFloat ? 0 : src.scalar_type() == at::kBFloat16 ? 1 : src.scalar_type() == at::kHalf ? 2 : -1;
  TORCH_CHECK(dtype >= 0, "accumulate: unsupported source dtype ", src.scalar_type());
  const float* res = nullptr;
  if (residual.numel()) {
    check_cuda(residual, "residual");
    TORCH_CHECK(residual.scalar_type() == at::kFloat, "accumulate: residual must be fp32");
    res = residual.data_ptr<float>();
  }
  check(dgc_cuda_accumulate(acc_m.data_ptr<float>(), acc_m.size(1), col, src.data_ptr(), dtype, offset, stride, n, c,
                            owners.data_ptr<int64_t>(), acc_m.size(0), res, static_cast<float>(divisor),
                            reinterpret_cast<cudaStream_t>(stream)),
        "accumulate");
}

// Returns (nibbles uint8 (k,), decoded fp32 (k,)).
std::tuple<at::Tensor, at::Tensor> int4_encode(at::Tensor vals, at::Tensor scales, at::Tensor gid, int64_t stream) {
  check_cuda(vals, "vals");
  check_cuda(scales, "scales");
  check_cuda(gid, "gid");
  at::Tensor nibbles = at::empty({vals.numel()}, vals.options().dtype(at::kByte));
  at::Tensor decoded = at::empty({vals.numel()}, vals.options().dtype(at::kFloat));
  check(dgc_cuda_int4_encode(vals.data_ptr<float>(), scales.data_ptr<float>(), gid.data_ptr<int64_t>(), vals.numel(),
                             nibbles.data_ptr<uint8_t>(), decoded.data_ptr<float>(), reinterpret_cast<cudaStream_t>(stream)),
        "int4_encode");
  return {nibbles, decoded};
}

void dequant_add(at::Tensor out, at::Tensor pos, at::Tensor packed, at::Tensor scales, at::Tensor gid, int64_t stream) {
  check_cuda(out, "out");
  check_cuda(pos, "pos");
  check_cuda(packed, "packed");
  check_cuda(scales, "scales");
  check_cuda(gid, "gid");
  TORCH_CHECK(packed.numel() >= (pos.numel() + 1) / 2, "dequant_add: too few value bytes");
  check(dgc_cuda_dequant_add(out.data_ptr<float>(), pos.data_ptr<int64_t>(), packed.data_ptr<uint8_t>(),
                             scales.data_ptr<float>(), gid.data_ptr<int64_t>(), pos.numel(),
                             reinterpret_cast<cudaStream_t>(stream)),
        "dequant_add");
}

// Returns (codes uint8 (k,), one unpacked code per value; decoded fp32 (k,)). fmt: dgc::ValueFormat.
std::tuple<at::Tensor, at::Tensor> values_encode(at::Tensor vals, at::Tensor scales, at::Tensor gid, int64_t fmt,
                                                 int64_t stream) {
  check_cuda(vals, "vals");
  check_cuda(scales, "scales");
  check_cuda(gid, "gid");
  TORCH_CHECK(vals.scalar_type() == at::kFloat && scales.scalar_type() == at::kFloat && gid.scalar_type() == at::kLong &&
                  gid.numel() == vals.numel(), "values_encode: fp32 values and scales, one int64 group per value");
  at::Tensor codes = at::empty({vals.numel()}, vals.options().dtype(at::kByte));
  at::Tensor decoded = at::empty({vals.numel()}, vals.options().dtype(at::kFloat));
  check(dgc_cuda_values_encode(vals.data_ptr<float>(), scales.data_ptr<float>(), gid.data_ptr<int64_t>(), vals.numel(),
                               static_cast<int>(fmt), codes.data_ptr<uint8_t>(), decoded.data_ptr<float>(),
                               reinterpret_cast<cudaStream_t>(stream)),
        "values_encode");
  return {codes, decoded};
}

// nonzero: bool (k,) (False: the value is exactly 0), or empty for none.
void values_decode_add(at::Tensor out, at::Tensor pos, at::Tensor packed, at::Tensor scales, at::Tensor gid,
                       at::Tensor nonzero, int64_t fmt, int64_t stream) {
  check_cuda(out, "out");
  check_cuda(pos, "pos");
  check_cuda(packed, "packed");
  check_cuda(scales, "scales");
  check_cuda(gid, "gid");
  const int64_t k = pos.numel();
  const int bits = fmt == 0 ? 4 : fmt == 1 ? 2 : fmt == 2 ? 1 : 8;
  TORCH_CHECK(packed.numel() >= (k * bits + 7) / 8, "values_decode_add: too few value bytes");
  TORCH_CHECK(gid.numel() == k, "values_decode_add: one group per position");
  const bool* nz = nullptr;
  if (nonzero.numel()) {
    check_cuda(nonzero, "nonzero");
    TORCH_CHECK(nonzero.scalar_type() == at::kBool && nonzero.numel() == k, "values_decode_add: one bool per value");
    nz = nonzero.data_ptr<bool>();
  }
  check(dgc_cuda_values_decode_add(out.data_ptr<float>(), pos.data_ptr<int64_t>(), packed.data_ptr<uint8_t>(),
                                   scales.data_ptr<float>(), gid.data_ptr<int64_t>(), nz, k, static_cast<int>(fmt),
                                   reinterpret_cast<cudaStream_t>(stream)),
        "values_decode_add");
}

// Returns uint8 (n,), one unpacked code per weight. wfmt: dgc::WeightFormat.
at::Tensor weights_encode(at::Tensor x, at::Tensor scales, at::Tensor gid, int64_t wfmt, int64_t stream) {
  check_cuda(x, "x");
  check_cuda(scales, "scales");
  check_cuda(gid, "gid");
  TORCH_CHECK(x.scalar_type() == at::kFloat && gid.numel() == x.numel(), "weights_encode: fp32 x, one group per weight");
  at::Tensor codes = at::empty({x.numel()}, x.options().dtype(at::kByte));
  check(dgc_cuda_weights_encode(x.data_ptr<float>(), scales.data_ptr<float>(), gid.data_ptr<int64_t>(), x.numel(),
                                static_cast<int>(wfmt), codes.data_ptr<uint8_t>(), reinterpret_cast<cudaStream_t>(stream)),
        "weights_encode");
  return codes;
}

void weights_decode(at::Tensor codes, at::Tensor scales, at::Tensor gid, at::Tensor out, int64_t wfmt, int64_t stream) {
  check_cuda(codes, "codes");
  check_cuda(scales, "scales");
  check_cuda(gid, "gid");
  check_cuda(out, "out");
  int dtype = out.scalar_type() == at::kFloat ? 0 : out.scalar_type() == at::kBFloat16 ? 1 : out.scalar_type() == at::kHalf ? 2 : -1;
  TORCH_CHECK(dtype >= 0, "weights_decode: unsupported output dtype ", out.scalar_type());
  TORCH_CHECK(gid.numel() == out.numel(), "weights_decode: one group per weight");
  check(dgc_cuda_weights_decode(codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), gid.data_ptr<int64_t>(),
                                out.numel(), static_cast<int>(wfmt), out.data_ptr(), dtype,
                                reinterpret_cast<cudaStream_t>(stream)),
        "weights_decode");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed_dgc CUDA kernels (accumulate, value and weight codes, decode)";
  // the calling convention of these functions; op_builder/dgc.py rebuilds a prebuilt module of another one
  m.attr("ABI") = 2;
  m.def("accumulate", &accumulate, "acc = src / divisor + residual into an owner matrix");
  m.def("int4_encode", &int4_encode, "INT4 nibbles and decoded values of kept values");
  m.def("dequant_add", &dequant_add, "scatter-add dequantized INT4 values into a dense fp32 row");
  m.def("values_encode", &values_encode, "codes (unpacked) and decoded values of kept values, any value format");
  m.def("values_decode_add", &values_decode_add, "scatter-add decoded values of any format into a dense fp32 row");
  m.def("weights_encode", &weights_encode, "INT8/FP8/INT4 codes (unpacked) of weights given their group scales");
  m.def("weights_decode", &weights_decode, "weights decoded from their codes into a float tensor");
}
