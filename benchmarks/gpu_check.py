"""The stages of `tools/gpu_check.sh`, one JSON file each (`--stage NAME --out DIR`, `--cpu` for tiny shapes).

    python benchmarks/gpu_check.py --stage trainer --out runs/gpu_check          # on the GPU
    python benchmarks/gpu_check.py --stage trainer --out /tmp/check --cpu         # its dry run on CPU
    python benchmarks/gpu_check.py --summary --out runs/gpu_check                 # a few lines per stage

Each stage writes <out>/<stage>.json as it goes and again at its end, also when it fails ({"error": ...,
"traceback": ...} next to what was measured before), so a timeout or a crash leaves partial results.

- ``env``: torch, CUDA, Python, the device (and `nvidia-smi`), megazero's Python requirements, the NCCL
  environment megazero sets; on a GPU the kernels built for this device's architecture
  (`MEGAZERO_KERNELS=strict`: a failed build is an error) with the build's time and its check: the JIT
  cache key names this sm_XY and build.ninja has `code=sm_XY` (or the ahead-of-time library is used).
- ``kernels``: the ``gpu``-marked tests (fused LayerNorm/RMSNorm, masked and causal softmax, multi-tensor
  Adam against their PyTorch twins) and the CUDA-only clock and attention-core tests: pass/fail per test,
  recorded as pytest reports them (on CPU: skipped, no CUDA).
- ``trainer``: megazero's real trainer (`megazero.run.train.run`, as `python -m megazero.run.train`) on a
  Llama spec (`model_specs/llama.py`, ~1.1B parameters in bf16 on the GPU; 2 layers of 64 on CPU, also in
  bf16), with only the flash SDPA backend allowed (`sdpa_kernel(FLASH_ATTENTION)`: any other would be an
  error). Four runs:
  (1) ``zero1``: ZeRO-1, no recompute, uninstrumented: the benchmark (step time, tokens/s, MFU, peak memory)
      and the uninterrupted losses;
  (2) ``zero1_save``: the same run to step `save_at`, ending with an asynchronous checkpoint save (the time
      of the save call, the snapshot, and of the wait for the background write);
  (3) ``resume``: the same run resumed from that checkpoint to the end: its losses must equal (1)'s (on a
      GPU within `RESUME_RTOL`: flash's backward accumulates in a nondeterministic order);
  (4) ``zero3_offload``: ZeRO-3 with the optimizer offloaded to the CPU and overlap_comm, full recompute
      with the checkpointed activations partitioned and kept on the CPU (cpu_checkpointing).
  (2)-(4) run under `torch.cuda.set_sync_debug_mode("warn")` (GPU; the warnings counted by call site) and
  megazero's `SyncCounter` (host synchronisations per step and by call site; also which SDPA backend
  op ran and how often); (2) profiles its second step with `torch.profiler`: the kernel names containing
  "flash" confirm the backend (on CPU the aten op names).
- ``planner``: megazero's planner for run (1) (and the nearest layout it models for run (4)) on the
  `h200-141gb` preset: memory per GPU and step time, next to what ``trainer`` measured (ratios).
- ``plain``: a plain PyTorch loop whose model code is not megazero's: transformers' `LlamaForCausalLM` from a
  `LlamaConfig` of the same shape (`megazero.models.hf.hf_config_dict`; nothing downloaded), loaded with
  megazero's initial weights (`export_hf_state_dict` of run (1)'s model at step 0), the same batches, bf16
  weights, SDPA attention (flash forced), gradient clipping and AdamW with the config's settings (torch's
  fused AdamW on GPU). Its step-1 loss must be close to megazero's from the same weights; then step time,
  tokens/s, MFU, peak memory, and megazero ÷ plain.

Step times: the trainer's (host time between steps; the trainer reads the loss every step at
log.interval 1, so each is a whole step), the median after `warmup` steps. Tokens per step:
global batch × sequence. MFU = FLOPs per step / step time / the dense bf16 peak of the hardware preset
(989 TFLOP/s for the H200; none on CPU), FLOPs per token `megazero.core.flops.model_flops_per_token` of the spec
(the trainer's and the planner's count): the same for megazero and the plain loop.
Peak memory: `torch.cuda.max_memory_allocated` and `max_memory_reserved` over the run (reset before it); on CPU
the process' peak resident set over the run (VmHWM, reset through /proc/self/clear_refs).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HARDWARE = "h200-141gb"
# ~1.1B parameters: 16 layers of hidden 2048 (Llama-3.2-1B's shape with a 32k vocabulary), sequence 2048
GPU = {"model": {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn_hidden": 8192, "vocab": 32000,
                 "seq_len": 2048},
       "batch": 4, "steps": 16, "save_at": 6, "zero3_steps": 8, "warmup": 2}
CPU = {"model": {"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 4, "ffn_hidden": 176, "vocab": 512, "seq_len": 32},
       "batch": 2, "steps": 6, "save_at": 3, "zero3_steps": 4, "warmup": 1}
PROFILED_STEP = 2  # of run zero1_save
LR = 3e-4  # constant (the config's AdamW otherwise: betas 0.9/0.95, eps 1e-5, weight decay 0.01, clipping 1.0)
RESUME_RTOL = 5e-3  # GPU: bf16, flash's backward sums in a nondeterministic order (CPU: equal)
HF_STEP1_RTOL = 2e-2  # the plain loop's first loss against megazero's, same weights and batch, bf16
SYNC_WARNING = r".*synchroniz.*"  # torch.cuda.set_sync_debug_mode("warn"): "called a synchronizing CUDA operation"
NCCL_SET: dict = {}  # what main() set of megazero's NCCL/CUDA environment
REQUIREMENTS = ("omegaconf", "einops", "networkx", "tqdm", "safetensors", "yaml", "transformers")


def _shape(cpu: bool) -> dict:
    return CPU if cpu else GPU


def _device(cpu: bool) -> str:
    return "cpu" if cpu else "cuda"


def _write(out: Path, name: str, data: dict) -> None:
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)  # a kill mid-write leaves the previous version whole


# -- measuring -------------------------------------------------------------------------------------------

def _status_kib(key: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """The peak memory of what runs inside: CUDA's allocator (allocated and reserved) on a GPU, the
    process' resident set (VmHWM, reset through /proc/self/clear_refs) on CPU."""

    def __init__(self, device: str):
        self.device = device
        self.result: dict = {}

    def __enter__(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current resident set
                self.resettable = True
            except OSError:
                self.resettable = False
            self.before = (_status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.result = {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
                           "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                           "allocated_before_bytes": int(self.before),
                           "allocated_after_bytes": int(torch.cuda.memory_allocated())}
        else:
            hwm = _status_kib("VmHWM") if self.resettable else None
            peak = hwm * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.result = {"peak_rss_bytes": int(peak), "rss_before_bytes": int(self.before),
                           "peak_rss_is_per_run": bool(hwm)}
        return False

    @property
    def peak(self) -> int:
        return self.result.get("peak_allocated_bytes", self.result.get("peak_rss_bytes", 0))


def _peak_tflops(cpu: bool) -> float | None:
    if cpu:
        return None
    from megazero.planner.hardware import load_hardware

    return float(load_hardware(HARDWARE, str(ROOT / "configs" / "hardware")).peak_tflops)


def _timing(step_times: list[float], tokens: int, flops_per_token: float, peak: float | None, warmup: int) -> dict:
    measured = sorted(step_times[warmup:] or step_times)
    median = measured[len(measured) // 2]
    return {"step_time_s": {"median": median, "min": measured[0], "max": measured[-1], "n": len(measured),
                            "warmup_steps_left_out": min(warmup, len(step_times) - len(measured))},
            "tokens_per_step": tokens, "tokens_per_s": tokens / median,
            "mfu": tokens * flops_per_token / median / (peak * 1e12) if peak else None}


class Counter:
    """megazero's SyncCounter (host synchronisations by call site) and a count of the scaled-dot-product
    attention ops that ran (which SDPA backend: flash, efficient, cudnn; math decomposes into plain ops).
    The sync counter is the inner mode, so the call sites it records are the callers' own."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from megazero.runtime.sync_counter import SyncCounter

        class AttentionOps(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.seen: collections.Counter = collections.Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if "scaled_dot_product" in name:
                    self.seen[name] += 1
                return func(*args, **(kwargs or {}))

        self.ops, self.syncs = AttentionOps(), SyncCounter()

    @property
    def attention(self) -> collections.Counter:
        return self.ops.seen

    @property
    def events(self):
        return self.syncs.events

    @property
    def count(self) -> int:
        return self.syncs.count

    def by_site(self) -> collections.Counter:
        return self.syncs.by_site()

    def __enter__(self):
        self.ops.__enter__()
        self.syncs.__enter__()
        return self

    def __exit__(self, *exc):
        self.syncs.__exit__(*exc)
        self.ops.__exit__(*exc)
        return False


@contextlib.contextmanager
def _sync_debug_warnings(device: str):
    """torch.cuda.set_sync_debug_mode("warn") inside; yields a Counter of its warnings by call site
    (counted, not printed: one per synchronising call would flood the log). Nothing on CPU."""
    sites: collections.Counter = collections.Counter()
    if device != "cuda":
        yield sites
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if re.match(SYNC_WARNING, str(message)):
            sites[f"{os.path.relpath(filename, ROOT) if filename.startswith(str(ROOT)) else filename}:{lineno}"] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=SYNC_WARNING)
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(0)


class Probe:
    """Wraps the engine the trainer builds (`megazero.run.train.initialize_from_config`): marks each step's
    start in the sync counter, times the checkpoint save call and the final wait, and profiles one step."""

    def __init__(self, counter, device: str, profile_step: int | None):
        self.counter, self.device, self.profile_step = counter, device, profile_step
        self.marks: list[tuple[int, int]] = []  # (global step, events seen before it)
        self.end_mark: int | None = None
        self.save: dict = {}
        self.profile: dict = {}

    @contextlib.contextmanager
    def installed(self):
        from megazero.run import train

        original = train.initialize_from_config

        def initialize(*args, **kwargs):
            built = original(*args, **kwargs)
            self._wrap(built[0])
            return built

        train.initialize_from_config = initialize
        try:
            yield self
        finally:
            train.initialize_from_config = original

    def _events(self) -> int:
        return self.counter.count if self.counter is not None else 0

    def _wrap(self, engine) -> None:
        step_fn, save_fn, wait_fn = engine.train_step, engine.save_checkpoint, engine.wait_for_checkpoint

        def train_step(*args, **kwargs):
            step = engine.global_steps + 1
            self.marks.append((step, self._events()))
            if step == self.profile_step:
                return self._profiled(step_fn, *args, **kwargs)
            return step_fn(*args, **kwargs)

        def save_checkpoint(*args, **kwargs):
            start = time.perf_counter()
            path = save_fn(*args, **kwargs)
            self.save = {"path": os.path.basename(str(path)), "async": bool(kwargs.get("async_save")),
                         "save_call_s": time.perf_counter() - start}
            return path

        def wait_for_checkpoint(*args, **kwargs):
            self.end_mark = self._events()
            start = time.perf_counter()
            result = wait_fn(*args, **kwargs)
            if self.save:
                self.save["wait_s"] = time.perf_counter() - start
            return result

        engine.train_step, engine.save_checkpoint = train_step, save_checkpoint
        engine.wait_for_checkpoint = wait_for_checkpoint

    def _profiled(self, step_fn, *args, **kwargs):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        with profile(activities=activities) as prof:
            loss = step_fn(*args, **kwargs)
            if self.device == "cuda":
                torch.cuda.synchronize()
        from torch.autograd import DeviceType

        events = prof.events()
        kernels = {e.name for e in events if e.device_type != DeviceType.CPU}  # what ran on the GPU
        ops = {e.name for e in events if e.device_type == DeviceType.CPU}  # aten ops, autograd nodes
        other = re.compile(r"efficient_attention|cudnn_attention|fmha|cudnn.*sdpa|sdpa.*cudnn|"
                           r"_scaled_dot_product_attention_math")
        flash = sorted(n for n in (kernels if self.device == "cuda" else ops) if "flash" in n.lower())
        others = sorted(n for n in kernels | ops if other.search(n))
        self.profile = {"step": self.profile_step, "flash_names": [n[:200] for n in flash[:20]],
                        "flash_ops": sorted(n for n in ops if "flash" in n.lower())[:10],
                        "other_attention_names": others[:20],
                        "kind": "CUDA kernel names" if self.device == "cuda" else "aten op names (CPU)",
                        "kernels_seen": len(kernels), "confirmed": bool(flash) and not others}
        return loss

    def syncs(self) -> dict:
        """Host synchronisations: before the first step (build, load), per step (its train_step, the
        metrics flush, a save), after the last step (the final wait, the closing barrier), and by site."""
        c = self.counter
        if c is None:
            return {}
        events = c.events
        bounds = [m for _, m in self.marks] + [self.end_mark if self.end_mark is not None else len(events)]
        per_step = []
        for (step, start), end in zip(self.marks, bounds[1:]):
            sites = collections.Counter(f"{site} ({kind})" for kind, site in events[start:end])
            per_step.append({"step": step, "count": end - start, "sites": dict(sites.most_common())})
        first = self.marks[0][1] if self.marks else len(events)
        counts = [s["count"] for s in per_step]
        return {"total": c.count, "before_first_step": first, "after_last_step": len(events) - bounds[-1],
                "per_step": per_step, "per_step_counts": counts,
                "max_per_step": max(counts) if counts else 0,
                "by_site": dict(c.by_site().most_common())}


# -- env -----------------------------------------------------------------------------------------------

def _requirements() -> dict:
    found = {}
    for name in REQUIREMENTS:
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "?")
        except Exception as err:  # noqa: BLE001
            found[name] = f"missing: {type(err).__name__}: {err}"
    return found


def _nvidia_smi() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _build_check() -> dict:
    """The CUDA extension was built for this GPU's architecture (the JIT cache key and build.ninja), or
    the ahead-of-time library (`MEGAZERO_BUILD_OPS=1 pip install`) is used."""
    from megazero.runtime.kernels import build

    m, n = torch.cuda.get_device_capability()
    aot = build.aot_library(build.CUDA_OPS)
    if aot is not None:
        return {"ahead_of_time_library": str(aot), "nvcc_flags": build.aot_nvcc_flags(), "ok": True}
    out = build.build_dir(build.CUDA_OPS, torch.cuda.current_device())
    ninja = out / "build.ninja"
    key_ok = f"{m}{n}" in out.parent.name.split("-sm")[-1].split("_")
    gencode_ok = ninja.exists() and f"code=sm_{m}{n}" in ninja.read_text()
    return {"cache": str(out), "key_names_arch": key_ok, "build_ninja_has_gencode": gencode_ok,
            "ok": key_ok and gencode_ok}


def stage_env(out: Path, cpu: bool) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cuda_available": torch.cuda.is_available(), "requirements": _requirements(),
            "kernels_mode": os.environ.get("MEGAZERO_KERNELS", "auto"),
            "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    _write(out, "env", info)  # before megazero is imported (a missing requirement fails it)
    from megazero.runtime.launch import NCCL_ENVIRONMENT

    info["nccl_environment_set"] = dict(NCCL_SET)
    info["nccl_environment"] = {k: os.environ.get(k) for k in NCCL_ENVIRONMENT}
    import megazero.runtime.kernels as kernels

    if torch.cuda.is_available() and not cpu:
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
        info["nvidia_smi"] = _nvidia_smi()
        _write(out, "env", info)
        start = time.perf_counter()
        info["kernels"] = kernels.kernel_info()  # builds for this architecture (strict: or raises)
        info["kernel_build_and_load_s"] = time.perf_counter() - start
        info["build_check"] = _build_check()
        if not info["build_check"]["ok"]:
            info["error"] = f"the CUDA extension is not built for {info['capability']}: {info['build_check']}"
    else:
        info["device"] = platform.processor() or platform.machine()
        info["cuda_build"] = {"skipped": "no CUDA device: no CUDA kernels to build (the reference twins run)"}
        info["kernels"] = kernels.kernel_info()  # the CPU side: the CPU Adam (built as the trainer would)
    return info


# -- kernels -------------------------------------------------------------------------------------------

KERNEL_TESTS = ("tests/test_kernels_gpu.py", "tests/test_clock.py", "tests/test_attention_core.py")
_OUTCOME = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")  # ids may hold spaces
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::.+?)(?: - (.*))?$")  # -rfE: the short reason of each failure


def stage_kernels(out: Path, cpu: bool, limit_s: float | None = None) -> dict:
    if cpu or not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the gpu-marked kernel tests need one", "tests": {}}
    result = {"files": list(KERNEL_TESTS), "tests": {}, "counts": {}}
    budget = (limit_s - 15) if limit_s else 300  # end pytest ourselves: its results so far are recorded
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-m", "gpu or not gpu",
           "--tb=line", *KERNEL_TESTS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start, tail, last_write = time.perf_counter(), collections.deque(maxlen=60), 0.0
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            m = _OUTCOME.match(line)
            if m:
                result["tests"][m.group(1)] = m.group(2).lower()
            m = _SUMMARY.match(line.rstrip())
            if m:
                result.setdefault("failure_messages", {})[m.group(2)] = (m.group(3) or "")[:300]
            if time.perf_counter() - last_write > 5:
                result["counts"] = dict(collections.Counter(result["tests"].values()))
                _write(out, "kernels", result)
                last_write = time.perf_counter()
            if time.perf_counter() - start > budget:
                proc.kill()
                result["error"] = f"pytest stopped after {budget:.0f} s (the stage's limit): the results so far"
                break
    finally:
        proc.wait()
    result["returncode"] = proc.returncode
    result["counts"] = dict(collections.Counter(result["tests"].values()))
    result["failed"] = sorted(k for k, v in result["tests"].items() if v in ("failed", "error"))
    result["tail"] = "\n".join(tail)
    if proc.returncode not in (0, None) and "error" not in result:
        result["error"] = f"pytest exit code {proc.returncode}: {len(result['failed'])} failed"
    return result


# -- trainer -------------------------------------------------------------------------------------------

def _overrides(cpu: bool, run_dir: str, steps: int, extra: list[str]) -> list[str]:
    shape = _shape(cpu)
    model, batch = shape["model"], shape["batch"]
    overrides = [f"model.{k}={v}" for k, v in model.items()] + [
        "model.spec=model_specs/llama.py:debug", "parallel.pp=1", "parallel.tp=1", "data.path=null",
        f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}", f"train.steps={steps}",
        "log.interval=1", "log.progress_bar=false", f"run_dir={run_dir}", "precision=bf16",
        "activation_checkpointing.policy=none", "zero.stage=1", f"optimizer.lr={LR}"]
    peak = _peak_tflops(cpu)
    if peak:
        overrides.append(f"log.peak_tflops={peak}")
    return overrides + extra


def _config(cpu: bool, run_dir: str, steps: int, extra: list[str]):
    from megazero.engine import load_run_config

    return load_run_config("configs/debug_llama.yaml", _overrides(cpu, run_dir, steps, extra))


ZERO3 = ["zero.stage=3", "zero.offload_optimizer.device=cpu", "zero.overlap_comm=true",
         "activation_checkpointing.policy=full", "activation_checkpointing.partition_activations=true",
         "activation_checkpointing.cpu_checkpointing=true"]


def _train(cpu: bool, run_dir: str, steps: int, extra: list[str], instrument: bool, profile_step: int | None = None,
           warmup: int | None = None) -> dict:
    """One run of megazero's trainer (flash only): its metrics, timing, peak memory and, when
    instrumented, host synchronisations per step and by site, the attention ops and one profiled step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.core.flops import model_flops_per_token
    from megazero.models import count_params
    from megazero.planner.from_config import spec_of
    from megazero.run import train

    cfg = _config(cpu, run_dir, steps, extra)
    device, shape = _device(cpu), _shape(cpu)
    spec = spec_of(cfg)
    counter = Counter() if instrument else None
    probe = Probe(counter, device, profile_step if instrument else None)
    start = time.perf_counter()
    with PeakMemory(device) as memory, probe.installed(), _sync_debug_warnings(device if instrument else "cpu") as \
            sync_warnings, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no fallback: flash or an error
        if counter is not None:
            with counter:
                code = train.run(cfg, 0)
        else:
            code = train.run(cfg, 0)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in open(cfg.log.metrics_file) if line.strip()]
    params = count_params(spec)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    fpt = model_flops_per_token(spec)
    result = {"exit_code": code, "instrumented": instrument, "config": [o for o in extra], "parameters": params,
              "steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows],
              "grad_norms": [r.get("grad_norm") for r in rows],
              **_timing([r["step_time_s"] for r in rows if r["step"] != probe.profile_step], tokens, fpt,
                        _peak_tflops(cpu), shape["warmup"] if warmup is None else warmup),
              "memory": memory.result, "wall_s": wall}
    if instrument:
        result["host_syncs"] = probe.syncs()
        result["attention_ops"] = dict(counter.attention)
        if device == "cuda":
            result["sync_debug_warnings"] = {"total": sum(sync_warnings.values()),
                                             "by_site": dict(sync_warnings.most_common(30))}
        if probe.profile:
            result["profiled_step"] = probe.profile
    if probe.save:
        result["checkpoint_save"] = probe.save
    return result


def _compare(losses: list[float], reference: list[float], rtol: float) -> dict:
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
    return {"equal": losses == reference[:len(losses)], "max_rel_diff": max(diffs) if diffs else None,
            "rtol": rtol, "close": bool(diffs) and max(diffs) <= rtol}


def _guarded(result: dict, name: str, out: Path, fn) -> dict | None:
    """result[name] = fn(), or {"error", "traceback"} if it raises (the process group and the device
    memory it left are released, and the next run goes on); trainer.json rewritten either way."""
    try:
        result[name] = fn()
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        result[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _write(out, "trainer", result)
    return None if "error" in result[name] else result[name]


def stage_trainer(out: Path, cpu: bool) -> dict:
    shape = _shape(cpu)
    steps, half, zsteps = shape["steps"], shape["save_at"], shape["zero3_steps"]
    tol = 0.0 if cpu else RESUME_RTOL
    result = {"model": shape["model"], "micro_batch": shape["batch"], "precision": "bf16",
              "sdpa_backend_forced": "FLASH_ATTENTION", "device": _device(cpu)}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        # (1) the benchmark and the uninterrupted reference: nothing counted, nothing saved
        zero1 = _guarded(result, "zero1", out,
                         lambda: _train(cpu, os.path.join(tmp, "zero1"), steps, [], instrument=False))
        reference = zero1["losses"] if zero1 else []

        # (2) the same run to step `half`, an asynchronous save there (the run waits for it at its end)
        def save_run():
            run = _train(cpu, os.path.join(tmp, "save"), half, [f"checkpoint.save_interval={half}",
                         "checkpoint.async_save=true"], instrument=True, profile_step=PROFILED_STEP, warmup=1)
            run["losses_vs_zero1"] = _compare(run["losses"], reference, tol)
            return run

        saved = _guarded(result, "zero1_save", out, save_run)
        if saved:
            result["flash"] = saved.get("profiled_step", {}) | {"attention_ops": saved["attention_ops"]}

        # (3) resumed from that checkpoint: the later steps' losses must be (1)'s
        def resume_run():
            ckpt = os.path.join(tmp, "save", "checkpoints", f"step{half}")
            run = _train(cpu, os.path.join(tmp, "resume"), steps, [f"checkpoint.load={ckpt}"], instrument=True,
                         warmup=1)
            run["resumed_at"] = half
            run["losses_vs_uninterrupted"] = _compare(run["losses"], reference[half:], tol)
            run["equal_to_uninterrupted"] = run["losses_vs_uninterrupted"]["equal"]
            return run

        resumed = _guarded(result, "resume", out, resume_run) if saved else None
        if not saved:
            result["resume"] = {"error": "not run: no checkpoint (zero1_save failed)"}

        # (4) ZeRO-3, optimizer on the CPU, overlap_comm, full recompute with activations checkpointed to the CPU
        def zero3_run():
            run = _train(cpu, os.path.join(tmp, "zero3"), zsteps, ZERO3, instrument=True)
            run["losses_vs_zero1"] = _compare(run["losses"], reference[:zsteps], 0.0 if cpu else 5e-2)
            return run

        _guarded(result, "zero3_offload", out, zero3_run)
    import megazero.runtime.kernels as kernels

    result["kernels"] = kernels.kernel_info()[_device(cpu)]  # the backends the runs used (built or cached)
    problems = [f"{r}: {result[r]['error']}" for r in ("zero1", "zero1_save", "resume", "zero3_offload")
                if "error" in result[r]]
    problems += [f"{r} exited {result[r]['exit_code']}" for r in ("zero1", "zero1_save", "resume", "zero3_offload")
                 if result[r].get("exit_code")]
    if resumed and zero1 and not (resumed["losses_vs_uninterrupted"]["close"] or resumed["equal_to_uninterrupted"]):
        problems.append(f"the resumed losses differ from the uninterrupted run's: {resumed['losses_vs_uninterrupted']}")
    if saved and not result["flash"].get("confirmed"):
        problems.append(f"flash attention not confirmed by the profiler: {result['flash']}")
    if problems:
        result["error"] = "; ".join(problems)
    return result


# -- plain PyTorch -------------------------------------------------------------------------------------

def _megazero_start(cfg) -> tuple[dict, float, object]:
    """Run (1)'s model at step 0 as a Hugging Face state dict, its first step's loss, and its spec; the
    engine is gone afterwards (memory freed, process group destroyed)."""
    import torch.distributed as dist

    from megazero.engine import initialize_from_config
    from megazero.models.hf import export_hf_state_dict

    engine, optimizer, data, _ = initialize_from_config(cfg)
    spec = engine.module.model_spec
    state = {k: v.detach().to("cpu", copy=True)  # off the device: the plain loop's peak memory is its own
             for k, v in export_hf_state_dict(engine.module, spec, engine.pctx.tp_group).items()}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        loss = float(engine.train_step(data))
    del engine, optimizer, data
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    return state, loss, spec


def _hf_model(spec, state: dict, device: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megazero.models.hf import hf_config_dict

    config = LlamaConfig.from_dict(hf_config_dict(spec))
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config)
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # RoPE's inv_freq stays fp32
    model.to(dtype)
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, b)
    missing, unexpected = model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"megazero's weights do not fit LlamaForCausalLM: missing {missing}, "
                           f"unexpected {unexpected}")
    return model


def stage_plain(out: Path, cpu: bool) -> dict:
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.core.flops import model_flops_per_token
    from megazero.engine.factories import synthetic_batches

    shape = _shape(cpu)
    device, dtype = _device(cpu), torch.bfloat16
    steps = shape["steps"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        cfg = _config(cpu, tmp, steps, [])
        state, mz_loss, spec = _megazero_start(cfg)
    result = {"model": "transformers.LlamaForCausalLM", "transformers": transformers.__version__,
              "megazero_step1_loss": mz_loss, "precision": "bf16 weights, gradients and AdamW states",
              "sdpa_backend_forced": "FLASH_ATTENTION"}
    _write(out, "plain", result)
    if device == "cuda":
        torch.cuda.empty_cache()
    t, o = cfg.train, cfg.optimizer
    with PeakMemory(device) as memory:
        model = _hf_model(spec, state, device, dtype)
        del state
        result["attn_implementation"] = model.config._attn_implementation
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=device == "cuda")
        data = synthetic_batches(spec.vocab, t.micro_batch_size, 1, spec.seq_len, t.seed, 0, 1)
        times, losses = [], []
        model.train()
        for step in range(steps):
            batch = next(data)
            tokens, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            counter = Counter() if step == 0 else contextlib.nullcontext()
            start = time.perf_counter()
            with counter, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                logits = model(input_ids=tokens).logits
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, spec.vocab), labels.reshape(-1))
                del logits
                loss.backward()
                if cfg.gradient_clipping:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())  # one read per step, as the trainer at log.interval 1
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if step == 0:
                result["attention_ops_step1"] = dict(counter.attention)
                result["host_syncs_step1"] = {"count": counter.count,
                                              "by_site": dict(counter.by_site().most_common(10))}
    params = sum(p.numel() for p in model.parameters())
    fpt = model_flops_per_token(spec)
    result.update(parameters=params, losses=losses, memory=memory.result,
                  **_timing(times, t.global_batch_size * spec.seq_len, fpt, _peak_tflops(cpu), shape["warmup"]))
    rel = abs(losses[0] - mz_loss) / abs(mz_loss)
    result["step1_vs_megazero"] = {"rel_diff": rel, "rtol": HF_STEP1_RTOL, "close": rel <= HF_STEP1_RTOL}
    trainer = out / "trainer.json"
    if trainer.exists():
        zero1 = json.loads(trainer.read_text()).get("zero1")
        if zero1:
            result["losses_vs_trainer_zero1"] = _compare(losses, zero1["losses"], HF_STEP1_RTOL)
            result["megazero_over_plain"] = {
                "step_time": zero1["step_time_s"]["median"] / result["step_time_s"]["median"],
                "tokens_per_s": zero1["tokens_per_s"] / result["tokens_per_s"],
                "peak_memory": (zero1["memory"].get("peak_allocated_bytes") or zero1["memory"].get("peak_rss_bytes"))
                / memory.peak if memory.peak else None}
    if not result["step1_vs_megazero"]["close"]:
        result["error"] = (f"the first loss differs from megazero's from the same weights and batch: "
                           f"{losses[0]} vs {mz_loss} ({rel:.3g} relative > {HF_STEP1_RTOL})")
    return result


