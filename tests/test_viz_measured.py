"""Measured, predicted and compared schedule pictures (megazero.viz.measured / sources / compare / cli).

Traces are written here in the trainer's format from a simulated step whose times are known, with a
different clock origin per rank: reading them back must give the simulator's blocks, bubbles and peaks
on one time axis; the plan rebuilt from their measured costs must be the same step; a delay put into
one block must be what the comparison names. Predictions for a config must be the planner's own
simulation. The command line writes every format and fails with one line on bad input. Pure: no
torch, no processes (the trainer's own traces are checked in tests/test_trainer.py).
"""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from megazero.core.config.loading import load_config
from megazero.core.instructions import P2P
from megazero.core.schedules import get_schedule
from megazero.core.simulate import Costs, simulate
from megazero.planner.from_config import layout_of, spec_of
from megazero.planner.hardware import load_hardware
from megazero.planner.memory_plan import predict_memory
from megazero.planner.speed import predicted_simulation
from megazero.viz.cli import main
from megazero.viz.compare import compare
from megazero.viz.measured import MeasuredStep, TraceError
from megazero.viz.sources import planned_for, predicted
from megazero.viz.svg import render_svg
from megazero.viz.timeline import from_simulation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARDWARE = os.path.join(ROOT, "configs", "hardware")
NS = "{http://www.w3.org/2000/svg}"
COSTS = Costs(forward=2.0, backward_input=3.0, backward_weight=1.5, p2p=0.25, load=0.1, reduce_grads=4.0,
              optimizer_step=1.0)  # ms
CASES = [("1f1b", 2, 4, 1), ("gpipe", 3, 4, 1), ("zb-h1", 4, 8, 1), ("interleaved", 2, 4, 2)]


def write_traces(folder, result, step=3, origins=None, dp_ranks=(0,), shift=None, with_origin=True):
    """The trainer's trace files (`megazero.run.trace`) of a step whose spans are `result`'s (ms),
    for every stage and dp rank in `dp_ranks`; rank r's clock starts at Unix time origins[r] (s).
    Another step (step - 1) comes first, so that the reader must pick. `shift` = (stage, index, ms)
    delays one span's end and everything after it on that stage."""
    os.makedirs(folder, exist_ok=True)
    p = result.num_stages
    for d in dp_ranks:
        for s, spans in enumerate(result.timeline):
            rank = d * p + s
            origin = origins[rank] if origins else 1000.0 + 0.37 * rank
            events, delay = [], 0.0
            for which, base in ((step - 1, 1e6), (step, 1e6 + 10 * result.makespan)):
                for i, sp in enumerate(spans):
                    start = sp.start + (delay if which == step else 0.0)
                    if shift and which == step and (s, i) == shift[:2]:
                        delay = shift[2]
                    end = sp.end + (delay if which == step else 0.0)
                    ins = sp.instr
                    args = {"step": which, "mb": getattr(ins, "mb", None), "chunk": getattr(ins, "chunk", 0)}
                    if isinstance(ins, P2P):
                        args["peer"] = ins.peer
                    ts = ((1e6 + base + start) / 1e3 - origin) * 1e6  # µs since this rank's origin
                    events.append({"name": repr(ins), "cat": type(ins).__name__, "ph": "X", "pid": s, "tid": rank,
                                   "ts": ts, "dur": (end - start) * 1e3, "args": args})
            meta = {"rank": rank, "stage": s, "dp_rank": d, "tp_rank": 0, "world_size": p * len(dp_ranks)}
            if with_origin:
                meta["unix_origin_s"] = origin
            with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
                json.dump({"traceEvents": events, "metadata": meta}, f)


def _sim(name, p, m, v, costs=COSTS):
    return simulate(get_schedule(name, p, m, v, costs), costs)


def _blocks(timeline):
    return [(b.stage, b.kind, b.mb, b.chunk, round(b.start, 6), round(b.end, 6)) for b in timeline.blocks]


