"""The planner on Mixture-of-Experts models (megazero/planner/moe_plan.py and the MoE parts of memory_plan.py,
activation_ledger.py and the step-time model) against megazero's own measurements.

Measured: every layout below runs one training step on 4 CPU ranks (gloo) with a tiny Mixtral-style or
DeepSeek-style model; each rank reports `megazero.run.memory.memory_report` (the ZeRO flat groups
after the step, the `SavedActivationMeter` peak during it) and the elements and bytes its all-to-alls
sent (`megazero.runtime.comm` stats, axis ep). The planner's prediction for the rank's pipeline stage
must equal every category and both counts exactly. The planner assumes balanced routing (moe_plan.py),
so the runs route balanced: `balanced_decide` replaces the router's discrete decision (`decide`, made
without autograd; the weights and losses are still computed from the real logits at the chosen
experts) by token t of each sequence to experts (t·k + j) mod E, capacity applied as the router applies it. A one-layer test checks the MoE ledger against real (unbalanced)
routing, given the rows the routing produced.
"""
from __future__ import annotations

import dataclasses

import pytest

from megazero.core.config.schema import ParallelConfig
from megazero.core.spec import load_spec
from megazero.planner.layout import Layout, PlanError
from megazero.planner.memory_plan import CATEGORIES, largest_slot, predict_memory
from megazero.planner.moe_plan import all_to_all_per_step, moe_shape
from tests.harness import run_ranks

