"""bf16 and fp16 training of the debug GPT on real text (a slice of the Python standard library)
at pp=2 x tp=2 x dp=2, 20 steps: the parallel run trains like one process in the same precision,
and like fp32 up to what 16-bit arithmetic itself costs. (The generated parity matrix,
tests/test_parity_matrix.py, checks bf16 and fp16 in many more layouts over 2 steps; this is the
longer run. The figures below were measured over 50 steps; 20 keep the suite's budget, and the
stated bounds hold for them too.)

What was measured on this 2-core AVX2 machine (no native bf16: torch emulates bf16 GEMMs), relative
to the step's loss:

- 8 ranks vs 1 process, same precision: per step at most 1.3e-2 (bf16) and 7.6e-3 (fp16), noise that
  does not accumulate (mean of the last 10 steps +2.5e-3 and -1.4e-3). Stated: 2e-2 per step, 5e-3
  on the tail. This is megazero's part: the layout changes only the order of 16-bit reductions.
- bf16 vs fp32: the bf16 loss drifts below fp32's, -2.1e-2 on the tail for 8 ranks and -2.4e-2 for
  one process, so the drift is bf16 arithmetic, not the layout (an earlier machine measured under
  1.5e-2). Stated: the tail within 5e-2 of fp32's, which a missing fp32 master or a wrong loss scale
  exceeds by far.

The per-step bound is 2e-2 or, where this CPU's 16-bit emulation moves one process's loss further
from fp32 in the same run, that distance. On an AMD EPYC machine (2026-12-02) step 10 is a loss
spike where one bf16 process lands 3.0e-2 below fp32 and the 8-rank run 0.75% below it: the
8-rank run differs from the one-process run by 2.3e-2 there because the one-process run is the
outlier, and by at most 5.8e-3 on every other step. A layout bug moves the parallel run away from
both, which the fp32 tail bound and the fp32 parity matrix catch.

fp16 uses dynamic loss scaling starting at 2^8 (no overflow on this model, so no step is skipped
and the curves align step by step).
"""
import pytest

from tests.harness import run_ranks
from tests.parity import train_worker

STEPS = 20


def config(corpus, precision, stage, pp=2, tp=2):
    return {"model": {"spec": "model_specs/gpt.py:debug", "vocab": 257, "seq_len": 64},
            "data": {"path": corpus}, "precision": precision, "parallel": {"pp": pp, "tp": tp},
            "zero": {"stage": stage}, "fp16": {"initial_scale_power": 8},
            "train": {"micro_batch_size": 4, "global_batch_size": 16, "seed": 5},
            "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}, "gradient_clipping": 1.0}


def losses(corpus, precision, stage, world):
    cfg = config(corpus, precision, stage, *((2, 2) if world == 8 else (1, 1)))
    return run_ranks(train_worker, world, cfg, STEPS, timeout=300)[0][0]


def tail(curve):
    return sum(curve[-10:]) / 10


@pytest.mark.parametrize("precision, stage", [("bf16", 2), ("fp16", 1)])
def test_low_precision_trains_like_one_process_and_tracks_fp32(corpus, precision, stage):
    fp32 = losses(corpus, "fp32", stage, 1)
    serial = losses(corpus, precision, stage, 1)
    parallel = losses(corpus, precision, stage, 8)
    assert parallel[-1] < 0.6 * parallel[0]  # the model learns
    worst = max(abs(a - b) / b for a, b in zip(parallel, serial, strict=True))
    floor = max(abs(a - b) / b for a, b in zip(serial, fp32, strict=True))  # what 16-bit arithmetic alone moves a step's loss
    assert worst <= max(2e-2, floor), (worst, floor)
    # the module docstring's measured figures: the mean of the last 10 steps moves +2.5e-3 / -1.4e-3 (8 ranks vs 1); stated 5e-3, and 5e-2 against fp32
    assert abs(tail(parallel) - tail(serial)) <= 5e-3 * tail(serial)
    assert abs(tail(parallel) - tail(fp32)) <= 5e-2 * tail(fp32)
