"""The simulator: rendezvous (blocking) p2p, deadlock reports, pairing checks, structure checks,
timeline accounting and the critical path."""
import re

import pytest

from megazero.core import schedules as S
from megazero.core.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, OptimizerStep, RecvAct, RecvGrad, ReduceGrads,
    ScheduleError, SendAct, SendGrad, check_programs, parse_program, render,
)
from megazero.core.simulate import Costs, DeadlockError, simulate

END = (ReduceGrads(), OptimizerStep())


def programs_of(*rows):
    return tuple(parse_program(row) for row in rows)


def test_single_stage_timeline_and_accounting():
    (program,) = programs_of("L0 F0 B0 L1 F1 B1 Reduce Step")
    result = simulate([program], Costs(forward=1, backward_input=2, backward_weight=1, load=0.5))
    assert [(sp.start, sp.end, repr(sp.instr)) for sp in result.timeline[0]][:3] == [
        (0, 0.5, "L0"), (0.5, 1.5, "F0"), (1.5, 4.5, "B0")]
    assert result.makespan == 9 and result.busy == (9,) and result.idle == (0,)
    assert result.bubble_fraction == 0 and result.peak_inflight == (1,)


def test_transfers_are_rendezvous_with_their_cost():
    # GPipe, p=2, m=1 with p2p = 0.5: F0 | send | F0 B0 | send | B0
    programs = S.get_schedule("gpipe", 2, 1)
    result = simulate(programs, Costs(forward=1, backward_input=1, backward_weight=1, p2p=0.5))
    assert result.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    assert result.idle == (7 - 3, 7 - 3)  # waiting and transfers count as idle
    assert len(result.messages) == 2
    send, recv = result.messages[0], result.timeline[1][result.messages[0].dst_index]
    assert result.timeline[0][send.src_index].start == recv.start  # both ends start and end together


def test_sender_blocks_until_the_receive_is_posted():
    # stage 1 posts its receive only after a slow warm-up load: the sender waits for it
    programs = (parse_program("L0 F0 SA0>1 RG0<1 B0 Reduce Step"), parse_program("RA0<0 L0 F0 B0 SG0>0 Reduce Step"))
    result = simulate(programs, lambda stage, ins: 5.0 if isinstance(ins, LoadMicroBatch) and stage == 0 else
                      Costs()(stage, ins))
    send = next(sp for sp in result.timeline[0] if isinstance(sp.instr, SendAct))
    assert send.start == 6.0  # ready at 6 (load 5 + F 1); stage 1 posted at 0 and waited
    assert result.timeline[1][0].start == 6.0


def naive_megatron_1f1b():
    """1F1B for p=2, m=3 with Megatron's order but plain blocking sends (no batched send+recv):
    stage 1 sends grad 0 before receiving activation 1, stage 0 sends activation 1 first."""
    return programs_of("L0 F0 SA0>1 L1 F1 SA1>1 RG0<1 B0 L2 F2 SA2>1 RG1<1 B1 RG2<1 B2 Reduce Step",
                       "RA0<0 L0 F0 B0 SG0>0 RA1<0 L1 F1 B1 SG1>0 RA2<0 L2 F2 B2 SG2>0 Reduce Step")


def test_blocking_sends_deadlock_where_buffered_would_not():
    with pytest.raises(DeadlockError) as info:
        simulate(naive_megatron_1f1b())
    message = str(info.value)
    assert "stage 0 blocked at SendAct mb 1 to stage 1 (instruction 6 of 17)" in message
    assert "stage 1 blocked at SendGrad mb 0 to stage 0 (instruction 5 of 17)" in message
    assert info.value.positions == ((5, SendAct(1, 0, 1)), (4, SendGrad(0, 0, 0)))


def test_deadlock_report_names_every_stage():
    programs = [list(prog) for prog in S.get_schedule("1f1b", 4, 8)]
    last = programs[3]
    i, j = last.index(RecvAct(2, 0, 2)), last.index(SendGrad(1, 0, 2))
    last[i], last[j] = last[j], last[i]  # stage 3 sends grad 1 before receiving activation 2
    with pytest.raises(DeadlockError) as info:
        simulate([tuple(prog) for prog in programs])
    message = str(info.value)
    for stage in range(4):
        assert re.search(f"stage {stage} (blocked at|finished)", message), message
    assert "stage 2 blocked at SendAct mb 2 to stage 3" in message
    assert "stage 3 blocked at SendGrad mb 1 to stage 2" in message
    assert all(pos is not None for pos in info.value.positions)


