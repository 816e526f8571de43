"""bf16 and fp16 training of the debug GPT on real text (a slice of the Python standard library)
at pp=2 x tp=2 x dp=2 tracks the fp32 loss curve over 50 steps.

Stated tolerance: every step's loss within 3% of fp32's (bf16 keeps 8 mantissa bits: its per-step
deviation measured here is ~2%), and the mean of the last 10 steps within 1.5%. fp16 uses dynamic
loss scaling starting at 2^8 (no overflow on this model, so no step is skipped and the curves
align step by step).
"""
import pytest

from tests.harness import run_ranks
from tests.parity import train_worker

STEPS = 50


def config(corpus, precision, stage):
    return {"model": {"spec": "model_specs/gpt.py:debug", "vocab": 257, "seq_len": 64},
            "data": {"path": corpus}, "precision": precision, "parallel": {"pp": 2, "tp": 2},
            "zero": {"stage": stage}, "fp16": {"initial_scale_power": 8},
            "train": {"micro_batch_size": 4, "global_batch_size": 16, "seed": 5},
            "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}, "gradient_clipping": 1.0}


@pytest.mark.parametrize("precision, stage", [("bf16", 2), ("fp16", 1)])
def test_low_precision_tracks_fp32(corpus, precision, stage):
    ref = run_ranks(train_worker, 8, config(corpus, "fp32", stage), STEPS, timeout=300)[0][0]
    low = run_ranks(train_worker, 8, config(corpus, precision, stage), STEPS, timeout=300)[0][0]
    assert ref[-1] < 0.6 * ref[0]  # the model learns
    worst = max(abs(a - b) / b for a, b in zip(low, ref))
    assert worst <= 0.03, worst
    tail, tail_ref = sum(low[-10:]) / 10, sum(ref[-10:]) / 10
    assert abs(tail - tail_ref) <= 0.015 * tail_ref
