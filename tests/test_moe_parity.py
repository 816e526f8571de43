"""MoE models trained in 3D layouts with expert parallelism equal the serial run (fp32).

Layouts: an all-pairs covering set (megazero.core.pairwise) of ep ∈ {1, 2, 4} × tp ∈ {1, 2 (the experts'
ffn split over it: parallel.expert_tp = tp), 2 with expert_tp = 1 (whole experts on every TP rank)} ×
pp ∈ {1, 2} × ZeRO 0-3 × model (Mixtral-style debug-moe, top-2 softmax, no dropping; DeepSeek-style
debug-deepseek, 16 fine-grained experts top-4 with sigmoid scores, a shared expert and capacity 1.25,
so tokens are dropped) × MLP biases (the experts' too) or none, on at most 8 ranks; dp is 2·ep where
that fits (every expert on 2 ranks, its gradient reduced over them), else ep.
Each runs 3 steps of the engine (megazero.toolbox.parity.run_layout: aux and z losses in the gradient, the
experts' gradients reduced over the expert-data-parallel group) and is compared with one process
training the same global batch: losses, grad norms, first-step gradients and final parameters, at the
fp32 tolerances of megazero.toolbox.parity (1e-5).
"""
from __future__ import annotations

import pytest
import torch

from megazero.core import pairwise
from megazero.core.config import ConfigError
from megazero.engine import load_run_config
from megazero.models.hf import spec_from_hf_config
from megazero.planner.from_config import spec_of
from megazero.toolbox.parity import compare, format_rows, merge_reports, run_layout, serial_overrides
from tests.harness import run_ranks

FACTORS = {"ep": (1, 2, 4), "tp": (1, 2, "2/etp1"), "pp": (1, 2), "zero": (0, 1, 2, 3),
           "model": ("debug-moe", "debug-deepseek"), "bias": (False, True)}
"""tp 2 splits each expert's ffn over the TP group (parallel.expert_tp = tp, the default); "2/etp1" is
tp 2 with parallel.expert_tp = 1 (whole experts on every TP rank)."""
STEPS = 3


def _dp(case):
    """2·ep where it fits in 8 ranks (so each expert is held by 2 ranks and reduced over them), else ep."""
    ep, rest = case["ep"], case["pp"] * _tp(case)
    return next((dp for dp in (2 * ep, ep) if rest * dp <= 8), None)


def _allowed(case) -> bool:
    dp = _dp(case)
    return dp is not None and case["pp"] * _tp(case) * dp <= 8


def _tp(case) -> int:
    return 2 if case["tp"] == "2/etp1" else case["tp"]


