"""Learning-rate schedules as pure functions of the step, and a scheduler that applies them.

Every function here takes megazero's optimizer step `step`, 0-based: the first update uses step 0,
the second step 1, and so on (`LRScheduler` sets step 0's lr when it is built, then the next step's at
each `step()`, called after each applied optimizer step).

Types: constant; megazero's own linear and cosine (warmup from warmup_min_lr to lr over warmup_steps,
then decay to min_lr at total_steps, see `lr_at`; one lr for every group); DeepSpeed's WarmupLR (warmup
then constant) and WarmupDecayLR (warmup then linear decay back to warmup_min_lr), also in `lr_at` for
one group, with a peak per parameter group in `LRScheduler` (each group's own lr unless a
warmup_max_lr is given); DeepSpeed's WarmupCosineLR (`warmup_cosine_ratio`: a factor on each
parameter group's own lr) and OneCycle (`one_cycle_at`: lr and momentum, the same for every group).

The four DeepSpeed kinds follow DeepSpeed 0.19.8 step for step. DeepSpeed's engine builds its
scheduler before the first optimizer step (the scheduler then stands at iteration -1, and its
constructor sets the lr for that iteration) and calls `step()` after each optimizer step that was
applied, so DeepSpeed's iteration during megazero's optimizer step `step` is ``step - 1``.
tests/test_lr_schedule.py compares all four with values recorded from DeepSpeed's classes
(tests/data/deepspeed_lr_schedules.json).
"""
from __future__ import annotations

import math
import warnings

from megazero.core.config.schema import SCHEDULER_CHOICES

VALID = SCHEDULER_CHOICES  # one list: the config schema's
WARMUP_COSINE, ONE_CYCLE = "WarmupCosineLR", "OneCycle"
PER_GROUP_KINDS = (WARMUP_COSINE, ONE_CYCLE)  # not `lr_at`'s: their own functions below
ONE_CYCLE_BETA2 = 0.99
"""Adam's beta2 while OneCycle cycles the momentum: DeepSpeed's OneCycle writes betas = (momentum, 0.99)
into every parameter group, whatever beta2 the optimizer had, so megazero does the same."""
ONE_CYCLE_PARAMS = ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                    "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                    "decay_step_size", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")
"""The parameters of `one_cycle_at` (the config's scheduler.* keys of the same names, with
scheduler.cycle_momentum, which says whether `LRScheduler` applies the momentum)."""


DEEPSPEED_WARMUP_KINDS = ("WarmupLR", "WarmupDecayLR")
"""`lr_at`'s DeepSpeed kinds (`deepspeed_warmup_lr`); its other kinds are megazero's own."""


