// Thin torch layer over megazero's CUDA kernels (kernels.h): checks tensors, allocates outputs, launches on the
// current stream, and registers torch.ops.megazero_cuda.*.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

namespace mc = megazero::cuda;

mc::DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return mc::DType::kFloat32;
    case at::kBFloat16: return mc::DType::kBFloat16;
    case at::kHalf: return mc::DType::kFloat16;
    default:
      TORCH_CHECK(false, "megazero_cuda.", op, ": ", name, " has dtype ", t.scalar_type(),
                  "; valid: float32, bfloat16, float16");
  }
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "megazero_cuda.", op, ": ", name, " is on ", t.device(),
              "; expected ", like.device());
  TORCH_CHECK(t.is_contiguous(), "megazero_cuda.", op, ": ", name, " must be contiguous");
}

// ---- norms -----------------------------------------------------------------------------------------------
void check_weight_dtype(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, "megazero_cuda.", op,
              ": weight has dtype ", weight.scalar_type(), "; valid: float32 or x's dtype ", x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias, double eps, bool rms) {
  TORCH_CHECK(x.dim() == 2, "megazero_cuda.norm_fwd: x must be (rows, cols), got ", x.sizes());
  const int64_t rows = x.size(0), cols = x.size(1);
  check_cuda(x, x, "norm_fwd", "x");
  check_cuda(weight, x, "norm_fwd", "weight");
  TORCH_CHECK(weight.numel() == cols, "megazero_cuda.norm_fwd: weight has ", weight.numel(), " elements, x rows have ",
              cols);
  check_weight_dtype(x, weight, "norm_fwd");
  if (bias.has_value()) {
    check_cuda(*bias, x, "norm_fwd", "bias");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->numel() == cols,
                "megazero_cuda.norm_fwd: bias must match weight in dtype and size");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rms ? 0 : rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(mc::norm_forward(x.data_ptr(), weight.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr,
                                  y.data_ptr(), rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows,
                                  cols, static_cast<float>(eps), rms, dtype_of(x, "norm_fwd", "x"),
                                  dtype_of(weight, "norm_fwd", "weight"), c10::cuda::getCurrentCUDAStream()));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& weight, const at::Tensor& mean,
                                                        const at::Tensor& rstd, bool rms, bool has_bias) {
  TORCH_CHECK(x.dim() == 2 && dy.sizes() == x.sizes(), "megazero_cuda.norm_bwd: dy ", dy.sizes(), " and x ",
              x.sizes(), " must be the same (rows, cols)");
  check_cuda(dy, x, "norm_bwd", "dy");
  check_cuda(x, x, "norm_bwd", "x");
  check_cuda(weight, x, "norm_bwd", "weight");
  check_cuda(rstd, x, "norm_bwd", "rstd");
  check_weight_dtype(x, weight, "norm_bwd");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "megazero_cuda.norm_bwd: dy and x must have the same dtype");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(rstd.numel() == rows && (rms || mean.numel() == rows),
              "megazero_cuda.norm_bwd: mean/rstd must have one entry per row");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dw = at::empty_like(weight);
  at::Tensor db = has_bias ? at::empty_like(weight) : at::empty({0}, weight.options());
  at::Tensor ws = at::empty({mc::norm_backward_workspace(rows, cols)}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(mc::norm_backward(dy.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                   rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
                                   dw.data_ptr(), has_bias ? db.data_ptr() : nullptr, ws.data_ptr<float>(), rows, cols,
                                   rms, dtype_of(x, "norm_bwd", "x"), dtype_of(weight, "norm_bwd", "weight"),
                                   c10::cuda::getCurrentCUDAStream()));
  return {dx, dw, db};
}