def test_mismatched_transfer_is_an_error():
    # stage 1 receives activation 1 first, stage 0 sends activation 0 first: the wrong tensor would arrive
    programs = programs_of("L0 F0 SA0>1 L1 F1 SA1>1 RG0<1 B0 RG1<1 B1 Reduce Step",
                           "RA1<0 RA0<0 L0 F0 L1 F1 B0 SG0>0 B1 SG1>0 Reduce Step")
    with pytest.raises(ScheduleError, match="mismatched transfer: stage 0's SendAct mb 0 to stage 1 would be "
                                            "received by stage 1's RecvAct mb 1 from stage 0"):
        simulate(programs)


def test_act_and_grad_on_one_link_must_not_cross():
    # p=2 interleaved: stage 1 sends activations (wrap-around) and grads to stage 0 on the same link
    programs = [list(prog) for prog in S.get_schedule("interleaved", 2, 2, 2)]
    sends = [i for i, ins in enumerate(programs[1]) if isinstance(ins, (SendAct, SendGrad))]
    kinds = [type(programs[1][i]) for i in sends]
    assert SendAct in kinds and SendGrad in kinds
    a = next(i for i in sends if isinstance(programs[1][i], SendAct))
    g = next(i for i in sends if isinstance(programs[1][i], SendGrad) and i > a)
    programs[1][a], programs[1][g] = programs[1][g], programs[1][a]
    with pytest.raises(ScheduleError):
        simulate([tuple(prog) for prog in programs])


GOOD = ("L0 F0 SA0>1 RG0<1 B0 Reduce Step", "RA0<0 L0 F0 B0 SG0>0 Reduce Step")


@pytest.mark.parametrize("rows,message", [
    (("L0 F0 SA0>1 RG0<1 B0 Reduce Step", "L0 F0 B0 SG0>0 Reduce Step"), "stage 1: Forward mb 0 has no RecvAct mb 0"),
    (("L0 F0 SA0>1 B0 RG0<1 Reduce Step", GOOD[1]),
     "stage 0: RecvGrad mb 0 from stage 1 (instruction 5) must come before Backward mb 0 (instruction 4)"),
    (("L0 F0 SA0>2 RG0<1 B0 Reduce Step", GOOD[1]), "SendAct mb 0 to stage 2 has the wrong peer; it must be stage 1"),
    (("L0 F0 SA0>1 RG0<1 B0 Step Reduce", GOOD[1]), "must end with ReduceGrads, OptimizerStep"),
    (("L0 F0 F0 SA0>1 RG0<1 B0 Reduce Step", GOOD[1]), "Forward mb 0 appears twice (instructions 2 and 3)"),
    (("L0 L1 F0 SA0>1 RG0<1 B0 Reduce Step", GOOD[1]), "unexpected LoadMicroBatch mb 1"),
    (("F0 SA0>1 RG0<1 B0 Reduce Step", GOOD[1]), "Forward mb 0 has no LoadMicroBatch mb 0"),
    (("L0 F0 SA0>1 RG0<1 Reduce Step", GOOD[1]), "stage 0: Backward mb 0 is missing"),
])
def test_structure_checks(rows, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        simulate(programs_of(*rows))


def test_weight_grad_after_full_backward_is_rejected():
    program = (LoadMicroBatch(0), Forward(0), Backward(0), BackwardWeight(0)) + END
    with pytest.raises(ScheduleError, match="follows a full Backward"):
        check_programs([program])


def test_forward_only_programs_run_without_the_structure_check():
    programs = programs_of("L0 F0 SA0>1 L1 F1 SA1>1", "RA0<0 L0 F0 RA1<0 L1 F1")
    with pytest.raises(ScheduleError):
        simulate(programs)
    assert simulate(programs, check=False).makespan == 3
    with pytest.raises(ScheduleError, match=re.escape("stage 0: SendAct mb 0 to stage 0 names no other stage")):
        simulate(programs_of("L0 F0 SA0>0", "RA0<0 F0"), check=False)


def test_peaks_count_forward_to_input_grad_and_forward_to_weight_grad():
    (program,) = programs_of("L0 F0 L1 F1 B0 L2 F2 B1 B2 W0 W1 W2 Reduce Step")
    result = simulate([program])
    assert result.peak_inflight == (2,) and result.peak_unfinished == (3,)
    assert isinstance(program[4], BackwardInput)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 3, 6, 2), ("zb-h1", 4, 8, 1)])
