"""Learning-rate schedules: megazero's warmup + linear/cosine decay and constant; DeepSpeed's WarmupLR,
WarmupDecayLR (linear and log warmup), WarmupCosineLR and OneCycle against values recorded from
DeepSpeed 0.19.8 (tests/data/deepspeed_lr_schedules.json, see below), as pure functions and through the
config, the engine's factory and the ZeRO optimizer, and their state round trip."""
import json
import math
import os
import warnings

import pytest
import torch

from megazero.core.config import ConfigError, from_deepspeed, resolve
from megazero.engine.factories import build_scheduler
from megazero.zero.lr_schedule import LRScheduler, lr_at, one_cycle_at, warmup_cosine_ratio


def test_constant_and_warmup_shapes():
    assert [lr_at(s, "constant", 0.1, warmup_steps=5) for s in range(3)] == [0.1] * 3
    warm = [lr_at(s, "linear", 1.0, warmup_steps=4, total_steps=8) for s in range(8)]
    assert warm[:4] == [0.25, 0.5, 0.75, 1.0]
    assert warm[4:] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    cos = [lr_at(s, "cosine", 1.0, warmup_steps=0, total_steps=10, min_lr=0.1) for s in (0, 5, 10, 20)]
    assert cos == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert lr_at(100, "WarmupLR", 2.0, warmup_steps=10) == 2.0


