"""`DeviceClock`: host seconds on CPU right away; CUDA events resolved with one synchronisation."""
import time

import pytest
import torch

from megazero.runtime.clock import DeviceClock


def test_cpu_marks_are_host_seconds_in_order():
    clock = DeviceClock("cpu")
    assert not clock.deferred
    before = time.perf_counter()
    a = clock.mark()
    torch.ones(1000).sum()
    b = clock.mark()
    assert before <= a <= b <= time.perf_counter()
    assert clock.resolve([a, b]) == [a, b]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh runs it)")
def test_cuda_marks_time_the_kernels_not_their_launch():
    clock = DeviceClock("cuda")
    assert clock.deferred
    x = torch.randn(4096, 4096, device="cuda")
    start = clock.mark()
    for _ in range(20):
        x = x @ x / 64.0
    end = clock.mark()
    launched = time.perf_counter()
    t0, t1 = clock.resolve([start, end])
    finished = time.perf_counter()
    assert t0 < t1 <= finished + 1e-3  # the matmuls ran after their launch returned
    # 1 ms: perf_counter's readings on either side of a launch, well above its resolution
    assert t1 > launched - 1e-3 or t1 - t0 > 1e-3