def lr_at(step: int, kind: str, lr: float, warmup_steps: int = 0, total_steps: int = 0,
          min_lr: float = 0.0, warmup_min_lr: float = 0.0, warmup_type: str = "linear") -> float:
    """Learning rate for optimizer step `step` (0-based: the first update uses step 0).

    constant: `lr`. WarmupLR, WarmupDecayLR: DeepSpeed's for one group peaking at `lr`, see
    `deepspeed_warmup_lr` (they take no min_lr: WarmupDecayLR decays to warmup_min_lr, as DeepSpeed's).

    linear, cosine (megazero's own, not DeepSpeed's, and not shifted like them): steps
    s = 0 .. warmup_steps-1 warm up, at warmup_min_lr + (lr - warmup_min_lr) * f with
    f = (s+1)/warmup_steps (warmup_type linear) or log(s+1)/log(warmup_steps) (log; 1 when warmup_steps
    is 1), so the last warmup step has lr (and, with linear warmup, the first is already above
    warmup_min_lr); from
    step warmup_steps the lr decays linearly / by a half cosine from lr to min_lr, reached at step
    total_steps and kept after. warmup_steps 0: no warmup."""
    if kind not in VALID:
        raise ValueError(f"scheduler.type {kind!r} is not one of {', '.join(VALID)}")
    if warmup_type not in ("linear", "log"):
        raise ValueError(f"scheduler.warmup_type {warmup_type!r} is not one of linear, log")
    if kind in PER_GROUP_KINDS:
        raise ValueError(f"scheduler.type {kind!r} has its own parameters: use "
                         f"{'warmup_cosine_ratio' if kind == WARMUP_COSINE else 'one_cycle_at'} (or LRScheduler)")
    if kind == "constant":
        return lr
    if kind in DEEPSPEED_WARMUP_KINDS:
        if min_lr != 0:
            raise ValueError(f"scheduler.min_lr={min_lr}: {kind} takes none (DeepSpeed's WarmupDecayLR decays to "
                             f"warmup_min_lr); set scheduler.warmup_min_lr")
        return deepspeed_warmup_lr(step, lr, warmup_steps, total_steps if kind == "WarmupDecayLR" else None,
                                   warmup_min_lr, warmup_type)
    if warmup_steps > 0 and step < warmup_steps:
        if warmup_type == "log":
            frac = math.log(step + 1) / math.log(warmup_steps) if warmup_steps > 1 else 1.0
        else:
            frac = (step + 1) / warmup_steps
        return warmup_min_lr + (lr - warmup_min_lr) * frac
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, max(0.0, (step - warmup_steps) / span))
    if kind == "linear":
        return min_lr + (lr - min_lr) * (1.0 - frac)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def deepspeed_warmup_lr(step: int, lr: float, warmup_steps: int, total_steps: int | None = None,
                        warmup_min_lr: float = 0.0, warmup_type: str = "log") -> float:
    """DeepSpeed's WarmupLR (`total_steps` None) and WarmupDecayLR: the lr of optimizer step `step`
    (0-based) for one parameter group, `lr` being its peak: DeepSpeed's warmup_max_lr, or without it
    the group's own lr for WarmupLR, 0.001 for WarmupDecayLR (`LRScheduler` applies it per group; the
    default warmup_type is DeepSpeed's).

    DeepSpeed's iteration is i = step - 1 (see the module's docstring) and its lr
    warmup_min_lr + (lr - warmup_min_lr) * gamma(i): gamma = 0 at i = -1 (steps 0 and 1 both run at
    warmup_min_lr); over w = max(2, warmup_steps) iterations (DeepSpeed's minimum of 2), gamma =
    log(i+1)/log(w) or i/w, reaching 1 at step w+1 (log: already at step w); then WarmupLR keeps 1 and
    WarmupDecayLR takes gamma = max(0, (total_steps - i) / max(1, total_steps - w)), down to 0
    (warmup_min_lr) at step total_steps + 1 and kept after (with total_steps < w, at once at i = w).
    The arithmetic is DeepSpeed's, so that the values agree to the last bit or so."""
    if warmup_type not in ("linear", "log"):
        raise ValueError(f"scheduler.warmup_type {warmup_type!r} is not one of linear, log")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        kind = "WarmupLR" if total_steps is None else "WarmupDecayLR"
        raise ValueError(f"scheduler.warmup_steps must be an integer >= 1 for {kind}, got {warmup_steps!r}")
    i = step - 1  # DeepSpeed's last_batch_iteration
    if i < 0:
        return warmup_min_lr
    w = max(2, warmup_steps)
    if i < w:
        gamma = (1.0 / math.log(w)) * math.log(i + 1) if warmup_type == "log" else i / w
    elif total_steps is None:
        gamma = 1.0
    else:
        gamma = max(0.0, float(total_steps - i) / float(max(1.0, total_steps - w)))
    return warmup_min_lr + (lr - warmup_min_lr) * gamma