def _transfers(timeline):
    return [(b.stage, b.kind, b.mb, b.peer, round(b.start, 6), round(b.end, 6)) for b in timeline.transfers]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_measured_step_is_the_traced_spans_on_one_axis(name, p, m, v, tmp_path):
    result = _sim(name, p, m, v)
    write_traces(tmp_path / "trace", result, dp_ranks=(0, 1))
    step = MeasuredStep.load(str(tmp_path))
    assert step.step == 3 and step.ranks == tuple(range(p)) and step.aligned
    got, want = step.timeline(), from_simulation(result, unit="ms")
    assert _blocks(got) == _blocks(want) and _transfers(got) == _transfers(want)
    # float64 sums of the same block times in the trace's order vs the simulator's; abs in ms (1e-6 ms), bubble a ratio (1e-9)
    assert got.makespan == pytest.approx(result.makespan, abs=1e-6)
    assert got.bubble == pytest.approx(result.bubble_fraction, abs=1e-9)
    for a, b in zip(got.stages, want.stages, strict=True):
        # float64 sums of the same block times in another order, in ms: far below the trace's microsecond resolution
        assert (a.busy, a.idle, a.bubble) == pytest.approx((b.busy, b.idle, b.bubble), abs=1e-6)
        assert (a.peak_inflight, a.peak_unfinished) == (b.peak_inflight, b.peak_unfinished)
    assert got.source == "measured" and got.unit == "ms"
    assert MeasuredStep.load(str(tmp_path), dp_rank=1).ranks == tuple(range(p, 2 * p))
    assert MeasuredStep.load(str(tmp_path / "trace"), step=2).step == 2


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_plan_from_measured_costs_is_the_same_step(name, p, m, v, tmp_path):
    result = _sim(name, p, m, v)
    write_traces(tmp_path, result)
    step = MeasuredStep.load(str(tmp_path))
    plan = planned_for(step)
    assert _blocks(plan) == _blocks(from_simulation(result))
    c = compare(plan, step.timeline())
    # plan and measurement are built from the same simulation here: only float64 summation order separates them
    assert all(abs(d.difference) < 1e-9 for d in c.stages)
    assert c.worst_block is None and c.differs_most() == "planned and measured agree (within 1e-06 of the step)"


def test_comparison_names_the_delayed_block(tmp_path):
    result = _sim("1f1b", 4, 8, 1)
    index = next(i for i, sp in enumerate(result.timeline[2]) if repr(sp.instr) == "B3")
    write_traces(tmp_path, result, shift=(2, index, 5.0))
    c = compare(from_simulation(result, unit="ms"), MeasuredStep.load(str(tmp_path)).timeline())
    a, b = c.worst_block
    assert (b.stage, b.short) == (2, "B3") and b.end - a.end == pytest.approx(5.0)
    assert c.run.stages[2].busy == pytest.approx(c.plan.stages[2].busy + 5.0)
    assert [s.busy for i, s in enumerate(c.run.stages) if i != 2] == pytest.approx(
        [s.busy for i, s in enumerate(c.plan.stages) if i != 2])
    d = max(c.stages, key=lambda d: abs(d.difference))
    assert c.worst_stage == d.stage and abs(d.difference) > 0.01 and "differs most: stage" in c.summary()
    assert "B3 on stage 2 ends at" in c.differs_most()


def test_clock_origins_put_ranks_on_one_axis(tmp_path):
    """Rank origins seconds apart: the Unix origin aligns them; traces without it are read unaligned."""
    result = _sim("1f1b", 2, 4, 1)
    write_traces(tmp_path / "a", result, origins={0: 1000.0, 1: 1003.5})
    assert _blocks(MeasuredStep.load(str(tmp_path / "a")).timeline()) == _blocks(from_simulation(result))
    write_traces(tmp_path / "b", result, origins={0: 1000.0, 1: 1003.5}, with_origin=False)
    step = MeasuredStep.load(str(tmp_path / "b"))
    timeline = step.timeline()
    assert not step.aligned and "clocks NOT aligned" in timeline.title
    # without the origins, each rank sits on its own axis: rank 1 (origin 3.5 s later) is drawn 3500 ms early
    want = from_simulation(result)
    first_1 = result.timeline[1][0].start  # rank 1's first instruction is the earliest time on either clock
    got_0 = [b for b in timeline.blocks if b.stage == 0]
    got_1 = [b for b in timeline.blocks if b.stage == 1]
    assert [b.start for b in got_0] == pytest.approx([b.start + 3500.0 - first_1 for b in want.blocks if b.stage == 0])
    assert [b.start for b in got_1] == pytest.approx([b.start - first_1 for b in want.blocks if b.stage == 1])


def test_measured_peak_bytes_come_from_the_traces(tmp_path):
    result = _sim("1f1b", 2, 4, 1)
    write_traces(tmp_path, result)
    for r, nbytes in ((0, 3 << 20), (1, 1 << 20)):
        path = tmp_path / f"rank{r}.json"
        trace = json.loads(path.read_text())
        trace["metadata"]["peak_activation_bytes"] = nbytes
        path.write_text(json.dumps(trace))
    timeline = MeasuredStep.load(str(tmp_path)).timeline()
    assert [s.peak_bytes for s in timeline.stages] == [3 << 20, 1 << 20]
    assert "(3 MiB 1 MiB)" in timeline.summary()
    svg = ET.fromstring(render_svg(timeline).split("\n", 1)[1])
    stats = [t.text for t in svg.iter(f"{NS}text") if t.get("class") == "stage-stats"]
    assert stats == [f"bubble {s.bubble:.1%}, peak in flight {k} ({mib} MiB)"
                     for s, k, mib in zip(timeline.stages, (2, 1), (3, 1), strict=True)]


