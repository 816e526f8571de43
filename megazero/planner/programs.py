"""The pipeline programs a plan runs through, built once per distinct schedule when the caller
keeps a cache (a search plans thousands of layouts over a few dozen schedules)."""
from __future__ import annotations

from megazero.core.schedules import get_schedule
from megazero.core.simulate import Costs


def schedule_programs(name: str, p: int, m: int, v: int, costs: Costs | None = None, cache: dict | None = None):
    """`megazero.core.schedules.get_schedule(name, p, m, v, costs)`, from `cache` (a dict the caller
    owns, e.g. `megazero.toolbox.plan.Planner`'s) when it holds them, else built and stored there."""
    if cache is None:
        return get_schedule(name, p, m, v, costs)
    key = (name, p, m, v, costs)
    if key not in cache:
        cache[key] = get_schedule(name, p, m, v, costs)
    return cache[key]
