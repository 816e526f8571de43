"""DeepSpeed's optimizer names, for scripts that build them by hand (`from deepspeed.ops.adam import
FusedAdam` becomes `from megazero.ops.adam import FusedAdam`).

Both are `megazero.runtime.kernels.CPUAdam` (a torch.optim.Optimizer over megazero's fused Adam:
the SIMD CPU kernel, the CUDA multi-tensor kernel or the reference twin, whichever applies) with
DeepSpeed's argument names and defaults. Passed to `megazero.initialize(optimizer=...)`, the ZeRO
optimizer takes them over with their parameter groups, as it does torch's Adam and AdamW.
"""
from __future__ import annotations

from megazero.runtime.kernels import CPUAdam


class FusedAdam(CPUAdam):
    """DeepSpeed's FusedAdam: `adam_w_mode=True` is AdamW (decoupled weight decay), False is Adam
    with L2 weight decay; weight_decay defaults to 0 as in DeepSpeed. `set_grad_none` is accepted
    (gradients are always set to None)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adamw_mode=adam_w_mode, bias_correction=bias_correction)


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's CPU Adam (ZeRO-Offload's): `adamw_mode=True` by default, weight_decay 0.
    `fp32_optimizer_states=False` (16-bit moments) is refused: megazero keeps fp32 moments."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): megazero keeps the Adam moments in "
                             "fp32; use fp32_optimizer_states=True")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)
