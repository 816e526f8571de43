"""The stages of `tools/gpu_check.sh`, one JSON file each (`--stage NAME --out DIR`, `--cpu` for tiny shapes).

    python benchmarks/gpu_check.py --stage trainer --out runs/gpu_check          # on the GPU
    python benchmarks/gpu_check.py --stage trainer --out /tmp/check --cpu         # its dry run on CPU

Stages (each writes <out>/<stage>.json, also when it fails: {"error": ...}, so a timeout or a crash
leaves what was measured before):

- ``env``: torch, CUDA, the device, the NCCL environment megazero sets, the kernels megazero loads
  for this device (built for its architecture; on CPU the reference twins).
- ``kernels``: the ``gpu``-marked tests (fused norms, the causal softmax and multi-tensor Adam against
  their PyTorch twins) and the CUDA-only clock and attention tests, pass/fail per test (on CPU: skipped).
- ``trainer``: megazero's real trainer (`megazero.run.train.run`) on a Llama spec (~1B parameters in bf16
  on the GPU; a 2-layer one on CPU), the flash SDPA backend forced (no fallback possible) and confirmed by
  the profiler's kernel names: (a) ZeRO-1, selective recompute, an asynchronous checkpoint save half-way;
  (b) a resume from that checkpoint, whose losses must equal (a)'s; (c) ZeRO-3 with the optimizer offloaded
  to the CPU and overlap_comm, full recompute with activations checkpointed to the CPU. Each run under
  `torch.cuda.set_sync_debug_mode("warn")` (GPU) and `megazero.runtime.sync_counter.SyncCounter`: host
  synchronisations per step, by call site. Step time, tokens/s, MFU, the peak memory during the run
  (`torch.cuda.max_memory_allocated`; on CPU the process' peak resident set).
- ``plain``: the same shape as a plain PyTorch loop whose model code is not megazero's: transformers'
  `LlamaForCausalLM` from a `LlamaConfig` (random weights, nothing downloaded), SDPA attention, bf16,
  torch's fused AdamW; step time, tokens/s, MFU, peak memory.
- ``planner``: megazero's planner for run (a) on the device's hardware preset: memory per GPU and step
  time, next to what ``trainer`` measured (ratios).

MFU = 6·N·tokens + 12·L·h·s·tokens FLOPs per step over the step time and the dense bf16 peak of the
hardware preset (989 TFLOP/s on an H200; on CPU no MFU).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ~1.1B parameters: 16 layers of hidden 2048 (Llama-3.2-1B's shape, a 32k vocabulary), sequence 2048
GPU_MODEL = {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn_hidden": 8192, "vocab": 32000,
             "seq_len": 2048}
CPU_MODEL = {"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 4, "ffn_hidden": 176, "vocab": 512, "seq_len": 32}
GPU_BATCH, CPU_BATCH = 4, 2  # micro-batch (one rank: the global batch)
GPU_STEPS, CPU_STEPS = 12, 6  # steps per trainer run; the async save after half of them
HARDWARE = "h200-141gb"


def _device(cpu: bool) -> str:
    return "cpu" if cpu else "cuda"


def _peak_memory(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process' peak resident set


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_tflops(cpu: bool) -> float | None:
    if cpu:
        return None
    from megazero.planner.hardware import load_hardware

    return load_hardware(HARDWARE, str(ROOT / "configs" / "hardware")).peak_tflops


def _flops_per_step(model: dict, params: int, tokens: int) -> float:
    return 6 * params * tokens + 12 * model["layers"] * model["hidden"] * model["seq_len"] * tokens


# -- env -----------------------------------------------------------------------------------------------

def stage_env(out: Path, cpu: bool) -> dict:
    from megazero.run.launch import NCCL_ENVIRONMENT, nccl_environment

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cuda_available": torch.cuda.is_available(), "nccl_environment_set": nccl_environment("auto"),
            "nccl_environment": {k: os.environ.get(k) for k in NCCL_ENVIRONMENT}}
    if torch.cuda.is_available() and not cpu:
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
        import megazero.runtime.kernels as kernels

        info["kernels"] = kernels.kernel_info()  # builds for this architecture (MEGAZERO_KERNELS=strict: or fails)
    else:
        info["device"] = platform.processor() or platform.machine()
        info["kernels"] = {"skipped": "no CUDA device: the reference twins run on CPU"}
    return info


# -- kernels -------------------------------------------------------------------------------------------

def stage_kernels(out: Path, cpu: bool) -> dict:
    if cpu or not torch.cuda.is_available():
        return {"skipped": "no CUDA device (the gpu-marked tests need one)"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or not gpu",
                               "tests/test_kernels_gpu.py", "tests/test_clock.py", "tests/test_attention_core.py",
                               f"--junitxml={xml}"], cwd=ROOT, capture_output=True, text=True, timeout=170)
        cases = {}
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                failed = case.find("failure") if case.find("failure") is not None else case.find("error")
                skipped = case.find("skipped")
                cases[name] = ("failed: " + (failed.get("message") or "")[:300] if failed is not None
                               else "skipped" if skipped is not None else "passed")
    return {"returncode": proc.returncode, "tests": cases, "tail": proc.stdout[-2000:],
            "failed": sorted(k for k, v in cases.items() if v.startswith("failed"))}


# -- trainer -------------------------------------------------------------------------------------------

def _config(cpu: bool, run_dir: str, steps: int, extra: list[str]) -> list[str]:
    model = CPU_MODEL if cpu else GPU_MODEL
    batch = CPU_BATCH if cpu else GPU_BATCH
    overrides = [f"model.{k}={v}" for k, v in model.items() if k != "seq_len"] + [
        "model.spec=model_specs/llama.py:debug", f"model.seq_len={model['seq_len']}",
        "parallel.pp=1", "parallel.tp=1", "data.path=null", f"train.micro_batch_size={batch}",
        f"train.global_batch_size={batch}", f"train.steps={steps}", "log.interval=1",
        "log.progress_bar=false", f"run_dir={run_dir}", f"precision={'fp32' if cpu else 'bf16'}"]
    peak = _peak_tflops(cpu)
    if peak:
        overrides.append(f"log.peak_tflops={peak}")
    return overrides + extra


def _train(cpu: bool, run_dir: str, steps: int, extra: list[str]) -> dict:
    """One trainer run: its metrics, peak memory, host synchronisations and wall time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.engine import load_run_config
    from megazero.models import count_params
    from megazero.run import train
    from megazero.runtime.sync_counter import SyncCounter

    cfg = load_run_config("configs/debug_llama.yaml", _config(cpu, run_dir, steps, extra))
    device = _device(cpu)
    _reset_peak(device)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")  # every synchronising CUDA call warns on stderr too
    start = time.perf_counter()
    try:
        with SyncCounter() as syncs, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no fallback: flash or an error
            code = train.run(cfg, 0)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in open(cfg.log.metrics_file) if line.strip()]
    measured = rows[1:] or rows  # the first step builds and warms up
    step_times = sorted(r["step_time_s"] for r in measured)
    spec_params = count_params(_spec(cfg))
    median = step_times[len(step_times) // 2]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    peak = _peak_tflops(cpu)
    flops = _flops_per_step(CPU_MODEL if cpu else GPU_MODEL, spec_params, tokens)
    return {"exit_code": code, "steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows],
            "step_time_s": {"median": median, "min": step_times[0], "max": step_times[-1]},
            "tokens_per_s": tokens / median, "mfu": flops / median / (peak * 1e12) if peak else None,
            "parameters": spec_params, "peak_memory_bytes": _peak_memory(device), "wall_s": wall,
            "host_syncs": {"total": syncs.count, "per_step": syncs.count / max(1, len(rows)),
                           "by_site": dict(syncs.by_site().most_common())}}


def _spec(cfg):
    from megazero.planner.from_config import spec_of

    return spec_of(cfg)


def _flash_confirmed(cpu: bool) -> dict:
    """One attention call of the model's shape under the flash-only backend, profiled: the kernel names."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    model = CPU_MODEL if cpu else GPU_MODEL
    device, dtype = _device(cpu), torch.float32 if cpu else torch.bfloat16
    d = model["hidden"] // model["heads"]
    shape = (CPU_BATCH if cpu else GPU_BATCH, model["heads"], model["seq_len"], d)
    q = torch.randn(shape, device=device, dtype=dtype)
    k = torch.randn(shape[0], model["kv_heads"], shape[2], d, device=device, dtype=dtype)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        if device == "cuda":
            torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages() if "flash" in e.key.lower()})
    return {"flash_kernels": names, "confirmed": bool(names)}


def stage_trainer(out: Path, cpu: bool) -> dict:
    steps = CPU_STEPS if cpu else GPU_STEPS
    half = steps // 2
    result = {"model": CPU_MODEL if cpu else GPU_MODEL, "micro_batch": CPU_BATCH if cpu else GPU_BATCH,
              "flash": _flash_confirmed(cpu)}
    with tempfile.TemporaryDirectory() as tmp:
        zero1 = ["zero.stage=1", "activation_checkpointing.policy=selective", f"checkpoint.save_interval={half}",
                 "checkpoint.async_save=true", "checkpoint.keep_last=0"]
        result["zero1"] = _train(cpu, os.path.join(tmp, "a"), steps, zero1)
        _write(out, "trainer", result)  # what is measured so far survives a later failure
        # (b) the same run resumed from (a)'s checkpoint at step `half`: the later steps' losses must be (a)'s
        resumed_dir = os.path.join(tmp, "b")
        resume = zero1[:2] + [f"checkpoint.load={os.path.join(tmp, 'a', 'checkpoints', f'step{half}')}",
                              "checkpoint.save_interval=0"]
        result["resume"] = _train(cpu, resumed_dir, steps, resume)
        later = result["zero1"]["losses"][half:]
        result["resume"]["equal_to_uninterrupted"] = result["resume"]["losses"][-len(later):] == later
        result["resume"]["resumed_at"] = half
        _write(out, "trainer", result)
        zero3 = ["zero.stage=3", "zero.offload_optimizer.device=cpu", "zero.overlap_comm=true",
                 "activation_checkpointing.policy=full", "activation_checkpointing.partition_activations=true",
                 "activation_checkpointing.cpu_checkpointing=true"]
        result["zero3_offload"] = _train(cpu, os.path.join(tmp, "c"), steps, zero3)
    return result


# -- plain PyTorch -------------------------------------------------------------------------------------

def stage_plain(out: Path, cpu: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    model_shape = CPU_MODEL if cpu else GPU_MODEL
    device, dtype = _device(cpu), torch.float32 if cpu else torch.bfloat16
    batch, steps = (CPU_BATCH, CPU_STEPS) if cpu else (GPU_BATCH, GPU_STEPS)
    config = LlamaConfig(vocab_size=model_shape["vocab"], hidden_size=model_shape["hidden"],
                         intermediate_size=model_shape["ffn_hidden"], num_hidden_layers=model_shape["layers"],
                         num_attention_heads=model_shape["heads"], num_key_value_heads=model_shape["kv_heads"],
                         max_position_embeddings=model_shape["seq_len"], tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    _reset_peak(device)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(steps):
        tokens = torch.randint(0, model_shape["vocab"], (batch, model_shape["seq_len"]), generator=gen).to(device)
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))  # the plain loop reads its loss every step
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    median = sorted(times[1:])[len(times[1:]) // 2]
    tokens = batch * model_shape["seq_len"]
    peak = _peak_tflops(cpu)
    flops = _flops_per_step(model_shape, params, tokens)
    return {"model": "transformers.LlamaForCausalLM", "parameters": params, "losses": losses,
            "step_time_s": {"median": median, "min": min(times[1:]), "max": max(times[1:])},
            "tokens_per_s": tokens / median, "mfu": flops / median / (peak * 1e12) if peak else None,
            "peak_memory_bytes": _peak_memory(device)}


# -- planner -------------------------------------------------------------------------------------------

def stage_planner(out: Path, cpu: bool) -> dict:
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, predicted_memory, spec_of
    from megazero.planner.hardware import load_hardware
    from megazero.planner.speed import predict_step

    steps = CPU_STEPS if cpu else GPU_STEPS
    cfg = load_run_config("configs/debug_llama.yaml", _config(cpu, "/tmp/planner", steps, [
        "zero.stage=1", "activation_checkpointing.policy=selective"]))
    plan, why = predicted_memory(cfg, device=_device(cpu))
    result = {"hardware": HARDWARE}
    if plan is None:
        return result | {"error": why}
    stage = plan.stages[0]
    result["memory_bytes"] = stage.device_bytes  # without the fragmentation allowance: the allocator's peak
    result["memory_total_with_fragmentation"] = stage.total
    result["memory_breakdown"] = dict(stage.breakdown) | {f"transient {k}": v for k, v in stage.transient.items()}
    layout, _ = layout_of(cfg)
    hardware = load_hardware(HARDWARE, str(ROOT / "configs" / "hardware"))
    step = predict_step(spec_of(cfg), layout, hardware)
    result.update(step_time_s=step.step_time_s, tokens_per_s=step.tokens_per_s, mfu=step.mfu)
    measured = out / "trainer.json"
    if measured.exists():
        run = json.loads(measured.read_text()).get("zero1", {})
        if run:
            result["measured"] = {"step_time_s": run["step_time_s"]["median"],
                                  "peak_memory_bytes": run["peak_memory_bytes"]}
            result["ratio_predicted_over_measured"] = {
                "step_time": step.step_time_s / run["step_time_s"]["median"],
                "memory": result["memory_bytes"] / run["peak_memory_bytes"]}
    if cpu:
        result["note"] = "on CPU the step time is the H200's prediction, not comparable with the CPU measurement"
    return result


STAGES = {"env": stage_env, "kernels": stage_kernels, "trainer": stage_trainer, "plain": stage_plain,
          "planner": stage_planner}


def _write(out: Path, name: str, data: dict) -> None:
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=sorted(STAGES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (the dry run of the GPU check)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    start = time.perf_counter()
    try:
        data = STAGES[args.stage](out, args.cpu)
        code = 0
    except Exception as err:  # noqa: BLE001  (recorded: the next stage still runs)
        previous = out / f"{args.stage}.json"
        data = json.loads(previous.read_text()) if previous.exists() else {}
        data["error"] = f"{type(err).__name__}: {err}"
        data["traceback"] = traceback.format_exc()[-4000:]
        code = 1
    data["stage_s"] = round(time.perf_counter() - start, 2)
    _write(out, args.stage, data)
    print(f"gpu_check {args.stage}: {'ok' if code == 0 else data['error']} ({data['stage_s']} s)", flush=True)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # torch 2.13 + gloo can abort at interpreter exit