# -- planner -------------------------------------------------------------------------------------------

def _prediction(cfg, hardware, device: str) -> dict:
    from megazero.planner.from_config import layout_of, predicted_memory, spec_of
    from megazero.planner.speed import predict_step

    plan, why = predicted_memory(cfg, device=device)
    if plan is None:
        return {"error": why}
    stage = plan.stages[0]
    layout, _ = layout_of(cfg)
    step = predict_step(spec_of(cfg), layout, hardware)
    return {"memory_bytes": stage.device_bytes, "memory_with_fragmentation_bytes": stage.total,
            "memory_breakdown": dict(stage.breakdown) | {f"transient {k}": v for k, v in stage.transient.items()},
            "step_time_s": step.step_time_s, "tokens_per_s": step.tokens_per_s, "mfu": step.mfu,
            "step_breakdown_s": dict(step.breakdown)}


def stage_planner(out: Path, cpu: bool) -> dict:
    from megazero.planner.hardware import load_hardware

    shape = _shape(cpu)
    hardware = load_hardware(HARDWARE, str(ROOT / "configs" / "hardware"))
    measured = json.loads((out / "trainer.json").read_text()) if (out / "trainer.json").exists() else {}
    result = {"hardware": HARDWARE, "peak_tflops": hardware.peak_tflops}
    nearest = [o for o in ZERO3 if "partition_activations" not in o and "cpu_checkpointing" not in o]
    runs = {"zero1": ([], shape["steps"], "run zero1 as it ran"),
            "zero3_offload": (nearest, shape["zero3_steps"], "the nearest layout the planner models: run zero3_offload "
                              "with its checkpointed activations kept on the device (it models no cpu_checkpointing)")}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name, (extra, steps, what) in runs.items():
            pred = _prediction(_config(cpu, tmp, steps, extra), hardware, _device(cpu)) | {"predicts": what}
            run = measured.get(name)
            if run and "memory_bytes" in pred:
                mem = run["memory"]
                pred["measured"] = {"step_time_s": run["step_time_s"]["median"],
                                    "peak_memory_bytes": mem.get("peak_allocated_bytes", mem.get("peak_rss_bytes")),
                                    "peak_reserved_bytes": mem.get("peak_reserved_bytes")}
                m = pred["measured"]
                pred["predicted_over_measured"] = {
                    "step_time": pred["step_time_s"] / m["step_time_s"],
                    "memory": pred["memory_bytes"] / m["peak_memory_bytes"] if m["peak_memory_bytes"] else None,
                    "memory_with_fragmentation_over_reserved":
                        pred["memory_with_fragmentation_bytes"] / m["peak_reserved_bytes"]
                        if m["peak_reserved_bytes"] else None}
            result[name] = pred
    if cpu:
        result["note"] = ("on CPU the ratios compare the H200's predicted step time with a CPU step, and the "
                          "predicted device memory with the process' resident set: not comparable")
    elif "error" in result["zero1"]:
        result["error"] = result["zero1"]["error"]
    return result


