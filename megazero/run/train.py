"""The trainer: its command line (`main`) and its loop (`run`).

    torchrun --nproc_per_node=8 -m megazero.run.train configs/demo.yaml [key=value ...]
    python -m megazero.run.train configs/debug_gpt.yaml parallel.pp=1 parallel.tp=1   # one process

Every rank validates the config before any process group exists; a bad config, a layout that does
not fit the world size, or a missing data file ends every rank with one clear line (exit code 2).
Rank 0 prints a start summary, a progress bar, and the breakdowns; it writes one JSON object per
step to log.metrics_file, every log.interval steps (and at checkpoints and the end): the steps' losses
and gradient norms stay on the device until then (`PendingSteps`), so the host does not wait for the
device every step. Checkpoints go to checkpoint.dir every checkpoint.save_interval steps
and at the end; a run whose checkpoint.dir has a `latest` resumes from it (weights, optimizer, LR
schedule, RNG, data position; the metrics of later steps are dropped and appended again), else
checkpoint.load names where to start. Per-rank Chrome traces go to <run_dir>/trace/ when trace.enabled.

Communication beyond the engine's: the per-step metrics are already agreed on every rank by
`train_batch` (loss) and the optimizer (grad norm, loss scale); after the first step every rank's
measured memory is gathered to rank 0 over the world group, which prints it next to the planner's
prediction for each pipeline stage; with resilience.straggler_interval, every that many steps each
rank's step times are gathered over the world group (`megazero.resilience.stragglers`), after a ping-pong over
each link of the pp, dp and tp groups (`megazero.resilience.link_probe`). A rank whose step
fails prints why and ends at once (under torchrun --max-restarts the job restarts and resumes from
the newest complete checkpoint).
"""
from __future__ import annotations

import contextlib
import os
import sys

import megazero
from megazero.checkpoint import sharded
from megazero.core import flops as model_flops
from megazero.core.config import Config, ConfigError, to_dict, topology_of
from megazero.core.launch_env import LaunchEnvError, read_launch_env
from megazero.core.schedules import bubble_fraction
from megazero.core.spec import SpecError
from megazero.engine import data_iterator, initialize_from_config, load_run_config
from megazero.models import count_params
from megazero.planner.from_config import memory_lines, predicted_memory
from megazero.planner.layout import PlanError
from megazero.resilience.link_probe import LinkProbe
from megazero.resilience.on_failure import SaveOnFailure
from megazero.resilience.stragglers import StragglerWatch, describe
from megazero.run.memory import SavedActivationMeter, memory_report
from megazero.run.metrics import MetricsWriter, PendingSteps, Timers, comm_delta, format_bytes
from megazero.run.trace import Tracer
from megazero.runtime import comm
from megazero.viz.compare import compare
from megazero.viz.html import render_html
from megazero.viz.measured import MeasuredStep
from megazero.viz.sources import planned_for
from megazero.viz.svg import render_svg


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    path, overrides = argv[0], argv[1:]
    try:
        rank = read_launch_env(os.environ).rank
    except LaunchEnvError as err:
        print(f"megazero.run.train: error: {err}", file=sys.stderr)
        return 2
    try:
        if not os.path.exists(path):
            raise ConfigError(f"config file {path!r} does not exist")
        cfg = load_run_config(path, overrides)
        _check_data(cfg)
    except (ConfigError, SpecError, FileNotFoundError) as err:
        print(f"megazero.run.train: error: {str(err).splitlines()[0] if rank else err}", file=sys.stderr)
        return 2
    return run(cfg, rank)


def _check_data(cfg) -> None:
    """Every rank checks the data path (only some stages read it; all must stop together)."""
    if cfg.data.path is None:
        return
    if not os.path.exists(cfg.data.path + ".idx") or not os.path.exists(cfg.data.path + ".bin"):
        raise FileNotFoundError(
            f"data.path={cfg.data.path!r}: {cfg.data.path}.bin/.idx not found; create them with "
            f"`python tools/preprocess_data.py --input FILES --output-prefix {cfg.data.path}`")


