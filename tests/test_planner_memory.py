"""The planner's memory prediction (megazero/planner/memory_plan.py) against megazero's own measurement.

Every layout below runs one training step on CPU (gloo) with a debug flavor; each rank measures its
`megazero.run.memory.memory_report` (the ZeRO optimizer's breakdown after the step, the
`SavedActivationMeter` peak during it) and the test compares every category with
`predict_memory(..., device="cpu")` for that rank's pipeline stage, within 5% (a category measured 0
must be predicted 0; the kept gradient bucket slots, ``grad_buckets``, within one slot: see `compare`). The layouts cover ZeRO 0-3, recompute none / selective / full, the schedules gpipe,
1f1b, interleaved (2 chunks) and zb-h1, tp / pp / dp of 1, 2 and 4, sequence parallelism, optimizer
offload, bf16, GPT (learned positions, LayerNorm, GeLU, tied head) and Llama (RoPE, RMSNorm, SwiGLU,
grouped-query attention), SDPA and the reference attention core (attention dropout on), the
activation-checkpointing options (segments of 2 blocks and number_checkpoints, partitioned, CPU and
contiguous checkpoints) and uneven pipeline splits (uniform over L + 2 layers, flops, a count list).
All run on 4 ranks in one launch.
"""
import pytest

from megazero.core.spec import load_spec
from megazero.planner.facts import ModelFacts, StageFacts
from megazero.planner.layout import Layout
from megazero.planner.memory_plan import CATEGORIES, MAX_INFLIGHT, largest_slot, predict_memory
from tests.harness import run_ranks

GPT = {"spec": "model_specs/gpt.py:debug", "layers": 4, "hidden": 32, "heads": 4, "vocab": 200, "seq_len": 16}
GPT_DROPOUT = dict(GPT, dropout=0.1, overrides={"attention_dropout": 0.1})
LLAMA = {"spec": "model_specs/llama.py:debug", "layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2,
         "ffn_hidden": 48, "vocab": 200, "seq_len": 16}
LLAMA_DROPOUT = dict(LLAMA, dropout=0.1, overrides={"attention_dropout": 0.1})

# (model, Layout, zero.param_persistence_threshold)
CASES = {
    "tp2-pp2-z0-none-1f1b": (GPT, Layout(tp=2, pp=2, dp=1, micro_batch=2, global_batch=8, zero=0,
                                         precision="fp32"), 100_000),
    "pp2-dp2-z1-selective-gpipe-bf16": (GPT, Layout(pp=2, dp=2, micro_batch=2, global_batch=12, zero=1,
                                                    recompute="selective", schedule="gpipe"), 100_000),
    "tp2-dp2-z2-full-sp-llama": (LLAMA, Layout(tp=2, dp=2, micro_batch=2, global_batch=8, zero=2,
                                               recompute="full", sequence_parallel=True, precision="fp32"),
                                 100_000),
    "pp2-dp2-z3-zbh1": (GPT, Layout(pp=2, dp=2, micro_batch=1, global_batch=8, zero=3, schedule="zb-h1",
                                    precision="fp32", reduce_bucket_size=3000), 0),
    "tp2-pp2-selective-interleaved-sp-llama": (LLAMA, Layout(tp=2, pp=2, micro_batch=2, global_batch=8, zero=1,
                                                             recompute="selective", schedule="interleaved",
                                                             chunks=2, sequence_parallel=True), 100_000),
    "pp4-full-1f1b-dropout": (GPT_DROPOUT, Layout(pp=4, micro_batch=2, global_batch=12, zero=0, recompute="full",
                                                  precision="fp32"), 100_000),
    "dp4-z2-offload-bf16-llama": (LLAMA, Layout(dp=4, micro_batch=2, global_batch=8, zero=2,
                                                offload_optimizer=True, reduce_bucket_size=5000), 100_000),
    "tp2-dp2-z3-selective-dropout-sp": (GPT_DROPOUT, Layout(tp=2, dp=2, micro_batch=2, global_batch=8, zero=3,
                                                            recompute="selective", sequence_parallel=True,
                                                            precision="fp32"), 1000),
    "pp2-dp2-z2-full-interleaved-bf16-llama": (LLAMA_DROPOUT, Layout(pp=2, dp=2, micro_batch=1, global_batch=8,
                                                                     zero=2, recompute="full",
                                                                     schedule="interleaved", chunks=2), 100_000),
    "pp2-dp2-z0-none-zbh1-llama": (LLAMA, Layout(pp=2, dp=2, micro_batch=2, global_batch=8, zero=0,
                                                 schedule="zb-h1", precision="fp32"), 100_000),
    # activation-checkpointing options and uneven splits (issue 33: every layout the trainer runs)
    "tp2-dp2-full-every2-partitioned": (GPT, Layout(tp=2, dp=2, micro_batch=2, global_batch=8, zero=1,
                                                    recompute="full", every_k_layers=2, partition_activations=True,
                                                    precision="fp32"), 100_000),
    "tp2-pp2-full-cpu-contiguous-bf16-llama": (dict(LLAMA, layers=5), Layout(
        tp=2, pp=2, micro_batch=1, global_batch=4, zero=1, recompute="full", number_checkpoints=2,
        partition_activations=True, cpu_checkpointing=True, contiguous_checkpoints=True, partition=(1, 4)), 100_000),
    "pp2-dp2-full-contiguous-interleaved-uneven": (dict(GPT, layers=5), Layout(
        pp=2, dp=2, micro_batch=1, global_batch=8, zero=2, recompute="full", number_checkpoints=1,
        contiguous_checkpoints=True, schedule="interleaved", chunks=2, precision="fp32"), 100_000),
    "pp4-flops-partition-selective": (dict(GPT, layers=6), Layout(pp=4, micro_batch=2, global_batch=8, zero=0,
                                                                  recompute="selective", partition="flops",
                                                                  precision="fp32"), 100_000),
}
WORLD = 4


