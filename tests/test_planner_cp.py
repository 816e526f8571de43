"""The planner with context parallelism (megazero/planner: cp_ledger.py, cp_cost.py and the dp x cp groups) against
megazero's own measurement, and the layouts it refuses.

Every layout below runs one training step on 4 gloo ranks (one launch) with the debug Llama (RoPE, GQA), GPT
(learned positions, LayerNorm, GeLU, tied head) or Mixtral-style MoE (routed balanced, as tests/test_planner_moe.py
routes it: the planner assumes balanced routing), without dropout; each rank measures its
`megazero.run.memory.memory_report` (the ZeRO optimizer's breakdown, the `SavedActivationMeter` peak) and the
step's bytes by (axis, op) from its `CommStats`. Memory: every category within 5% of `predict_memory(...,
device="cpu")` for the rank's stage, a category measured 0 predicted 0, ``grad_buckets`` within one slot (the
tolerance of tests/test_planner_memory.py). Bytes: the predicted mean per rank of every (axis, op) of the cp,
dp x cp and (dp / ep) x cp groups equals the measured mean exactly, in all and across nodes
(``parallel.ranks_per_node: 2`` in some cases, so that the groups span nodes). The layouts cover ring and Ulysses
(with K/V repeated), cp 2 and 4, with tp + sequence parallelism, pp 2 (1F1B and ZB-H1), ep 2, ZeRO 0-3, no /
selective / full recompute, fp32 and bf16.
"""
import pytest

from megazero.core.spec import load_spec
from megazero.planner.comm_volume import predict_volume
from megazero.planner.layout import Layout
from megazero.planner.memory_plan import CATEGORIES, largest_slot, predict_memory
from tests.harness import run_ranks

LLAMA = {"spec": "model_specs/llama.py:debug", "layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2,
         "ffn_hidden": 48, "vocab": 200, "seq_len": 16, "dropout": 0.0}
MIXTRAL = dict(LLAMA, spec="model_specs/llama.py:debug-moe", moe={"num_experts": 8, "top_k": 2, "ffn": 16})
GPT = {"spec": "model_specs/gpt.py:debug", "layers": 4, "hidden": 32, "heads": 4, "vocab": 200, "seq_len": 16,
       "dropout": 0.0, "overrides": {"attention_dropout": 0.0}}

# (model, Layout, zero.param_persistence_threshold)
CASES = {
    "cp2-dp2-z1-ring-llama": (LLAMA, Layout(dp=2, cp=2, micro_batch=2, global_batch=8, zero=1, precision="fp32",
                                            ranks_per_node=2), 100_000),
    "cp4-z2-ulysses-bf16-llama": (LLAMA, Layout(cp=4, cp_method="ulysses", micro_batch=2, global_batch=4, zero=2,
                                                reduce_bucket_size=5000), 100_000),
    "tp2-sp-cp2-z3-ring-selective-llama": (LLAMA, Layout(tp=2, cp=2, micro_batch=2, global_batch=4, zero=3,
                                                         recompute="selective", sequence_parallel=True,
                                                         precision="fp32", ranks_per_node=2), 1000),
    "pp2-cp2-z0-ring-full-gpt": (GPT, Layout(pp=2, cp=2, micro_batch=1, global_batch=4, zero=0, recompute="full",
                                             precision="fp32"), 100_000),
    "pp2-cp2-z1-ulysses-zbh1-llama": (LLAMA, Layout(pp=2, cp=2, cp_method="ulysses", micro_batch=1, global_batch=4,
                                                    zero=1, schedule="zb-h1", precision="fp32"), 100_000),
    "cp4-z1-ring-bf16-gpt": (GPT, Layout(cp=4, micro_batch=2, global_batch=4, zero=1, ranks_per_node=2), 100_000),
    "tp2-cp2-z2-ulysses-selective-llama": (LLAMA, Layout(tp=2, cp=2, cp_method="ulysses", micro_batch=2,
                                                         global_batch=4, zero=2, recompute="selective",
                                                         precision="fp32"), 100_000),
    "cp2-dp2-ep2-z1-ring-moe": (MIXTRAL, Layout(dp=2, cp=2, ep=2, micro_batch=2, global_batch=8, zero=1,
                                                precision="fp32", ranks_per_node=2), 100_000),
    "cp2-dp2-ep2-z3-ulysses-full-bf16-moe": (MIXTRAL, Layout(dp=2, cp=2, ep=2, cp_method="ulysses", micro_batch=1,
                                                             global_batch=4, zero=3, recompute="full",
                                                             reduce_bucket_size=3000), 1000),
}
WORLD = 4
AXES = ("cp", "dp_cp", "edp_cp")


