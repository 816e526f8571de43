"""Real failures for the resilience tests: torchrun jobs started in the background, their rank processes
found by the environment torchrun gives them, and killed with SIGKILL at a chosen training step.

`Job(args)` starts ``python -m torch.distributed.run ARGS`` (its output in a file); `job.ranks()` maps
each global rank to the pid of its live process (children of that agent whose environment carries
TORCHELASTIC_RUN_ID and RANK); `job.wait_for_step(metrics, k)` waits until the metrics file has step k;
`job.kill_rank(r)` SIGKILLs rank r's process, `job.kill_agent()` the agent, `job.kill_node()` the agent and all its ranks; `slow_rank_env` makes one rank slow (a sleep in its compute) and optionally one link (a sleep per send), `bit_flip_env` flips one bit of one of its results;
`job.wait()` returns the agent's exit code (killing the
whole process tree on timeout: no test can hang the suite).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _environ(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


SLOW_SITE = """import os
if os.environ.get("RANK") == "{rank}":  # a slow device: every LayerNorm of this rank sleeps first
    import time
    import torch.nn.functional as F
    _layer_norm = F.layer_norm
    def layer_norm(*args, **kwargs):
        time.sleep({seconds})
        return _layer_norm(*args, **kwargs)
    F.layer_norm = layer_norm
"""


FLIP_SITE = """import os
if os.environ.get("RANK") == "{rank}":  # a silent hardware error: one bit of one LayerNorm output, once
    import torch
    import torch.nn.functional as F
    _layer_norm, _calls = F.layer_norm, [0]
    def layer_norm(*args, **kwargs):
        y = _layer_norm(*args, **kwargs)
        _calls[0] += 1
        if _calls[0] == {call}:
            wrong = y.detach().clone()
            wrong.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << {bit})
            y = y + (wrong - y.detach())  # the wrong value forward, the gradient as before
        return y
    F.layer_norm = layer_norm
"""


def _site_env(folder, text: str) -> dict:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(text)
    return {"PYTHONPATH": os.pathsep.join([str(folder), ROOT, os.environ.get("PYTHONPATH", "")])}


THROTTLE_SITE = """import os
if os.environ.get("RANK") in ("{a}", "{b}"):  # a slow link: what ranks {a} and {b} send each other is throttled
    import time
    import torch.distributed as dist
    _peer = {{"{a}": {b}, "{b}": {a}}}[os.environ["RANK"]]
    def _throttled(op):
        def call(tensor, dst=None, *args, **kwargs):
            if dst == _peer:
                time.sleep(tensor.numel() * tensor.element_size() / {bytes_per_s})
            return op(tensor, dst, *args, **kwargs)
        return call
    dist.send, dist.isend = _throttled(dist.send), _throttled(dist.isend)
"""


def slow_rank_env(folder, rank: int, seconds: float, link: tuple[int, int, float] | None = None) -> dict:
    """The environment that makes global rank `rank` of a torchrun job slow: a ``sitecustomize`` in `folder`
    (imported by every Python process at start) that makes each of that rank's LayerNorms sleep `seconds`.
    With `link` (a, b, bytes per second), what global ranks a and b send each other also goes at that rate
    (each send sleeps its bytes over the rate first)."""
    text = SLOW_SITE.format(rank=rank, seconds=seconds)
    if link is not None:
        text += THROTTLE_SITE.format(a=link[0], b=link[1], bytes_per_s=link[2])
    return _site_env(folder, text)


def bit_flip_env(folder, rank: int, call: int, bit: int = 22) -> dict:
    """The environment that flips bit `bit` of the first element of global rank `rank`'s `call`-th LayerNorm
    output (once), as a silently failing device would."""
    return _site_env(folder, FLIP_SITE.format(rank=rank, call=call, bit=bit))


def last_step(metrics: str) -> int:
    """The highest step in a metrics file (0 when it has none yet)."""
    if not os.path.exists(metrics):
        return 0
    with open(metrics) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip().endswith("}")]
    return max(steps, default=0)


class Job:
    """A torchrun agent in the background (see the module docstring)."""

    def __init__(self, args: list[str], log: str, env: dict | None = None):
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT,
                                     stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)

    def ranks(self) -> dict[int, int]:
        """{global rank: pid} of this agent's live rank processes."""
        found = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if _parent(int(name)) != self.proc.pid:
                    continue
                env = _environ(int(name))
            except (OSError, ValueError, IndexError):
                continue
            if b"TORCHELASTIC_RUN_ID" in env and b"RANK" in env:
                found[int(env[b"RANK"])] = int(name)
        return found

    def wait_for_step(self, metrics: str, step: int, timeout: float = 300.0) -> int:
        """Wait until `metrics` has reached `step`; the step it shows then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended (code {self.proc.returncode}) before step {step}:\n{self.output()[-3000:]}")
            seen = last_step(metrics)
            if seen >= step:
                return seen
            time.sleep(0.05)
        raise TimeoutError(f"step {step} not reached in {timeout} s:\n{self.output()[-3000:]}")

    def kill_rank(self, rank: int) -> int:
        """SIGKILL global rank `rank`'s process; its pid."""
        pid = self.ranks()[rank]
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_agent(self) -> list[int]:
        """SIGKILL the agent alone; its ranks follow it (`megazero.runtime.launch.follow_agent`). Their global ranks."""
        ranks = self.ranks()
        os.kill(self.proc.pid, signal.SIGKILL)
        return sorted(ranks)

    def kill_node(self) -> list[int]:
        """SIGKILL the agent and every rank process it started, as a node that goes down; their global ranks."""
        ranks = self.ranks()
        os.kill(self.proc.pid, signal.SIGKILL)
        for pid in ranks.values():
            os.kill(pid, signal.SIGKILL)
        return sorted(ranks)

    def wait(self, timeout: float = 600.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        finally:
            self._out.flush()

    def output(self) -> str:
        self._out.flush()
        with open(self.log, errors="replace") as f:
            return f.read()