def warmup_cosine_ratio(step: int, total_steps: int, warmup_steps: int = 1000, warmup_min_ratio: float = 0.0,
                        cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> float:
    """DeepSpeed's WarmupCosineLR: the factor on each parameter group's own initial lr for optimizer
    step `step` (0-based; the defaults are DeepSpeed's).

    The first step gets 0 (DeepSpeed's scheduler has not started then). DeepSpeed's iteration
    i = step - 1 then warms up over w = max(2, warmup_steps) iterations from warmup_min_ratio towards 1
    (by log(i+1)/log(w), or i/w), and from i = w follows a half cosine from 1 down to cos_min_ratio,
    reached at i = total_steps - 1 and kept after."""
    if warmup_type not in ("linear", "log"):
        raise ValueError(f"scheduler.warmup_type {warmup_type!r} is not one of linear, log")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"scheduler.warmup_steps must be an integer >= 1 for WarmupCosineLR, got {warmup_steps!r}")
    i = step - 1  # DeepSpeed's last_batch_iteration
    if i < 0:
        return 0.0
    w = max(2, warmup_steps)
    if i < w:
        rise = math.log(i + 1) * (1.0 / math.log(w)) if warmup_type == "log" else i / w
        return warmup_min_ratio + rise * (1.0 - warmup_min_ratio)
    progress = min(1.0, (i - w + 1) / max(1, total_steps - w))  # past the end: stays at the floor
    half_cosine = (1 + math.cos(math.pi * progress)) / 2
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * half_cosine)


def _one_cycle_scale(b: int, first: float, second: float, first_stairs: int, second_stairs: int) -> float:
    """Where batch `b` of the cycle stands between the lower (0) and upper (1) bound: up over the
    first `first` batches, down over the next `second`. A stair count n > 0 holds the value on n
    levels per half instead (levels from the integer position, as DeepSpeed does)."""
    total = first + second
    within = 1.0 + b / total - math.floor(1 + b / total)  # fraction of the cycle done
    rising = first / total
    if within <= rising:
        scale, stairs = within / rising, first_stairs
    else:
        scale, stairs = (within - 1) / (rising - 1), second_stairs
    if stairs > 0:
        pos = b % total
        level = pos * stairs / first if pos <= first else (total - pos) * stairs / second
        scale = math.floor(level) / stairs
    return scale


def one_cycle_at(step: int, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0) -> tuple[float, float]:
    """DeepSpeed's OneCycle: (lr, momentum) for optimizer step `step` (0-based; the defaults are
    DeepSpeed's). The momentum is Adam's beta1; `LRScheduler` applies it when cycle_momentum is on.

    Step 0 runs at the lower bounds, cycle_min_lr and cycle_min_mom (what DeepSpeed's constructor
    sets). Then step s is batch s of one cycle of cycle_first_step_size + cycle_second_step_size
    (the second defaults to the first) batches: lr rises from cycle_min_lr to cycle_max_lr and falls
    back while the momentum moves the other way, from cycle_max_mom to cycle_min_mom and back (see
    `_one_cycle_scale`; the second stair count defaults to the first). After the cycle, d batches on,
    lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size) and momentum = cycle_max_mom *
    (1 + decay_mom_rate * d / decay_step_size); a decay_step_size or rate of 0 keeps cycle_min_lr
    (cycle_max_mom)."""
    if cycle_first_step_size <= 0:
        raise ValueError(f"scheduler.cycle_first_step_size must be > 0, got {cycle_first_step_size}")
    first = float(cycle_first_step_size)
    second = first if cycle_second_step_size is None else float(cycle_second_step_size)
    if second < 0:
        raise ValueError(f"scheduler.cycle_second_step_size must be >= 0, got {cycle_second_step_size}")
    if step <= 0:
        return cycle_min_lr, cycle_min_mom
    total = first + second
    if step - 1 < total:
        second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        scale = _one_cycle_scale(step, first, second, cycle_first_stair_count, second_stairs)
        return (cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale,
                cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale)
    intervals = (step - total) / decay_step_size if decay_step_size != 0 else 0.0
    lr = cycle_min_lr if decay_lr_rate == 0 or decay_step_size == 0 else \
        cycle_min_lr / (1 + decay_lr_rate * intervals)
    mom = cycle_max_mom if decay_mom_rate == 0 or decay_step_size == 0 else \
        cycle_max_mom * (1 + decay_mom_rate * intervals)
    return lr, mom


