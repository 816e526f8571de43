"""Adam/AdamW: the functional step the ZeRO optimizer calls on flat fp32 shards, and the CPUAdam optimizer.

Dispatch of ``adam_step`` (a tensor or a list of tensors; ``lr`` and ``weight_decay`` a float or one float per
tensor): CPU tensors -> ONE call of the SIMD C++ multi-tensor kernel (megazero_cpu_adam.multi_tensor_adam: all
tensors in one OpenMP region, chunks taken across tensors, each tensor with its own lr and weight decay); CUDA
tensors -> ONE launch of megazero_cuda.multi_tensor_adam (per-tensor lr and weight decay in its tensor table),
else apex's amp_C.multi_tensor_adam once per distinct (lr, weight_decay) pair, else torch's fused Adam
(torch._fused_adamw_ / _fused_adam_, as torch.optim.AdamW(fused=True)) once per distinct pair; anything else, or
tensors the kernels do not take (non-fp32 params/states, non-contiguous, bias_correction=False on torch's
path, ...) -> the reference twin, tensor by tensor.
Tolerance against the twin and against torch.optim.AdamW(foreach=False): reference.TOLERANCES["adam"]; the CPU
and CUDA kernels agree with each other bit for bit, and a list call equals one call per tensor bit for bit.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from . import loader, reference

ISAS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
_KERNEL_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_COPY_DTYPES = (torch.bfloat16, torch.float16)
_APEX_CHUNK = 2048 * 32

TensorOrList = torch.Tensor | Sequence[torch.Tensor]
FloatOrList = float | Sequence[float]


def cpu_isa() -> int:
    """The instruction set MEGAZERO_CPU_ADAM_ISA asks for (auto, scalar, avx2, avx512) as the kernel's code."""
    name = os.environ.get("MEGAZERO_CPU_ADAM_ISA", "auto")
    if name not in ISAS:
        raise ValueError(f"MEGAZERO_CPU_ADAM_ISA={name!r}; valid: {', '.join(ISAS)}")
    return ISAS[name]


def _as_list(x: TensorOrList | None, name: str, n: int | None = None) -> list[torch.Tensor]:
    items = [x] if isinstance(x, torch.Tensor) else list(x or [])
    if n is not None and len(items) != n:
        raise ValueError(f"adam_step: {name} has {len(items)} tensors, param has {n}")
    return items


def _per_tensor(value: FloatOrList, name: str, n: int) -> list[float]:
    """`value` as n floats: a number (or 0-d tensor) repeated, or a sequence (or 1-d tensor) of n numbers."""
    many = (isinstance(value, Sequence) and not isinstance(value, (str, bytes))) or (
        isinstance(value, torch.Tensor) and value.dim() > 0)
    if many:
        values = [float(v) for v in value]
        if len(values) != n:
            raise ValueError(f"adam_step: {name} has {len(values)} values, param has {n} tensors; pass one "
                             f"{name} per tensor or a single float")
        return values
    try:
        return [float(value)] * n
    except (TypeError, ValueError):
        raise TypeError(f"adam_step: {name}={value!r}; expected a float or a sequence of floats (one per "
                        f"tensor)") from None


def _kernel_ready(params, grads, exp_avgs, exp_avg_sqs, copies) -> bool:
    """Whether the C++/CUDA kernels take these tensors (else the reference twin runs)."""
    fp32 = all(t.dtype == torch.float32 and t.is_contiguous() for t in (*params, *exp_avgs, *exp_avg_sqs))
    grads_ok = all(grad.dtype in _KERNEL_GRAD_DTYPES and grad.dtype == grads[0].dtype for grad in grads)
    copies_ok = all(c.dtype in _KERNEL_COPY_DTYPES and c.is_contiguous() and c.dtype == copies[0].dtype
                    for c in copies)
    sizes = all(t.numel() == p.numel() for lst in (grads, exp_avgs, exp_avg_sqs) for t, p in zip(lst, params))
    return fp32 and grads_ok and copies_ok and sizes