def spec_of(model: dict):
    fields = {k: v for k, v in model.items() if k not in ("spec", "overrides", "moe")}
    moe = {f"moe_{k}": v for k, v in model.get("moe", {}).items()}
    return load_spec(model["spec"], fields | moe | dict(model.get("overrides", {})))


def config_of(model: dict, lay: Layout, threshold: int) -> dict:
    parallel = {"pp": lay.pp, "tp": lay.tp, "cp": lay.cp, "cp_method": lay.cp_method, "ep": lay.ep,
                "sequence_parallel": lay.sequence_parallel}
    if lay.ranks_per_node:
        parallel["ranks_per_node"] = lay.ranks_per_node
    return {"model": model, "precision": lay.precision, "parallel": parallel,
            "pipeline": {"schedule": lay.schedule, "chunks": lay.chunks},
            "train": {"micro_batch_size": lay.micro_batch, "global_batch_size": lay.global_batch, "seed": 5},
            "zero": {"stage": lay.zero, "reduce_bucket_size": lay.reduce_bucket_size,
                     "allgather_bucket_size": lay.allgather_bucket_size,
                     "prefetch_bucket_size": lay.prefetch_bucket_size, "param_persistence_threshold": threshold},
            "activation_checkpointing": {"policy": lay.recompute},
            "optimizer": {"type": "adamw", "lr": 1e-3}}


def measure_worker(cases: dict) -> dict:
    """{case: (pp rank, memory_report after one step, {"axis/op": (bytes, inter-node bytes)} of the step)}."""
    import megazero
    import megazero.moe.layer as moe_layer
    from megazero.moe.routing import decide
    from megazero.run.memory import SavedActivationMeter, memory_report
    from tests.test_planner_moe import balanced_decide

    moe_layer.decide = balanced_decide(decide)  # MoE layers route balanced, as the planner assumes
    out = {}
    for name, (model, lay, threshold) in cases.items():
        engine, opt, data, _ = megazero.initialize(config=config_of(model, lay, threshold))
        ckpt = engine.module.activation_checkpointer
        meter = SavedActivationMeter(engine.module, checkpointer=ckpt)
        engine.pctx.stats.reset()
        with meter.measure():
            engine.train_batch(data)
        moved = {k: (v["bytes"], v["inter_node_bytes"]) for k, v in engine.pctx.stats.snapshot().items()
                 if k.split("/")[0] in AXES}
        out[name] = (engine.pctx.pp_rank, memory_report(opt, meter, ckpt), moved)
        del engine, opt, data, meter
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(measure_worker, WORLD, CASES, timeout=300)


def plan_of(name: str):
    model, lay, threshold = CASES[name]
    return predict_memory(spec_of(model), lay, device="cpu", param_persistence_threshold=threshold)


@pytest.mark.parametrize("name", list(CASES))
def test_memory_matches_the_measured_breakdown(measured, name):
    model, lay, threshold = CASES[name]
    plan, errors = plan_of(name), []
    for r, rank in enumerate(measured):
        stage, report, _ = rank[name]
        slot = largest_slot(spec_of(model), lay, stage, threshold)
        for key in CATEGORIES:
            got, want = report.get(key, 0), plan.stages[stage].breakdown[key]
            bound = slot if key == "grad_buckets" else 0.05 * got
            if (got == 0) != (want == 0) or abs(want - got) > bound:
                errors.append(f"{name} rank {r} stage {stage} {key}: measured {got}, predicted {want}")
    assert errors == []