def _summary(cfg, engine, optimizer) -> str:
    pctx, t, spec = engine.pctx, cfg.train, engine.module.model_spec
    p, m, v = pctx.pp_size, t.gradient_accumulation_steps, cfg.pipeline.chunks
    bubble = bubble_fraction(cfg.pipeline.schedule, p, m, v)
    return "\n".join([
        f"megazero {megazero.__version__} | run {cfg.name} -> {cfg.run_dir}",
        f"layout   pp={p} x tp={pctx.tp_size} x dp={pctx.dp_size}"
        + (f" x cp={pctx.cp_size} ({cfg.parallel.cp_method})" if pctx.cp_size > 1 else "")
        + f" = {pctx.topology.world_size} ranks, "
        f"ZeRO-{cfg.zero.stage}, {cfg.precision}, schedule {cfg.pipeline.schedule}"
        + (f" (v={v})" if v > 1 else ""),
        f"model    {cfg.model.spec}: {spec.layers} layers, hidden {spec.hidden}, heads {spec.heads}, "
        f"vocab {spec.vocab}, seq {spec.seq_len}; {count_params(spec) / 1e6:.2f}M params, "
        f"rank 0 holds {optimizer.num_params() / 1e6:.3f}M",
        f"batch    global {t.global_batch_size} = micro {t.micro_batch_size} x accumulation {m} x dp "
        f"{pctx.dp_size}; micro-batches per flush {m}; bubble {bubble:.1%} (simulated, unit costs)",
    ])


def run(cfg: Config, rank: int) -> int:
    """Train the resolved config `cfg` (from `load_run_config`) as global rank `rank`; returns the exit code.

    Built from the engine (`initialize_from_config`), the failure save's trigger
    (`megazero.resilience.on_failure`), the resume (`_resume`) and the step loop's parts (`_Loop`). One close
    path: whether the last step ends or a step raises, leaving `_Loop` closes the progress bar and the metrics
    file (no communication); only a run whose every step succeeded waits for its last checkpoint first, and
    then saves its trace, meets every rank at a barrier and draws the schedule."""
    tracer = _tracer(cfg, rank) if cfg.trace.enabled else None
    timers = Timers(tracer)
    # per-instruction times only when shown: on a GPU they are CUDA events, resolved once per step (a wait)
    timed = cfg.log.wall_clock_breakdown or tracer is not None
    engine, optimizer, data, _ = initialize_from_config(cfg, on_instruction=timers if timed else None)
    on_failure = SaveOnFailure(cfg.checkpoint.dir, to_dict(cfg), rank) if cfg.checkpoint.save_on_failure else None
    if on_failure is not None:  # what the ranks left alive by a failure saved becomes the newest checkpoint
        on_failure.arm(engine.pctx.world_group)
    resumed, data = _resume(cfg, engine, data, rank)
    if rank == 0:
        print(_summary(cfg, engine, optimizer), flush=True)
    every, last = cfg.checkpoint.save_interval, cfg.train.steps
    with _Loop(cfg, rank, engine, optimizer, tracer, timers, resumed, on_failure) as loop:
        for step in range(loop.first, last + 1):
            loop.step(step, data)
            saving = every and (step % every == 0 or step == last)
            if step % max(1, cfg.log.interval) == 0 or saving or step == last:
                loop.flush()
            if saving:
                loop.save_checkpoint()
    if tracer is not None:
        tracer.save()
    _finish(engine.pctx)  # a barrier: every rank's trace is on disk
    if rank == 0:
        if tracer is not None:
            _draw_schedule(cfg.run_dir)
        print(f"done: {cfg.train.steps} steps; metrics {cfg.log.metrics_file}", flush=True)
    return 0