def _cycles_betas(optimizer) -> bool:
    """Whether OneCycle's momentum applies to `optimizer`, as DeepSpeed decides it: for an optimizer with
    Adam's betas, not for SGD (DeepSpeed's OneCycle looks for "betas" in the optimizer's defaults,
    which torch's SGD lacks, and then cycles nothing). The ZeRO optimizer says by its update rule."""
    spec = getattr(optimizer, "spec", None)
    if getattr(spec, "type", None) is not None:
        return spec.type != "sgd"
    defaults = getattr(optimizer, "defaults", None)
    if defaults is not None:
        return "betas" in defaults
    return all("betas" in g for g in optimizer.param_groups)


def per_group(value, groups: int, name: str) -> list:
    """`value` for each of `groups` parameter groups: a number for all of them, or a list or tuple of
    one value per group (as DeepSpeed's schedulers take their float-or-list arguments)."""
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"scheduler.{name}: expected {groups} values (one per parameter group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * groups


class LRScheduler:
    """Sets the learning rate of every parameter group for optimizer step `last_step`, at construction
    (step 0) and at each `step()`.

    Per group, from each group's own lr as it was at construction (`base_lrs`, kept in the state):
    WarmupCosineLR scales it (`warmup_cosine_ratio`); WarmupLR and WarmupDecayLR warm up from
    warmup_min_lr to it (`deepspeed_warmup_lr`) when `lr` (their warmup_max_lr) is None, as DeepSpeed's
    WarmupLR does without warmup_max_lr. With `lr` a number (or a list, one per group), WarmupLR and
    WarmupDecayLR peak there instead, whatever the groups' lrs, as DeepSpeed's do with warmup_max_lr
    (DeepSpeed's WarmupDecayLR defaults it to 0.001: the DeepSpeed config translator fills that in);
    warmup_min_lr may be a list too. One lr for every group: megazero's linear and cosine (`lr`; None:
    the first group's lr) and OneCycle, which with cycle_momentum also sets Adam's betas = (momentum,
    `ONE_CYCLE_BETA2`) (not for SGD, as in DeepSpeed). `warmup_min_ratio` / `cos_min_ratio` are
    WarmupCosineLR's (with warmup_steps, total_steps, warmup_type); `cycle_momentum` and `one_cycle`
    (`ONE_CYCLE_PARAMS`) are OneCycle's."""

    def __init__(self, optimizer, kind: str = "constant", lr: float | list | None = None, warmup_steps: int = 0,
                 total_steps: int = 0, min_lr: float = 0.0, warmup_min_lr: float | list = 0.0,
                 warmup_type: str = "linear", *, warmup_min_ratio: float = 0.0, cos_min_ratio: float = 0.0001,
                 cycle_momentum: bool = True, **one_cycle):
        self.optimizer, self.kind = optimizer, kind
        self.base_lrs: list | None = None  # each group's own lr at construction, where the schedule uses it
        self.max_lrs: list | None = None  # WarmupLR / WarmupDecayLR: the peaks given (None: base_lrs)
        self.min_lrs: list | None = None  # WarmupLR / WarmupDecayLR: each group's warmup_min_lr
        self.cycle_momentum = False
        unknown = sorted(set(one_cycle) - set(ONE_CYCLE_PARAMS))
        if unknown or (one_cycle and kind != ONE_CYCLE):
            raise TypeError(f"LRScheduler: {', '.join(unknown or sorted(one_cycle))} "
                            f"{'unknown' if unknown else 'apply only to kind OneCycle'}")
        groups = len(optimizer.param_groups)
        if kind == WARMUP_COSINE:
            self.kwargs = dict(total_steps=total_steps, warmup_steps=warmup_steps, warmup_min_ratio=warmup_min_ratio,
                               cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)
            warmup_cosine_ratio(0, **self.kwargs)  # validates
            self.base_lrs = [param_group["lr"] for param_group in optimizer.param_groups]
        elif kind == ONE_CYCLE:
            self.kwargs = dict(one_cycle)
            one_cycle_at(0, **self.kwargs)  # validates
            self.cycle_momentum = bool(cycle_momentum) and _cycles_betas(optimizer)
            if cycle_momentum and not self.cycle_momentum:
                warnings.warn("scheduler.cycle_momentum: OneCycle cycles Adam's beta1; this optimizer has no betas "
                              "(SGD), so only the lr cycles, as in DeepSpeed", stacklevel=2)
        elif kind in DEEPSPEED_WARMUP_KINDS:
            if lr is None:
                self.base_lrs = [param_group["lr"] for param_group in optimizer.param_groups]
            else:
                self.max_lrs = per_group(lr, groups, "warmup_max_lr")
            self.min_lrs = per_group(warmup_min_lr, groups, "warmup_min_lr")
            self.kwargs = dict(kind=kind, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr,
                               warmup_type=warmup_type)
            for peak, floor in zip(self._peaks(), self.min_lrs):
                lr_at(0, lr=peak, warmup_min_lr=floor, **self.kwargs)  # validates
        else:
            self.kwargs = dict(kind=kind, lr=lr if lr is not None else optimizer.param_groups[0]["lr"],
                               warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr,
                               warmup_min_lr=warmup_min_lr, warmup_type=warmup_type)
            lr_at(0, **self.kwargs)  # validates the kind
        self.last_step = 0
        self._apply()

    def _peaks(self) -> list:
        return self.base_lrs if self.max_lrs is None else self.max_lrs

    def _apply(self) -> None:
        groups = self.optimizer.param_groups
        if self.kind == WARMUP_COSINE:
            ratio = warmup_cosine_ratio(self.last_step, **self.kwargs)
            for param_group, base_lr in zip(groups, self.base_lrs):
                param_group["lr"] = base_lr * ratio
        elif self.kind == ONE_CYCLE:
            lr, momentum = one_cycle_at(self.last_step, **self.kwargs)
            for param_group in groups:
                param_group["lr"] = lr
                if self.cycle_momentum:
                    param_group["betas"] = (momentum, ONE_CYCLE_BETA2)
        elif self.kind in DEEPSPEED_WARMUP_KINDS:
            for param_group, peak, floor in zip(groups, self._peaks(), self.min_lrs):
                param_group["lr"] = lr_at(self.last_step, lr=peak, warmup_min_lr=floor, **self.kwargs)
        else:
            lr = lr_at(self.last_step, **self.kwargs)
            for param_group in groups:
                param_group["lr"] = lr

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [param_group["lr"] for param_group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        """The step, and the groups' base lrs where the schedule uses them (WarmupCosineLR; WarmupLR and
        WarmupDecayLR without a warmup_max_lr): a resumed run scales / peaks at the same ones."""
        sd = {"last_step": self.last_step}
        if self.base_lrs is not None:
            sd["base_lrs"] = list(self.base_lrs)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()` and set every group's lr (and OneCycle's betas) for that step."""
        if self.base_lrs is not None and sd.get("base_lrs") is not None:
            if len(sd["base_lrs"]) != len(self.base_lrs):
                raise ValueError(f"the saved {self.kind} scheduler had {len(sd['base_lrs'])} parameter groups, "
                                 f"this one has {len(self.base_lrs)}")
            self.base_lrs = list(sd["base_lrs"])
        self.last_step = sd["last_step"]
        self._apply()


def step_lr_scheduler(scheduler) -> None:
    """`scheduler.step()` after an optimizer step. A torch scheduler built on a client optimizer that
    the ZeRO optimizer took over (they share the parameter-group dicts) cannot see the ZeRO step, so
    torch's check of the call order would warn wrongly; that one warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden")
        scheduler.step()