def spec_of(model: dict):
    fields = {k: v for k, v in model.items() if k not in ("spec", "overrides")}
    return load_spec(model["spec"], fields | dict(model.get("overrides", {})))


def config_of(model: dict, lay: Layout, threshold: int) -> dict:
    offload = {"device": "cpu" if lay.offload_optimizer else "none"}
    return {"model": model, "precision": lay.precision,
            "parallel": {"pp": lay.pp, "tp": lay.tp, "sequence_parallel": lay.sequence_parallel},
            "pipeline": {"schedule": lay.schedule, "chunks": lay.chunks,
                         "partition": lay.partition if isinstance(lay.partition, str) else list(lay.partition)},
            "train": {"micro_batch_size": lay.micro_batch, "global_batch_size": lay.global_batch, "seed": 5},
            "zero": {"stage": lay.zero, "offload_optimizer": offload,
                     "offload_param": {"device": "cpu" if lay.offload_param else "none"},
                     "overlap_comm": lay.overlap_comm, "reduce_bucket_size": lay.reduce_bucket_size,
                     "allgather_bucket_size": lay.allgather_bucket_size,
                     "prefetch_bucket_size": lay.prefetch_bucket_size, "param_persistence_threshold": threshold},
            "activation_checkpointing": {"policy": lay.recompute, "every_k_layers": lay.every_k_layers,
                                         "number_checkpoints": lay.number_checkpoints,
                                         "partition_activations": lay.partition_activations,
                                         "cpu_checkpointing": lay.cpu_checkpointing,
                                         "contiguous_memory_optimization": lay.contiguous_checkpoints},
            "optimizer": {"type": "adamw", "lr": 1e-3}}


def measure_worker(cases: dict) -> dict:
    """{case: (pp rank, memory_report after one step, (parameters, tied parameters, blocks) here)}."""
    import megazero
    from megazero.models import TransformerBlock
    from megazero.activation_checkpoint import CheckpointedBlock
    from megazero.run.memory import SavedActivationMeter, memory_report

    out = {}
    for name, (model, lay, threshold) in cases.items():
        engine, opt, data, _ = megazero.initialize(config=config_of(model, lay, threshold))
        ckpt = engine.module.activation_checkpointer
        meter = SavedActivationMeter(engine.module, checkpointer=ckpt)
        with meter.measure():
            engine.train_batch(data)
        report = memory_report(opt, meter, ckpt)
        blocks = sum(isinstance(m, (TransformerBlock, CheckpointedBlock)) for chunk in engine.module.local_chunks
                     for m in chunk)
        tied = sum(sum(g.layout.numels) for g in opt.groups if g.name == "tied")
        out[name] = (engine.pctx.pp_rank, report, (opt.num_params(), tied, blocks))
        del engine, opt, data, meter  # (no gc.collect(): a second here; the tiny models' cycles may wait)
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(measure_worker, WORLD, CASES, timeout=240)


def facts_of(name: str, ranks: list) -> ModelFacts:
    """The model facts of the real run (what megazero.toolbox.model_facts makes from the meta-device model)."""
    per_stage = {}
    for rank in ranks:
        stage, _, (params, tied, blocks) = rank[name]
        per_stage[stage] = StageFacts(stage, blocks, params, tied)
    stages = tuple(per_stage[s] for s in sorted(per_stage))
    return ModelFacts(sum(s.params for s in stages), stages)


