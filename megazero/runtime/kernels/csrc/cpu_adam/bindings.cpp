// Thin torch layer over the CPU Adam kernel: checks tensors and registers torch.ops.megazero_cpu_adam.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "cpu_adam.h"

namespace {

using megazero::cpu_adam::Buffers;
using megazero::cpu_adam::DType;
using megazero::cpu_adam::Isa;

// How an argument is named in messages: "grad" in the single-tensor op (index < 0), "grads[3]" in the list op.
// Streamed only when a check fails, so the checks of a long list build no strings.
struct Name {
  const char* singular;
  const char* plural;
  int64_t index;
};

std::ostream& operator<<(std::ostream& out, const Name& name) {
  if (name.index < 0) return out << name.singular;
  return out << name.plural << "[" << name.index << "]";
}

DType dtype_of(const at::Tensor& t, const char* op, const Name& name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "megazero cpu ", op, ": ", name, " has dtype ", t.scalar_type(),
                  "; valid: float32, bfloat16, float16");
  }
}

void check_buffer(const at::Tensor& t, const char* op, const Name& name, int64_t numel, const Name& param_name) {
  TORCH_CHECK(t.device().is_cpu(), "megazero cpu ", op, ": ", name, " is on ", t.device(), "; expected cpu");
  TORCH_CHECK(t.is_contiguous(), "megazero cpu ", op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "megazero cpu ", op, ": ", name, " has ", t.numel(), " elements but ", param_name,
              " has ", numel);
}

Isa isa_of(int64_t isa, const char* op) {
  TORCH_CHECK(isa >= -1 && isa <= 2, "megazero cpu ", op, ": isa=", isa,
              "; valid: -1 (auto), 0 (scalar), 1 (avx2), 2 (avx512)");
  const Isa chosen = static_cast<Isa>(isa);
  TORCH_CHECK(megazero::cpu_adam::isa_supported(chosen), "megazero cpu ", op, ": this CPU does not support ",
              megazero::cpu_adam::isa_name(chosen), "; best available is ",
              megazero::cpu_adam::isa_name(megazero::cpu_adam::best_isa()));
  return chosen;
}

// The checked buffers of one tensor (entry `index` of the lists, or the single-tensor op's when index < 0).
Buffers buffers_of(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const at::Tensor* param_copy, const char* op, int64_t index) {
  const int64_t n = param.numel();
  const Name param_name{"param", "params", index};
  TORCH_CHECK(param.scalar_type() == at::kFloat, "megazero cpu ", op, ": ", param_name, " has dtype ",
              param.scalar_type(), "; expected float32");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat, "megazero cpu ", op,
              ": ", Name{"exp_avg", "exp_avgs", index}, " and ", Name{"exp_avg_sq", "exp_avg_sqs", index},
              " must be float32");
  check_buffer(param, op, param_name, n, param_name);
  check_buffer(grad, op, Name{"grad", "grads", index}, n, param_name);
  check_buffer(exp_avg, op, Name{"exp_avg", "exp_avgs", index}, n, param_name);
  check_buffer(exp_avg_sq, op, Name{"exp_avg_sq", "exp_avg_sqs", index}, n, param_name);
  Buffers b{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
            nullptr, n, dtype_of(grad, op, Name{"grad", "grads", index}), DType::kNone};
  if (param_copy != nullptr) {
    const Name copy_name{"param_copy", "param_copies", index};
    check_buffer(*param_copy, op, copy_name, n, param_name);
    b.copy_dtype = dtype_of(*param_copy, op, copy_name);
    TORCH_CHECK(b.copy_dtype != DType::kFloat32, "megazero cpu ", op, ": ", copy_name,
                " must be bfloat16 or float16");
    b.param_copy = param_copy->data_ptr();
  }
  return b;
}

