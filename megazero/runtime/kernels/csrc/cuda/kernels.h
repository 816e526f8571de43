// Raw-pointer launchers of megazero's CUDA kernels. No torch headers: the .cu files that define these compile
// with plain nvcc; bindings.cpp is the thin torch layer. Every launcher enqueues on `stream` and returns the
// launch status (cudaGetLastError) without synchronising.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megazero/adam_math.h"

namespace megazero {
namespace cuda {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = 3 };

// ---- LayerNorm / RMSNorm over a (rows, cols) matrix; statistics in fp32 -------------------------------------
// x, y, dy, dx: x_dtype. weight, bias, dweight, dbias: w_dtype (x_dtype or kFloat32). mean, rstd: float[rows];
// mean is unused (may be null) when rms. bias/dbias may be null. LayerNorm: y = (x - mean) * rstd * w + b with
// rstd = 1 / sqrt(var + eps) (biased variance); RMSNorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps).
cudaError_t norm_forward(const void* x, const void* weight, const void* bias, void* y, float* mean, float* rstd,
                         int64_t rows, int64_t cols, float eps, bool rms, DType x_dtype, DType w_dtype,
                         cudaStream_t stream);

// Floats of scratch memory norm_backward needs for (rows, cols).
int64_t norm_backward_workspace(int64_t rows, int64_t cols);

cudaError_t norm_backward(const void* dy, const void* x, const void* weight, const float* mean, const float* rstd,
                          void* dx, void* dweight, void* dbias, float* workspace, int64_t rows, int64_t cols,
                          bool rms, DType x_dtype, DType w_dtype, cudaStream_t stream);

// ---- Scaled masked softmax (Megatron's fused ops) ----------------------------------------------------------
// x, y: (batches, heads, sq, sk) contiguous. Row r = ((b * heads) + h) * sq + i.
// Masked (causal == false): z = mask[b', 0, i, j] ? -10000 : scale * x, with b' = b, or 0 when mask_batches == 1;
//   mask is (mask_batches, 1, sq, sk) bytes (non-zero = masked) or null for no mask.
// Causal (causal == true, mask ignored): z = j > i ? -inf : scale * x.
// y = softmax(z) along sk, computed in fp32. Backward: dx = masked ? 0 : scale * y * (dy - sum_j(dy * y));
// dx may alias dy.
struct SoftmaxShape {
  int64_t batches, heads, sq, sk, mask_batches;
  float scale;
  bool causal;
};

cudaError_t softmax_forward(const void* x, const uint8_t* mask, void* y, const SoftmaxShape& shape, DType dtype,
                            cudaStream_t stream);
cudaError_t softmax_backward(const void* dy, const void* y, const uint8_t* mask, void* dx,
                             const SoftmaxShape& shape, DType dtype, cudaStream_t stream);

// ---- Multi-tensor Adam: one launch over a list of tensors -------------------------------------------------
// Each tensor is cut into chunks of kAdamChunk elements; block k works on chunks k, k + gridDim.x, ...
// Both tables live in device memory. Each tensor carries its own step constants (its own lr and weight decay:
// e.g. the decay and no-decay parameters of one shard in one launch). The update is adam_element (adam_math.h),
// bit-identical to the CPU kernel.
struct AdamTensor {
  float* param;
  const void* grad;      // grad_dtype
  float* exp_avg;
  float* exp_avg_sq;
  void* param_copy;      // copy_dtype, null when copy_dtype == kNone
  int64_t numel;
  AdamCoeffs coeffs;     // make_adam_coeffs(lr, ..., weight_decay, ...) of this tensor
};
// The host builds the tables in a buffer of int64 words.
static_assert(sizeof(AdamTensor) % sizeof(int64_t) == 0, "AdamTensor must be a whole number of int64 words");

struct AdamChunk {
  int64_t tensor;  // index into the tensor table
  int64_t start;   // first element of the chunk
};

constexpr int64_t kAdamChunk = 65536;

inline int64_t adam_chunks(int64_t numel) { return (numel + kAdamChunk - 1) / kAdamChunk; }

cudaError_t multi_tensor_adam(const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks,
                              DType grad_dtype, DType copy_dtype, cudaStream_t stream);

}  // namespace cuda
}  // namespace megazero
