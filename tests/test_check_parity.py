"""tools/check_parity.py on the debug GPT and Llama configs: every layout (pp x tp x dp) trains like
1x1x1, and a deliberately injected bug makes the tool fail.

Each layout is a torchrun launch (~5 s of start-up on 2 cores), so the suite runs the GPT config
with ZeRO 1, 2 and 3 and the Llama config with ZeRO 3; the README's parity table lists the full
matrix (both configs x ZeRO 1-3) as measured with the same tool. The cheaper in-process parity
matrix is tests/test_zero_3d.py."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ["1x1x1", "2x2x2", "2x1x4", "1x2x4", "4x2x1"]


def check_parity(config, layouts, *overrides, env=None, steps=2):
    cmd = [sys.executable, "tools/check_parity.py", config, "--layouts", *layouts, "--steps", str(steps), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)


@pytest.mark.parametrize("config, stage", [("configs/debug_gpt.yaml", 1), ("configs/debug_gpt.yaml", 2),
                                           ("configs/debug_gpt.yaml", 3), ("configs/debug_llama.yaml", 3)])
def test_layouts_match(config, stage, corpus):
    p = check_parity(config, LAYOUTS, f"data.path={corpus}", f"zero.stage={stage}")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.count(" OK") == len(LAYOUTS) - 1


BUG = '''
import megazero.zero.flat_group as fg
_orig = fg.FlatGroup.reduce_bucket
def reduce_bucket(self, b, async_op=False):   # injected bug: gradients summed, not averaged, over dp
    if self.full_grads:
        bk = self.layout.buckets[b]
        self.grad_flat[bk.start:bk.end].mul_(self.dp.size)
    return _orig(self, b, async_op)
fg.FlatGroup.reduce_bucket = reduce_bucket
'''


def test_injected_bug_fails(corpus, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BUG)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = check_parity("configs/debug_gpt.yaml", ["1x1x1", "1x1x2"], f"data.path={corpus}", "zero.stage=1",
                     "parallel.pp=1", "parallel.tp=1", env=env)
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    assert "1x1x2 vs 1x1x1" in p.stdout and "FAIL" in p.stdout