def _resume(cfg: Config, engine, data, rank: int):
    """Load this run's own latest checkpoint (a restart), else checkpoint.load (any layout), if either is set:
    (the step resumed at, the data iterator from the next step on), or (None, `data`). Collective over the
    world group (the load)."""
    source = cfg.checkpoint.dir if sharded.has_checkpoint(cfg.checkpoint.dir) else cfg.checkpoint.load
    if not source:
        return None, data
    path, _ = engine.load_checkpoint(source)
    if rank == 0:
        print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    return engine.global_steps, data_iterator(cfg, engine, engine.global_steps)  # batches depend only on the step


class _Loop:
    """The step loop's parts on one rank: the meters around a step (saved activations, the straggler
    window, the step's communication), its record, the flush of the pending records to the metrics file,
    the log and the progress bar, and the checkpoint saves. A context: leaving it closes the bar and the
    metrics file, after waiting for an asynchronous save still in flight when no step raised."""

    def __init__(self, cfg: Config, rank: int, engine, optimizer, tracer, timers, resumed: int | None,
                 on_failure: SaveOnFailure | None):
        pctx, spec, t, r = engine.pctx, engine.module.model_spec, cfg.train, cfg.resilience
        self.cfg, self.rank, self.engine, self.optimizer = cfg, rank, engine, optimizer
        self.tracer, self.timers, self.on_failure = tracer, timers, on_failure
        self.first = (resumed or 0) + 1  # the first step this run trains
        self.lead = rank == 0 or cfg.log.all_ranks
        self.writer = MetricsWriter(cfg.log.metrics_file if rank == 0 else None, resume_step=resumed)
        flops = model_flops.model_flops_per_step(spec, t.global_batch_size)  # MFU's numerator, as the planner's
        tokens = t.global_batch_size * spec.seq_len
        self.bar = _progress(cfg, rank, self.first - 1)
        self.pending = PendingSteps(tokens, flops, pctx.topology.world_size, cfg.log.peak_tflops)
        self.checkpointer = engine.module.activation_checkpointer
        self.meter = SavedActivationMeter(engine.module, checkpointer=self.checkpointer) \
            if cfg.log.memory_breakdown else None
        self.moved = pctx.stats.snapshot()
        links = LinkProbe([pctx.pp_group, pctx.dp_group, pctx.tp_group], r.link_probe_bytes,
                          next(engine.module.parameters()).device) \
            if r.straggler_interval and r.link_probe_bytes else None
        self.watch = StragglerWatch(pctx.stats, pctx.world_group, pctx.pp_rank, r.straggler_interval,
                                    r.straggler_ratio, links) if r.straggler_interval else None

    def __enter__(self) -> _Loop:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None and self.engine.wait_for_checkpoint() is not None and self.rank == 0:
            _say(self.bar, "the last checkpoint is written")  # an asynchronous save was still in flight
        if self.bar is not None:
            self.bar.close()
        self.writer.close()

    def step(self, step: int, data) -> None:
        """Train step `step` and add its record to the pending ones. After the first, every rank's measured
        memory is gathered over the world group (`_memory_check`); every resilience.straggler_interval steps,
        every rank's step times are (`StragglerWatch.end`)."""
        engine, pctx = self.engine, self.engine.pctx
        if self.tracer is not None:
            self.tracer.begin_step(step)
        first = step == self.first  # measured always: the summary shows it next to the planner's
        meter = self.meter or (SavedActivationMeter(engine.module, checkpointer=self.checkpointer) if first else None)
        if self.watch is not None:
            self.watch.begin()
        with meter.measure() if meter is not None else contextlib.nullcontext():  # saved-activation bytes (peak)
            # the loss stays on the device: read when the pending steps are flushed
            loss = engine.train_step(data) if self.on_failure is None else self.on_failure.train_step(engine, data)
        stepped = pctx.stats.snapshot()  # the step's own communication, before the straggler window's link probe
        slow = self.watch.end() if self.watch is not None else None  # every straggler_interval steps: world group
        if first:
            report = memory_report(self.optimizer, meter, self.checkpointer)
            if self.tracer is not None and "activations" in report:
                self.tracer.note_peak_activations(report["activations"])
            _memory_check(self.cfg, engine, report, self.rank, self.bar)
        if slow is not None and self.rank == 0:  # the ranks and links named slow over the window
            for line in describe(slow, step - self.cfg.resilience.straggler_interval + 1, step):
                _say(self.bar, line)
        on_device = {"loss": loss, "grad_norm": engine.last_info.get("grad_norm")}
        self.pending.add(self._record(step, stepped, slow), on_device)

    def _record(self, step: int, stepped: dict, slow: dict | None) -> dict:
        """Step `step`'s metrics record but its loss and gradient norm (still on the device): the engine's
        `last_info`, this rank's communication since the last step (`stepped`: the stats after the step),
        and the straggler window's step times (`slow`, or None)."""
        info = self.engine.last_info
        record = {"step": step, "lr": info.get("lr"), "loss_scale": info.get("loss_scale"),
                  "skipped": info.get("skipped", False), "skipped_steps": info.get("skipped_steps", 0)}
        record["comm"] = comm_delta(self.moved, stepped)  # this rank's bytes by axis/op, inter-node apart
        # the link probe's bytes are no step's
        self.moved = self.engine.pctx.stats.snapshot() if slow is not None else stepped
        if info.get("silent_error") is not None:  # a checked step's two passes differed (resilience/silent_check.py)
            record["silent_error"] = info["silent_error"]
        if info.get("moe") is not None:  # MoE load balance of the step (megazero.moe.stats)
            record["moe"] = info["moe"]
        if self.cfg.log.wall_clock_breakdown:
            record["time_ms"] = self.timers.pop()
        if slow is not None:  # every rank's step times over the window, and the ranks named slow
            record["step_times"] = slow
        return record

    def flush(self) -> None:
        """The pending steps' records, read from the device now: to the metrics file, the progress bar and, at
        log intervals, the log."""
        records = self.pending.flush()
        for record in records:
            self.writer.write(record)
            if self.bar is not None:
                self.bar.update(1)
            if self.lead and self.cfg.log.interval and record["step"] % self.cfg.log.interval == 0:
                self._log_line(record)
        if self.bar is not None and records:
            record = records[-1]
            moe = {"aux": f"{record['moe']['aux_loss']:.3f}", "imb": f"{record['moe']['imbalance']:.2f}"} \
                if "moe" in record else {}
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu="-" if record["mfu"] is None else f"{record['mfu']:.1%}",
                                 scale=f"{record['loss_scale']:g}", **moe)

    def save_checkpoint(self) -> None:
        """A checkpoint into checkpoint.dir (collective over the world group; written in the background with
        checkpoint.async_save)."""
        c = self.cfg.checkpoint
        path = self.engine.save_checkpoint(c.dir, keep_last=c.keep_last, config=to_dict(self.cfg),
                                           async_save=c.async_save)
        if self.rank == 0:
            _say(self.bar, f"{'saving' if c.async_save else 'saved'} checkpoint {path}")

    def _log_line(self, record: dict) -> None:
        parts = [f"[rank {self.rank}] step {record['step']}: loss {record['loss']:.4f}"]
        if record["grad_norm"] is not None:
            parts.append(f"grad_norm {record['grad_norm']:.3f}")
        parts.append(f"lr {record['lr']:.2e}")
        if "moe" in record:
            m = record["moe"]
            parts.append(f"moe aux {m['aux_loss']:.4f} z {m['z_loss']:.3f} dropped {m['dropped']:.1%} "
                         f"imbalance {m['imbalance']:.2f} tokens/expert {m['tokens_per_expert']}")
        if "time_ms" in record:
            parts.append("time_ms " + " ".join(f"{k}={v:.1f}" for k, v in record["time_ms"].items()))
        if self.cfg.log.memory_breakdown:
            mem = memory_report(self.optimizer, self.meter, self.checkpointer)
            parts.append("memory " + " ".join(f"{k}={format_bytes(v)}" for k, v in mem.items()))
        _say(self.bar, " | ".join(parts))


