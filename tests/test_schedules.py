"""Pipeline schedules as data: every schedule for p <= 8, m <= 32 (v in {2, 3} for interleaving),
run against itself by the blocking-p2p simulator; bubble and memory figures of docs/reference.md.

What the sweep verifies, per (schedule, p, m, v), with unit costs t_F = t_B = t_W = 1 per chunk
(a full backward costs t_B + t_W = 2, so t_f = 1, t_b = 2 in Megatron's notation):
  * no deadlock and every transfer pairs with the right receive (simulate raises otherwise);
  * on each stage every micro-batch chunk runs F, then B, then W; across stages a micro-batch's
    forwards follow the virtual stages up and its input-grad backwards come back down;
  * GPipe, 1F1B: every stage idles exactly (p-1)(t_f+t_b) = 3(p-1); bubble fraction (p-1)/(m+p-1);
  * interleaved: every stage idles exactly (p-1)(t_f+t_b)/v in whole-stage costs (= 3(p-1) in
    chunk costs), i.e. bubble over ideal (1/v)(p-1)/m;
  * ZB-H1: every stage idles exactly (p-1)(t_F+t_B-t_W) = p-1 for m >= p, a third of 1F1B's
    3(p-1); for m < p, 2p-1-m (still below 1F1B);
  * peak in-flight activations: min(p-s, m) for 1F1B and ZB-H1, m for GPipe, Megatron's warm-up
    count + 1 for interleaved; ZB-H1 keeps at most min(p, m) chunks between F and W.
"""
import re

import pytest
from hypothesis import given, settings, strategies as st

from megazero.core import schedules as S
from megazero.core.csv_schedule import parse_csv, to_csv
from megazero.core.instructions import (
    BACKWARD_INPUT, Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, RecvAct, ScheduleError,
    SendAct, parse_program, render, virtual_stage,
)
from megazero.core.simulate import Costs, DeadlockError, simulate

P_MAX, M_MAX = 8, 32


def check_dataflow(programs, result):
    """Order checks on the simulated timeline, independent of the simulator's own validation."""
    p = len(programs)
    spans = {}  # ("F"/"B"/"W", mb, vstage) -> span
    for s, timeline in enumerate(result.timeline):
        for span in timeline:
            ins = span.instr
            if isinstance(ins, (Forward,) + BACKWARD_INPUT + (BackwardWeight,)):
                kind = "F" if isinstance(ins, Forward) else "W" if isinstance(ins, BackwardWeight) else "B"
                key = (kind, ins.mb, virtual_stage(s, ins.chunk, p))
                assert key not in spans, f"{key} runs twice"
                spans[key] = span
    for (kind, mb, vs), span in spans.items():
        if kind == "F":
            assert span.end <= spans[("B", mb, vs)].start, f"mb {mb} vstage {vs}: F after B"
            if ("F", mb, vs + 1) in spans:
                assert span.end <= spans[("F", mb, vs + 1)].start
        if kind == "B":
            if ("W", mb, vs) in spans:
                assert span.end <= spans[("W", mb, vs)].start, f"mb {mb} vstage {vs}: B after W"
            if vs > 0:
                assert span.end <= spans[("B", mb, vs - 1)].start


def sweep_cases():
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p in range(1, P_MAX + 1):
            yield name, p, 1
    for v in (2, 3):
        for p in range(2, P_MAX + 1):
            yield "interleaved", p, v