@pytest.mark.parametrize("name", list(CASES))
def test_cp_and_dp_cp_bytes_equal_the_comm_stats(measured, name):
    model, lay, threshold = CASES[name]
    volumes = predict_volume(spec_of(model), lay, param_persistence_threshold=threshold)
    per_stage: dict = {}
    for rank in measured:
        stage, _, moved = rank[name]
        per_stage.setdefault(stage, []).append(moved)
    for stage, ranks in per_stage.items():
        vol = volumes[stage]
        keys = {k for k in vol.moved if k.split("/")[0] in AXES} | {k for moved in ranks for k in moved}
        assert any(k.startswith("cp/") for k in keys) and any(k.startswith("dp_cp") for k in keys)
        for key in sorted(keys):
            got = [moved.get(key, (0.0, 0.0)) for moved in ranks]
            mean = (sum(g[0] for g in got) / len(got), sum(g[1] for g in got) / len(got))
            # float64 means of the same byte counts summed in another order: a few ulps
            assert (vol.moved.get(key, 0.0), vol.crossed.get(key, 0.0)) == pytest.approx(mean, rel=1e-12, abs=0), \
                (stage, key)


def test_the_cases_cover_both_methods_and_the_layouts():
    lays = [lay for _, lay, _ in CASES.values()]
    assert {(lay.cp, lay.cp_method) for lay in lays} >= {(2, "ring"), (4, "ring"), (2, "ulysses"), (4, "ulysses")}
    assert {lay.zero for lay in lays} == {0, 1, 2, 3} and {lay.recompute for lay in lays} == {"none", "selective",
                                                                                               "full"}
    assert {lay.pp for lay in lays} == {1, 2} and {lay.tp for lay in lays} == {1, 2}
    assert any(lay.sequence_parallel for lay in lays) and {lay.precision for lay in lays} == {"fp32", "bf16"}
    assert all(lay.gpus == WORLD for lay in lays)


# -- issue 35's acceptance: activations at cp 4 are a quarter of cp 1's at the same sequence length -----------

RATIO_MODEL = {"spec": "model_specs/llama.py:debug", "layers": 2, "hidden": 128, "heads": 8, "kv_heads": 4,
               "ffn_hidden": 344, "vocab": 256, "seq_len": 512, "dropout": 0.0}
