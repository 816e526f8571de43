"""Where a picture's times come from: the plan, the planner's prediction for a config, or a run.

* `planned(name, p, m, v, costs)`: the schedule through the simulator, unit or given costs;
* `predicted(cfg, hardware)`: the schedule a resolved training config runs, each instruction on each
  stage timed by the planner (`megazero.planner.speed.predicted_simulation`) for that model on that
  hardware, in ms, with each stage's activation bytes at its peak (`predict_memory`); `PlanError`
  when the planner cannot model the layout, or it does not fit the device;
* `planned_for(step)`: what a measured step's own programs promise when every instruction takes its
  mean measured time and every transfer the fastest measured on its link (`MeasuredStep.costs`).
"""
from __future__ import annotations

from megazero.core.schedules import get_schedule
from megazero.core.simulate import Costs, simulate
from megazero.planner.from_config import layout_of, spec_of
from megazero.planner.layout import PlanError
from megazero.planner.memory_plan import predict_memory
from megazero.planner.speed import predicted_simulation
from megazero.viz.measured import MeasuredStep
from megazero.viz.timeline import Timeline, format_bytes, from_simulation


def planned(name: str, p: int, m: int, v: int, costs: Costs | None = None) -> Timeline:
    """The simulated step of schedule `name` (or a .csv) as a Timeline; ScheduleError on bad sizes."""
    result = simulate(get_schedule(name, p, m, v, costs), costs)
    return from_simulation(result, f"{name}: p={p} m={m} v={v}")


def predicted(cfg, hardware, device: str = "cuda") -> Timeline:
    """The planner's prediction of one step of resolved config `cfg` on `hardware` (a `Hardware`)."""
    layout, why = layout_of(cfg)
    if layout is None:
        raise PlanError(f"the planner cannot model this config: {why}")
    spec = spec_of(cfg)
    memory = predict_memory(spec, layout, None, hardware, device=device,
                            param_persistence_threshold=cfg.zero.param_persistence_threshold)
    if not memory.fits:
        over = ", ".join(f"stage {s} by {gb:.2f} GB" for s, gb in memory.over)
        raise PlanError(f"the layout pp={layout.pp} tp={layout.tp} dp={layout.dp} ZeRO-{layout.zero} does not fit "
                        f"{hardware.name} ({hardware.hbm_bytes / 2 ** 30:.0f} GiB): {over}; "
                        f"tools/plan.py --search finds layouts that fit")
    sim, _ = predicted_simulation(spec, layout, hardware)
    peak = [st.breakdown["activations"] for st in memory.stages]
    title = (f"{cfg.pipeline.schedule} p={layout.pp} m={layout.num_microbatches} v={layout.chunks}, "
             f"tp={layout.tp} dp={layout.dp}, {cfg.model.spec} on {hardware.name}")
    return from_simulation(sim, title, unit="ms", source="predicted", scale=1e3, peak_bytes=peak)


def planned_for(step: MeasuredStep) -> Timeline:
    """The plan of a measured step: its executed programs simulated with its measured costs (ms)."""
    result = simulate(step.programs, step.costs())
    title = f"step {step.step}'s programs at its mean measured costs"
    return from_simulation(result, title, unit="ms", source="planned")


__all__ = ["format_bytes", "planned", "planned_for", "predicted"]