SMALL = {"layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 48, "vocab": 200, "seq_len": 16}
MIXTRAL = {"spec": "model_specs/llama.py:debug-moe", **SMALL, "moe": {"num_experts": 8, "top_k": 2, "ffn": 16}}
DEEPSEEK = {"spec": "model_specs/llama.py:debug-deepseek", **SMALL, "dropout": 0.1,
            "moe": {"num_experts": 16, "top_k": 4, "ffn": 8, "shared_experts": 1, "shared_ffn": 16,
                    "capacity_factor": 0.5}}  # balanced: 4 assignments per expert and sequence, capacity 2
GPT_MOE = {"spec": "model_specs/gpt.py:debug", **SMALL, "moe": {"num_experts": 4, "top_k": 1, "ffn": 24}}

# (model, Layout, zero.param_persistence_threshold); world 4; expert_tp unset: each expert's ffn split over TP
CASES = {
    "ep2-pp2-z1-none-1f1b": (MIXTRAL, Layout(pp=2, dp=2, ep=2, micro_batch=2, global_batch=8, zero=1,
                                             precision="fp32"), 100_000),
    "ep2-tp2-z2-selective-bf16": (MIXTRAL, Layout(tp=2, dp=2, ep=2, expert_tp=1, micro_batch=2, global_batch=8,
                                                  zero=2, recompute="selective", reduce_bucket_size=3000), 100_000),
    "ep4-z3-full-deepseek-capacity": (DEEPSEEK, Layout(dp=4, ep=4, micro_batch=1, global_batch=8, zero=3,
                                                       recompute="full", precision="fp32",
                                                       reduce_bucket_size=3000), 0),
    "ep1-pp2-dp2-z0-gpipe-deepseek": (DEEPSEEK, Layout(pp=2, dp=2, micro_batch=2, global_batch=8, zero=0,
                                                       schedule="gpipe", precision="fp32"), 100_000),
    "ep2-pp2-z3-zbh1-bf16": (MIXTRAL, Layout(pp=2, dp=2, ep=2, micro_batch=1, global_batch=8, zero=3,
                                             schedule="zb-h1", reduce_bucket_size=3000), 1000),
    "ep2-tp2-expert-tp2-z1-gpt-bias": (GPT_MOE, Layout(tp=2, dp=2, ep=2, micro_batch=2, global_batch=8, zero=1,
                                                       precision="fp32"), 100_000),
    "tp2-pp2-expert-tp2-z3-deepseek": (DEEPSEEK, Layout(tp=2, pp=2, micro_batch=1, global_batch=4, zero=3,
                                                        reduce_bucket_size=3000), 1000),
    "tp2-pp2-z1-interleaved": (MIXTRAL, Layout(tp=2, pp=2, expert_tp=1, micro_batch=2, global_batch=8, zero=1,
                                               schedule="interleaved", chunks=2, precision="fp32"), 100_000),
}
WORLD = 4
EXPERT_TP_KEY = "expert_tp" in {f.name for f in dataclasses.fields(ParallelConfig)}


def spec_of(model: dict):
    fields = {k: v for k, v in model.items() if k not in ("spec", "moe")}
    return load_spec(model["spec"], fields | {f"moe_{k}": v for k, v in model["moe"].items()})


def config_of(model: dict, lay: Layout, threshold: int) -> dict:
    parallel = {"pp": lay.pp, "tp": lay.tp, "dp": lay.dp, "ep": lay.ep}
    if EXPERT_TP_KEY:
        parallel["expert_tp"] = lay.etp
    elif lay.etp != 1:
        pytest.skip("parallel.expert_tp is not in the config schema yet (its runtime replicates experts over TP)")
    return {"model": model, "precision": lay.precision, "parallel": parallel,
            "pipeline": {"schedule": lay.schedule, "chunks": lay.chunks},
            "train": {"micro_batch_size": lay.micro_batch, "global_batch_size": lay.global_batch, "seed": 5},
            "zero": {"stage": lay.zero, "reduce_bucket_size": lay.reduce_bucket_size,
                     "allgather_bucket_size": lay.allgather_bucket_size,
                     "prefetch_bucket_size": lay.prefetch_bucket_size, "param_persistence_threshold": threshold},
            "activation_checkpointing": {"policy": lay.recompute},
            "optimizer": {"type": "adamw", "lr": 1e-3}}


def balanced_decide(real):
    """`real` (megazero.moe.routing.decide) with balanced choices: token t of every sequence to experts
    (t·k + j) mod E, j < k; capacity as `decide` applies it (first choices first, then by position)."""
    import torch

    from megazero.moe.routing import Decision

    def decide(logits, seq_len, spec):
        real(logits, seq_len, spec)
        rows, E, k = logits.shape[0], spec.num_experts, spec.top_k
        pos = torch.arange(rows, device=logits.device) % seq_len
        indices = (pos.unsqueeze(1) * k + torch.arange(k, device=logits.device)) % E  # (b·s, k)
        b, cap = rows // seq_len, spec.capacity(seq_len)
        if cap is None:
            return Decision(indices, torch.ones_like(indices, dtype=torch.bool))
        by_choice = indices.view(b, seq_len, k).transpose(1, 2).reshape(b, k * seq_len)
        chose = torch.zeros(b, seq_len * k, E).scatter_(2, by_choice.unsqueeze(-1), 1.0)
        queue = chose.cumsum(1).gather(2, by_choice.unsqueeze(-1)).squeeze(-1) - 1
        return Decision(indices, (queue < cap).view(b, k, seq_len).transpose(1, 2).reshape(rows, k))

    return decide


def measure_worker(cases: dict) -> dict:
    """{case: (pp rank, memory_report after one step, (all-to-all elements, bytes) of the step)}."""
    import megazero
    import megazero.moe.layer as moe_layer
    from megazero.moe.routing import decide
    from megazero.run.memory import SavedActivationMeter, memory_report

    moe_layer.decide = balanced_decide(decide)
    out = {}
    for name, (model, lay, threshold) in cases.items():
        engine, opt, data, _ = megazero.initialize(config=config_of(model, lay, threshold))
        ckpt = engine.module.activation_checkpointer
        meter = SavedActivationMeter(engine.module, checkpointer=ckpt)
        engine.pctx.stats.reset()
        with meter.measure():
            engine.train_batch(data)
        sent = engine.pctx.stats.total(axis="ep", op="all_to_all")
        out[name] = (engine.pctx.pp_rank, memory_report(opt, meter, ckpt), (sent.elements, sent.bytes))
        del engine, opt, data, meter
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(measure_worker, WORLD, CASES, timeout=300)


def plan_of(name: str):
    from megazero.toolbox.model_facts import model_facts

    model, lay, threshold = CASES[name]
    spec = spec_of(model)
    return spec, predict_memory(spec, lay, model_facts(spec, lay.tp, lay.pp, lay.chunks), device="cpu",
                                param_persistence_threshold=threshold)


@pytest.mark.parametrize("name", list(CASES))
def test_memory_equals_the_measured_breakdown(measured, name):
    spec, plan = plan_of(name)
    errors = []
    model, lay, threshold = CASES[name]
    for r, rank in enumerate(measured):
        stage, report, _ = rank[name]
        slot = largest_slot(spec, lay, stage, threshold)  # grad_buckets: within one slot (see largest_slot)
        for key in CATEGORIES:
            got, want = report.get(key, 0), plan.stages[stage].breakdown[key]
            if got != want if key != "grad_buckets" else abs(got - want) > slot:
                errors.append(f"rank {r} stage {stage} {key}: measured {report.get(key, 0)}, "
                              f"predicted {plan.stages[stage].breakdown[key]}")
    assert errors == []


@pytest.mark.parametrize("name", list(CASES))
def test_all_to_all_volume_equals_the_comm_stats(measured, name):
    from megazero.planner.stages import pipeline_layers

    model, lay, _ = CASES[name]
    spec, shape = spec_of(model), moe_shape(spec_of(model), lay)
    for rank in measured:
        stage, _, sent = rank[name]
        blocks = sum(kind == "block" for chunk in pipeline_layers(spec, lay)[stage] for kind, _ in chunk)
        assert sent == all_to_all_per_step(shape, lay, blocks)
        assert (sent[0] > 0) == (lay.ep > 1)


def test_the_cases_cover_ep_tp_pp_and_zero():
    lays = [lay for _, lay, _ in CASES.values()]
    assert {lay.ep for lay in lays} == {1, 2, 4} and {lay.tp for lay in lays} == {1, 2}
    assert {lay.pp for lay in lays} == {1, 2} and {lay.zero for lay in lays} == {0, 1, 2, 3}
    assert {lay.recompute for lay in lays} == {"none", "selective", "full"}
    assert {lay.precision for lay in lays} == {"fp32", "bf16"} and all(lay.gpus == WORLD for lay in lays)


def test_from_config_reads_the_expert_layout():
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of

    for name, (model, lay, threshold) in CASES.items():
        got, why = layout_of(load_run_config(config_of(model, lay, threshold), world_size=WORLD))
        fields = ("tp", "pp", "dp", "ep", "etp", "zero", "recompute", "schedule", "chunks", "precision")
        assert why == "" and [getattr(got, f) for f in fields] == [getattr(lay, f) for f in fields], name


# -- the ledger against real (unbalanced) routing, one layer on 2 ep ranks -----------------------------------

def _one_layer_worker(model: dict, b: int):
    """One MoE layer's forward on this rank's b sequences with the router's own (unbalanced) routing:
    (bytes saved for backward, rows kept and sent N, rows received M)."""
    import torch

    from megazero.moe.layer import MoELayer
    from megazero.run.memory import SavedActivationMeter
    from megazero.runtime.comm import CommStats, world_group

    spec = spec_of(model)
    torch.manual_seed(3)
    layer = MoELayer(spec.moe, spec.hidden, world_group(CommStats()), "layers.0.mlp", seed=7)
    x = torch.randn(spec.seq_len, b, spec.hidden, requires_grad=True)
    meter = SavedActivationMeter()
    with meter.measure():
        out = layer(x)
    r = layer.last_routing
    counts = torch.bincount(r.indices[r.keep], minlength=spec.moe.num_experts).view(2, -1).sum(1)
    received = torch.empty_like(counts)
    torch.distributed.all_to_all_single(received, counts)
    del out
    return meter.peak["device"], int(r.keep.sum()), int(received.sum())


@pytest.mark.parametrize("model", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek"])
def test_the_moe_ledger_counts_what_real_routing_saves(model):
    """With the rows the routing really produced (N kept and sent, M received: unequal over the ranks),
    the ledger's MoE tensors are the bytes one layer's forward keeps for backward, on each rank."""
    from megazero.planner.activation_ledger import _Ledger, dims
    from megazero.planner.moe_ledger import moe_saves

    lay = Layout(dp=2, ep=2, micro_batch=2, global_batch=4, precision="fp32")
    ranks = run_ranks(_one_layer_worker, 2, model, 2, timeout=120)
    assert ranks[0][1:] != ranks[1][1:] or ranks[0][2] != ranks[0][1]  # the routing is not balanced
    for saved, sent, received in ranks:
        c = dims(spec_of(model), lay, "cpu")
        c = dataclasses.replace(c, moe=dataclasses.replace(c.moe, sent=sent, received=received))
        ledger = _Ledger()
        moe_saves(ledger, c, "u0")
        assert ledger.saved == saved


# -- pure: step time, checks, search -------------------------------------------------------------------------

def _hw():
    from megazero.planner.hardware import load_hardware

    return load_hardware("h100-80gb", "configs/hardware")


MIXTRAL_8X7B = load_spec("model_specs/llama.py:mixtral-8x7b", {"seq_len": 4096})
BIG = Layout(tp=8, pp=1, dp=8, ep=8, micro_batch=1, global_batch=64, zero=1, recompute="full")


def test_model_flops_count_active_parameters_as_the_trainer_does():
    from megazero.core.flops import hardware_flops_per_step, model_flops_per_step
    from megazero.planner.speed import step_flops

    for spec in (MIXTRAL_8X7B, spec_of(DEEPSEEK), spec_of(GPT_MOE)):
        model, hardware = step_flops(spec, BIG)
        assert model == model_flops_per_step(spec, 64)  # the trainer's MFU reads the same function
        assert hardware == hardware_flops_per_step(spec, 64, "full") > model
    dense = MIXTRAL_8X7B.replace(moe_num_experts=0)
    assert step_flops(MIXTRAL_8X7B, BIG)[0] < 2 * step_flops(dense, BIG)[0]  # 8 experts held, 2 run


def test_mixtral_param_counts_are_the_published_ones():
    from megazero.planner.moe_plan import active_params
    from megazero.toolbox.model_facts import model_facts

    total = model_facts(MIXTRAL_8X7B, 8, 1).total_params
    assert round(total / 1e9, 1) == 46.7 and round(active_params(MIXTRAL_8X7B, total) / 1e9, 1) == 12.9


def test_step_time_has_the_all_to_all_and_the_expert_data_parallel_group():
    from megazero.planner.speed import predict_step

    hw = _hw()
    plans = {ep: predict_step(MIXTRAL_8X7B, BIG.replace(ep=ep), hw) for ep in (1, 2, 8)}
    for plan in plans.values():
        # float64: the categories summed in another order than the step was computed, ~10 terms of ~1e-16 rounding
        assert sum(plan.breakdown.values()) == pytest.approx(plan.step_time_s, rel=1e-9) and 0 < plan.mfu < 1
    assert plans[1].breakdown["all_to_all"] == 0 < plans[2].breakdown["all_to_all"] < plans[8].breakdown["all_to_all"]
    # the experts' gradients: reduced over dp / ep ranks, none at ep = dp
    assert plans[8].breakdown["dp_comm"] < plans[2].breakdown["dp_comm"] < plans[1].breakdown["dp_comm"]
    # an ep group inside a node (tp 1: ranks 1 apart) is faster than one across nodes (tp 8)
    near = BIG.replace(tp=1, dp=64, expert_tp=1)
    inside = predict_step(MIXTRAL_8X7B, near, hw).breakdown["all_to_all"] / near.num_microbatches
    assert inside < plans[8].breakdown["all_to_all"] / BIG.num_microbatches / 4


def test_imbalance_slows_the_experts_and_capacity_caps_it():
    from megazero.planner.speed import predict_step

    hw = _hw()
    base = predict_step(MIXTRAL_8X7B, BIG, hw)
    skewed = predict_step(MIXTRAL_8X7B, BIG.replace(moe_imbalance=2.0), hw)
    assert skewed.breakdown["gemm"] > base.breakdown["gemm"] and skewed.step_time_s > base.step_time_s
    assert predict_step(MIXTRAL_8X7B, BIG.replace(ep=1, dp=8, moe_imbalance=2.0), hw).breakdown["gemm"] == \
        pytest.approx(predict_step(MIXTRAL_8X7B, BIG.replace(ep=1), hw).breakdown["gemm"])  # one rank: all its rows
    capped = MIXTRAL_8X7B.replace(moe_capacity_factor=1.25)
    cap = [moe_shape(capped, BIG.replace(moe_imbalance=r)).received for r in (1.0, 1.25, 3.0)]
    assert cap[0] < cap[1] == cap[2]  # at most E·C rows per sequence on a rank
    mem = [predict_memory(MIXTRAL_8X7B, BIG.replace(moe_imbalance=r)).stages[0].breakdown["activations"]
           for r in (1.0, 2.0)]
    assert mem[1] > mem[0]


def test_expert_tensor_parallelism_splits_the_experts():
    from megazero.planner.speed import predict_step

    hw = _hw()
    split, whole = BIG, BIG.replace(expert_tp=1)
    ms, mw = predict_memory(MIXTRAL_8X7B, split), predict_memory(MIXTRAL_8X7B, whole)
    assert ms.stages[0].breakdown["params"] < mw.stages[0].breakdown["params"] / 4
    ps, pw = predict_step(MIXTRAL_8X7B, split, hw), predict_step(MIXTRAL_8X7B, whole, hw)
    assert ps.breakdown["gemm"] < pw.breakdown["gemm"] and ps.breakdown["tp_comm"] > pw.breakdown["tp_comm"]


@pytest.mark.parametrize("changes, words", [
    (dict(ep=3, dp=6, global_batch=6), "ep=3 does not divide moe_num_experts=8"),
    (dict(ep=4, dp=2), "ep=4 does not divide dp=2"),
    (dict(expert_tp=4), "expert_tp=4 must be 1 or tp=8"),
    (dict(sequence_parallel=True), "sequence_parallel is not supported with Mixture-of-Experts"),
    (dict(moe_imbalance=0.5), "moe_imbalance=0.5 must be a number >= 1"),
])
def test_layouts_the_runtime_refuses_are_refused(changes, words):
    with pytest.raises(PlanError, match=words):
        BIG.replace(**changes).check(MIXTRAL_8X7B)


def test_ep_needs_an_moe_model_and_describe_names_it():
    dense = MIXTRAL_8X7B.replace(moe_num_experts=0)
    assert "ep=2 needs a Mixture-of-Experts model" in " ".join(Layout(dp=2, ep=2, global_batch=2).problems(dense))
    assert BIG.replace(expert_tp=1, moe_imbalance=1.5).describe().startswith("tp8 pp1 dp8 ep8 expert-tp1 imbalance=1.5")


def test_search_enumerates_ep_and_no_sequence_parallelism():
    from megazero.planner.search import candidates

    fixed = {"tp": 8, "pp": 1, "micro_batch": 1, "zero": 1, "recompute": "full"}
    lays = list(candidates(MIXTRAL_8X7B, 64, 64, 8, fixed))
    assert {lay.ep for lay in lays} == {1, 2, 4, 8} and not any(lay.sequence_parallel for lay in lays)


def test_explain_and_the_visualizer_plan_the_moe_config():
    from megazero.core.config import explain, load_config
    from megazero.planner.hardware import load_hardware
    from megazero.viz.sources import predicted

    cfg = load_config("configs/debug_moe.yaml", world_size=4)
    text = explain(cfg, 4)
    assert "cannot plan" not in text and "stage 1:" in text
    tl = predicted(cfg, load_hardware("h100-80gb", "configs/hardware"))
    assert len(tl.stages) == 2 and all(st.peak_bytes > 0 for st in tl.stages)
