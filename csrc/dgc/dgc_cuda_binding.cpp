// Torch binding of the CUDA kernels in dgc_cuda.cu (module dgc_cuda_op). Shapes and dtypes are
// checked here; the Python side (deepspeed_dgc/codec/kernels.py, FusedCUDAOps) does the rest. The caller
// passes the CUDA stream as an integer (torch.cuda.current_stream().cuda_stream), so this file needs
// no c10/cuda header and compiles (syntax check in the tests) against a CPU-only torch too.
#include <torch/csrc/utils/pybind.h>  // pybind11 and the Tensor casters: half the compile of torch/python.h, a third of torch/extension.h's
#include <ATen/ops/empty.h>

#include <cuda_runtime.h>

#include <string>

extern "C" cudaError_t dgc_cuda_accumulate(float* acc_m, int64_t acc_cols, int64_t col, const void* src, int dtype,
                                           int64_t offset, int64_t stride, int64_t n, int64_t c, const int64_t* owners,
                                           int64_t rows, const float* residual, float divisor, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_dequant_add(float* out, const int64_t* pos, const uint8_t* packed, const float* scales,
                                            const int64_t* gid, int64_t k, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_values_decode_add(float* out, const int64_t* pos, const uint8_t* packed,
                                                  const float* scales, const int64_t* gid, const bool* nonzero,
                                                  int64_t k, int fmt, cudaStream_t stream);
// dgc_cuda_fixed.cu
extern "C" cudaError_t dgc_cuda_owner_gather(void* out, int out_dtype, int64_t rows, int64_t columns,
                                             const int64_t* table, int tensors, const int64_t* row_base, int dtype,
                                             float divisor, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_fixed_encode(void* A, int A_dtype, int64_t rows, int64_t C, int64_t Cd,
                                             const void* slots, int64_t Ks, const int32_t* flat,
                                             const int32_t* padding, uint8_t* payload, int64_t P, int64_t scales_at,
                                             int64_t values_at, int fmt, int group, int span, int64_t K, int64_t Kp,
                                             cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_fixed_decode(const uint8_t* received, int64_t senders, int64_t P, int64_t scales_at,
                                             int64_t values_at, int fmt, int group, int64_t Cd, int64_t Ks,
                                             const int32_t* cols, const bool* valid, float* D, int64_t Cs, float* out,
                                             cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_weights_encode_seg(const float* x, int64_t n, const int64_t* seg, int S,
                                                   int64_t group, int64_t n_groups, int wfmt, float* scales,
                                                   uint8_t* codes, cudaStream_t stream);
extern "C" cudaError_t dgc_cuda_weights_decode_seg(const uint8_t* codes, const float* scales, int64_t n,
                                                   const int64_t* seg, int S, int64_t group, int wfmt, void* out,
                                                   int dtype, cudaStream_t stream);

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

int dtype_code(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? 0 : t.scalar_type() == at::kBFloat16 ? 1 : t.scalar_type() == at::kHalf ? 2 : -1;
}

// An owner matrix's dtype: 0 fp32, 1 bf16 (fixed.matrix_dtype), else -1.
int matrix_code(const at::Tensor& t) {
  const int code = dtype_code(t);
  return code <= 1 ? code : -1;
}

// The fixed layout (dgc_cuda_fixed.cu). table: int64 (T, 4) of (source pointer, c, n, first column), column order;
// row_base: int64 (2, R), the chunk each row reads (its owner's, or the row's) and its owner; all sources of dtype
// `src_dtype_like`.
void owner_gather(at::Tensor out, at::Tensor table, at::Tensor row_base, at::Tensor src_dtype_like, double divisor,
                  int64_t stream) {
  check_cuda(out, "out");
  check_cuda(table, "table");
  check_cuda(row_base, "row_base");
  const int out_dtype = matrix_code(out);
  TORCH_CHECK(out_dtype >= 0 && out.dim() == 2, "owner_gather: out must be 2-D fp32 or bf16");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 4 && table.size(0) > 0,
              "owner_gather: table must be int64 (T, 4)");
  TORCH_CHECK(row_base.scalar_type() == at::kLong && row_base.numel() == 2 * out.size(0),
              "owner_gather: row_base must be int64 (2, R): each row's chunk to read and its owner");
  const int dtype = dtype_code(src_dtype_like);
  TORCH_CHECK(dtype >= 0, "owner_gather: unsupported source dtype ", src_dtype_like.scalar_type());
  check(dgc_cuda_owner_gather(out.data_ptr(), out_dtype, out.size(0), out.size(1), table.data_ptr<int64_t>(),
                              static_cast<int>(table.size(0)), row_base.data_ptr<int64_t>(), dtype,
                              static_cast<float>(divisor), reinterpret_cast<cudaStream_t>(stream)),
        "owner_gather");
}

// A (R, C) fp32 or bf16 owner matrix, the whole-sent columns [0, Cd); slots (R, Ks) of A's dtype and flat (R, Ks) int32
// (-1: empty) or empty tensors; padding int32 per whole-sent group (INT2) or empty; payload (R, P) uint8.
void fixed_encode(at::Tensor A, int64_t Cd, at::Tensor slots, at::Tensor flat, at::Tensor padding, at::Tensor payload,
                  int64_t scales_at, int64_t values_at, int64_t fmt, int64_t group, int64_t span, int64_t K, int64_t Kp,
                  int64_t stream) {
  check_cuda(A, "A");
  check_cuda(payload, "payload");
  const int A_dtype = matrix_code(A);
  TORCH_CHECK(A_dtype >= 0 && A.dim() == 2 && payload.dim() == 2 && payload.size(0) == A.size(0) &&
                  payload.scalar_type() == at::kByte,
              "fixed_encode: fp32 or bf16 (R, C) owner matrix, uint8 (R, P) payload");
  const int64_t Ks = slots.numel() ? slots.size(1) : 0;
  if (Ks) {
    check_cuda(slots, "slots");
    check_cuda(flat, "flat");
    TORCH_CHECK(slots.scalar_type() == A.scalar_type() && flat.scalar_type() == at::kInt &&
                    flat.sizes() == slots.sizes() && slots.size(0) == A.size(0),
                "fixed_encode: slots of the owner matrix's dtype and int32 flat, (R, Ks) each");
  }
  const int32_t* pad = nullptr;
  if (padding.numel()) {
    check_cuda(padding, "padding");
    TORCH_CHECK(padding.scalar_type() == at::kInt, "fixed_encode: int32 padding");
    pad = padding.data_ptr<int32_t>();
  }
  TORCH_CHECK(Cd + Ks == K && Kp >= K && Cd <= A.size(1), "fixed_encode: sizes do not add up");
  check(dgc_cuda_fixed_encode(A.data_ptr(), A_dtype, A.size(0), A.size(1), Cd, Ks ? slots.data_ptr() : nullptr, Ks,
                              Ks ? flat.data_ptr<int32_t>() : nullptr, pad, payload.data_ptr<uint8_t>(),
                              payload.size(1), scales_at, values_at, static_cast<int>(fmt), static_cast<int>(group),
                              static_cast<int>(span), K, Kp, reinterpret_cast<cudaStream_t>(stream)),
        "fixed_encode");
}

// received (W, P) uint8; cols (W, Ks) int32 columns in the sparse region and valid (W, Ks) bool, or empty; D (W, Cs)
// fp32 scratch; out (Cd + Cs,) fp32.
void fixed_decode(at::Tensor received, int64_t scales_at, int64_t values_at, int64_t fmt, int64_t group, int64_t Cd,
                  at::Tensor cols, at::Tensor valid, at::Tensor D, at::Tensor out, int64_t stream) {
  check_cuda(received, "received");
  check_cuda(out, "out");
  TORCH_CHECK(received.scalar_type() == at::kByte && received.dim() == 2, "fixed_decode: uint8 (W, P) payloads");
  const int64_t Ks = cols.numel() ? cols.size(1) : 0, Cs = D.numel() ? D.size(1) : 0;
  if (Ks) {
    check_cuda(cols, "cols");
    check_cuda(valid, "valid");
    check_cuda(D, "D");
    TORCH_CHECK(cols.scalar_type() == at::kInt && valid.scalar_type() == at::kBool && valid.sizes() == cols.sizes() &&
                    D.scalar_type() == at::kFloat && D.size(0) == received.size(0), "fixed_decode: cols, valid, D");
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.numel() >= Cd + Cs, "fixed_decode: fp32 out of Cd + Cs");
  check(dgc_cuda_fixed_decode(received.data_ptr<uint8_t>(), received.size(0), received.size(1), scales_at, values_at,
                              static_cast<int>(fmt), static_cast<int>(group), Cd, Ks,
                              Ks ? cols.data_ptr<int32_t>() : nullptr, Ks ? valid.data_ptr<bool>() : nullptr,
                              Ks ? D.data_ptr<float>() : nullptr, Cs, out.data_ptr<float>(),
                              reinterpret_cast<cudaStream_t>(stream)),
        "fixed_decode");
}

// Weights whose groups restart at each segment: seg int64 (S, 2) = (first element, first group). Returns unpacked
// codes uint8 (n,) and writes scales (n_groups,).
at::Tensor weights_encode_seg(at::Tensor x, at::Tensor seg, int64_t group, at::Tensor scales, int64_t wfmt,
                              int64_t stream) {
  check_cuda(x, "x");
  check_cuda(seg, "seg");
  check_cuda(scales, "scales");
  TORCH_CHECK(x.scalar_type() == at::kFloat && scales.scalar_type() == at::kFloat && seg.scalar_type() == at::kLong &&
                  seg.dim() == 2 && seg.size(1) == 2 && seg.size(0) > 0, "weights_encode_seg: fp32 x, int64 (S, 2) seg");
  at::Tensor codes = at::empty({x.numel()}, x.options().dtype(at::kByte));
  check(dgc_cuda_weights_encode_seg(x.data_ptr<float>(), x.numel(), seg.data_ptr<int64_t>(),
                                    static_cast<int>(seg.size(0)), group, scales.numel(), static_cast<int>(wfmt),
                                    scales.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                    reinterpret_cast<cudaStream_t>(stream)),
        "weights_encode_seg");
  return codes;
}

void weights_decode_seg(at::Tensor codes, at::Tensor scales, at::Tensor seg, int64_t group, at::Tensor out,
                        int64_t wfmt, int64_t stream) {
  check_cuda(codes, "codes");
  check_cuda(scales, "scales");
  check_cuda(seg, "seg");
  check_cuda(out, "out");
  const int dtype = dtype_code(out);
  TORCH_CHECK(dtype >= 0, "weights_decode_seg: unsupported output dtype ", out.scalar_type());
  TORCH_CHECK(seg.scalar_type() == at::kLong && seg.dim() == 2 && seg.size(1) == 2 && seg.size(0) > 0,
              "weights_decode_seg: int64 (S, 2) seg");
  check(dgc_cuda_weights_decode_seg(codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.numel(),
                                    seg.data_ptr<int64_t>(), static_cast<int>(seg.size(0)), group,
                                    static_cast<int>(wfmt), out.data_ptr(), dtype,
                                    reinterpret_cast<cudaStream_t>(stream)),
        "weights_decode_seg");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed_dgc CUDA kernels (accumulate, value and weight codes, decode; the fixed layout's bucket stages)";
  // the calling convention of these functions; op_builder/dgc.py rebuilds a prebuilt module of another one
  m.attr("ABI") = 3;
  m.def("owner_gather", &owner_gather, "a bucket's owner matrix from its tensors, divided, in one launch");
  m.def("fixed_encode", &fixed_encode, "every scale group's scale, codes packed into the payload, residual in place");
  m.def("fixed_decode", &fixed_decode, "every sender's payload decoded and summed in rank order into this row");
  m.def("weights_encode_seg", &weights_encode_seg, "weight scales and codes, groups restarting at each segment");
  m.def("weights_decode_seg", &weights_decode_seg, "weights decoded, groups restarting at each segment");
  m.def("accumulate", &accumulate, "acc = src / divisor + residual into an owner matrix");
  m.def("dequant_add", &dequant_add, "scatter-add dequantized INT4 values into a dense fp32 row");
  m.def("values_decode_add", &values_decode_add, "scatter-add decoded values of any format into a dense fp32 row");
}
