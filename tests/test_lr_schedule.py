"""Learning-rate schedules: warmup + linear/cosine decay, constant, DeepSpeed's WarmupLR and
WarmupDecayLR (linear and log warmup)."""
import math

import pytest

from megazero.zero.lr_schedule import LRScheduler, lr_at


def test_constant_and_warmup_shapes():
    assert [lr_at(s, "constant", 0.1, warmup_steps=5) for s in range(3)] == [0.1] * 3
    warm = [lr_at(s, "linear", 1.0, warmup_steps=4, total_steps=8) for s in range(8)]
    assert warm[:4] == [0.25, 0.5, 0.75, 1.0]
    assert warm[4:] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    cos = [lr_at(s, "cosine", 1.0, warmup_steps=0, total_steps=10, min_lr=0.1) for s in (0, 5, 10, 20)]
    assert cos == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert lr_at(100, "WarmupLR", 2.0, warmup_steps=10) == 2.0
    assert lr_at(9, "WarmupDecayLR", 1.0, warmup_steps=10, total_steps=20) == 1.0
    assert lr_at(15, "WarmupDecayLR", 1.0, warmup_steps=10, total_steps=20) == pytest.approx(0.5)
    log = lr_at(4, "WarmupLR", 1.0, warmup_steps=10, warmup_min_lr=0.0, warmup_type="log")
    assert log == pytest.approx(math.log(5) / math.log(10))


def test_scheduler_sets_every_param_group_and_round_trips():
    class Opt:
        param_groups = [{"lr": 0.0}, {"lr": 0.0}]
    opt = Opt()
    sched = LRScheduler(opt, "linear", 1.0, warmup_steps=2, total_steps=4)
    assert sched.get_last_lr() == [0.5, 0.5]
    sched.step()
    state = sched.state_dict()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)
    sched.load_state_dict(state)
    assert opt.param_groups[1]["lr"] == 1.0


@pytest.mark.parametrize("kwargs, needle", [(dict(kind="triangle"), "scheduler.type"),
                                            (dict(kind="linear", warmup_type="exp"), "scheduler.warmup_type")])
def test_bad_schedule_names(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        lr_at(0, lr=1.0, **kwargs)
