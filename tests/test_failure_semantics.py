"""Failures on NCCL end as they do on gloo: every rank stops, saying where in the schedule it was.

NCCL's `work.wait()` does not block the host, so the `PipelineError` a gloo wait raises never comes;
the host blocks later, at its next read of a device value. megazero's `StallWatch` (the executor tells
it every position) ends such a rank with exit code 72 and the last position. Here the host-side block
is emulated on gloo: a handler that never returns, as a host waiting on a hung kernel would.
"""
import time

import pytest

from megazero.runtime.stall_watch import EXIT_CODE, StallWatch, limit_for
from tests.harness import RankError, run_ranks


def test_the_watch_fires_only_when_armed_and_silent():
    codes = []
    watch = StallWatch(0.3, rank=3, exit=codes.append, poll_s=0.05)
    watch.arm()
    for _ in range(6):  # progress: notes every 0.1 s
        watch.note("stage 0 (rank 3) at Forward mb 0 (instruction 2 of 9)")
        time.sleep(0.1)
    watch.disarm()
    time.sleep(0.5)  # between steps: no limit
    assert codes == []
    watch.arm()
    watch.note("stage 1 (rank 3) at RecvGrad mb 4 from stage 2 (instruction 17 of 40)")
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:  # fires after 0.3 s (asking torch for NCCL's record first)
        time.sleep(0.05)
    assert codes == [EXIT_CODE]
    assert "rank 3" in watch.fired and "RecvGrad mb 4 from stage 2 (instruction 17 of 40)" in watch.fired


def test_the_limit_comes_before_nccls_watchdog_and_after_gloos_error():
    assert limit_for("nccl", 300) == 270 and limit_for("nccl", 60) == 50
    assert limit_for("gloo", 300) == 330


def _stuck_at_receive(stuck_rank: int):
    import megazero

    engine, _, data, _ = megazero.initialize(config="configs/debug_gpt.yaml", overrides=[
        "data.path=null", "parallel.tp=1", "train.global_batch_size=8"])
    engine.executor.watch = StallWatch(3.0, engine.pctx.global_rank, poll_s=0.2)
    if engine.pctx.global_rank == stuck_rank:  # the host blocked behind a receive that never completes
        engine.executor.handlers = dict(engine.executor.handlers)
        for kind in list(engine.executor.handlers):
            if kind.__name__ == "RecvAct":
                engine.executor.handlers[kind] = lambda *args: time.sleep(3600)
    engine.train_batch(data)
    return "finished"


@pytest.mark.parametrize("stuck_rank", [2])
def test_a_rank_blocked_on_the_host_exits_naming_its_schedule_position(stuck_rank):
    """pp 2 x dp 2: the stage-1 rank 2 never gets its activation; its watch ends it with exit code 72
    and "stage 1 (rank 2) at RecvAct mb 0 ..."; its stage-0 peer, left waiting for gradients, ends too."""
    with pytest.raises(RankError) as err:
        run_ranks(_stuck_at_receive, 4, stuck_rank, timeout=90)
    text = str(err.value)
    assert f"exit code {EXIT_CODE}" in text, text
    assert "last schedule position: stage 1 (rank 2) at RecvAct mb 0" in text, text


def test_nccl_runs_get_the_environment_megazero_relies_on(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (the TP overlap's launch order), NCCL's async error handling and
    flight recorder; a value the user set is kept; a gloo or CPU run gets none."""
    import torch

    from megazero.runtime import launch

    for key in launch.NCCL_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")  # the user's choice
    assert launch.nccl_environment("auto") == {}  # no CUDA here: the device is the CPU
    assert launch.nccl_environment("auto", torch.device("cpu")) == {}
    gpu = torch.device("cuda", 0)  # as `compute_device` gives on a GPU node
    assert launch.nccl_environment("gloo", gpu) == {}
    added = launch.nccl_environment("auto", gpu)
    assert added == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                     "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    import os

    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100" and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