std::string adam_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                      const std::optional<at::Tensor>& param_copy, double lr, double beta1, double beta2,
                      double eps, double weight_decay, int64_t step, bool adamw_mode, bool bias_correction,
                      bool maximize, int64_t isa) {
  const char* op = "adam_step";
  TORCH_CHECK(step >= 1, "megazero cpu adam_step: step=", step, "; expected >= 1");
  const Buffers b = buffers_of(param, grad, exp_avg, exp_avg_sq, param_copy.has_value() ? &*param_copy : nullptr,
                               op, -1);
  const megazero::AdamCoeffs c = megazero::make_adam_coeffs(lr, beta1, beta2, eps, weight_decay, step,
                                                            adamw_mode, bias_correction, maximize);
  return megazero::cpu_adam::isa_name(megazero::cpu_adam::adam_step(b, c, isa_of(isa, op), at::get_num_threads()));
}

// A per-tensor value list: one value per tensor, or one shared by all of them.
void check_values(c10::ArrayRef<double> values, const char* name, size_t n) {
  TORCH_CHECK(values.size() == n || values.size() == 1, "megazero cpu multi_tensor_adam: ", name, " has ",
              values.size(), " values; expected ", n, " (one per tensor) or 1 (shared by all)");
}

double value_at(c10::ArrayRef<double> values, size_t i) { return values.size() == 1 ? values[0] : values[i]; }

void check_list(at::TensorList list, const char* name, size_t n) {
  TORCH_CHECK(list.size() == n, "megazero cpu multi_tensor_adam: ", name, " has ", list.size(),
              " tensors, params has ", n);
}

// Adam over lists of tensors in one parallel region, tensor i with lr[i] and weight_decay[i] (or the one value
// given); param_copies is empty (no copies) or one bf16/fp16 tensor per param.
std::string multi_tensor_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList param_copies, c10::ArrayRef<double> lr,
                              double beta1, double beta2, double eps, c10::ArrayRef<double> weight_decay,
                              int64_t step, bool adamw_mode, bool bias_correction, bool maximize, int64_t isa) {
  const char* op = "multi_tensor_adam";
  const size_t n = params.size();
  TORCH_CHECK(step >= 1, "megazero cpu multi_tensor_adam: step=", step, "; expected >= 1");
  check_list(grads, "grads", n);
  check_list(exp_avgs, "exp_avgs", n);
  check_list(exp_avg_sqs, "exp_avg_sqs", n);
  if (!param_copies.empty()) check_list(param_copies, "param_copies", n);
  check_values(lr, "lr", n);
  check_values(weight_decay, "weight_decay", n);
  const Isa chosen = isa_of(isa, op);
  std::vector<Buffers> buffers;
  std::vector<megazero::AdamCoeffs> coeffs;
  buffers.reserve(n);
  coeffs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    buffers.push_back(buffers_of(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                                 param_copies.empty() ? nullptr : &param_copies[i], op, static_cast<int64_t>(i)));
    coeffs.push_back(megazero::make_adam_coeffs(value_at(lr, i), beta1, beta2, eps, value_at(weight_decay, i), step,
                                                adamw_mode, bias_correction, maximize));
  }
  return megazero::cpu_adam::isa_name(megazero::cpu_adam::adam_step_multi(
      buffers.data(), coeffs.data(), static_cast<int64_t>(n), chosen, at::get_num_threads()));
}

std::string best_isa() { return megazero::cpu_adam::isa_name(megazero::cpu_adam::best_isa()); }

}  // namespace

TORCH_LIBRARY(megazero_cpu_adam, m) {
  m.def(
      "adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_copy, float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool adamw_mode, bool bias_correction, bool maximize, int isa) -> str",
      &adam_step);
  m.def(
      "multi_tensor_adam(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] param_copies, float[] lr, float beta1, float beta2, float eps, float[] weight_decay, int step, "
      "bool adamw_mode, bool bias_correction, bool maximize, int isa) -> str",
      &multi_tensor_adam);
  m.def("best_isa() -> str", &best_isa);
}