def _config(*overrides, world=1024):
    return load_config(os.path.join(ROOT, "configs", "gpt3_175b.yaml"), list(overrides), world_size=world)


@pytest.mark.parametrize("overrides", [(), ("pipeline.schedule=1f1b", "pipeline.chunks=1"),
                                       ("pipeline.schedule=zb-h1", "pipeline.chunks=1", "train.global_batch_size=256")])
def test_prediction_is_the_planners_simulation(overrides):
    cfg = _config(*overrides)
    hardware = load_hardware("h100-80gb", HARDWARE)
    timeline = predicted(cfg, hardware)
    layout, _ = layout_of(cfg)
    sim, _ = predicted_simulation(spec_of(cfg), layout, hardware)
    want = from_simulation(sim, scale=1e3)
    assert _blocks(timeline) == _blocks(want)
    assert timeline.bubble == pytest.approx(sim.bubble_fraction) and timeline.makespan == pytest.approx(sim.makespan * 1e3)
    memory = predict_memory(spec_of(cfg), layout, None, hardware, device="cuda")
    assert [s.peak_bytes for s in timeline.stages] == [st.breakdown["activations"] for st in memory.stages]
    assert [s.peak_inflight for s in timeline.stages] == list(sim.peak_inflight)
    kinds = {b.kind for b in timeline.blocks}
    assert {"Forward", "ReduceGrads", "OptimizerStep"} <= kinds
    assert ("BackwardInput" in kinds) == (cfg.pipeline.schedule == "zb-h1")