def _memory_check(cfg: Config, engine, report: dict[str, int], rank: int, bar) -> None:
    """After the first step: every rank's measured memory (`memory_report`) gathered over the world
    group; rank 0 prints the planner's prediction for each pipeline stage next to what one of its
    ranks holds (predicted/measured, MiB)."""
    pctx = engine.pctx
    reports = comm.all_gather_object((pctx.pp_rank, report), pctx.world_group)
    if rank != 0:
        return
    measured: dict[int, dict[str, int]] = {}
    for stage, rep in reports:
        measured.setdefault(stage, rep)
    device = "cpu" if next(engine.module.parameters()).device.type == "cpu" else "cuda"
    try:
        plan, why = predicted_memory(cfg, device=device)
    except (PlanError, SpecError) as err:
        plan, why = None, str(err)
    if plan is None:
        _say(bar, f"memory   the planner cannot predict this run ({why})")
        return
    _say(bar, "memory   after step 1, predicted/measured MiB per pipeline stage (megazero.planner vs memory_report):")
    for line in memory_lines(plan, measured):
        _say(bar, f"         {line}")


def _draw_schedule(run_dir: str) -> None:
    """Rank 0, after the process group is gone: the last step's plan above its measurement, as
    `<run_dir>/schedule.html` (hover, zoom) and `schedule.svg` (`python -m megazero.viz --run
    RUN_DIR --compare`). A picture that cannot be drawn is reported, never fatal."""
    try:
        step = MeasuredStep.load(run_dir)
        picture = compare(planned_for(step), step.timeline())
        for name, text in (("schedule.html", render_html(picture)), ("schedule.svg", render_svg(picture))):
            with open(os.path.join(run_dir, name), "w", encoding="utf-8") as handle:
                handle.write(text)
    except Exception as err:  # noqa: BLE001  (the run itself succeeded; a picture must never fail it)
        print(f"schedule picture not drawn: {type(err).__name__}: {err}", flush=True)
        return
    print(f"schedule {os.path.join(run_dir, 'schedule.html')}: step {step.step} planned vs measured, bubble "
          f"{picture.plan.bubble:.1%} vs {picture.run.bubble:.1%}", flush=True)


