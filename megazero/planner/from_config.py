"""A resolved training config as the planner's `Layout`, and its memory prediction as text.

`config explain` and the trainer's start-up summary show the prediction next to what a run holds;
both start from the resolved `megazero.core.config.Config`. Every layout the trainer accepts has a plan: every schedule (a
.csv file too), partition and activation-checkpointing option.
"""
from __future__ import annotations

from megazero.core.spec import spec_of
from megazero.planner.layout import Layout
from megazero.planner.memory_plan import predict_memory

MIB = 2 ** 20


def expert_tp_of(cfg) -> int | None:
    """``parallel.expert_tp`` (None: tp), or 1 from a schema without the key, whose runtime replicates
    every expert over the TP group."""
    return getattr(cfg.parallel, "expert_tp", 1)


def layout_of(cfg) -> tuple[Layout | None, str]:
    """(the Layout of resolved config `cfg`, "") or (None, why the planner cannot model it). Context parallelism:
    ``parallel.cp`` and ``parallel.cp_method`` (dp is already the config's derived world / (pp x tp x cp)); the
    planner places the cp ranks just outside tp, the default ``parallel.order``."""
    pl, ac, z, t = cfg.pipeline, cfg.activation_checkpointing, cfg.zero, cfg.train
    layout = Layout(tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp, ep=cfg.parallel.ep,
                    expert_tp=expert_tp_of(cfg), micro_batch=t.micro_batch_size,
                    global_batch=t.global_batch_size, zero=z.stage, recompute=ac.policy, schedule=pl.schedule,
                    every_k_layers=ac.every_k_layers, number_checkpoints=ac.number_checkpoints,
                    partition_activations=ac.partition_activations, cpu_checkpointing=ac.cpu_checkpointing,
                    contiguous_checkpoints=ac.contiguous_memory_optimization,
                    chunks=pl.chunks, partition=pl.partition if isinstance(pl.partition, str) else tuple(pl.partition),
                    sequence_parallel=cfg.parallel.sequence_parallel,
                    offload_optimizer=z.offload_optimizer.device == "cpu", offload_param=z.offload_param.device == "cpu",
                    precision=cfg.precision, reduce_bucket_size=z.reduce_bucket_size,
                    allgather_bucket_size=z.allgather_bucket_size, prefetch_bucket_size=z.prefetch_bucket_size,
                    overlap_comm=z.overlap_comm, cp=getattr(cfg.parallel, "cp", 1),
                    cp_method=getattr(cfg.parallel, "cp_method", "ring"), **comm_options_of(cfg))
    return layout, ""


def comm_options_of(cfg) -> dict:
    """The Layout's communication options from ``comm.hierarchical``, ``parallel.ranks_per_node``,
    ``optimizer.type`` (onebit_adam: modelled past its warm-up) and ``zero.quantized_weights`` /
    ``hpz_partition_size`` / ``quantized_gradients``; read with getattr, so a schema without a key
    gives the option's default."""
    z = cfg.zero
    return {"hierarchical": bool(getattr(getattr(cfg, "comm", None), "hierarchical", False)),
            "ranks_per_node": getattr(cfg.parallel, "ranks_per_node", None),
            "onebit": getattr(getattr(cfg, "optimizer", None), "type", None) == "onebit_adam",
            "quantized_weights": bool(getattr(z, "quantized_weights", False)),
            "hpz": getattr(z, "hpz_partition_size", 1) or 1,
            "quantized_gradients": bool(getattr(z, "quantized_gradients", False))}


def predicted_memory(cfg, facts=None, device: str = "cuda"):
    """(MemoryPlan, "") of resolved config `cfg`, or (None, why not)."""
    layout, why = layout_of(cfg)
    if layout is None:
        return None, why
    return predict_memory(spec_of(cfg), layout, facts, device=device,
                          param_persistence_threshold=cfg.zero.param_persistence_threshold), ""


def memory_lines(plan, measured: dict[int, dict[str, int]] | None = None) -> list[str]:
    """One line per pipeline stage: the predicted categories in MiB, and with `measured`
    ({stage: memory_report of one of its ranks}) each measured value after a slash."""
    lines = []
    for st in plan.stages:
        got = (measured or {}).get(st.stage)
        parts = []
        for k, v in st.breakdown.items():
            if v or (got and got.get(k)):
                parts.append(f"{k} {v / MIB:.2f}" + (f"/{got.get(k, 0) / MIB:.2f}" if got is not None else ""))
        lines.append(f"stage {st.stage}: " + ", ".join(parts) + f"; device total with transients and "
                     f"{plan.fragmentation:.0%} fragmentation {st.total / MIB:.2f}")
    return lines