@pytest.mark.parametrize("name,p,v", list(sweep_cases()))
def test_sweep_no_deadlock_order_bubble_memory(name, p, v):
    ms = range(p, M_MAX + 1, p) if name == "interleaved" else range(1, M_MAX + 1)
    for m in ms:
        programs = S.get_schedule(name, p, m, v)
        result = simulate(programs)
        check_dataflow(programs, result)
        unit = p - 1  # one unit of t_F = t_B = t_W per hop
        if name in ("gpipe", "1f1b", "interleaved"):
            assert result.idle == (3 * unit,) * p, (name, p, m, v)
            # float64 sums of unit costs in the simulator's event order: a few ulps
            assert result.bubble_over_ideal == pytest.approx(unit / (m * v), rel=1e-12)
            if v == 1:
                assert result.bubble_fraction == pytest.approx(unit / (m + p - 1), rel=1e-12)
        else:
            assert result.idle == ((unit,) if m >= p else (2 * p - 1 - m,)) * p, (p, m)
            assert max(result.idle) <= 3 * unit  # never worse than 1F1B
        if name == "gpipe":
            assert result.peak_inflight == (m,) * p
        elif name in ("1f1b", "zb-h1"):
            assert result.peak_inflight == tuple(min(p - s, m) for s in range(p))
        else:
            assert result.peak_inflight == tuple(min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p))
        if name == "zb-h1":
            assert max(result.peak_unfinished) <= min(p, m)
        else:
            assert result.peak_unfinished == result.peak_inflight


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(S.SCHEDULES), p=st.integers(2, 6), k=st.integers(1, 4), v=st.sampled_from([2, 3]),
       f=st.floats(0.1, 5), b=st.floats(0.1, 5), w=st.floats(0.1, 5), comm=st.floats(0, 2), other=st.floats(0, 2))
def test_no_deadlock_with_any_costs(name, p, k, v, f, b, w, comm, other):
    """Programs are built with unit costs; replayed with arbitrary costs they still never deadlock."""
    m, chunks = (k * p, v) if name == "interleaved" else (k + p - 2, 1)
    costs = Costs(forward=f, backward_input=b, backward_weight=w, p2p=comm, load=other, reduce_grads=other,
                  optimizer_step=other)
    programs = S.get_schedule(name, p, m, chunks)
    check_dataflow(programs, simulate(programs, costs))


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 1, 1), (1, 1.5, 0.5), (1, 3, 1), (1.3, 1.7, 0.9)])
def test_bubble_formulas_with_other_costs(f, b, w):
    """GPipe and 1F1B: (p-1)(t_f+t_b) for any costs; ZB-H1 built for its costs: (p-1)(t_F+t_B-t_W)."""
    costs = Costs(forward=f, backward_input=b, backward_weight=w)
    for p in (2, 3, 5, 8):
        for m in (p, p + 3, 2 * p + 1):
            for name in ("gpipe", "1f1b"):
                idle = simulate(S.get_schedule(name, p, m), costs).idle
                # float64 sums of the costs (non-dyadic fractions) in the simulator's event order: rounding ~1e-16 per event
                assert idle == pytest.approx([(p - 1) * (f + b + w)] * p, rel=1e-9)
            idle = simulate(S.get_schedule("zb-h1", p, m, costs=costs), costs).idle
            assert idle == pytest.approx([(p - 1) * (f + b - w)] * p, rel=1e-9)


@pytest.mark.parametrize("ratio", [0.5, 1, 2])
def test_interleaved_bubble_at_common_backward_ratios(ratio):
    """Built for the costs it runs with, interleaved reaches (p-1)(t_f+t_b)/v for t_b/t_f in {0.5, 1, 2}."""
    costs = Costs(forward=1.0, backward_input=ratio / 2, backward_weight=ratio / 2)
    for p, m, v in ((2, 4, 2), (3, 9, 3), (5, 10, 2), (8, 16, 3)):
        idle = simulate(S.get_schedule("interleaved", p, m, v, costs=costs), costs).idle
        # float64 sums of the costs (non-dyadic fractions) in the simulator's event order: rounding ~1e-16 per event
        assert idle == pytest.approx([(p - 1) * (1 + ratio)] * p, rel=1e-9)


def compute_only(program):
    return render(ins for ins in program if isinstance(ins, (Forward, Backward, BackwardInput, BackwardWeight)))