RATIO_CASES = {f"cp{cp}-{method}": (RATIO_MODEL, Layout(dp=WORLD // cp, cp=cp, cp_method=method, micro_batch=1,
                                                        global_batch=WORLD // cp, zero=1), 100_000)
               for cp, method in ((1, "ring"), (2, "ring"), (4, "ring"), (2, "ulysses"), (4, "ulysses"))}


@pytest.fixture(scope="module")
def measured_ratio():
    return run_ranks(measure_worker, WORLD, RATIO_CASES, timeout=300)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_activations_at_cp4_are_a_quarter_of_cp1s_measured_and_predicted(measured_ratio, method):
    """Per-rank activation memory (the SavedActivationMeter peak of one step) at cp 4 is a quarter of cp 1's
    within 10% at the same sequence length (512 tokens, bf16), measured on every rank, and the planner predicts
    every figure within 5% and the same ratio. Measured (equal to the prediction to the byte): ring 0.2688, Ulysses
    0.2623 at cp 4 (cp 2: 0.5373, 0.5220). Above a quarter because a cp rank keeps a little more per token than
    one rank: the ring its fp32 output beside the rearranged copy the out GEMM keeps (SDPA's output is that input
    itself), Ulysses the gathered q, k, v and its output beside that copy, and both RoPE's tables per layer."""
    measured, predicted = {}, {}
    for name in ("cp1-ring", f"cp2-{method}", f"cp4-{method}"):
        model, lay, threshold = RATIO_CASES[name]
        plan = predict_memory(spec_of(model), lay, device="cpu", param_persistence_threshold=threshold)
        got = {rank[name][1]["activations"] for rank in measured_ratio}
        assert len(got) == 1, (name, got)  # every rank alike
        measured[lay.cp], predicted[lay.cp] = got.pop(), plan.stages[0].breakdown["activations"]
        # the planner's activation model against the meter: 5% is its accuracy claim for this layout (the measured and predicted figures are printed below)
        assert predicted[lay.cp] == pytest.approx(measured[lay.cp], rel=0.05), name
    print(method, {cp: (measured[cp], predicted[cp], round(measured[cp] / measured[1], 4)) for cp in measured})
    # 10%: the docstring's bound; what does not split over cp (the embedding's and the loss's per-token buffers are per rank, ring buffers come on top) keeps the ratio off 1/cp
    assert measured[4] / measured[1] == pytest.approx(0.25, rel=0.10)
    # the planner must get the ratio itself right to 1%, tighter than its absolute 5%
    assert predicted[4] / predicted[1] == pytest.approx(measured[4] / measured[1], rel=0.01)
    assert measured[2] / measured[1] == pytest.approx(0.5, rel=0.10)


# -- the whole step: every live storage against the planner's total, the cores' working sets included ---------

PEAK_CASES = [  # (cp, cp_method, precision, zero, recompute, kv heads): 1024 tokens, where the cores' buffers count
    (2, "ring", "fp32", 0, "none", 2), (2, "ring", "bf16", 1, "selective", 2), (2, "ulysses", "fp32", 0, "none", 2),
    (4, "ring", "bf16", 2, "selective", 1)]


def peak_config(cp: int, method: str, precision: str, zero: int, policy: str, kv: int) -> dict:
    model = {"spec": "model_specs/llama.py:debug", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": kv,
             "ffn_hidden": 256, "vocab": 256, "seq_len": 1024, "dropout": 0.0}
    return {"model": model, "precision": precision, "parallel": {"cp": cp, "cp_method": method},
            "train": {"micro_batch_size": 2, "global_batch_size": 2, "seed": 1}, "zero": {"stage": zero},
            "activation_checkpointing": {"policy": policy}, "optimizer": {"type": "adamw", "lr": 1e-4}}


def peak_worker(config: dict) -> int:
    """LiveTensorBytes' peak over this rank's second training step."""
    import megazero
    from megazero.run.memory import LiveTensorBytes

    engine, _, data, _ = megazero.initialize(config=config)
    engine.train_batch(data)
    with LiveTensorBytes() as live:
        engine.train_batch(data)
    return live.peak


@pytest.mark.parametrize("case", PEAK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_steps_peak_of_live_bytes_is_the_planners_total(case):
    """The planner's stage total (breakdown and transients, the context-parallel core's backward working set,
    `cp_ledger.core_working`, among them) against every storage alive in a real step, within 3% as
    tests/test_planner_memory.py holds the one-rank layouts (measured +2.5%, -0.7%, +2.5% and +2.4% in the order
    above, on the ring's fused CPU pairs). `layout_of` reads cp from the config. Full recompute is left out: at
    these lengths its whole-stage peak is under-predicted without cp too (cp 1, 1024 tokens: -6.7%; 256: -3.5%),
    and cp 2 and 4 land in between (-6.5%, -5.6%)."""
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, spec_of as spec_of_config

    config = peak_config(*case)
    peaks = run_ranks(peak_worker, case[0], config, timeout=180)
    cfg = load_run_config(config, world_size=case[0])
    layout, _ = layout_of(cfg)
    assert (layout.cp, layout.cp_method, layout.dp) == (case[0], case[1], 1)
    st = predict_memory(spec_of_config(cfg), layout, device="cpu").stages[0]
    predicted = sum(st.breakdown.values()) + sum(st.transient.values()) - st.counted_twice
    for peak in peaks:
        print(case, f"{predicted / peak - 1:+.4f}", st.transient)
        assert abs(predicted / peak - 1) < 0.03, (predicted, peak, st.transient)


# -- one core's backward: its working set, both ring paths (a GPU's plain PyTorch pairs forced on a CPU) -------

CORE_CASES = [  # (path, b, heads, kv heads, tokens per rank, head dim, dtype)
    (path, *shape, dtype) for path in ("math", "flash") for shape, dtype in (
        ((2, 4, 2, 512, 32), "float32"), ((2, 4, 2, 512, 32), "bfloat16"), ((1, 16, 1, 512, 32), "float32"),
        ((2, 8, 8, 256, 16), "float32"))] + [("ulysses", 2, 4, 2, 512, 32, dtype) for dtype in ("float32", "bfloat16")]


def core_worker(cases) -> list[int]:
    """LiveTensorBytes' rise during one core's backward (the incoming gradient already allocated), per case."""
    import torch
    import torch.distributed as dist

    from megazero.context_parallel import ring
    from megazero.context_parallel.ulysses import ulysses_attention
    from megazero.core.topology import Topology
    from megazero.run.memory import LiveTensorBytes
    from megazero.runtime.parallel_context import ParallelContext

    cp, pctx, out = dist.get_world_size(), ParallelContext(Topology(cp=dist.get_world_size())), []
    kernel = ring._kernel
    for path, b, heads, kv, n, d, dtype in cases:
        ring._kernel = (lambda blocks, q: ring._MathPair) if path == "math" else kernel
        dt = getattr(torch, dtype)
        q, k, v = ((torch.randn(n, b, h * d, dtype=dt, requires_grad=True) * 1).view(n, b, h, d).permute(1, 2, 0, 3)
                   for h in (heads, kv, kv))  # (b, h, n, d) views of GEMM outputs, as the attention layer makes them
        fn = ulysses_attention if path == "ulysses" else ring.ring_attention
        y = fn(q, k, v, pctx.cp_group, n * cp)
        grad = torch.randn(n, b, heads, d, dtype=dt).permute(1, 2, 0, 3)  # as the rearrangement's backward gives it
        with LiveTensorBytes() as live:
            start = live.total
            y.backward(grad)
        out.append(live.peak - start)
    ring._kernel = kernel
    pctx.destroy()
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_core_working_is_what_one_cores_backward_holds(cp):
    """`cp_ledger.core_working` (less the incoming gradient, allocated before) equals the bytes one ring or Ulysses
    backward allocates at its peak on the busiest rank (the ranks hold different chunk pairs), up to one transfer
    buffer that gloo releases late: the ring's to the byte otherwise, on the plain PyTorch pairs a GPU runs (the
    scores of one chunk pair materialised) and the CPU's fused flash pairs, fp32 and bf16, grouped-query g = 1, 2 and 16;
    Ulysses' within one (b, heads/cp, s) fp32 buffer (exact at cp 2; that much high at cp 4, where K and V are
    repeated: 16 KB of 2.6 MB)."""
    from megazero.planner.activation_ledger import dims
    from megazero.planner.cp_ledger import core_working

    measured = run_ranks(core_worker, cp, CORE_CASES, timeout=240)
    for i, (path, b, heads, kv, n, d, dtype) in enumerate(CORE_CASES):
        spec = load_spec("model_specs/llama.py:debug", {"hidden": heads * d, "heads": heads, "kv_heads": kv,
                                                         "seq_len": n * cp, "dropout": 0.0})
        lay = Layout(cp=cp, cp_method="ulysses" if path == "ulysses" else "ring", micro_batch=b,
                     global_batch=b, precision="fp32" if dtype == "float32" else "bf16")
        c = dims(spec, lay, "cuda" if path == "math" else "cpu")
        got, want = max(rank[i] for rank in measured), core_working(c) - c.q_bytes  # the busiest rank's
        # gloo's threads may let go of a transfer's buffer just after the peak: the measured peak is the prediction
        # or up to one transfer buffer more (seen: a key/value block, 512 KB, in the ring; a K-sized all-to-all
        # buffer, 256 KB, in Ulysses; each in about 1 of 10 runs)
        if path == "ulysses":  # its (b, heads/cp, s) fp32 buffers (4·b·heads·n) are not counted
            late = b * heads * n * d * 4  # the largest all-to-all buffer: q's, fp32
            assert -4 * b * heads * n <= got - want <= 4 * b * heads * n + late, (path, b, heads, kv, n, d, dtype,
                                                                               got, want)
        else:
            late = 2 * b * kv * n * d * 4  # the largest transfer: a dK/dV partial, fp32
            assert 0 <= got - want <= late, (path, b, heads, kv, n, d, dtype, got, want)


# -- pure: the step-time model's cp communication ---------------------------------------------------------------

@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp_communication_is_its_own_category_on_the_cp_groups_fabric(method):
    """The cores' communication is ``cp_comm``: a 100x slower network changes no compute category and raises it.
    The ring's block transfers hide behind its chunk pairs on H100 (cp 4 x tp 8 spans 4 nodes: each hop at the
    inter-node rate); Ulysses' all-to-alls are exposed, cheaper with the cp group inside a node (cp·tp <= 8)."""
    import dataclasses

    from megazero.planner.hardware import load_hardware
    from megazero.planner.speed import COMPUTE, predict_step

    h100 = load_hardware("h100-80gb", "configs/hardware")
    slow = dataclasses.replace(h100, nvlink_gbs=h100.nvlink_gbs / 100, internode_gbs=h100.internode_gbs / 100)
    spec = load_spec("model_specs/llama.py:llama3-8b", {"seq_len": 65536})
    lay = Layout(tp=8, cp=4, cp_method=method, micro_batch=1, global_batch=1, recompute="full", sequence_parallel=True)
    fast_plan, slow_plan = predict_step(spec, lay, h100), predict_step(spec, lay, slow)
    for k in COMPUTE:
        # float64: the compute categories should be identical; 1e-12 leaves only summation-order rounding
        assert slow_plan.breakdown[k] == pytest.approx(fast_plan.breakdown[k], rel=1e-12), k
    assert slow_plan.breakdown["cp_comm"] > fast_plan.breakdown["cp_comm"] > 0
    # float64: the categories summed in another order than the step was computed, ~10 terms of ~1e-16 rounding
    assert sum(fast_plan.breakdown.values()) == pytest.approx(fast_plan.step_time_s, rel=1e-9)
    assert fast_plan.cp_bytes > 0 and fast_plan.cp_internode_bytes > 0
    if method == "ring":
        assert fast_plan.breakdown["cp_comm"] < 0.01 * fast_plan.breakdown["attention"]
    else:
        inside = predict_step(spec, lay.replace(tp=2), h100)  # cp 4 x tp 2: one node
        across = predict_step(spec, lay.replace(tp=2, ranks_per_node=2), h100)  # each cp pair of ranks a node
        assert inside.cp_internode_bytes == 0 < across.cp_internode_bytes
        assert inside.breakdown["cp_comm"] < across.breakdown["cp_comm"]


def test_layouts_the_runtime_refuses_with_cp_are_refused_by_name():
    spec = spec_of(LLAMA)
    assert Layout(cp=3, global_batch=1).problems(spec) == [
        "cp=3 needs seq_len=16 divisible by 2 x cp = 6: each cp rank holds a head and a tail chunk of every sequence"]
    assert "cp_method=ulysses needs the 2 heads per tp rank" in Layout(tp=2, cp=4, cp_method="ulysses",
                                                                      global_batch=1).problems(spec)[0]
    assert "dropout 0.1" in Layout(cp=2, global_batch=1).problems(spec_of(dict(LLAMA, dropout=0.1)))[0]
    assert "hpz=2 with cp=2" in Layout(dp=2, cp=2, zero=3, hpz=2, global_batch=2).problems(spec)[0]
    assert "cp_method='rings' is not one of ring, ulysses" in Layout(cp_method="rings").problems(spec)[0]
    capped = spec_of(dict(MIXTRAL, moe=dict(MIXTRAL["moe"], capacity_factor=1.0)))
    assert "moe_capacity_factor=1.0" in Layout(cp=2, global_batch=1).problems(capped)[0]
    assert Layout(dp=2, cp=2, ep=2, global_batch=2).problems(spec_of(MIXTRAL)) == []
    lay = Layout(tp=2, pp=2, dp=2, cp=4, cp_method="ulysses", global_batch=2)
    assert (lay.gpus, lay.dp_cp, lay.num_microbatches) == (32, 8, 1)
    assert lay.describe().startswith("tp2 pp2 dp2 cp4-ulysses mb1")
