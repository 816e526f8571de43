"""tools/plan.py: one layout (text and --json), --search, and one clear line for each bad input.

The figures themselves are tested in test_planner_memory.py (memory equals CPU measurements) and
test_planner_speed.py (step time against Megatron-LM's Table 1); here the command line around them.
"""
import json
import os
import subprocess
import sys

import pytest

from megazero.toolbox import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HW, SPECS = os.path.join(ROOT, "configs", "hardware"), os.path.join(ROOT, "model_specs")
KEYS = ("memory_gb_per_gpu", "memory_gb_per_stage", "step_time_s", "tokens_per_s", "model_tflops_per_gpu",
        "hardware_tflops_per_gpu", "mfu", "breakdown")


def run(capsys, *argv):
    code = plan.main(list(argv), hardware_dir=HW, spec_dir=SPECS)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_one_layout_as_json_has_the_issue_keys(capsys):
    code, out, _ = run(capsys, "gpt:gpt-7.5b", "--hardware", "a100-80gb", "--gpus", "128", "--global-batch", "512",
                       "--tp", "4", "--micro-batch", "4", "--recompute", "full", "--json")
    assert code == 0
    got = json.loads(out)
    for key in KEYS:
        assert key in got, key
    assert got["memory_gb_per_gpu"] == max(got["memory_gb_per_stage"]) and got["fits"]
    # float64: the categories summed in another order than the step was computed, ~10 terms of ~1e-16 rounding
    assert abs(sum(got["breakdown"].values()) - got["step_time_s"]) <= 1e-9 * got["step_time_s"]
    assert 0 < got["mfu"] < 1 and got["hardware_tflops_per_gpu"] > got["model_tflops_per_gpu"]  # recompute counted
    assert got["layout_fields"]["dp"] == 32


def test_a_layout_that_does_not_fit_names_the_stage_and_the_excess(capsys):
    code, out, _ = run(capsys, "gpt:gpt3-175b", "--hardware", "a100-80gb", "--gpus", "64", "--global-batch", "64",
                       "--tp", "8", "--pp", "2", "--zero", "1")
    assert code == 1
    assert "does not fit: stage 0 by" in out and " GB" in out and "* " in out  # the tightest stage marked


def test_search_ranks_the_layouts_that_fit_and_says_why_others_do_not(capsys):
    code, out, _ = run(capsys, "gpt:gpt-1.7b", "--hardware", "a100-80gb", "--gpus", "16", "--global-batch", "64",
                       "--tp", "2", "--json", "--search", "--top", "3")
    assert code == 0
    got = json.loads(out)
    speeds = [r["tokens_per_s"] for r in got["fits"]]
    assert speeds == sorted(speeds, reverse=True) and got["fitting"] >= len(speeds) > 0
    assert all(r["layout_fields"]["tp"] == 2 and r["fits"] for r in got["fits"])  # a fixed flag is held
    for r in got["rejected"]:
        assert "GB over the" in r["why"], r


@pytest.mark.parametrize("argv, message", [
    (["gpt:debug", "--tp", "3", "--gpus", "3", "--global-batch", "3"], "tp=3 does not divide heads=8"),
    (["gpt:debug", "--pp", "5", "--gpus", "5", "--global-batch", "5"],
     "cannot split 4 layers into num_stages=5 x chunks=1"),
    (["gpt:debug", "--pp", "2", "--partition", "1,2"], "layer counts sum to 3, not model.layers=2"),
    (["gpt:debug", "--partition", "1,x"], "--partition '1,x': a list is comma-separated"),
    (["gpt:debug", "--partition", "flop"], "'flop' is not valid; did you mean 'flops'?"),
    (["gpt:debug", "--global-batch", "7"], "global_batch=7 is not divisible by micro_batch x dp = 1 x 8"),
    (["gpt:debug", "--hardware", "a100"], "--hardware 'a100': no such preset or file; presets: a100-80gb"),
    (["gpt:debg"], "flavor 'debg' is not in"),
    (["gpt:debug", "--gpus", "6", "--tp", "4"], "--gpus 6 is not divisible by tp x pp = 4 x 1"),
    (["gpt:debug", "--schedule", "interleaved:x"], "--schedule 'interleaved:x'"),
    (["gpt:debug", "layrs=4"], "unknown model spec field 'layrs'; did you mean 'layers'?"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    base = {"--hardware": "a100-80gb", "--gpus": "8", "--global-batch": "8"}
    for flag, value in base.items():
        if flag not in argv:
            argv = argv + [flag, value]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_interleaved_without_chunks_chooses_the_fastest_count(capsys):
    """70 layers over pp 4: V = 2, 3, 4, 6, 8 all run (uneven splits); the one chosen is the fastest that fits."""
    argv = ["gpt:debug", "layers=70", "hidden=2048", "heads=16", "seq_len=1024", "vocab=50000", "--hardware",
            "a100-80gb", "--gpus", "8", "--global-batch", "64", "--tp", "2", "--pp", "4", "--schedule", "interleaved"]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    chosen = json.loads(out)
    speeds = {}
    for v in (2, 3, 4, 6, 8):
        code, out, _ = run(capsys, *argv[:-1], f"interleaved:{v}", "--json")
        got = json.loads(out)
        if got["fits"]:
            speeds[v] = got["tokens_per_s"]
    best = max(speeds, key=speeds.get)
    assert chosen["layout_fields"]["chunks"] == best and chosen["tokens_per_s"] == speeds[best]
    assert f"V={best} chunks per stage, the fastest that fits" in chosen["chunks_chosen"]


def test_a_partition_is_planned_as_given(capsys):
    argv = ["gpt:debug", "layers=70", "hidden=2048", "heads=16", "seq_len=1024", "vocab=50000", "--hardware",
            "a100-80gb", "--gpus", "12", "--global-batch", "24", "--pp", "12", "--json"]
    plans = {}
    for part in ("uniform", "flops", "4," + "6," * 10 + "6"):
        code, out, _ = run(capsys, *argv, "--partition", part)
        assert code == 0
        plans[part] = json.loads(out)
    assert plans["flops"]["layout_fields"]["partition"] == "flops"
    assert plans["4," + "6," * 10 + "6"]["layout_fields"]["partition"] == [4] + [6] * 10 + [6]
    assert len({tuple(p["memory_gb_per_stage"]) for p in plans.values()}) == 3  # (uniform: 5, 6 x 10, 5)


def test_a_search_where_nothing_can_run_says_why(capsys):
    code, out, err = run(capsys, "gpt:gpt2-xl", "--hardware", "a100-80gb", "--gpus", "16", "--global-batch", "64",
                         "--tp", "2", "--search")
    assert code == 2 and "tp=2 does not divide heads=25" in err, err


def test_tools_plan_runs_as_a_script():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "llama:debug", "--hardware",
                           "h200-141gb", "--gpus", "4", "--global-batch", "8", "--tp", "2", "--pp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "memory per GPU" in proc.stdout and "MFU" in proc.stdout


def test_config_explain_shows_the_memory_prediction_per_stage():
    proc = subprocess.run([sys.executable, "-m", "megazero.core.config", "explain", "configs/debug_gpt.yaml",
                           "--world-size", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("#   stage ")]
    assert [x.split(":")[0] for x in lines] == ["#   stage 0", "#   stage 1"]
    assert all("params" in x and "activations" in x for x in lines)