def adam_step(param: TensorOrList, grad: TensorOrList, exp_avg: TensorOrList, exp_avg_sq: TensorOrList, *,
              step: int, lr: FloatOrList, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
              weight_decay: FloatOrList = 0.0, adamw_mode: bool = True, bias_correction: bool = True,
              maximize: bool = False, param_copy: TensorOrList | None = None) -> str:
    """One Adam step, in place, on a tensor or a list of tensors (all on one device); returns the backend used.

    lr and weight_decay are each a float shared by every tensor, or a sequence with one float per tensor (e.g.
    the decay and no-decay runs of a flat ZeRO shard in one call). step counts from 1 and is shared by every
    tensor of the call. adamw_mode=False is classic Adam (L2 added to the gradient); bias_correction=False drops
    the 1 - beta^step factors. States are fp32 for the kernels; grads may be fp32, bf16 or fp16 (one dtype per
    call); param_copy (bf16/fp16), when given, receives the updated param rounded to nearest even in the same
    pass (e.g. the working weights of mixed-precision training). A list call gives the same bits as one call per
    tensor; the kernels run the whole list at once.
    """
    params = _as_list(param, "param")
    n = len(params)
    grads = [t if t.is_contiguous() else t.contiguous() for t in _as_list(grad, "grad", n)]
    exp_avgs, exp_avg_sqs = _as_list(exp_avg, "exp_avg", n), _as_list(exp_avg_sq, "exp_avg_sq", n)
    copies = _as_list(param_copy, "param_copy", n) if param_copy is not None else []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"adam_step: step={step!r}; expected an int >= 1")
    lrs, wds = _per_tensor(lr, "lr", n), _per_tensor(weight_decay, "weight_decay", n)
    if n == 0:
        return "none"
    devices = {t.device for t in (*params, *grads, *exp_avgs, *exp_avg_sqs, *copies)}
    if len(devices) != 1:
        raise ValueError(f"adam_step: all tensors must be on one device, got {sorted(map(str, devices))}")
    shared = dict(beta1=beta1, beta2=beta2, eps=eps, adamw_mode=adamw_mode, bias_correction=bias_correction,
                  maximize=maximize)
    ready = _kernel_ready(params, grads, exp_avgs, exp_avg_sqs, copies)
    with torch.no_grad():
        if ready and params[0].device.type == "cpu":
            ops = loader.cpu_adam()
            if ops is not None:
                used = ops.multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, copies, lrs, beta1, beta2, eps,
                                             wds, step, adamw_mode, bias_correction, maximize, cpu_isa())
                return f"megazero_cpu_adam[{used}]"
        if ready and params[0].device.type == "cuda":
            backend = _cuda_adam(params, grads, exp_avgs, exp_avg_sqs, copies, step, lrs, wds, shared)
            if backend is not None:
                return backend
        for i in range(n):
            reference.adam_step(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], step=step, lr=lrs[i],
                                weight_decay=wds[i], param_copy=copies[i] if copies else None, **shared)
    return "reference"


def _cuda_adam(params, grads, exp_avgs, exp_avg_sqs, copies, step, lrs, wds, shared) -> str | None:
    """One launch of megazero's multi-tensor Adam (per-tensor lr and weight decay), else apex's once per
    distinct (lr, weight_decay), else torch's fused Adam (`torch_fused_adam`); None when none takes them."""
    ops = loader.cuda_ops()
    if ops is not None:
        ops.multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, copies, lrs, shared["beta1"], shared["beta2"],
                              shared["eps"], wds, step, shared["adamw_mode"], shared["bias_correction"],
                              shared["maximize"])
        return "megazero_cuda"
    amp_c = loader.apex("amp_C")
    if amp_c is None or shared["maximize"] or any(grad.dtype != torch.float32 for grad in grads):
        return torch_fused_adam(params, grads, exp_avgs, exp_avg_sqs, copies, step, lrs, wds, shared)
    noop = torch.zeros(1, dtype=torch.int, device=params[0].device)
    for (lr, wd), idx in _by_hyper(lrs, wds).items():
        lists = [[lst[i] for i in idx] for lst in (grads, params, exp_avgs, exp_avg_sqs)]
        amp_c.multi_tensor_adam(_APEX_CHUNK, noop, lists, lr, shared["beta1"], shared["beta2"], shared["eps"],
                                step, int(shared["adamw_mode"]), int(shared["bias_correction"]), wd)
    if copies:
        torch._foreach_copy_(copies, params)
    return "apex"