def test_deepspeed_warmup_kinds_run_one_iteration_behind():
    """DeepSpeed's WarmupLR / WarmupDecayLR at optimizer step k use DeepSpeed's iteration k - 1 (the
    scheduler is built before the first step, at iteration -1, and stepped after each): steps 0 and 1
    at warmup_min_lr, then the warmup over max(2, warmup_steps) iterations, then the decay, which
    reaches warmup_min_lr at step total_steps + 1 (the fixture below has DeepSpeed's own values)."""
    decay = [lr_at(k, "WarmupDecayLR", 1.0, warmup_steps=10, total_steps=20) for k in range(25)]
    assert decay[:3] == [0.0, 0.0, 0.1] and decay[10] == pytest.approx(0.9) and decay[11] == 1.0
    assert decay[16] == pytest.approx(0.5) and decay[21:] == [0.0] * 4
    log = [lr_at(k, "WarmupLR", 1.0, warmup_steps=10, warmup_min_lr=0.2, warmup_type="log") for k in range(13)]
    assert log[:2] == [0.2, 0.2] and log[11:] == [1.0, 1.0]
    assert log[5] == pytest.approx(0.2 + 0.8 * math.log(5) / math.log(10))
    assert log[10] == pytest.approx(0.2 + 0.8 * math.log(10) / math.log(10))
    for warmup_type in ("linear", "log"):  # warmup_steps 1 warms up over 2 iterations, as DeepSpeed's
        one = [lr_at(k, "WarmupLR", 1.0, warmup_steps=1, warmup_type=warmup_type) for k in range(5)]
        assert one == [lr_at(k, "WarmupLR", 1.0, warmup_steps=2, warmup_type=warmup_type) for k in range(5)]
    assert [lr_at(k, "WarmupLR", 1.0, warmup_steps=1, warmup_type="linear") for k in range(4)] == [0, 0, 0.5, 1]


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


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kind="triangle"), "scheduler.type"), (dict(kind="linear", warmup_type="exp"), "scheduler.warmup_type"),
    (dict(kind="WarmupLR", warmup_steps=0), "scheduler.warmup_steps must be an integer >= 1 for WarmupLR"),
    (dict(kind="WarmupDecayLR", warmup_steps=4, total_steps=9, min_lr=0.1), "scheduler.min_lr"),
])
def test_bad_schedule_names(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        lr_at(0, lr=1.0, **kwargs)


# --- DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle ----------------------------------
# tests/data/deepspeed_lr_schedules.json was recorded from DeepSpeed itself by a throwaway script (not
# kept) in a separate venv (`pip install torch==2.13.0 deepspeed==0.19.8`): for each case, it built
# torch.optim.<optimizer> (Adam/AdamW with betas (0.9, 0.95), SGD with momentum 0.9) with one param
# group per entry of `group_lrs`, constructed deepspeed.runtime.lr_schedules.<scheduler>(optimizer,
# **kwargs) (DeepSpeed 0.19.8's classes; the case's kwargs are DeepSpeed's scheduler.params), and
# recorded every group's lr, betas and momentum after the construction and after each of 59 calls of
# step(). Entry k is what DeepSpeed's engine uses for optimizer step k, as it builds the scheduler before
# the first step and calls step() after each (the script checked that entry k is the lr each group holds
# inside the k-th optimizer.step() when step() follows each one; DeepSpeed's engine itself, run on CPU,
# showed the same, also that under deepspeed.initialize a warmup_max_lr other than optimizer.params.lr sets
# every group's lr from the first step, for a config optimizer, model_parameters groups and a client
# optimizer alike). The cases: WarmupLR and WarmupDecayLR with log and linear warmup, warmup_min_lr 0 and
# not, warmup_num_steps 1 and 2 (DeepSpeed warms up over at least 2) and more, 2 groups (warmup_max_lr
# sets both), SGD, the decay past total_num_steps (it stays at warmup_min_lr), total equal to and below
# warmup, DeepSpeed's defaults, and (the last 9) 2 groups of different lrs without warmup_max_lr (WarmupLR
# peaks at each group's own lr, WarmupDecayLR at 0.001 for both) and warmup_max_lr other than the
# optimizer's lr (the first group's: every group peaks at warmup_max_lr); WarmupCosineLR with 2 groups of different lrs, log and linear warmup,
# warmup_num_steps 1, total below warmup, DeepSpeed's defaults; OneCycle with cycle_momentum on
# (Adam/AdamW: betas = (mom, 0.99)) and off, continuous and stairs (equal, unequal, first 0), post-cycle
# lr/momentum decay, 2 groups, SGD (DeepSpeed cycles no momentum there). The file's "source" says the same.
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed_lr_schedules.json")
with open(FIXTURE) as _f:
    DS = json.load(_f)
CASES = {case["name"]: case for case in DS["cases"]}


def torch_optimizer(case, params=None, **extra):
    """The case's torch optimizer, as the recording built it (one group per entry of group_lrs)."""
    lrs = case["group_lrs"]
    if params is None:
        params = [[torch.nn.Parameter(torch.zeros(2))] for _ in lrs]
    groups = [{"params": p, "lr": lr} for p, lr in zip(params, lrs, strict=True)]
    if case["optimizer"] == "SGD":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return getattr(torch.optim, case["optimizer"])(groups, lr=lrs[0], betas=(0.9, 0.95), **extra)


def ds_config(case) -> dict:
    opt = {"type": case["optimizer"], "params": {"lr": case["group_lrs"][0]}}
    if case["optimizer"] != "SGD":
        opt["params"]["betas"] = [0.9, 0.95]
    return {"optimizer": opt, "scheduler": {"type": case["scheduler"], "params": case["kwargs"]}}


def assert_close(got, want, what):
    # float64 learning rates computed by the same formula in another order as DeepSpeed's recorded values: a few ulps (~1e-16)
    assert got == (want if want is None else pytest.approx(want, rel=1e-12, abs=0.0)), what


def assert_groups_match(optimizer, case, k, momentum=True):
    """Every group's lr, betas and (unless `momentum` is false: the ZeRO optimizer's groups have a
    momentum whatever the rule) momentum at step k are the recorded ones."""
    for g, (group, lr, betas, mom) in enumerate(zip(optimizer.param_groups, case["lr"][k], case["betas"][k],
                                                    case["momentum"][k], strict=True)):
        where = f"{case['name']} step {k} group {g}"
        assert_close(group["lr"], lr, where + " lr")
        assert_close(None if betas is None else list(group["betas"]), betas, where + " betas")
        if momentum:
            assert_close(group.get("momentum"), mom, where + " momentum")


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedules_match_deepspeed_step_for_step(name):
    """A DeepSpeed config with the case's scheduler.params, read by megazero and built by the engine's
    factory on the same torch optimizer, sets every group's lr (and betas / momentum) at each of 60
    steps as DeepSpeed's class did, within 1e-12 relative. (A WarmupDecayLR with total_num_steps below
    warmup_num_steps, which DeepSpeed only warns about, megazero's config refuses.)"""
    case = CASES[name]
    if name == "decay_total_below_warmup":
        with pytest.raises(ConfigError, match="scheduler.total_steps"):
            resolve(from_deepspeed(ds_config(case)), 1)
        return
    cfg = resolve(from_deepspeed(ds_config(case)), 1)
    optimizer = torch_optimizer(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = build_scheduler(cfg, optimizer)
    assert bool(caught) == (case["scheduler"] == "OneCycle" and case["optimizer"] == "SGD"
                            and case["kwargs"].get("cycle_momentum", True))
    for k in range(DS["steps"]):
        if k:
            sched.step()
        assert_groups_match(optimizer, case, k)


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if CASES[n]["scheduler"] == "WarmupCosineLR"])
def test_warmup_cosine_ratio_is_a_pure_function_of_the_step(name):
    case = CASES[name]
    kw = case["kwargs"]
    args = dict(total_steps=kw["total_num_steps"], warmup_steps=kw.get("warmup_num_steps", 1000),
                warmup_min_ratio=kw.get("warmup_min_ratio", 0.0), cos_min_ratio=kw.get("cos_min_ratio", 0.0001),
                warmup_type=kw.get("warmup_type", "log"))
    for k in reversed(range(DS["steps"])):  # any order: no state
        assert_close([base * warmup_cosine_ratio(k, **args) for base in case["group_lrs"]], case["lr"][k], k)


