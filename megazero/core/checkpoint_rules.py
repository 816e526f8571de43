"""The ``activation_checkpointing`` rules (pure): config validation (`megazero.core.config.checks`) and the
planner's `Layout` both ask `checkpointing_problems`, so a layout the trainer refuses the planner refuses
with the same message."""
from __future__ import annotations

from typing import Any

from megazero.core.suggest import did_you_mean

POLICIES = ("none", "full", "selective")
"""``activation_checkpointing.policy`` values."""


def checkpointing_problems(a: Any, sequence_parallel: bool) -> list[str]:
    """The ``activation_checkpointing`` rules, on any object with the section's fields (the config's section,
    the planner's `Layout` fields under these names); one message per problem, naming the key."""
    key = "activation_checkpointing"
    errs = [] if a.policy in POLICIES else [
        f"{key}.policy: {a.policy!r} is not valid{did_you_mean(str(a.policy), POLICIES)} (valid: {', '.join(POLICIES)})"]
    errs += [f"{key}.{k}: must be >= 1, got {v}" for k, v in (("every_k_layers", a.every_k_layers),
                                                              ("number_checkpoints", a.number_checkpoints))
             if v is not None and v < 1]
    if a.cpu_checkpointing and not a.partition_activations:
        errs.append(f"{key}.cpu_checkpointing: needs {key}.partition_activations")
    if a.contiguous_memory_optimization and a.number_checkpoints is None:
        errs.append(f"{key}.contiguous_memory_optimization: needs {key}.number_checkpoints")
    if a.every_k_layers != 1 and a.number_checkpoints is not None:
        errs.append(f"{key}.every_k_layers={a.every_k_layers} and {key}.number_checkpoints={a.number_checkpoints} "
                    f"both choose the checkpointed segments; set one of them")
    if a.policy == "none":
        for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                  "synchronize_checkpoint_boundary", "profile"):
            if getattr(a, k):
                errs.append(f"{key}.{k}: has no effect with {key}.policy=none; set {key}.policy=full (or selective)")
    if a.policy != "full":
        for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            if getattr(a, k) and a.policy == "selective":
                errs.append(f"{key}.{k}: acts on checkpointed layer inputs, which {key}.policy=selective does not "
                            f"keep; set {key}.policy=full")
        if a.every_k_layers != 1 or a.number_checkpoints is not None:
            errs.append(f"{key}.every_k_layers / number_checkpoints: choose the segments of {key}.policy=full; "
                        f"has no effect with policy={a.policy}")
    if a.partition_activations and sequence_parallel:
        errs.append(f"{key}.partition_activations: with parallel.sequence_parallel the layer inputs are already "
                    f"split across the TP group (each rank holds a different sequence chunk); unset one of them")
    return errs