def _by_hyper(lrs: list[float], wds: list[float]) -> dict[tuple[float, float], list[int]]:
    """Tensor indices grouped by their (lr, weight_decay), in first-seen order."""
    groups: dict[tuple[float, float], list[int]] = {}
    for i, key in enumerate(zip(lrs, wds)):
        groups.setdefault(key, []).append(i)
    return groups


def torch_fused_adam(params, grads, exp_avgs, exp_avg_sqs, copies, step, lrs, wds, shared) -> str | None:
    """torch's fused Adam (torch._fused_adamw_, or _fused_adam_ for adamw_mode=False; what
    torch.optim.AdamW(fused=True) runs), once per distinct (lr, weight_decay); grads are cast to fp32 first. None
    (the caller runs the twin) for bias_correction=False, which torch's kernel always applies, and under
    MEGAZERO_KERNELS=reference."""
    if not shared["bias_correction"] or loader.mode() == "reference":
        return None
    fused = torch._fused_adamw_ if shared["adamw_mode"] else torch._fused_adam_
    grads = [grad if grad.dtype == torch.float32 else grad.float() for grad in grads]
    step_t = torch.tensor(float(step), device=params[0].device)  # read, not advanced, by the kernel
    for (lr, wd), idx in _by_hyper(lrs, wds).items():
        fused(*[[lst[i] for i in idx] for lst in (params, grads, exp_avgs, exp_avg_sqs)], [], [step_t] * len(idx),
              lr=lr, beta1=shared["beta1"], beta2=shared["beta2"], weight_decay=wd, eps=shared["eps"],
              amsgrad=False, maximize=shared["maximize"])
    if copies:
        torch._foreach_copy_(copies, params)
    return "torch"


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW with torch.optim.AdamW's arguments, stepping the parameters with megazero's SIMD CPU kernel.

    One pass over memory per parameter, one kernel call per parameter group (per step count and dtype within
    it; AVX-512/AVX2/scalar chosen at run time, OpenMP threads = torch's). adamw_mode=False gives classic Adam
    (weight_decay as L2 on the gradient), bias_correction=False drops the 1 - beta^step factors. Parameters the
    kernel does not take (non-fp32, non-contiguous, CUDA) are stepped by adam_step's other backends with the
    same semantics. State keys match torch.optim.AdamW (step, exp_avg, exp_avg_sq), so state dicts load both
    ways.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 adamw_mode: bool = True, bias_correction: bool = True):
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported (the kernel keeps no running max of "
                             "exp_avg_sq); use torch.optim.AdamW(amsgrad=True)")
        if not 0.0 <= lr:
            raise ValueError(f"CPUAdam: lr={lr}; expected >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"CPUAdam: eps={eps}; expected >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"CPUAdam: betas[{i}]={beta}; expected 0 <= beta < 1")
        if not 0.0 <= weight_decay:
            raise ValueError(f"CPUAdam: weight_decay={weight_decay}; expected >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        """Also runs at the end of load_state_dict: groups saved by torch.optim.Adam/AdamW lack our keys."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            group.setdefault("maximize", False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad", False):
                raise ValueError("CPUAdam: amsgrad=True is not supported (param group setting)")
            beta1, beta2 = group["betas"]
            # One adam_step per set of parameters the kernel can take together (same step count, device,
            # dtypes and layout): a stray fp64 or non-contiguous parameter does not send the others to the twin.
            batches: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                key = (int(state["step"].item()), p.device, p.dtype, p.grad.dtype, p.is_contiguous())
                batches.setdefault(key, []).append(p)
            for (step, *_), ps in batches.items():
                states = [self.state[p] for p in ps]
                adam_step(ps, [p.grad for p in ps], [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states], step=step, lr=float(group["lr"]), beta1=beta1,
                          beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                          adamw_mode=group["adamw_mode"], bias_correction=group["bias_correction"],
                          maximize=group["maximize"])
        return loss