def compare(name: str, ranks: list) -> list[str]:
    model, lay, threshold = CASES[name]
    plan = predict_memory(spec_of(model), lay, facts_of(name, ranks), device="cpu",
                          param_persistence_threshold=threshold)
    errors = []
    for r, rank in enumerate(ranks):
        stage, report, _ = rank[name]
        predicted = plan.stages[stage].breakdown
        slot = largest_slot(spec_of(model), lay, stage, threshold)
        for key in CATEGORIES:
            got, want = report.get(key, 0), predicted[key]
            # grad_buckets (the kept bucket slots): within one slot (memory_plan.largest_slot says why)
            bound = slot if key == "grad_buckets" else 0.05 * got
            if (got == 0) != (want == 0) or abs(want - got) > bound:
                errors.append(f"{name} rank {r} stage {stage} {key}: measured {got}, predicted {want}")
    return errors


@pytest.mark.parametrize("name", list(CASES))
def test_prediction_matches_the_measured_breakdown(measured, name):
    assert compare(name, measured) == []


def test_the_layouts_cover_every_stage_policy_and_schedule():
    lays = [lay for _, lay, _ in CASES.values()]
    assert {lay.zero for lay in lays} == {0, 1, 2, 3}
    assert {lay.recompute for lay in lays} == {"none", "selective", "full"}
    assert {lay.schedule for lay in lays} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert any(lay.sequence_parallel for lay in lays) and any(lay.offload_optimizer for lay in lays)
    assert {lay.precision for lay in lays} == {"fp32", "bf16"}
    assert all(lay.gpus == WORLD for lay in lays)
    assert any(lay.every_k_layers > 1 for lay in lays) and any(lay.number_checkpoints for lay in lays)
    assert all(any(getattr(lay, k) for lay in lays)
               for k in ("partition_activations", "cpu_checkpointing", "contiguous_checkpoints"))
    assert {type(lay.partition) for lay in lays} == {str, tuple} and {"uniform", "flops"} <= {
        lay.partition for lay in lays if isinstance(lay.partition, str)}


def test_the_planner_mirrors_megazeros_constants():
    from megazero.zero.flat_group import FlatGroup

    assert MAX_INFLIGHT == FlatGroup.MAX_INFLIGHT


# -- pure: no processes ----------------------------------------------------------------------------

S, B, H, A = 2048, 2, 1024, 16  # a GPT block with dropout everywhere, 16-bit, on CUDA's fused kernels
SBH, AS2B, STATS = S * B * H, A * S * S * B, 16 * S * B  # STATS: two LayerNorms' fp32 mean and rstd


@pytest.mark.parametrize("t, sp, policy, table_2", [
    (1, False, "none", 34 * SBH + 5 * AS2B),
    (4, False, "none", SBH * (10 + 24 / 4) + 5 * AS2B / 4),
    (4, True, "none", (34 * SBH + 5 * AS2B) / 4),
    (4, False, "selective", SBH * (10 + 24 / 4)),
    (4, True, "selective", 34 * SBH / 4),
    (4, False, "full", 2 * SBH),
    (4, True, "full", 2 * SBH / 4),
])
def test_cuda_block_bytes_are_korthikanti_table_2(t, sp, policy, table_2):
    """On CUDA (fused norm and softmax kernels, 16-bit activations, 1-byte dropout masks) one block keeps
    exactly docs/reference.md's Table 2 row, plus the LayerNorm statistics the formula leaves out."""
    from megazero.planner.activation_ledger import layer_bytes

    spec = load_spec("model_specs/gpt.py:gpt2-medium", {"seq_len": S})
    lay = Layout(tp=t, micro_batch=B, global_batch=B, sequence_parallel=sp, recompute=policy, precision="bf16")
    stats = 0 if policy == "full" else STATS / (t if sp else 1)
    assert layer_bytes(spec, lay, "cuda")["block"] == table_2 + stats