// ---- softmax -----------------------------------------------------------------------------------------------
mc::SoftmaxShape softmax_shape(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale, bool causal,
                               const char* op) {
  TORCH_CHECK(x.dim() == 4, "megazero_cuda.", op, ": scores must be (batch, heads, sq, sk), got ", x.sizes());
  mc::SoftmaxShape s{x.size(0), x.size(1), x.size(2), x.size(3), 1, static_cast<float>(scale), causal};
  TORCH_CHECK(!causal || s.sq == s.sk, "megazero_cuda.", op, ": causal softmax needs sq == sk, got ", s.sq, " and ",
              s.sk);
  if (mask.has_value() && !causal) {
    check_cuda(*mask, x, op, "mask");
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == at::kByte,
                "megazero_cuda.", op, ": mask must be bool or uint8, got ", mask->scalar_type());
    TORCH_CHECK(mask->dim() == 4 && (mask->size(0) == 1 || mask->size(0) == s.batches) && mask->size(1) == 1 &&
                    mask->size(2) == s.sq && mask->size(3) == s.sk,
                "megazero_cuda.", op, ": mask must be (batch or 1, 1, sq, sk), got ", mask->sizes());
    s.mask_batches = mask->size(0);
  }
  return s;
}

const uint8_t* mask_ptr(const std::optional<at::Tensor>& mask, bool causal) {
  return (mask.has_value() && !causal) ? static_cast<const uint8_t*>(mask->data_ptr()) : nullptr;
}

