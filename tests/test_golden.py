"""Golden files: the single-process numbers of the debug configs, checked in.

Layout parity (every layout equals one process) cannot see a change that moves the single-process
run itself: a new init, another reduction order, a changed default. These files pin the per-step
loss and grad norm of `configs/debug_gpt.yaml` and `configs/debug_llama.yaml` run serially (pp = tp =
dp = 1, fp32, synthetic tokens so that no data file is needed, 10 steps). A change that moves them on
purpose regenerates them and says why in its commit:

    .venv/bin/python -m tests.test_golden        # rewrites tests/golden/*.json

Tolerance: 1e-5 relative. Same torch build, same inputs: with 1 and 2 threads the numbers are
bitwise equal here; another CPU's SIMD path (AVX2 vs AVX-512 GEMMs) may reorder fp32 sums, which moves
them by ~1e-7 relative per step. Anything beyond 1e-5 is a real change of the single-process numbers.
"""
import json
import pathlib

import pytest

from tests.harness import run_ranks
from tests.parity import train_worker

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
CONFIGS = {"debug_gpt": ROOT / "configs" / "debug_gpt.yaml", "debug_llama": ROOT / "configs" / "debug_llama.yaml"}
STEPS = 10
OVERRIDES = ["parallel.pp=1", "parallel.tp=1", "data.path=null", f"train.steps={STEPS}"]
RTOL = 1e-5


def serial_run(name: str) -> dict:
    """Per-step losses and grad norms of config `name` on one process."""
    (losses, norms, _), = run_ranks(train_worker, 1, str(CONFIGS[name]), STEPS, OVERRIDES, timeout=300)
    return {"config": f"configs/{name}.yaml", "overrides": OVERRIDES, "steps": STEPS,
            "loss": losses, "grad_norm": norms}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_serial_run_matches_golden_file(name):
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    assert golden["overrides"] == OVERRIDES and golden["steps"] == STEPS
    now = serial_run(name)
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(now[key], golden[key], strict=True), start=1):
            assert abs(a - b) <= RTOL * abs(b), (f"{name} step {step}: {key} {a!r}, golden {b!r} "
                                                 f"(relative {abs(a - b) / abs(b):.2e} > {RTOL})")
    assert len(now["loss"]) == len(golden["loss"]) == STEPS


def main() -> None:
    for name in sorted(CONFIGS):
        path = GOLDEN / f"{name}.json"
        path.write_text(json.dumps(serial_run(name), indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