@pytest.mark.parametrize("zero, bytes_per_param", [(0, 18), (1, 6 + 12 / 8), (2, 2 + 16 / 8), (3, 18 / 8)])
def test_model_states_are_the_zero_papers_with_fp32_gradients(zero, bytes_per_param):
    """Rajbhandari et al.'s 2 + 2 + 12 bytes per parameter (bf16 params and grads, fp32 master and
    moments) become 2 + 4 + 12 with megazero's fp32 gradient accumulation, divided over dp = 8 as each
    ZeRO stage shards them (padding to dp per bucket aside)."""
    from megazero.planner.layer_params import layer_params

    spec = load_spec("model_specs/llama.py:llama2-7b")
    psi = sum(p.numel for kind in ("embedding", "head") for p in layer_params(spec, kind, 1))
    psi += spec.layers * sum(p.numel for p in layer_params(spec, "block", 1))
    plan = predict_memory(spec, Layout(dp=8, micro_batch=1, global_batch=8, zero=zero),
                          param_persistence_threshold=0)
    states = sum(plan.stages[0].breakdown[k] for k in ("params", "grads", "master", "optimizer_states"))
    # float64 ratio of byte counts that should be equal: a few ulps
    assert abs(states / (psi * bytes_per_param) - 1) < 1e-6


def test_the_plan_names_the_tightest_stage_and_what_does_not_fit():
    """1F1B keeps p - s micro-batches in flight on stage s; the allowance is a stated fraction of the
    device bytes; offloaded states are host memory; a stage above the device is named with its excess."""
    from megazero.planner.hardware import Hardware
    from megazero.planner.memory_plan import FRAGMENTATION

    spec = load_spec("model_specs/gpt.py:gpt-1.7b")
    lay = Layout(pp=4, dp=2, micro_batch=4, global_batch=64, zero=1, offload_optimizer=True)
    plan = predict_memory(spec, lay)
    totals = [st.total for st in plan.stages]
    assert plan.tightest.stage == totals.index(max(totals)) and plan.over == [] and plan.fits
    acts = [st.breakdown["activations"] for st in plan.stages]
    assert acts[0] > acts[1] > acts[2] > acts[3]
    for st in plan.stages:
        assert st.host["master"] == st.breakdown["master"] > 0 and st.host["optimizer_states"] > 0
        device = sum(st.breakdown.values()) - sum(st.host.values()) + sum(st.transient.values())
        assert st.device_bytes == device and st.fragmentation == round(FRAGMENTATION * device)
        assert st.total == device + st.fragmentation
    cut = sorted(totals)[1] + 1  # every stage but the two smallest is above it
    plan = predict_memory(spec, lay, hardware=Hardware("tiny", 1.0, cut / 2 ** 30, 1.0, 8, 1.0, 1.0))
    assert [s for s, _ in plan.over] == [s for s, v in enumerate(totals) if v > cut]
    # float64 GB of byte counts that should be equal: a few ulps
    assert all(abs(gb - (totals[s] - cut) / 1e9) < 1e-6 for s, gb in plan.over)
    assert "does not fit: stage" in plan.table()


def test_facts_that_disagree_with_the_planners_layers_are_an_error():
    from megazero.planner.layout import PlanError

    spec = spec_of(GPT)
    lay = Layout(pp=2, micro_batch=1, global_batch=2)
    with pytest.raises(PlanError, match="stage 0: the model facts count 5 parameters in 2 blocks"):
        predict_memory(spec, lay, ModelFacts(10, (StageFacts(0, 2, 5), StageFacts(1, 2, 5))))


def test_live_tensor_bytes_counts_every_storage_alive_at_the_peak():
    """`LiveTensorBytes` (what benchmarks/planner_cpu.py measures the planner's peak against): the storages
    alive on entry (found through gc), each operator output once (a view shares its storage), freed ones gone."""
    import torch

    from megazero.run.memory import LiveTensorBytes

    before = torch.zeros(1000)
    with LiveTensorBytes() as live:
        start = live.total
        a = torch.ones(2000)
        b = (a * 2).view(40, 50)
        del a, b
        c = torch.ones(100)
        assert live.current() - start == 400
    assert live.peak - start == 16000 and start >= before.numel() * 4
    del c


def gloo_reduce_scatter_worker() -> int:
    """Bytes LiveTensorBytes sees a gloo reduce-scatter of a 4 MiB input allocate beyond its output."""
    import torch
    import torch.distributed as dist

    from megazero.run.memory import LiveTensorBytes

    x, out = torch.ones(1 << 20), torch.empty(1 << 19)
    with LiveTensorBytes() as live:
        start = live.total
        dist.reduce_scatter_tensor(out, x)
    return live.peak - start