WARMUP_CASES = [n for n in sorted(CASES) if CASES[n]["scheduler"] in ("WarmupLR", "WarmupDecayLR")]
TWO_LR_CASES = [n for n in WARMUP_CASES if len(set(CASES[n]["group_lrs"])) > 1]
"""WarmupLR / WarmupDecayLR cases with parameter groups of different lrs."""


def test_the_fixture_covers_per_group_peaks():
    no_max = [n for n in TWO_LR_CASES if "warmup_max_lr" not in CASES[n]["kwargs"]]
    overrides = [n for n in WARMUP_CASES if CASES[n]["kwargs"].get("warmup_max_lr", CASES[n]["group_lrs"][0])
                 != CASES[n]["group_lrs"][0]]
    assert {CASES[n]["scheduler"] for n in no_max} == {"WarmupLR", "WarmupDecayLR"}
    assert {CASES[n]["scheduler"] for n in overrides} == {"WarmupLR", "WarmupDecayLR"}
    peaks = CASES["warmup_no_max_two_groups"]["lr"][-1]
    assert peaks == CASES["warmup_no_max_two_groups"]["group_lrs"]  # DeepSpeed: each group's own lr
    assert CASES["decay_no_max_two_groups"]["lr"][5] == [0.001, 0.001]  # DeepSpeed's WarmupDecayLR default
    assert CASES["warmup_max_overrides_two_groups"]["lr"][-1] == [2e-3, 2e-3]  # warmup_max_lr, not the groups'


def _deepspeed_peaks(case) -> list:
    """Each group's peak as DeepSpeed's class takes it: warmup_max_lr for every group, or without it
    each group's own lr (WarmupLR) or 0.001 (WarmupDecayLR)."""
    kw, lrs = case["kwargs"], case["group_lrs"]
    if "warmup_max_lr" in kw:
        return [kw["warmup_max_lr"]] * len(lrs)
    return [0.001] * len(lrs) if case["scheduler"] == "WarmupDecayLR" else list(lrs)


def _warmup_args(case) -> dict:
    kw = case["kwargs"]  # DeepSpeed's defaults where it leaves one out: 1000 steps, log
    return dict(warmup_steps=kw.get("warmup_num_steps", 1000), total_steps=kw.get("total_num_steps", 0),
                warmup_min_lr=kw.get("warmup_min_lr", 0.0), warmup_type=kw.get("warmup_type", "log"))


@pytest.mark.parametrize("name", WARMUP_CASES)
def test_warmup_lr_and_warmup_decay_lr_are_pure_functions_of_the_step(name):
    """`lr_at` with the case's parameters and each group's peak (`_deepspeed_peaks`) gives every group
    DeepSpeed's lr at each step, within 1e-12 relative."""
    case = CASES[name]
    peaks, args = _deepspeed_peaks(case), _warmup_args(case)
    for k in reversed(range(DS["steps"])):  # any order: no state
        assert_close([lr_at(k, case["scheduler"], peak, **args) for peak in peaks], case["lr"][k], k)


