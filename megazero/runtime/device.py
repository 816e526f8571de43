"""The one decision of this process's compute device.

`compute_device(env, backend, cuda_devices)`: ``cuda:<local rank mod visible CUDA devices>`` when the
process sees a CUDA device and the backend is not gloo, else the CPU. The engine's start-up
(`megazero/runtime/launch.py:init_distributed`, the kernels loaded before it) and DeepSpeed's accelerator
(`megazero/compat/accelerator.py:get_accelerator`) all ask it, so they cannot disagree. No communication.
"""
from __future__ import annotations

import torch

from megazero.core.launch_env import LaunchEnv


def visible_cuda_devices() -> int:
    """The CUDA devices torch sees in this process (after CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def compute_device(env: LaunchEnv, backend: str = "auto", cuda_devices: int | None = None) -> torch.device:
    """This process's device: ``cuda:<env.local_rank mod cuda_devices>`` when `cuda_devices` (default: the
    visible ones, `visible_cuda_devices`) is positive and `backend` is not "gloo" ("auto" and "nccl" use
    the GPU), else the CPU. With one visible device per process (srun --gpus-per-task=1) every local rank
    gets cuda:0."""
    count = visible_cuda_devices() if cuda_devices is None else cuda_devices
    if count < 0:
        raise ValueError(f"compute_device(cuda_devices={count}): a device count is 0 or more")
    if count > 0 and backend != "gloo":
        return torch.device("cuda", env.local_rank % count)
    return torch.device("cpu")