def test_a_cpu_reduce_scatter_holds_a_copy_of_its_input_and_the_planner_counts_it():
    """gloo's reduce-scatter copies its whole input while it runs (measured on 2 ranks: 4 MiB for a 4 MiB
    bucket; all-reduce and all-gather work in place); the planner's reduction transient on a CPU is the
    output shard plus that copy of the largest bucket, on an accelerator the shard alone."""
    from megazero.planner.memory_plan import flat_groups, reduce_outputs
    from megazero.planner.stages import pipeline_layers

    assert run_ranks(gloo_reduce_scatter_worker, 2) == [4 << 20] * 2
    spec = load_spec("model_specs/gpt.py:debug")
    lay = Layout(dp=2, micro_batch=1, global_batch=2, zero=2, precision="fp32")
    chunks = pipeline_layers(spec, lay)[0]
    (group,) = [g for g in flat_groups(spec, lay, chunks, 0) if g.stage == 2]
    big = max(b.numel for b in group.layout.buckets)
    assert reduce_outputs(group, False, accelerator=True) == big // 2 * 4
    assert reduce_outputs(group, False, accelerator=False) == big // 2 * 4 + big * 4


STEP_PEAK_CASES = [  # (model, world, tp, pp, sequence parallel, zero, recompute, hidden dropout)
    ("gpt", 1, 1, 1, False, 0, "none", 0.0), ("gpt", 1, 1, 1, False, 2, "selective", 0.0),
    ("gpt", 1, 1, 1, False, 1, "full", 0.0), ("gpt", 1, 1, 1, False, 0, "none", 0.1),
    ("llama", 1, 1, 1, False, 0, "none", 0.0), ("llama", 1, 1, 1, False, 2, "selective", 0.0),
    ("llama", 1, 1, 1, False, 1, "full", 0.0),
    ("gpt", 2, 2, 1, True, 0, "none", 0.0), ("llama", 2, 2, 1, True, 2, "none", 0.0),
    ("gpt", 2, 1, 1, False, 3, "none", 0.0), ("llama", 2, 1, 1, False, 3, "selective", 0.0),
    ("gpt", 2, 1, 2, False, 3, "none", 0.0), ("llama", 2, 1, 2, False, 1, "none", 0.0)]


def step_peak_config(model: str, tp: int, pp: int, sp: bool, zero: int, policy: str, dropout: float) -> dict:
    dims = {"gpt": dict(GPT, layers=2, hidden=128, vocab=256, seq_len=64, dropout=dropout),
            "llama": dict(LLAMA, layers=2, hidden=128, ffn_hidden=256, vocab=256, seq_len=64, dropout=dropout)}[model]
    return {"model": dims, "precision": "fp32", "parallel": {"tp": tp, "pp": pp, "sequence_parallel": sp},
            "train": {"micro_batch_size": 2, "global_batch_size": 4 * (2 if pp > 1 else 1), "seed": 1},
            "zero": {"stage": zero}, "activation_checkpointing": {"policy": policy},
            "optimizer": {"type": "adamw", "lr": 1e-4}}


def step_peak_worker(config: dict) -> int:
    """LiveTensorBytes' peak over this rank's second training step (every storage alive, as the CPU table
    measures it)."""
    import megazero
    from megazero.run.memory import LiveTensorBytes

    engine, _, data, _ = megazero.initialize(config=config)
    engine.train_batch(data)
    with LiveTensorBytes() as live:
        engine.train_batch(data)
    return engine.pctx.pp_rank, live.peak


@pytest.mark.parametrize("case", STEP_PEAK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_steps_peak_of_live_bytes_is_the_planners_total(case):
    """The planner's whole stage (breakdown plus transients: the backward's working set at the first block's
    backward, `activation_ledger.backward_working`, and ZeRO-3's gathered and prefetched buckets included)
    against every storage alive during a real step on every stage, within 3% (measured -1.5% to +0.8%; without the
    working set Llama with full recompute is -4.5%; without the prefetched buckets ZeRO-3 is 6-11% low)."""
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, spec_of as spec_of_config

    model, world, tp, pp, sp, zero, policy, dropout = case
    config = step_peak_config(model, tp, pp, sp, zero, policy, dropout)
    measured = run_ranks(step_peak_worker, world, config, timeout=180)
    cfg = load_run_config(config, world_size=world)
    layout, _ = layout_of(cfg)
    plan = predict_memory(spec_of_config(cfg), layout, device="cpu",
                          param_persistence_threshold=cfg.zero.param_persistence_threshold)
    for stage, peak in measured:
        st = plan.stages[stage]
        predicted = sum(st.breakdown.values()) + sum(st.transient.values()) - st.counted_twice
        print(case, stage, f"{predicted / peak - 1:+.4f}", st.transient)
        assert abs(predicted / peak - 1) < 0.03, (stage, predicted, peak, st.transient)