def test_known_programs():
    assert compute_only(S.one_f_one_b(4, 8, stage=1)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert render(S.one_f_one_b(4, 8, stage=1)[:6]) == "RA0<0 F0 RA1<0 SA0>2 F1 RA2<0"
    assert S.one_f_one_b(4, 8, stage=1)[-2:] == S.gpipe(4, 8, stage=0)[-2:]
    assert render(S.gpipe(4, 8, stage=1)[-2:]) == "Reduce Step"
    # ZB-H1 as in the paper's figure: the last stage defers its W passes by p-1 micro-batches
    assert compute_only(S.zb_h1(4, 8, stage=3)) == ("F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 "
                                                     "F7 B7 W4 W5 W6 W7")
    assert compute_only(S.zb_h1(4, 8, stage=0)) == ("F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 "
                                                     "B5 W5 B6 W6 B7 W7")
    assert isinstance(S.zb_h1(4, 8, 0)[-4], BackwardInput)


def test_per_stage_functions_match_registry_and_are_cached():
    for name, fn, v in (("gpipe", S.gpipe, 1), ("1f1b", S.one_f_one_b, 1), ("zb-h1", S.zb_h1, 1)):
        assert tuple(fn(4, 6, s) for s in range(4)) == S.get_schedule(name, 4, 6, v)
    assert tuple(S.interleaved_1f1b(3, 6, s, 2) for s in range(3)) == S.get_schedule("interleaved", 3, 6, 2)
    assert S.one_f_one_b(4, 8, 1) is S.one_f_one_b(4, 8, 1)


def test_interleaved_wraps_around_and_loads_on_first_and_last_virtual_stage():
    programs = S.get_schedule("interleaved", 2, 4, 2)
    assert SendAct(0, 0, 0) in programs[1] and RecvAct(0, 1, 1) in programs[0]  # stage 1 chunk 0 -> stage 0 chunk 1
    for s, program in enumerate(programs):
        loads = [i for i, ins in enumerate(program) if isinstance(ins, LoadMicroBatch)]
        assert len(loads) == 4
        for i in loads:  # each load sits right before the forward of the first / last virtual stage
            nxt = program[i + 1]
            assert isinstance(nxt, Forward) and virtual_stage(s, nxt.chunk, 2) in (0, 3)


@pytest.mark.parametrize("name,p,m", [("gpipe", 3, 4), ("1f1b", 4, 8), ("zb-h1", 4, 6), ("interleaved", 2, 4)])
def test_render_parse_round_trip(name, p, m):
    for program in S.get_schedule(name, p, m, 2 if name == "interleaved" else 1):
        assert parse_program(render(program)) == program


@pytest.mark.parametrize("call,message", [
    (lambda: S.get_schedule("1f1", 4, 8), "did you mean '1f1b'"),
    (lambda: S.get_schedule("pipedream", 4, 8), "valid schedules are gpipe, 1f1b, interleaved, zb-h1"),
    (lambda: S.get_schedule("interleaved", 4, 2, 2), "m=2 < p=4"),
    (lambda: S.get_schedule("interleaved", 4, 6, 2), "multiple of num_stages"),
    (lambda: S.get_schedule("interleaved", 4, 8, 1), "chunks >= 2"),
    (lambda: S.get_schedule("interleaved", 1, 4, 2), "num_stages >= 2"),
    (lambda: S.get_schedule("1f1b", 4, 8, 2), "only applies to the 'interleaved'"),
    (lambda: S.get_schedule("gpipe", 0, 8), "num_stages=0"),
    (lambda: S.get_schedule("gpipe", 2, True), "num_microbatches=True"),
    (lambda: S.one_f_one_b(4, 8, stage=4), "stage=4 must be an integer in 0..3"),
])
def test_argument_errors(call, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        call()


# -- compute orders -> programs (build_programs) and CSV schedules ----------------------------------

@st.composite
def local_orders(draw, p, m):
    """Each stage: a random merge of F0..F(m-1) and B0..B(m-1) with every F(i) before its B(i)."""
    orders = []
    for _ in range(p):
        order, f, b = [], 0, 0
        while b < m:
            if f < m and (f == b or draw(st.booleans())):
                order.append(Forward(f))
                f += 1
            else:
                order.append(Backward(b))
                b += 1
        orders.append(order)
    return orders


@settings(max_examples=60, deadline=None)
@given(data=st.data(), p=st.integers(1, 4), m=st.integers(1, 6), f=st.floats(0.1, 3), b=st.floats(0.1, 3))
def test_build_programs_from_any_order_never_deadlocks(data, p, m, f, b):
    """Any runnable compute order becomes programs that run with blocking p2p under any costs;
    an order with a cross-stage cycle is rejected up front."""
    orders = data.draw(local_orders(p, m))
    try:
        programs = S.build_programs(orders)
    except ScheduleError as exc:
        assert "cannot run" in str(exc)
        return
    check_dataflow(programs, simulate(programs, Costs(forward=f, backward_input=b, backward_weight=b)))


def test_build_programs_rejects_a_cycle_naming_every_stuck_stage():
    orders = [[Forward(0), Backward(0), Forward(1), Backward(1)], [Forward(1), Backward(1), Forward(0), Backward(0)]]
    with pytest.raises(ScheduleError, match=r"stage 0 at B0 .*; stage 1 at F1 waits for its input activation"):
        S.build_programs(orders)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("zb-h1", 4, 6, 1),
                                        ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 3)])