STAGES = {"env": stage_env, "kernels": stage_kernels, "trainer": stage_trainer, "planner": stage_planner,
          "plain": stage_plain}  # in tools/gpu_check.sh's order


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _run_line(name: str, r: dict) -> str:
    mem = r.get("memory", {})
    peak = mem.get("peak_allocated_bytes", mem.get("peak_rss_bytes"))
    mfu = r.get("mfu")
    reserved = _gib(mem.get("peak_reserved_bytes"))
    line = (f"  {name:14s} {1e3 * r['step_time_s']['median']:9.1f} ms/step {r['tokens_per_s']:10.0f} tok/s  MFU "
            f"{'-' if mfu is None else f'{mfu:.1%}'}  peak {_gib(peak)} (reserved {reserved})")
    if "host_syncs" in r:
        line += f"  syncs/step {r['host_syncs'].get('per_step_counts')}"
    if "sync_debug_warnings" in r:
        line += f"  sync warnings {r['sync_debug_warnings']['total']}"
    return line


def summary(out: Path) -> str:
    """A few lines per stage from the JSON files in `out` (what tools/gpu_check.sh prints at its end)."""
    lines = []
    for name in STAGES:
        path = out / f"{name}.json"
        if not path.exists():
            lines.append(f"{name}: no JSON (not run)")
            continue
        d = json.loads(path.read_text())
        state = f"ERROR {str(d['error'])[:300]}" if "error" in d else "ok"
        lines.append(f"{name}: {state} ({d.get('stage_s', '?')} s)")
        try:
            if name == "env":
                side = d.get("kernels", {}).get("cpu" if d.get("cuda_build") else "cuda", {})
                backends = ", ".join(f"{k}={v}" for k, v in side.items()) if isinstance(side, dict) else side
                missing = {k: v for k, v in d.get("requirements", {}).items() if str(v).startswith("missing")}
                lines.append(f"  {d.get('device')}, torch {d.get('torch')}, CUDA {d.get('cuda')}; kernels: {backends}; "
                             f"build {d.get('kernel_build_and_load_s', '-')} s "
                             f"{d.get('build_check', d.get('cuda_build'))}"
                             + (f"; MISSING {missing}" if missing else ""))
            elif name == "kernels":
                lines.append(f"  {d.get('skipped') or d.get('counts')} failed: {d.get('failed', [])[:10]}")
            elif name == "trainer":
                for run in ("zero1", "zero1_save", "resume", "zero3_offload"):
                    if run in d:
                        lines.append(_run_line(run, d[run]))
                if "resume" in d:
                    lines.append(f"  resume at {d['resume']['resumed_at']}: {d['resume']['losses_vs_uninterrupted']}")
                if "flash" in d:
                    flash = d["flash"]
                    lines.append(f"  flash confirmed {flash.get('confirmed')}: {flash.get('flash_names', [])[:4]}")
            elif name == "plain":
                lines.append(_run_line("hf llama", d) if "step_time_s" in d else "  (no timing)")
                lines.append(f"  step 1 vs megazero {d.get('step1_vs_megazero')}; megazero / plain "
                             f"{d.get('megazero_over_plain')}")
            elif name == "planner":
                for run in ("zero1", "zero3_offload"):
                    p = d.get(run, {})
                    lines.append(f"  {run}: predicted {p.get('step_time_s', 0) * 1e3:.1f} ms, "
                                 f"{_gib(p.get('memory_bytes'))}; "
                                 f"predicted / measured {p.get('predicted_over_measured', p.get('error'))}")
        except (KeyError, TypeError, ValueError) as err:
            lines.append(f"  (summary incomplete: {type(err).__name__}: {err})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=sorted(STAGES))
    parser.add_argument("--summary", action="store_true", help="print the summary of the JSON files in --out")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (the dry run of the GPU check)")
    parser.add_argument("--limit", type=float, help="the stage's time limit in seconds (gpu_check.sh's timeout)")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary(Path(args.out)))
        return 0
    if not args.stage:
        parser.error("--stage or --summary")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    start = time.perf_counter()
    try:
        if not args.cpu:  # megazero's NCCL/CUDA environment before anything creates the CUDA context, as its launcher
            from megazero.runtime.launch import nccl_environment

            NCCL_SET.update(nccl_environment("auto"))
        if args.stage == "kernels":
            data = stage_kernels(out, args.cpu, args.limit)
        else:
            data = STAGES[args.stage](out, args.cpu)
        code = 1 if "error" in data else 0
    except Exception as err:  # noqa: BLE001  (recorded: the next stage still runs)
        previous = out / f"{args.stage}.json"
        data = json.loads(previous.read_text()) if previous.exists() else {}
        data["error"] = f"{type(err).__name__}: {err}"
        data["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
        code = 1
    data["stage_s"] = round(time.perf_counter() - start, 2)
    _write(out, args.stage, data)
    print(f"gpu_check {args.stage}: {'ok' if code == 0 else 'FAILED: ' + str(data['error'])[:500]} "
          f"({data['stage_s']} s)", flush=True)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch 2.13 + gloo can abort at interpreter exit
