"""Whether every rank's PipelineModule was built for that rank's own pipeline stage, agreed over the world group.

A user builds a PipelineModule per rank with ``stage=...``; which stage a rank holds is the topology's, known
once the process groups exist. This is the one refusal of `megazero.initialize` that needs a group (every
other one is raised before any exists: `megazero.core.config.spec_checks`, `initialize_checks`): the ranks
take the max of a "wrong stage" flag, so that all of them stop with the error, not only the wrong ones.
"""
from __future__ import annotations

import torch

from megazero.core.config import ConfigError
from megazero.runtime import comm


def agree_on_stage(stage_index: int, pp_rank: int, global_rank: int, world_group, device) -> None:
    """Raise ConfigError on every rank unless each rank's module (built with `stage_index`) holds its
    pipeline stage `pp_rank`. One all-reduce (max) of a one-element flag over `world_group`."""
    wrong = stage_index != pp_rank
    flag = torch.tensor([1.0 if wrong else 0.0], device=device)
    comm.all_reduce(flag, world_group, op="max")
    if flag.item() > 0:
        mine = (f"this rank's module was built with stage={stage_index}, its pipeline stage is {pp_rank}"
                if wrong else "another rank's module was built for another stage")
        raise ConfigError(f"PipelineModule stage (global rank {global_rank}): {mine}; build each rank's module "
                          f"with stage = Topology(pp=..., dp=..., tp=..., order=...).coords(rank).pp")
