// Thin torch layer over the CPU Adam kernel: checks tensors and registers torch.ops.megazero_cpu_adam.*.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "cpu_adam.h"

namespace {

using megazero::cpu_adam::Buffers;
using megazero::cpu_adam::DType;
using megazero::cpu_adam::Isa;

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "megazero cpu adam_step: ", name, " has dtype ", t.scalar_type(),
                  "; valid: float32, bfloat16, float16");
  }
}

void check_buffer(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "megazero cpu adam_step: ", name, " is on ", t.device(), "; expected cpu");
  TORCH_CHECK(t.is_contiguous(), "megazero cpu adam_step: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "megazero cpu adam_step: ", name, " has ", t.numel(),
              " elements but param has ", numel);
}

Isa isa_of(int64_t isa) {
  TORCH_CHECK(isa >= -1 && isa <= 2, "megazero cpu adam_step: isa=", isa,
              "; valid: -1 (auto), 0 (scalar), 1 (avx2), 2 (avx512)");
  const Isa chosen = static_cast<Isa>(isa);
  TORCH_CHECK(megazero::cpu_adam::isa_supported(chosen), "megazero cpu adam_step: this CPU does not support ",
              megazero::cpu_adam::isa_name(chosen), "; best available is ",
              megazero::cpu_adam::isa_name(megazero::cpu_adam::best_isa()));
  return chosen;
}

std::string adam_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                      const std::optional<at::Tensor>& param_copy, double lr, double beta1, double beta2,
                      double eps, double weight_decay, int64_t step, bool adamw_mode, bool bias_correction,
                      bool maximize, int64_t isa) {
  const int64_t n = param.numel();
  TORCH_CHECK(param.scalar_type() == at::kFloat, "megazero cpu adam_step: param has dtype ", param.scalar_type(),
              "; expected float32");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "megazero cpu adam_step: exp_avg and exp_avg_sq must be float32");
  TORCH_CHECK(step >= 1, "megazero cpu adam_step: step=", step, "; expected >= 1");
  check_buffer(param, "param", n);
  check_buffer(grad, "grad", n);
  check_buffer(exp_avg, "exp_avg", n);
  check_buffer(exp_avg_sq, "exp_avg_sq", n);
  Buffers b{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
            nullptr, n, dtype_of(grad, "grad"), DType::kNone};
  if (param_copy.has_value()) {
    check_buffer(*param_copy, "param_copy", n);
    b.copy_dtype = dtype_of(*param_copy, "param_copy");
    TORCH_CHECK(b.copy_dtype != DType::kFloat32, "megazero cpu adam_step: param_copy must be bfloat16 or float16");
    b.param_copy = param_copy->data_ptr();
  }
  const megazero::AdamCoeffs c = megazero::make_adam_coeffs(lr, beta1, beta2, eps, weight_decay, step,
                                                            adamw_mode, bias_correction, maximize);
  return megazero::cpu_adam::isa_name(megazero::cpu_adam::adam_step(b, c, isa_of(isa), at::get_num_threads()));
}

std::string best_isa() { return megazero::cpu_adam::isa_name(megazero::cpu_adam::best_isa()); }

}  // namespace

TORCH_LIBRARY(megazero_cpu_adam, m) {
  m.def(
      "adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_copy, float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool adamw_mode, bool bias_correction, bool maximize, int isa) -> str",
      &adam_step);
  m.def("best_isa() -> str", &best_isa);
}