@pytest.mark.parametrize("name", WARMUP_CASES)
def test_lr_scheduler_takes_deepspeeds_arguments(name):
    """`LRScheduler` on the case's torch optimizer with DeepSpeed's class arguments: `lr` (warmup_max_lr)
    None peaks at each group's own lr, as DeepSpeed's WarmupLR without warmup_max_lr; a number peaks
    every group there; a list (one per group, as DeepSpeed also takes) gives the same values."""
    case = CASES[name]
    kw, args = case["kwargs"], _warmup_args(case)
    if "warmup_max_lr" in kw:
        givens = [kw["warmup_max_lr"], [kw["warmup_max_lr"]] * len(case["group_lrs"])]
    elif case["scheduler"] == "WarmupDecayLR":
        givens = [0.001]  # DeepSpeed's default, which the config translator fills in
    else:
        givens = [None]
    for given in givens:
        optimizer = torch_optimizer(case)
        sched = LRScheduler(optimizer, case["scheduler"], given, **args)
        assert (sched.base_lrs is not None) == (given is None)
        for k in range(DS["steps"]):
            if k:
                sched.step()
            assert_groups_match(optimizer, case, k)


class _Groups:
    def __init__(self, *lrs):
        self.param_groups = [{"lr": lr} for lr in lrs]


@pytest.mark.parametrize("name", ["warmup_no_max_two_groups", "warmup_max_overrides_two_groups",
                                  "decay_no_max_two_groups", "decay_max_overrides_two_groups"])
def test_megazero_format_peaks_at_each_groups_lr_unless_warmup_max_lr(name):
    """megazero's own config: scheduler.warmup_max_lr unset peaks every group at its own lr (optimizer.lr
    for groups that set none), set peaks all there; the same values as DeepSpeed's (for WarmupDecayLR
    without warmup_max_lr, DeepSpeed's 0.001 written out). megazero's linear keeps one lr for all groups."""
    from megazero.core.config import load_config

    case = CASES[name]
    kw = case["kwargs"]
    overrides = [f"scheduler.type={case['scheduler']}", f"scheduler.warmup_steps={kw['warmup_num_steps']}",
                 f"scheduler.warmup_type={kw['warmup_type']}", f"scheduler.warmup_min_lr={kw.get('warmup_min_lr', 0)}",
                 f"optimizer.lr={case['group_lrs'][0]}"]
    if "total_num_steps" in kw:
        overrides.append(f"scheduler.total_steps={kw['total_num_steps']}")
    peak = kw.get("warmup_max_lr", 0.001 if case["scheduler"] == "WarmupDecayLR" else None)
    if peak is not None:
        overrides.append(f"scheduler.warmup_max_lr={peak}")
    cfg = resolve(load_config(None, overrides, world_size=1), 1)
    optimizer = torch_optimizer(case)
    sched = build_scheduler(cfg, optimizer)
    for k in range(DS["steps"]):
        if k:
            sched.step()
        assert_groups_match(optimizer, case, k)
    linear = resolve(load_config(None, ["scheduler.type=linear", "scheduler.warmup_steps=2", "optimizer.lr=0.01"],
                                 world_size=1), 1)
    optimizer = torch_optimizer(case)
    build_scheduler(linear, optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [0.005, 0.005]


def test_lr_scheduler_per_group_lists_and_their_length():
    opt = _Groups(0.1, 0.2)
    sched = LRScheduler(opt, "WarmupLR", [1.0, 2.0], warmup_steps=2, warmup_min_lr=[0.0, 0.5],
                        warmup_type="linear")
    assert sched.get_last_lr() == [0.0, 0.5]
    for _ in range(3):
        sched.step()
    assert sched.get_last_lr() == [1.0, 2.0] and sched.state_dict() == {"last_step": 3}
    with pytest.raises(ValueError, match="scheduler.warmup_max_lr: expected 2 values"):
        LRScheduler(opt, "WarmupLR", [1.0], warmup_steps=2)
    with pytest.raises(ValueError, match="scheduler.warmup_min_lr: expected 2 values"):
        LRScheduler(opt, "WarmupDecayLR", None, warmup_steps=2, total_steps=5, warmup_min_lr=[0.0, 0.0, 0.0])
    native = LRScheduler(_Groups(0.1, 0.2), "linear", None, warmup_steps=2, total_steps=4)  # one lr
    assert native.get_last_lr() == [0.05, 0.05] and native.base_lrs is None


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if CASES[n]["scheduler"] == "OneCycle"])
def test_one_cycle_at_is_a_pure_function_of_the_step(name):
    case = CASES[name]
    kw = {k: v for k, v in case["kwargs"].items() if k != "cycle_momentum"}
    for k in reversed(range(DS["steps"])):
        lr, mom = one_cycle_at(k, **kw)
        assert_close(lr, case["lr"][k][0], k)
        if case["betas"][k][0] is not None and case["kwargs"].get("cycle_momentum", True):
            assert_close(mom, case["betas"][k][0][0], k)