def test_critical_path_spans_the_step(name, p, m, v):
    result = simulate(S.get_schedule(name, p, m, v), Costs(forward=1, backward_input=1.5, backward_weight=0.5, p2p=0.1))
    path = result.critical_path()
    assert path[0][1].start == 0 and path[-1][1].end == pytest.approx(result.makespan)
    for (_, a), (_, b) in zip(path[:-1], path[1:], strict=True):
        assert b.start == pytest.approx(a.end)  # no gap: each waits for the previous one


def test_bubble_fraction_definitions():
    result = simulate(S.get_schedule("1f1b", 4, 8))  # unit costs: t_f = 1, t_b = 2
    assert result.makespan == (8 + 3) * 3
    assert result.bubble_fraction == pytest.approx(3 / 11)
    assert result.bubble_over_ideal == pytest.approx(3 / 8)


def test_render_and_describe():
    program = S.get_schedule("interleaved", 2, 2, 2)[0]
    assert render(program[:4]) == "L0 F0 SA0>1 L1"
    assert RecvGrad(7, 0, 3).describe() == "RecvGrad mb 7 from stage 3"
    assert SendAct(3, 1, 0).describe() == "SendAct mb 3 chunk 1 to stage 0" and repr(SendAct(3, 1, 0)) == "SA3c1>0"
    assert repr(BackwardWeight(2, 1)) == "W2c1" and repr(RecvAct(0, 0, 1)) == "RA0<1"


# -- batched, non-blocking p2p (megazero's NCCL path; the planner predicts GPU runs with it) ----------------

def test_a_batched_run_overlaps_its_transfers():
    """Megatron's 1F1B order with a send and a receive in one run on each stage: blocking p2p deadlocks on it
    (each stage sends first), batched p2p posts both at once, as NCCL runs them, and the step completes,
    the two transfers of a run overlapping in time."""
    costs = Costs(forward=1, backward_input=1, backward_weight=1, p2p=0.5)
    with pytest.raises(DeadlockError):
        simulate(naive_megatron_1f1b(), costs)
    result = simulate(naive_megatron_1f1b(), costs, batched=True)
    run = [sp for sp in result.timeline[0] if isinstance(sp.instr, (SendAct, RecvGrad))][1:3]  # SA1, RG0
    assert [repr(sp.instr) for sp in run] == ["SA1>1", "RG0<1"]
    assert run[0].start < run[1].end and run[1].start < run[0].end
    assert len(result.messages) == 6 and result.makespan > 3 * 3 + 0.5


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1),
                                           ("interleaved", 4, 8, 2), ("interleaved", 4, 12, 3), ("zb-h1", 4, 8, 1)])
def test_batched_p2p_is_never_slower_and_equal_without_transfer_cost(name, p, m, v):
    programs = S.get_schedule(name, p, m, v)
    free = Costs(forward=1, backward_input=1.5, backward_weight=0.5)
    assert simulate(programs, free, batched=True).makespan == simulate(programs, free).makespan
    for c in (0.05, 0.3, 1.0):
        costs = Costs(forward=1, backward_input=1.5, backward_weight=0.5, p2p=c)
        batched, blocking = simulate(programs, costs, batched=True), simulate(programs, costs)
        assert batched.makespan <= blocking.makespan + 1e-9
        assert batched.busy == pytest.approx(blocking.busy, rel=1e-12)  # the same compute, summed in another order
        # no faster than the compute of one stage plus one transfer per boundary each way
        assert batched.makespan >= max(batched.busy) + 2 * (p - 1) * c - 1e-9


def test_batched_deadlocks_are_reported_like_blocking_ones():
    """Both stages first wait for a transfer the other posts only later: no batching helps."""
    programs = programs_of("RG0<1 L0 F0 SA0>1 B0 Reduce Step", "RA0<0 L0 F0 B0 SG0>0 Reduce Step")
    with pytest.raises(DeadlockError, match="stage 0 blocked at RecvGrad"):
        simulate(programs, check=False, batched=True)