def _tracer(cfg: Config, rank: int) -> Tracer:
    """This rank's tracer; its grid coordinates come from the topology (no process group needed)."""
    topology = topology_of(cfg)
    coords = topology.coords(rank)
    folder = os.path.join(cfg.run_dir, "trace")
    if rank == 0 and os.path.isdir(folder):  # an earlier run's traces (another world size) must not mix in;
        for name in os.listdir(folder):      # no rank writes before the end, after every rank's collectives
            if name.startswith("rank") and name.endswith(".json"):
                os.remove(os.path.join(folder, name))
    return Tracer(os.path.join(folder, f"rank{rank}.json"), rank, coords.pp, coords.dp, coords.tp,
                  topology.world_size)


def _say(bar, text: str) -> None:
    if bar is not None:
        bar.write(text)
    else:
        print(text, flush=True)


def _progress(cfg, rank, start):
    if rank != 0 or not cfg.log.progress_bar:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _finish(pctx) -> None:
    """A barrier over the world group (through comm, so the order check sees it), then the process
    groups' end."""
    import torch.distributed as dist

    comm.barrier(pctx.world_group)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001  (a failed step, e.g. a peer died: say why and end now, so that a
        import traceback   # thread still blocked in a collective cannot hold the exit and torchrun restarts at once)

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch 2.13 + gloo can abort in interpreter teardown after a clean run