@pytest.mark.parametrize("name", ["cosine_linear_two_groups", "onecycle_momentum_decay",
                                  "decay_linear_min_lr_two_groups", "warmup_no_max_two_groups",
                                  "warmup_max_overrides_two_groups", "decay_no_max_two_groups"])
def test_the_zero_optimizer_trains_with_deepspeeds_lr_and_beta1(name):
    """megazero.initialize with the DeepSpeed config (two parameter groups): 6 steps of the ZeRO
    optimizer equal torch's optimizer stepped with the lr and betas DeepSpeed recorded, and the
    groups hold those values at each step."""
    import megazero

    case = CASES[name]

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

    ref, model = net(), net()
    groups = lambda m: [list(m[0].parameters()), list(m[1].parameters())]  # noqa: E731
    torch_opt = torch_optimizer(case, groups(ref), weight_decay=0.0)  # the config's (DeepSpeed's default)
    ds = {**ds_config(case), "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "gradient_clipping": 0.0}
    engine, opt, _, sched = megazero.initialize(
        model=model, config=ds, model_parameters=[{"params": p, "lr": lr} for p, lr in
                                                  zip(groups(model), case["group_lrs"], strict=True)])
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for k in range(6):
        assert_groups_match(opt, case, k, momentum=False)
        for group, lr, betas in zip(torch_opt.param_groups, case["lr"][k], case["betas"][k], strict=True):
            group["lr"], group["betas"] = lr, tuple(betas)
        ref(x).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
        engine.backward(model(x).pow(2).mean())
        engine.step()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        # fp32 parameters after the same updates, computed by another optimizer implementation (fused vs torch's): ~8 ulps; atol for near-0 entries
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("how", ["client_optimizer", "model_parameters"])
@pytest.mark.parametrize("name", [n for n in TWO_LR_CASES if CASES[n]["optimizer"] != "SGD"])
def test_initialize_sets_deepspeeds_per_group_lrs_at_every_step(name, how):
    """A DeepSpeed config dict through megazero.initialize on a tiny model with two parameter groups of
    different lrs, either a client torch.optim.AdamW holding the groups (the config has no optimizer
    section) or model_parameters as groups (the first without an lr: it gets optimizer.params.lr, the
    first recorded group's, as in DeepSpeed): at each of the 60 optimizer steps every group's lr is the
    one DeepSpeed recorded, within 1e-12 relative."""
    import megazero

    case = CASES[name]
    model = _net()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters()),
                                                         "lr": case["group_lrs"][1]}]
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "scheduler": {"type": case["scheduler"], "params": case["kwargs"]}}
    if how == "client_optimizer":
        client = torch.optim.AdamW(groups, lr=case["group_lrs"][0], betas=(0.9, 0.95))
        engine, opt, _, sched = megazero.initialize(model=model, optimizer=client, config=ds)
    else:
        ds["optimizer"] = ds_config(case)["optimizer"]
        engine, opt, _, sched = megazero.initialize(model=model, model_parameters=groups, config=ds)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for k in range(DS["steps"]):
        # float64 learning rates computed by the same formula in another order as DeepSpeed's recorded values: a few ulps
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(case["lr"][k], rel=1e-12, abs=0.0), k
        engine.backward(model(x).pow(2).mean())
        engine.step()
    assert sched.last_step == DS["steps"]