def test_cli_run_compare_and_config_write_every_format(tmp_path, capsys):
    result = _sim("zb-h1", 4, 8, 1)
    write_traces(tmp_path / "run" / "trace", result)
    run = str(tmp_path / "run")
    for suffix in ("svg", "html", "png", "pdf"):
        out = tmp_path / f"compare.{suffix}"
        assert main(["--run", run, "--compare", "--out", str(out), "--chrome-trace", str(tmp_path / "c.json")]) == 0
        assert out.stat().st_size > 1000
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "compare.pdf").read_bytes()[:5] == b"%PDF-"
    root = ET.parse(tmp_path / "compare.svg").getroot()
    data = json.loads(root.find(f".//{NS}script[@id='schedule-data']").text)
    step = MeasuredStep.load(run)
    for key, timeline in (("plan", planned_for(step)), ("run", step.timeline())):
        assert [(b["stage"], b["kind"], b["mb"], b["chunk"], round(b["start"], 6), round(b["end"], 6))
                for b in data[key]["blocks"]] == _blocks(timeline)
    lanes = [r.get("data-lane") for r in root.iter(f"{NS}rect") if r.get("class") == "block"]
    assert lanes.count("0") == len(data["plan"]["blocks"]) and lanes.count("1") == len(data["run"]["blocks"])
    trace = json.loads((tmp_path / "c.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    out = capsys.readouterr().out
    assert "planned and measured agree" in out and "planned: step 3's programs" in out
    assert main(["--run", run]) == 0 and "measured: step 3 (ranks 0, 1, 2, 3)" in capsys.readouterr().out
    assert main(["--config", os.path.join(ROOT, "configs", "gpt3_175b.yaml"), "--world-size", "1024",
                 "--out", str(tmp_path / "p.svg")], hardware_dir=HARDWARE) == 0
    assert "predicted: interleaved p=16 m=64 v=2" in capsys.readouterr().out
    blocks = [r for r in ET.parse(tmp_path / "p.svg").getroot().iter(f"{NS}rect") if r.get("class") == "block"]
    assert len(blocks) == 16 * 64 * 2 * 2 + 16 * 2  # F and B of 64 micro-batches x 2 chunks, R and O per stage


CONFIG = os.path.join(ROOT, "configs", "gpt3_175b.yaml")


@pytest.mark.parametrize("argv,words", [
    (["--run", "/nonexistent/run"], "--run '/nonexistent/run': no such directory"),
    (["--run", "{empty}"], "no trace/rank*.json; run the trainer with trace.enabled=true"),
    (["--run", "{run}", "--step", "9"], "--step 9: the traces hold steps 2..3"),
    (["--trace", "{empty}"], "--trace '{empty}': no trace/rank*.json"),
    (["--trace", "{run}", "--step", "9"], "no events of step 9; steps 2..3"),
    (["--run", "{run}", "--dp-rank", "5"], "no rank at dp rank 5"),
    (["--compare"], "--compare needs --run RUN_DIR"),
    (["--run", "{run}", "--config", CONFIG], "--config with --run needs --compare"),
    (["--run", "{run}", "--schedule", "gpipe"], "take the schedule from the config or the run"),
    (["--run", "{run}", "--compare", "--config", CONFIG, "--world-size", "1024"], "16 pipeline stages, the run 2"),
    (["--config", CONFIG], "parallel.dp is unset; give --world-size N"),
    (["--config", CONFIG, "--world-size", "1000"], "does not divide world size 1000"),
    (["--config", CONFIG, "parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false", "pipeline.chunks=1",
      "pipeline.schedule=1f1b", "--world-size", "8"], "does not fit NVIDIA H100 80GB SXM (80 GiB): stage 0 by"),
    (["--config", CONFIG, "parallel.pp=5", "pipeline.schedule=1f1b", "pipeline.chunks=1",
      "pipeline.partition=[20,20,20,20,20]", "--world-size", "40"],
     "pipeline.partition: layer counts sum to 100, not model.layers=96"),
    (["--config", CONFIG, "train.global_batch_size=64", "--world-size", "1024"], "needs num_microbatches"),
    (["--config", CONFIG, "--world-size", "1024", "--hardware", "h300"], "--hardware 'h300': no such preset"),
    (["--config", CONFIG, "pipeline.schedul=1f1b", "--world-size", "1024"], "pipeline.schedul"),
])
def test_cli_bad_input_is_one_line(argv, words, tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    write_traces(tmp_path / "run", _sim("1f1b", 2, 4, 1))
    argv = [a.format(empty=tmp_path / "empty", run=tmp_path / "run") for a in argv]
    words = words.format(empty=tmp_path / "empty")
    assert main(argv, hardware_dir=HARDWARE) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("visualize_schedule: ") and words in lines[0], lines[0]


def test_zero_bubble_kinds_are_kept(tmp_path):
    result = _sim("zb-h1", 2, 4, 1)
    write_traces(tmp_path, result)
    timeline = MeasuredStep.load(str(tmp_path)).timeline()
    for kind in ("BackwardInput", "BackwardWeight"):
        assert sum(b.kind == kind for b in timeline.blocks) == 8
        assert sum(type(sp.instr).__name__ == kind for st in result.timeline for sp in st) == 8


def test_one_stage_run(tmp_path, capsys):
    """pp = 1: one row, no transfers, the bubble is only the reduction and step's share (zero here)."""
    write_traces(tmp_path, _sim("1f1b", 1, 4, 1, Costs(forward=2.0, backward_input=3.0, backward_weight=1.0)))
    assert main(["--run", str(tmp_path), "--compare", "--out", str(tmp_path / "c.svg")]) == 0
    out = capsys.readouterr().out
    assert "planned and measured agree" in out and "bubble 0.0%" in out


def test_mixed_or_incomplete_traces_are_refused(tmp_path):
    result = _sim("1f1b", 2, 4, 1)
    write_traces(tmp_path / "mixed", result)
    trace = json.loads((tmp_path / "mixed" / "rank1.json").read_text())
    (tmp_path / "mixed" / "rank7.json").write_text(json.dumps(trace))  # an earlier run's rank 7: stage 1 again
    with pytest.raises(TraceError, match="both trace stage 1 at dp rank 0, tp rank 0: traces of two runs are mixed"):
        MeasuredStep.load(str(tmp_path / "mixed"))
    trace["metadata"].update(rank=7, dp_rank=3, world_size=8)
    (tmp_path / "mixed" / "rank7.json").write_text(json.dumps(trace))
    with pytest.raises(TraceError, match=r"world sizes \[2, 8\] are mixed"):
        MeasuredStep.load(str(tmp_path / "mixed"))
    write_traces(tmp_path / "gap", result)
    trace = json.loads((tmp_path / "gap" / "rank1.json").read_text())
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["args"]["step"] != 3]
    (tmp_path / "gap" / "rank1.json").write_text(json.dumps(trace))
    assert MeasuredStep.load(str(tmp_path / "gap")).step == 2  # the last step every stage ran
    with pytest.raises(TraceError, match="--step 3: rank 1's trace does not hold it; every stage holds steps 2"):
        MeasuredStep.load(str(tmp_path / "gap"), step=3)


def test_text_comparison_shares_one_time_axis(tmp_path, capsys):
    result = _sim("1f1b", 2, 4, 1)
    write_traces(tmp_path, result, shift=(1, 3, 10.0))
    assert main(["--run", str(tmp_path), "--compare", "--width", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    columns = [line for line in lines if line.startswith("one column = ")]
    assert len(columns) == 2 and columns[0] == columns[1]
    rows = [line for line in lines if line.startswith("stage ")]
    assert len(rows) == 4 and max(len(r) for r in rows) <= len("stage 0 ") + 60
    assert "'=' gradient reduction" in lines[-1] and "=" in rows[0]
