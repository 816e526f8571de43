"""DeepSpeed's ZeRO memory estimators (`deepspeed.runtime.zero.stage3` / `stage_1_and_2`
`estimate_zero{2,3}_model_states_mem_needs_all_live / _all_cold`): DeepSpeed's published rule of thumb
for the model states per CPU and per GPU, with its arguments, table and numbers (16-bit parameters,
fp32 master and Adam states, `additional_buffer_factor` on host memory). They describe DeepSpeed's
engine; megazero's own exact per-rank bytes for a layout come from `tools/plan.py` (and, measured,
from `log.memory_breakdown`). Pure arithmetic: no communication."""
from __future__ import annotations


def _fmt(nbytes: float) -> str:
    return f"{nbytes / 2**30:7.2f}GB"


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5) -> tuple[int, int]:
    """(cpu bytes, gpu bytes) per device: offloaded, 2 bytes per parameter on the GPU and
    max(4 x GPUs, 16) on the host; else 2 + 18 / GPUs (16-bit and fp32 gradients, fp32 master, Adam's
    two states) on the GPU and 4 x GPUs per node on the host, host figures x the buffer factor."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5) -> tuple[int, int, int]:
    """(cpu bytes, gpu bytes, largest layer bytes): the largest layer gathered in fp32 (4 bytes per
    parameter) on the GPU always; the 18 bytes per parameter of the model states on the GPU, split over
    every GPU, unless offloaded (16 with the parameters still on the GPU: 2 / GPUs stay); the host holds
    what is offloaded (split per node) or, without zero.Init, every GPU's whole model once."""
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest
            per_param = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        else:
            gpu_mem = largest + int(2 * total_params / gpus)
            per_param = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        cpu_mem = total_params * per_param * additional_buffer_factor
    else:
        gpu_mem = largest + int(18 * total_params / gpus)
        held = largest_layer_params if zero_init else total_params
        cpu_mem = held * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest


def model_to_params(model) -> tuple[int, int]:
    """(total parameters, each shared one once; the largest number any one module owns directly)."""
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _header(num_nodes, num_gpus_per_node, params_line) -> str:
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {'nodes' if num_nodes > 1 else 'node'}, {num_gpus_per_node} "
            f"{'GPUs' if num_gpus_per_node > 1 else 'GPU'} per node.\n{params_line}\n  per CPU  |  per GPU |   Options")


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> list[tuple[int, int, str]]:
    """Print DeepSpeed's ZeRO-2 table for a model of `total_params`; returns its rows
    (cpu bytes, gpu bytes, options)."""
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                         additional_buffer_factor)
        rows.append((cpu, gpu, f"offload_optimizer={'cpu ' if offload else 'none'}"))
    print(_header(num_nodes, num_gpus_per_node, f"SW: Model with {int(total_params / 1e6)}M total params."))
    for cpu, gpu, options in rows:
        print(f" {_fmt(cpu)} | {gpu / 2**30:6.2f}GB | {options}")
    return rows


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    return estimate_zero2_model_states_mem_needs_all_cold(model_to_params(model)[0], num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5):
    """Print DeepSpeed's ZeRO-3 table (offload of optimizer / parameters, with and without zero.Init);
    returns its rows (cpu bytes, gpu bytes, options)."""
    rows = []
    for offload in (True, False):
        for offload_params in (True, False):
            if offload_params and not offload:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                                                                    num_gpus_per_node, num_nodes, offload,
                                                                    offload_params, zero_init,
                                                                    additional_buffer_factor)
                rows.append((cpu, gpu, f"offload_param={'cpu ' if offload_params else 'none'}, offload_optimizer="
                                       f"{'cpu ' if offload else 'none'}, zero_init={int(zero_init)}"))
    print(_header(num_nodes, num_gpus_per_node, f"SW: Model with {int(total_params / 1e6)}M total params, "
                                                f"{int(largest_layer_params / 1e6)}M largest layer params."))
    for cpu, gpu, options in rows:
        print(f" {_fmt(cpu)} | {gpu / 2**30:6.2f}GB | {options}")
    return rows


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)