def _run(sched, optimizer, steps):
    seen = []
    for _ in range(steps):
        sched.step()
        seen.append([(g["lr"], tuple(g.get("betas", ()))) for g in optimizer.param_groups])
    return seen


@pytest.mark.parametrize("name", ["cosine_linear_two_groups", "onecycle_momentum_decay", "onecycle_stairs_decay",
                                  "decay_linear_min_lr_two_groups", "warmup_no_max_two_groups",
                                  "warmup_max_overrides_two_groups"])
def test_state_dict_round_trip_mid_schedule(name):
    """Saved at step 17 (through JSON, as a checkpoint's manifest), loaded into a scheduler built anew on
    an optimizer whose groups hold other values (a resumed run's, or the same optimizer rebuilt): the
    groups get step 17's lr and betas at once and every later step equals the uninterrupted run's."""
    case = CASES[name]
    cfg = resolve(from_deepspeed(ds_config(case)), 1)
    optimizer = torch_optimizer(case)
    sched = build_scheduler(cfg, optimizer)
    _run(sched, optimizer, 17)
    state = json.loads(json.dumps(sched.state_dict()))
    at_17 = [(g["lr"], tuple(g["betas"])) for g in optimizer.param_groups]
    later = _run(sched, optimizer, 20)

    fresh = torch_optimizer(case)
    for g in fresh.param_groups:
        g["lr"] = 0.5
        if case["scheduler"] == "OneCycle":  # its momentum is the scheduler's to restore
            g["betas"] = (0.1, 0.2)
    resumed = build_scheduler(cfg, fresh)  # base lrs 0.5: the state's must win
    resumed.load_state_dict(state)
    assert [(g["lr"], tuple(g["betas"])) for g in fresh.param_groups] == at_17
    assert _run(resumed, fresh, 20) == later
    assert_groups_match(fresh, case, 37)


def test_existing_kinds_keep_their_state_format():
    class Opt:
        param_groups = [{"lr": 0.0}]
    sched = LRScheduler(Opt(), "WarmupLR", 1.0, warmup_steps=4)
    sched.step()
    assert sched.state_dict() == {"last_step": 1}
    sched.load_state_dict({"last_step": 3})
    assert Opt.param_groups[0]["lr"] == lr_at(3, "WarmupLR", 1.0, warmup_steps=4)


def test_one_cycle_leaves_sgd_momentum_alone_on_the_zero_optimizer():
    """The ZeRO optimizer has betas in every group whatever its rule; for SGD (spec.type) OneCycle cycles
    only the lr, as DeepSpeed's does on torch's SGD."""
    from megazero.zero.optimizer import OptimizerSpec

    class ZeroLike:
        spec = OptimizerSpec("sgd", lr=0.1, momentum=0.9)
        param_groups = [{"lr": 0.1, "betas": (0.9, 0.999), "momentum": 0.9}]
    opt = ZeroLike()
    with pytest.warns(UserWarning, match="cycle_momentum"):
        sched = LRScheduler(opt, "OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 + 0.09 / 4)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999) and opt.param_groups[0]["momentum"] == 0.9
    ZeroLike.spec = OptimizerSpec("adamw")
    LRScheduler(opt, "OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_min_mom=0.85)
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kind="WarmupCosineLR", total_steps=10, warmup_steps=0), "scheduler.warmup_steps"),
    (dict(kind="WarmupCosineLR", total_steps=10, warmup_steps=5, warmup_type="exp"), "scheduler.warmup_type"),
    (dict(kind="OneCycle", cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0),
     "scheduler.cycle_first_step_size"),
    (dict(kind="OneCycle", cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_second_step_size=-1),
     "scheduler.cycle_second_step_size"),
])
def test_bad_per_group_schedules(kwargs, needle):
    class Opt:
        param_groups = [{"lr": 1.0, "betas": (0.9, 0.999)}]
    with pytest.raises(ValueError, match=needle):
        LRScheduler(Opt(), **kwargs)
    with pytest.raises(ValueError, match="warmup_cosine_ratio"):
        lr_at(0, "WarmupCosineLR", 1.0)
    with pytest.raises(TypeError, match="cycle_min_lr"):
        LRScheduler(Opt(), "WarmupLR", 1.0, cycle_min_lr=0.1)