def config(case) -> dict:
    dp = _dp(case)
    model = {"spec": f"model_specs/llama.py:{case['model']}", "layers": 4}
    if case["model"] == "debug-deepseek":
        model["moe"] = {"capacity_factor": 1.25}
    if case.get("bias"):
        model["overrides"] = {"bias": True}  # the MLP biases: the experts' too
    expert_tp = 1 if case["tp"] == "2/etp1" else _tp(case)
    return {"precision": "fp32", "gradient_clipping": 1.0,
            "parallel": {"pp": case["pp"], "tp": _tp(case), "dp": dp, "ep": case["ep"], "expert_tp": expert_tp},
            "model": model,
            "train": {"micro_batch_size": 1, "global_batch_size": 2 * case["pp"] * dp, "seed": 1234},
            "optimizer": {"type": "adamw", "lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01},
            "zero": {"stage": case["zero"], "reduce_bucket_size": 5000, "allgather_bucket_size": 5000,
                     "prefetch_bucket_size": 5000, "param_persistence_threshold": 0},
            "log": {"interval": 1000}}


CASES = pairwise.covering_set(FACTORS, _allowed, seed=0)


def _id(case):
    return (f"ep{case['ep']}-tp{str(case['tp']).replace('/', '-')}-pp{case['pp']}-dp{_dp(case)}-zero{case['zero']}-"
            f"{case['model']}{'-bias' if case['bias'] else ''}")


def test_the_covering_set_covers_every_pair():
    covered = set().union(*(pairwise.pairs_in(c, FACTORS) for c in CASES))
    possible = {p for p in pairwise.all_pairs(FACTORS)
                if any(_allowed(c) and pairwise.pairs_in(c, FACTORS) >= {p} for c in pairwise.full_product(FACTORS))}
    assert possible <= covered and len(CASES) <= 16, len(CASES)


_SERIAL: dict = {}


def _serial(case):
    cfg = config(case)
    key = (case["model"], case["bias"], cfg["train"]["global_batch_size"])
    if key not in _SERIAL:
        _SERIAL[key] = run_ranks(run_layout, 1, cfg, serial_overrides(cfg["train"]["global_batch_size"]), STEPS,
                                 timeout=300)[0]
    return _SERIAL[key]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_moe_layout_equals_serial(case):
    cfg = config(case)
    world = case["pp"] * _tp(case) * _dp(case)
    result = merge_reports(run_ranks(run_layout, world, cfg, (), STEPS, timeout=300))
    rows = compare(result, _serial(case), STEPS)
    assert all(r["ok"] for r in rows), f"{_id(case)}\n{format_rows(rows)}"
    assert any(".experts." in name for name in result["params"])
    assert any(name.endswith(".experts.down_bias") for name in result["params"]) == case["bias"]


@pytest.mark.parametrize("overrides,words", [
    (["parallel.ep=3"], "parallel.ep=3 does not divide the data-parallel size dp=4"),
    (["parallel.ep=4", "model.moe.num_experts=6"], "model.moe.num_experts=6 does not split over parallel.ep=4"),
    (["parallel.ep=2", "model.spec=model_specs/llama.py:debug"], "parallel.ep=2: expert parallelism needs a Mixture"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "not supported with model.moe"),
    (["model.moe.top_k=9"], "moe_top_k=9 must be between 1 and num_experts=8"),
    (["parallel.tp=2", "parallel.expert_tp=4"], "parallel.expert_tp: 4 is not valid (valid: 1, experts whole"),
    (["model.moe.drop_tokens=false", "model.moe.capacity_factor=1.5"], "no dropping has no capacity"),
    (["model.moe.drop_tokens=true"], "model.moe.drop_tokens=true: the spec has no capacity"),
])
def test_bad_moe_layouts_are_refused_before_any_process_group(overrides, words):
    base = config({"ep": 1, "tp": 1, "pp": 1, "zero": 1, "model": "debug-moe"})
    del base["parallel"]["dp"]  # derived from the 4 ranks
    with pytest.raises((ConfigError, ValueError)) as err:
        load_run_config(base, overrides, world_size=4)
    assert words in str(err.value).splitlines()[0] or words in str(err.value), str(err.value)


def _ckpt_config(corpus, ep, zero=1, pp=1, tp=1, expert_tp=None):
    from tests.test_checkpoint import BASE

    return dict(BASE, parallel={"pp": pp, "tp": tp, "ep": ep, "expert_tp": expert_tp}, data={"path": corpus},
                model={"spec": "model_specs/llama.py:debug-deepseek", "layers": 4, "vocab": 257, "seq_len": 32,
                       "moe": {"capacity_factor": 1.25}, "overrides": {"bias": True}},
                zero=dict(BASE["zero"], stage=zero))


@pytest.fixture(scope="module")
def saved_at_ep2(corpus, tmp_path_factory):
    """4 ranks (tp 2 with the experts' ffn split over it, dp 2, ep 2, ZeRO-1; experts with biases):
    2 x 3 steps with a checkpoint after 3."""
    from tests.test_checkpoint import train

    path = tmp_path_factory.mktemp("moe-ckpt")
    whole = run_ranks(train, 4, _ckpt_config(corpus, 2, tp=2, expert_tp=2), 6, str(path), None, 3, timeout=300)[0]
    return str(path), whole, corpus


@pytest.mark.parametrize("world,ep,zero,pp,tp,expert_tp", [(4, 4, 2, 1, 1, None), (4, 1, 0, 1, 2, 1),
                                                           (4, 2, 3, 1, 2, 2), (4, 2, 1, 2, 1, None)])
def test_checkpoint_at_ep2_continues_at_another_ep(saved_at_ep2, world, ep, zero, pp, tp, expert_tp):
    """The experts' slices (and their Adam states), split over ep (dim 0) and over TP (their ffn), are
    saved as boxes of their logical (E, f, h) tensors: any ep, TP split of the experts (or none),
    dp, ZeRO stage or pipeline split reads its own slices back and continues the run."""
    from tests.test_checkpoint import train

    path, whole, corpus = saved_at_ep2
    cfg = _ckpt_config(corpus, ep, zero, pp, tp, expert_tp)
    losses, norms = run_ranks(train, world, cfg, 3, None, path, timeout=300)[0]
    for got, want in ((losses, whole[0][3:]), (norms, whole[1][3:])):
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
        # fp32: another ep layout sums the same gradients in another order each step (the parity suites' 1e-5)
        assert worst <= 1e-5, (worst, got, want)


@pytest.mark.parametrize("flavor,extra", [("debug-moe", []), ("debug-deepseek", ["model.moe.capacity_factor=1.25"])])
def test_moe_flavors_train_with_falling_loss(corpus, tmp_path, flavor, extra):
    """The trainer as a user runs it (torchrun, 4 ranks: pp 2 x dp 2, experts over ep 2) for 30 steps:
    the loss falls, and every step's metrics carry the load balance (aux and z losses, dropped share,
    imbalance, tokens per expert), which the log line prints."""
    import json
    import subprocess
    import sys

    from tests.test_trainer import ROOT

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m",
           "megazero.run.train", "configs/debug_moe.yaml", f"model.spec=model_specs/llama.py:{flavor}",
           f"data.path={corpus}", f"run_dir={run}", "train.steps=30", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    losses = [r["loss"] for r in rows]
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses
    for r in rows:
        m = r["moe"]
        assert 0.9 < m["aux_loss"] < 4 and m["z_loss"] > 0 and m["imbalance"] >= 1.0
        assert (m["dropped"] > 0) == bool(extra) and sum(m["tokens_per_expert"]) > 0
    experts = 8 if flavor == "debug-moe" else 16
    assert len(rows[0]["moe"]["tokens_per_expert"]) == experts
    assert "moe aux" in p.stdout and "imbalance" in p.stdout


def test_drop_tokens_false_resets_a_flavors_capacity(tmp_path):
    """A flavor that drops tokens (capacity 1.25) runs without dropping under model.moe.drop_tokens=false:
    a null capacity_factor could not say it, since unset keys keep the spec's value."""
    spec_file = tmp_path / "capped.py"
    spec_file.write_text("from megazero.core.spec import load_spec\n"
                         "FLAVORS = {'capped': load_spec('model_specs/llama.py:debug-moe').replace(moe_capacity_factor=1.25)}\n")
    base = config({"ep": 1, "tp": 1, "pp": 1, "zero": 1, "model": "debug-moe"})
    del base["parallel"]["dp"]
    base["model"]["spec"] = f"{spec_file}:capped"
    assert spec_of(load_run_config(base, [], world_size=2)).moe.capacity_factor == 1.25
    unlimited = spec_of(load_run_config(base, ["model.moe.drop_tokens=false"], world_size=2)).moe
    assert unlimited.capacity_factor is None and unlimited.capacity(64) is None


def test_config_explain_flags_the_per_node_rule(capsys):
    from megazero.core.config.__main__ import main

    assert main(["explain", "configs/debug_moe.yaml", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "8 experts per MoE layer, top-2, over parallel.ep=2: 4 per rank" in out and "WARNING" not in out
    assert main(["explain", "configs/debug_moe.yaml", "model.moe.num_experts=12", "--world-size", "4",
                 "--gpus-per-node", "8"]) == 0
    assert "WARNING: model.moe.num_experts=12 is not a multiple of the 8 GPUs per node" in capsys.readouterr().out
    assert main(["explain", "configs/debug_moe.yaml", "model.moe.num_experts=12", "--world-size", "4",
                 "--gpus-per-node", "4"]) == 0
    assert "WARNING" not in capsys.readouterr().out


def _zero3_expert_worker(cfg):
    import megazero

    engine, optimizer, data, _ = megazero.initialize(config=cfg)
    engine.train_batch(data)
    groups = {g.name: (g.shard_params, g.dp.size, g.stage) for g in optimizer.groups}
    experts = [p for p in engine.module.parameters() if getattr(p, "expert", False)]
    held = sum(p.untyped_storage().nbytes() for p in experts)  # between steps: released
    owned = sum(t.numel() for t in optimizer.groups[[g.name for g in optimizer.groups].index("experts")].master)
    local = sum(p.full_shape[0] // p.ep_size * p.full_shape[1] * p.full_shape[2] for p in experts)
    return groups, held, owned, local


def test_zero3_shards_the_experts_over_their_group():
    """At ZeRO-3 the experts' parameters are sharded over the expert-data-parallel group and gathered
    per layer like the others: between steps a rank holds none of them whole, and 1 / (dp / ep) of its
    experts' fp32 master."""
    case = {"ep": 2, "tp": 1, "pp": 1, "zero": 3, "model": "debug-moe"}
    cfg = config(case)
    cfg["parallel"]["dp"] = 4  # dp 4, ep 2: each expert on 2 ranks
    cfg["train"]["global_batch_size"] = 8
    for groups, held, owned, local in run_ranks(_zero3_expert_worker, 4, cfg, timeout=300):
        assert groups["experts"] == (True, 2, 3), groups
        assert held == 0
        assert owned == local // 2


def test_the_planner_plans_moe():
    import subprocess
    import sys

    from tests.test_trainer import ROOT

    p = subprocess.run([sys.executable, "tools/plan.py", "llama:mixtral-8x7b", "seq_len=4096", "--hardware",
                        "h100-80gb", "--gpus", "64", "--global-batch", "64", "--tp", "8", "--ep", "8",
                        "--recompute", "full"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "46.70B parameters (12.88B active per token)" in p.stdout and "all_to_all" in p.stdout
    assert "\nfits\n" in p.stdout


def test_moe_checkpoint_consolidates_by_logical_shape_and_refuses_hf_export(saved_at_ep2, tmp_path):
    """The manifest and `consolidate` (what save_16bit_model writes) keep the experts' logical (E, f, h)
    shape; the Hugging Face export (Mixtral's routing only) names what a DeepSeek-style model has that
    Mixtral has not."""
    from safetensors import safe_open

    from megazero.checkpoint.convert import consolidate, export_hf
    from megazero.checkpoint.sharded import CheckpointError

    path = saved_at_ep2[0]
    step = sorted(d for d in __import__("os").listdir(path) if d.startswith("step"))[0]
    out = tmp_path / "model.safetensors"
    consolidate(f"{path}/{step}", str(out))
    with safe_open(str(out), "pt") as f:
        assert tuple(f.get_tensor("layers.0.mlp.experts.gate").shape) == (16, 32, 64)
        assert tuple(f.get_tensor("layers.0.mlp.experts.down").shape) == (16, 64, 32)
        assert tuple(f.get_tensor("layers.0.mlp.shared.down").shape) == (1, 64, 64)
        assert tuple(f.get_tensor("layers.0.mlp.router").shape) == (16, 64)
        for name, shape in (("experts.gate_bias", (16, 32)), ("experts.down_bias", (16, 64)),
                            ("shared.up_bias", (1, 64))):  # trained from zero
            bias = f.get_tensor(f"layers.0.mlp.{name}")
            assert tuple(bias.shape) == shape and (bias != 0).float().mean() > 0.9, name
    with pytest.raises(CheckpointError, match="moe_score='sigmoid' has no Hugging Face Mixtral equivalent"):
        export_hf(f"{path}/{step}", str(tmp_path / "hf"))


def test_a_mixtral_style_checkpoint_exports_to_hugging_face(corpus, tmp_path):
    """debug-moe trained 2 steps at ep 2 over 2 ranks: `export_hf` writes a MixtralForCausalLM directory
    that transformers loads, holding the checkpoint's tensors, with megazero's logits."""
    transformers = pytest.importorskip("transformers")
    from megazero.checkpoint.convert import consolidate, export_hf
    from megazero.models import CausalLM
    from megazero.models.hf import hf_to_logical
    from megazero.runtime.comm import single_rank_group
    from megazero.tensor_parallel import load_full_params
    from safetensors.torch import load_file
    from tests.test_checkpoint import train

    cfg = dict(_ckpt_config(corpus, 2), model={"spec": "model_specs/llama.py:debug-moe", "vocab": 257, "seq_len": 32})
    run_ranks(train, 2, cfg, 2, str(tmp_path / "ckpt"), None, 2, timeout=300)
    step = sorted(d for d in __import__("os").listdir(tmp_path / "ckpt") if d.startswith("step"))[-1]
    ckpt = str(tmp_path / "ckpt" / step)
    written = export_hf(ckpt, str(tmp_path / "hf"))
    assert written["model_type"] == "mixtral" and written["num_local_experts"] == 8
    consolidate(ckpt, str(tmp_path / "whole.safetensors"))
    whole = load_file(str(tmp_path / "whole.safetensors"))
    hf = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    spec = spec_from_hf_config(hf.config)
    assert all(torch.equal(v, whole[k]) for k, v in hf_to_logical(hf.state_dict(), spec).items())
    model = CausalLM(spec, single_rank_group("tp")).eval()
    load_full_params(model, whole, strict=True)
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (model(tokens)[..., :257].transpose(0, 1) - hf(tokens).logits).abs().max().item()
    # fp32 logits of two implementations (other kernels, another summation order) over |logit| ~ 10: 1e-4 as tests/test_hf_interop.py (measured ~1e-6 there)
    assert err <= 1e-4, err


def test_sequence_parallel_is_refused_by_the_spec_too():
    from megazero.core.spec import SpecError, load_spec

    with pytest.raises(SpecError, match="sequence_parallel is not supported with Mixture-of-Experts"):
        load_spec("model_specs/llama.py:debug-moe").validate_layout(2, True)