at::Tensor softmax_fwd(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale, bool causal) {
  check_cuda(x, x, "softmax_fwd", "scores");
  const mc::SoftmaxShape s = softmax_shape(x, mask, scale, causal, "softmax_fwd");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  C10_CUDA_CHECK(mc::softmax_forward(x.data_ptr(), mask_ptr(mask, causal), y.data_ptr(), s,
                                     dtype_of(x, "softmax_fwd", "scores"), c10::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& dy, const at::Tensor& y, const std::optional<at::Tensor>& mask, double scale,
                       bool causal) {
  check_cuda(y, y, "softmax_bwd", "y");
  check_cuda(dy, y, "softmax_bwd", "dy");
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(),
              "megazero_cuda.softmax_bwd: dy and y must match in shape and dtype");
  const mc::SoftmaxShape s = softmax_shape(y, mask, scale, causal, "softmax_bwd");
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor dx = at::empty_like(y);
  C10_CUDA_CHECK(mc::softmax_backward(dy.data_ptr(), y.data_ptr(), mask_ptr(mask, causal), dx.data_ptr(), s,
                                      dtype_of(y, "softmax_bwd", "y"), c10::cuda::getCurrentCUDAStream()));
  return dx;
}

// ---- multi-tensor Adam -----------------------------------------------------------------------------------------
void check_list(const at::TensorList list, const at::TensorList params, const char* name) {
  TORCH_CHECK(list.size() == params.size(), "megazero_cuda.multi_tensor_adam: ", name, " has ", list.size(),
              " tensors, params has ", params.size());
  for (size_t i = 0; i < list.size(); ++i) {
    check_cuda(list[i], params[0], "multi_tensor_adam", name);
    TORCH_CHECK(list[i].numel() == params[i].numel(), "megazero_cuda.multi_tensor_adam: ", name, "[", i, "] has ",
                list[i].numel(), " elements, params[", i, "] has ", params[i].numel());
  }
}

// A per-tensor value list: one value per tensor, or one shared by all of them.
void check_values(c10::ArrayRef<double> values, const char* name, size_t n) {
  TORCH_CHECK(values.size() == n || values.size() == 1, "megazero_cuda.multi_tensor_adam: ", name, " has ",
              values.size(), " values; expected ", n, " (one per tensor) or 1 (shared by all)");
}

double value_at(c10::ArrayRef<double> values, size_t i) { return values.size() == 1 ? values[0] : values[i]; }

// Adam over lists of tensors in one launch, tensor i with lr[i] and weight_decay[i] (or the one value given);
// param_copies is empty (no copies) or one bf16/fp16 tensor per param.
void multi_tensor_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList param_copies, c10::ArrayRef<double> lr,
                       double beta1, double beta2, double eps, c10::ArrayRef<double> weight_decay, int64_t step,
                       bool adamw_mode, bool bias_correction, bool maximize) {
  check_values(lr, "lr", params.size());
  check_values(weight_decay, "weight_decay", params.size());
  if (params.empty()) return;
  TORCH_CHECK(step >= 1, "megazero_cuda.multi_tensor_adam: step=", step, "; expected >= 1");
  check_list(params, params, "params");
  check_list(grads, params, "grads");
  check_list(exp_avgs, params, "exp_avgs");
  check_list(exp_avg_sqs, params, "exp_avg_sqs");
  const bool copies = !param_copies.empty();
  if (copies) check_list(param_copies, params, "param_copies");
  const mc::DType gdt = dtype_of(grads[0], "multi_tensor_adam", "grads");
  const mc::DType cdt = copies ? dtype_of(param_copies[0], "multi_tensor_adam", "param_copies") : mc::DType::kNone;
  TORCH_CHECK(cdt != mc::DType::kFloat32, "megazero_cuda.multi_tensor_adam: param_copies must be bfloat16 or float16");
  const int64_t n = static_cast<int64_t>(params.size());
  int64_t num_chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(params[i].scalar_type() == at::kFloat && exp_avgs[i].scalar_type() == at::kFloat &&
                    exp_avg_sqs[i].scalar_type() == at::kFloat,
                "megazero_cuda.multi_tensor_adam: params, exp_avgs and exp_avg_sqs must be float32 (index ", i, ")");
    TORCH_CHECK(grads[i].scalar_type() == grads[0].scalar_type() &&
                    (!copies || param_copies[i].scalar_type() == param_copies[0].scalar_type()),
                "megazero_cuda.multi_tensor_adam: all grads (and all param_copies) must share one dtype");
    num_chunks += mc::adam_chunks(params[i].numel());
  }
  // Tensor table (with each tensor's step constants) then chunk table, built on the host and copied to the
  // device in one transfer.
  const int64_t tensor_words = n * static_cast<int64_t>(sizeof(mc::AdamTensor) / sizeof(int64_t));
  const int64_t words = tensor_words + num_chunks * static_cast<int64_t>(sizeof(mc::AdamChunk) / sizeof(int64_t));
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* tensors = reinterpret_cast<mc::AdamTensor*>(host.data_ptr<int64_t>());
  auto* chunks = reinterpret_cast<mc::AdamChunk*>(host.data_ptr<int64_t>() + tensor_words);
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    const megazero::AdamCoeffs coeffs =
        megazero::make_adam_coeffs(value_at(lr, static_cast<size_t>(i)), beta1, beta2, eps,
                                   value_at(weight_decay, static_cast<size_t>(i)), step, adamw_mode, bias_correction,
                                   maximize);
    tensors[i] = {params[i].data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                  exp_avg_sqs[i].data_ptr<float>(), copies ? param_copies[i].data_ptr() : nullptr, params[i].numel(),
                  coeffs};
    for (int64_t start = 0; start < params[i].numel(); start += mc::kAdamChunk) chunks[c++] = {i, start};
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  const at::Tensor table = host.to(params[0].device(), /*non_blocking=*/true);
  const auto* table_ptr = table.data_ptr<int64_t>();
  C10_CUDA_CHECK(mc::multi_tensor_adam(reinterpret_cast<const mc::AdamTensor*>(table_ptr),
                                       reinterpret_cast<const mc::AdamChunk*>(table_ptr + tensor_words), num_chunks,
                                       gdt, cdt, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY(megazero_cuda, m) {
  m.def("norm_fwd(Tensor x, Tensor weight, Tensor? bias, float eps, bool rms) -> (Tensor, Tensor, Tensor)");
  m.def("norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor mean, Tensor rstd, bool rms, bool has_bias) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("softmax_fwd(Tensor x, Tensor? mask, float scale, bool causal) -> Tensor");
  m.def("softmax_bwd(Tensor dy, Tensor y, Tensor? mask, float scale, bool causal) -> Tensor");
  m.def("multi_tensor_adam(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] param_copies, float[] lr, float beta1, float beta2, float eps, float[] weight_decay, "
        "int step, bool adamw_mode, bool bias_correction, bool maximize) -> ()");
}

TORCH_LIBRARY_IMPL(megazero_cuda, CUDA, m) {
  m.impl("norm_fwd", &norm_fwd);
  m.impl("norm_bwd", &norm_bwd);
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
  m.impl("multi_tensor_adam", &multi_tensor_adam);
}
