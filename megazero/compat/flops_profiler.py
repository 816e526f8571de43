"""DeepSpeed's flops profiler (`deepspeed.profiling.flops_profiler`): a model's forward counted per module
by torch's `FlopCounterMode` (every aten op's FLOPs, attributed to the modules that ran it) and timed,
printed as DeepSpeed prints it: parameters, forward MACs and FLOPs, latency and FLOP/s, the backward
estimated as twice the forward (plus `recompute_fwd_factor` forwards under activation recompute), and
the `top_modules` modules by FLOPs at each depth up to `module_depth`. `FlopsProfiler` is its class
(start_profile / stop_profile / get_total_* / print_model_profile / end_profile); `get_model_profile`
its one-call form; the engines run it on the forward of step `log.flops_profiler.profile_step` when
``flops_profiler.enabled``. Local: no communication (each rank profiles its own forward; rank 0 prints)."""
from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode


def _num(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}".rstrip()


class FlopsProfiler:
    """DeepSpeed's FlopsProfiler(model): counts and times what runs between start and stop."""

    def __init__(self, model, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model, self.recompute_fwd_factor = model, recompute_fwd_factor
        self._mode, self._start, self.duration, self.counts = None, None, 0.0, {}

    def start_profile(self, ignore_list=None) -> None:
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()
        self._start = time.perf_counter()

    def stop_profile(self) -> None:
        if self._mode is None:
            return
        self.duration = time.perf_counter() - self._start
        self._mode.__exit__(None, None, None)
        self.counts = {name: sum(ops.values()) for name, ops in self._mode.get_flop_counts().items()}
        self._mode = None

    def reset_profile(self) -> None:
        self.counts, self.duration = {}, 0.0

    def end_profile(self) -> None:
        self.stop_profile()

    def get_total_flops(self, as_string: bool = False):
        flops = self.counts.get("Global", 0)
        return _num(flops, "FLOPS") if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self.get_total_flops() / 2
        return _num(macs, "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False):
        n = sum(p.numel() for p in self.model.parameters())
        return _num(n) if as_string else n

    def get_total_duration(self, as_string: bool = False):
        return f"{self.duration * 1e3:.2f} ms" if as_string else self.duration

    def report(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1) -> str:
        """DeepSpeed's summary: totals, then the top modules by forward FLOPs at each depth."""
        fwd = self.get_total_flops()
        factor = 2.0 + self.recompute_fwd_factor
        lines = [f"-------------------------- DeepSpeed Flops Profiler --------------------------",
                 f"Profile Summary at step {profile_step}:",
                 f"params per GPU:                                                 {self.get_total_params(True)}",
                 f"fwd MACs per GPU:                                               {self.get_total_macs(True)}",
                 f"fwd flops per GPU:                                              {_num(fwd)}",
                 f"fwd+bwd flops per GPU (bwd = {factor:g} x fwd):                    {_num(fwd * (1 + factor))}",
                 f"fwd latency:                                                    {self.get_total_duration(True)}",
                 f"fwd FLOPS per GPU = fwd flops per GPU / fwd latency:            "
                 f"{_num(fwd / self.duration if self.duration else 0.0, 'FLOPS')}",
                 "----------------------------- Aggregated Profile per GPU -----------------------------",
                 f"Top {top_modules} modules in terms of FLOPs at each depth:"]
        by_depth: dict[int, list[tuple[str, int]]] = {}
        for name, flops in self.counts.items():
            if name == "Global":
                continue
            depth = name.count(".")
            if module_depth < 0 or depth <= module_depth:
                by_depth.setdefault(depth, []).append((name, flops))
        for depth in sorted(by_depth):
            best = sorted(by_depth[depth], key=lambda kv: -kv[1])[:top_modules]
            lines.append(f"depth {depth}: " + ", ".join(f"{n} {_num(f)}" for n, f in best))
        return "\n".join(lines)

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        text = self.report(profile_step, module_depth, top_modules)
        if output_file is not None:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text, flush=True)
        return text


def get_model_profile(model, input_shape=None, args=None, kwargs=None, print_profile: bool = True,
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1, warm_up: int = 1,
                      as_string: bool = True, output_file=None, ignore_modules=None, mode: str = "forward"):
    """DeepSpeed's one call: (flops, macs, params) of `model`'s forward on a random input of
    `input_shape` or on `args`/`kwargs`, after `warm_up` unprofiled runs."""
    if mode != "forward":
        raise NotImplementedError(f"get_model_profile(mode={mode!r}): only the forward is profiled")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        device = next(model.parameters()).device
        args = [torch.ones(input_shape, device=device)]
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile()
        model(*args, **kwargs)
        prof.stop_profile()
    if print_profile:
        prof.print_model_profile(module_depth=module_depth, top_modules=top_modules, detailed=detailed,
                                 output_file=output_file)
    return (prof.get_total_flops(as_string), prof.get_total_macs(as_string), prof.get_total_params(as_string))