def test_csv_round_trip(name, p, m, v, tmp_path):
    programs = S.get_schedule(name, p, m, v)
    assert S.from_csv(to_csv(programs)) == programs  # compute-only rows: communication re-derived
    assert S.from_csv(to_csv(programs, compute_only=False)) == programs  # explicit rows
    path = tmp_path / "schedule.csv"
    path.write_text("# hand-written\n" + to_csv(programs))
    assert S.get_schedule(str(path), p, m, v) == programs
    with pytest.raises(ScheduleError, match=f"has num_stages={p}, but num_stages={p + 1} was asked for"):
        S.get_schedule(str(path), p + 1, m, v)


def test_csv_format_example():
    rows, explicit = parse_csv("stage,actions\n1,F0 B0 F1 B1 F2 B2\n\n0,F0 F1 B0 F2 B1 B2\n")
    assert not explicit and render(rows[0]) == "F0 F1 B0 F2 B1 B2"
    assert S.from_csv("0,F0 F1 B0 F2 B1 B2\n1,F0 B0 F1 B1 F2 B2") == S.get_schedule("1f1b", 2, 3)
    zb_rows, _ = parse_csv("0,F0 B0 W0\n1,F0 B0 W0")
    assert zb_rows[0] == (Forward(0), BackwardInput(0), BackwardWeight(0))


@pytest.mark.parametrize("text,message", [
    ("0,F0 X1 B0", "line 1 (stage 0), action 1: cannot parse action 'X1'"),
    ("0,F0 B0\n0,F0 B0", "line 2: stage 0 appears twice"),
    ("0,F0 B0\n2,F0 B0", "missing stage 1"),
    ("zero,F0 B0", "stage 'zero' is not an integer"),
    ("0 F0 B0", "expected 'stage,actions'"),
    ("0,L0 F0 SA0>1 RG0<1 B0 Reduce Step\n1,F0 B0", "either every row is a complete program or none is"),
    ("0,F0 B0 F1 B1\n1,F1 B1 F0 B0", "compute orders cannot run"),
    ("0,F0 W0 B0\n1,F0 B0",
     "stage 0: BackwardInput mb 0 (instruction 3) must come before BackwardWeight mb 0 (instruction 2)"),
    ("0,F0 B0\n1,F0 B0 F1 B1", "stage 0 never runs mb 1"),
    ("", "no stage rows"),
])
def test_csv_errors(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        S.from_csv(text)


def test_csv_explicit_programs_are_checked_for_deadlock(tmp_path):
    # both stages send first: fine with buffered sends, a hang with blocking ones
    path = tmp_path / "bad.csv"
    path.write_text("0,L0 F0 SA0>1 L1 F1 SA1>1 RG0<1 B0 RG1<1 B1 Reduce Step\n"
                    "1,RA0<0 L0 F0 B0 SG0>0 RA1<0 L1 F1 B1 SG1>0 Reduce Step\n")
    with pytest.raises(DeadlockError, match="bad.csv: deadlock .*stage 0 blocked at SendAct mb 1 to stage 1"):
        S.load_csv(path)
    with pytest.raises(ScheduleError, match="cannot read pipeline schedule file"):
        S.get_schedule(str(tmp_path / "missing.csv"), 2, 2)
