"""The probes that time megazero's own training step on this machine, for ``plan.py --calibrate``
(`megazero.toolbox.calibrate`, whose one rank alone runs them): the host time per dispatched operator (`probe_host`)
and a probe model's step against the planner's prediction of it (`probe_in_step`), with the single-process
engines they run (`tiny_engine`) and the operator count (`OpCount`)."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from megazero.toolbox.probe_timing import median_seconds


def _debug_spec(name: str) -> str | None:
    """The path of the repository's model_specs/`name`:debug, None where model_specs/ is not at hand."""
    from pathlib import Path

    import megazero

    spec = Path(megazero.__file__).resolve().parents[1] / "model_specs" / name
    return f"{spec}:debug" if spec.is_file() else None


def probe_host(repeats: int = 5) -> float:
    """Seconds of host time per dispatched operator in megazero's own training step on this machine (Python,
    the dispatcher, autograd, the engine): a tiny debug GPT (h 32, s 8) of 2 and of 6 blocks, one step each,
    its operators counted with a dispatch mode; the difference of the step times over the difference of the
    counts. A single-process engine (run by one rank alone, `_alone`). 0.0 where the repository's
    model_specs/ is not at hand."""
    spec = _debug_spec("gpt.py")
    if spec is None:
        return 0.0

    def step(layers: int) -> tuple[int, float]:
        engine, data = tiny_engine(spec, layers)
        engine.train_batch(data)
        with OpCount() as count:
            engine.train_batch(data)
        return count.n, median_seconds(lambda: engine.train_batch(data), repeats, lambda: None, sample_s=0.1)

    (n_small, t_small), (n_big, t_big) = step(2), step(6)
    return max(0.0, (t_big - t_small) / max(1, n_big - n_small))


PROBE_MODEL = {"layers": 4, "hidden": 192, "heads": 6, "vocab": 256, "seq_len": 96}
"""The debug GPT whose training step `probe_in_step` times (4 micro-batches of 2 sequences, ZeRO-1, fp32): a
shape of its own, none of the benchmark's (benchmarks/planner_cpu.py: h 256, s 128)."""


def probe_in_step(hardware: dict, repeats: int = 5) -> float:
    """On a CPU, a training step's time over the time the planner gives it from `hardware` (a hardware file's
    content, measured alone on this machine by one rank, ``in_step`` 1): `PROBE_MODEL`'s step, one rank, the
    median of `repeats` samples. A CPU's kernels run slower inside a step than one by one (each finds the
    caches full of the previous one's data; the allocator, autograd's and the engine's bookkeeping); the
    planner scales every compute second by this, host time included (`Efficiency.in_step`): an empirical
    correction from one model. 1.0 where model_specs/ is not at hand. A single-process engine (run by one rank
    alone, with all the cores: `_alone`)."""
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, spec_of
    from megazero.planner.hardware import FIELDS, Hardware
    from megazero.planner.speed import predict_step

    spec = _debug_spec("gpt.py")
    if spec is None:
        return 1.0
    config = tiny_config(spec, micro_batch=2, micro_batches=4, zero=1, **PROBE_MODEL)
    engine, data = tiny_engine(config=config)
    engine.train_batch(data)
    measured = median_seconds(lambda: engine.train_batch(data), repeats, lambda: None, sample_s=0.3)
    run = load_run_config(config, world_size=1)
    machine = Hardware(**{k: hardware[k] for k in FIELDS}, efficiency=tuple(sorted(hardware["efficiency"].items())))
    predicted = predict_step(spec_of(run), layout_of(run)[0], machine).step_time_s
    return measured / predicted


class OpCount(TorchDispatchMode):
    """Counts the operators dispatched while active (`n`)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def tiny_config(spec: str, layers: int, policy: str = "none", micro_batch: int = 1, micro_batches: int = 1,
                 zero: int = 0, **model) -> dict:
    """A single-process fp32 run config of the model `spec` (default h 32, s 8; `model` overrides)."""
    return {"model": {"spec": spec, "layers": layers, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8, **model},
            "precision": "fp32",
            "train": {"micro_batch_size": micro_batch, "global_batch_size": micro_batch * micro_batches, "seed": 1,
                      "steps": 100},
            "zero": {"stage": zero}, "activation_checkpointing": {"policy": policy},
            "optimizer": {"type": "adamw", "lr": 1e-4}}


def tiny_engine(spec: str | None = None, layers: int = 2, policy: str = "none", config: dict | None = None, **model):
    """(engine, data) of a single-process run: `config`, default a tiny model (h 32, s 8, one micro-batch of one
    sequence, ZeRO-0) of `spec`."""
    import megazero

    engine, _, data, _ = megazero.initialize(config=config or tiny_config(spec, layers, policy, **model))
    return engine, data
