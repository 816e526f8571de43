"""Llama-3 405B at 128K context through the planner (issue 35): the Llama 3 Herd of Models (2024, Table 4) trained
its 131,072-token stage on 16,384 H100s with tp 8, cp 16, pp 16, dp 8 and 16M-token steps (128 sequences: 16
per data-parallel rank). Pure: no processes.

* That layout fits an H100 80GB with megazero's ring and Ulysses cores (full recompute, ZeRO-1, the published
  7 + 14 x 8 + 7 split of the 126 layers), and with cp 1 the same pipeline (16 sequences of 131,072 tokens in
  flight on the first stage) fits at no ZeRO stage and no recompute policy.
* On the same 16,384 GPUs without cp, dp is 128 and each pipeline gets one sequence per step: the layouts that
  fit leave the pipeline idle most of the step, and cp 16 is several times faster.
* ``tools/plan.py --search`` at 128K context tries cp and ranks a cp layout first: tp 8, cp 16, pp 16, dp 8,
  the published one, with Ulysses (megazero's ring computes its chunk pairs in fp32 without a fused kernel,
  several times slower at this length).
"""
import json
import os

import pytest

from megazero.core.spec import load_spec
from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout
from megazero.planner.memory_plan import predict_memory
from megazero.planner.speed import predict_step
from megazero.toolbox import plan as plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = load_hardware("h100-80gb", os.path.join(ROOT, "configs", "hardware"))
SPEC = load_spec(os.path.join(ROOT, "model_specs", "llama.py") + ":llama3-405b", {"seq_len": 131072})
PARTITION = (7,) + (8,) * 14 + (7,)
PUBLISHED = Layout(tp=8, pp=16, dp=8, cp=16, cp_method="ulysses", micro_batch=1, global_batch=128, zero=1,
                   recompute="full", sequence_parallel=True, partition=PARTITION)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_the_published_layout_fits_an_h100(method):
    lay = PUBLISHED.replace(cp_method=method)
    assert lay.gpus == 16384 and lay.num_microbatches == 16 and lay.problems(SPEC) == []
    plan = predict_memory(SPEC, lay, hardware=H100)
    assert plan.fits, plan.table()
    assert plan.tightest.total < 40e9  # room to spare: 30.4 GB (ring), 26.6 GB (Ulysses)
    # ZeRO-1 shards the optimizer states over dp x cp = 128 ranks: 12 bytes per parameter / 128
    params = plan.stages[1].breakdown["params"] / 2  # bf16
    # Adam's two fp32 moments, 8 bytes / 128 ranks per parameter; 1% for the padding of shards to whole elements per rank
    assert plan.stages[1].breakdown["optimizer_states"] == pytest.approx(8 * params / 128, rel=0.01)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_without_cp_the_same_pipeline_does_not_fit(zero, recompute):
    lay = PUBLISHED.replace(cp=1, zero=zero, recompute=recompute)
    assert lay.num_microbatches == 16
    assert not predict_memory(SPEC, lay, hardware=H100).fits


def test_on_the_same_gpus_without_cp_the_pipeline_idles():
    """cp 1 on 16,384 GPUs: dp 128, one sequence per pipeline and step; it fits (ZeRO-1, full recompute) but the
    bubble takes (p - 1) / p of the step, and cp 16 is more than 3x faster."""
    alone = PUBLISHED.replace(cp=1, dp=128)
    assert alone.gpus == PUBLISHED.gpus and alone.num_microbatches == 1
    assert predict_memory(SPEC, alone, hardware=H100).fits
    slow, fast = predict_step(SPEC, alone, H100), predict_step(SPEC, PUBLISHED, H100)
    assert slow.bubble_fraction > 0.9
    assert fast.tokens_per_s > 3 * slow.tokens_per_s
    assert fast.cp_bytes > 0 and fast.breakdown["cp_comm"] > 0 and slow.cp_bytes == 0


def test_search_at_128k_proposes_the_published_cp_layout(capsys):
    code = plan_cli.main(["llama:llama3-405b", "seq_len=131072", "--hardware", "h100-80gb", "--gpus", "16384",
                          "--global-batch", "128", "--tp", "8", "--pp", "16", "--micro-batch", "1", "--zero", "1",
                          "--schedule", "1f1b", "--partition", ",".join(map(str, PARTITION)), "--search", "--json"],
                         hardware_dir=os.path.join(ROOT, "configs", "hardware"),
                         spec_dir=os.path.join(ROOT, "model_specs"))
    got = json.loads(capsys.readouterr().out)
    assert code == 0
    best = got["fits"][0]["layout"]
    assert best.startswith("tp8 pp16 dp8 cp16-ulysses ") and "recompute=full" in best, best
    layouts = [r["layout"] for r in got["fits"]] + [r["layout"] for r in got["rejected"]]
    assert any(" cp" not in lay for lay in layouts)  # cp 1 was tried too
    assert any("-ring " in lay for lay in layouts) and any("-ulysses " in lay for lay in layouts)
