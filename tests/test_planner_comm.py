"""The planner's model of the communication options (megazero/planner/comm_volume.py, comm_memory.py,
machine.py, stage_costs.py) against megazero's own counts.

One launch of 4 gloo ranks emulating 2 nodes x 2 ranks (``parallel.ranks_per_node: 2``) runs the debug
GPT (fp32, dp 4, 2 micro-batches per step) under each option; each rank measures one step's bytes by
(axis, op) from its `CommStats` (all, and what left the node; the second step, so that 1-bit Adam is
past its one-step warm-up) and its `memory_breakdown()` between steps and at the optimizer step. The
predicted mean bytes per rank equal the measured means exactly, for every (axis, op) of the data-parallel
axes; 1-bit Adam's error buffers in ``optimizer_states`` and hpZ's secondary partition (``params`` at the
step minus between steps) equal the prediction exactly. Step times are checked by direction only.
"""
import copy

import pytest

from megazero.core.spec import load_spec
from megazero.planner.comm_volume import predict_volume
from megazero.planner.layout import Layout
from megazero.planner.memory_plan import predict_memory
from tests.harness import run_ranks

BASE = {"model": {"spec": "model_specs/gpt.py:debug"}, "precision": "fp32",
        "train": {"micro_batch_size": 1, "global_batch_size": 8, "seed": 5},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "zero": {"reduce_bucket_size": 20000, "param_persistence_threshold": 0},
        "parallel": {"ranks_per_node": 2}}
LAYOUT = dict(dp=4, micro_batch=1, global_batch=8, precision="fp32", reduce_bucket_size=20000, ranks_per_node=2)


def _config(**sections) -> dict:
    cfg = copy.deepcopy(BASE)
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


# name: (config, the planner's Layout)
CASES = {
    "z1-flat": (_config(zero={"stage": 1}), Layout(zero=1, **LAYOUT)),
    "z1-hierarchical": (_config(zero={"stage": 1}, comm={"hierarchical": True}),
                        Layout(zero=1, hierarchical=True, **LAYOUT)),
    "z2-hierarchical": (_config(zero={"stage": 2}, comm={"hierarchical": True}),
                        Layout(zero=2, hierarchical=True, **LAYOUT)),
    "z0-onebit": (_config(zero={"stage": 0}, optimizer={"type": "onebit_adam", "freeze_step": 1}),
                  Layout(zero=0, onebit=True, **LAYOUT)),
    "z3-hpz": (_config(zero={"stage": 3, "hpz_partition_size": 2}), Layout(zero=3, hpz=2, **LAYOUT)),
    "z3-qwz-qgz": (_config(zero={"stage": 3, "quantized_weights": True, "quantized_gradients": True}),
                   Layout(zero=3, quantized_weights=True, quantized_gradients=True, **LAYOUT)),
}
DP_AXES = ("dp", "dp.intra", "dp.inter", "hpz")


def measure_worker(cases: dict) -> dict:
    """{case: ({"axis/op": (bytes, inter-node bytes)} of the second step, memory_breakdown() between
    steps, memory_breakdown()["params"] at the second step's optimizer step)}."""
    import megazero

    out = {}
    for name, (cfg, _) in cases.items():
        engine, opt, data, _ = megazero.initialize(config=cfg)
        engine.train_batch(data)
        between = opt.memory_breakdown()
        held = []
        step = opt.step
        opt.step = lambda: (held.append(opt.memory_breakdown()["params"]), step())[1]
        before = engine.pctx.stats.snapshot()
        engine.train_batch(data)
        after = engine.pctx.stats.snapshot()
        zero = {"bytes": 0.0, "inter_node_bytes": 0.0}
        out[name] = ({k: (v["bytes"] - before.get(k, zero)["bytes"],
                          v["inter_node_bytes"] - before.get(k, zero)["inter_node_bytes"])
                      for k, v in after.items() if k.split("/")[0] in DP_AXES}, between, held[0])
        del engine, opt, data
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(measure_worker, 4, CASES, timeout=240)


def _spec():
    return load_spec("model_specs/gpt.py:debug")


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_dp_and_internode_bytes_equal_the_measured(measured, name):
    vol = predict_volume(_spec(), CASES[name][1], param_persistence_threshold=0)[0]
    keys = set(vol.moved) | {k for rank in measured for k in rank[name][0]}
    for key in sorted(keys):
        got = [rank[name][0].get(key, (0.0, 0.0)) for rank in measured]
        mean_moved, mean_crossed = sum(g[0] for g in got) / 4, sum(g[1] for g in got) / 4
        # float64 means of the same byte counts summed in another order: a few ulps
        assert (vol.moved.get(key, 0.0), vol.crossed.get(key, 0.0)) == pytest.approx((mean_moved, mean_crossed),
                                                                                      rel=1e-12, abs=0), key


def test_hierarchical_sends_fewer_bytes_across_nodes(measured):
    """The same dp bytes in all, (n−1)/n over (N−1)/N = 1.5x fewer across the 2 nodes (n = 4, N = 2)."""
    def crossed(name):
        return sum(c for rank in measured for _, c in rank[name][0].values())

    flat = predict_volume(_spec(), CASES["z1-flat"][1], param_persistence_threshold=0)[0]
    tiered = predict_volume(_spec(), CASES["z1-hierarchical"][1], param_persistence_threshold=0)[0]
    # float64: the same ratio of byte counts computed in two orders
    assert crossed("z1-flat") / crossed("z1-hierarchical") == pytest.approx(
        flat.internode_bytes / tiered.internode_bytes, rel=1e-12)
    # 1.5 is the two-level scheme's byte ratio for this layout; 1e-3 covers the buckets' rounding to whole elements
    assert flat.internode_bytes / tiered.internode_bytes == pytest.approx(1.5, rel=1e-3)


def test_onebit_error_buffers_are_the_measured_optimizer_states(measured):
    plan = predict_memory(_spec(), CASES["z0-onebit"][1], device="cpu", param_persistence_threshold=0)
    plain = predict_memory(_spec(), Layout(zero=0, **LAYOUT), device="cpu", param_persistence_threshold=0)
    for rank in measured:
        assert plan.stages[0].breakdown["optimizer_states"] == rank["z0-onebit"][1]["optimizer_states"]
    assert plan.stages[0].breakdown["optimizer_states"] > plain.stages[0].breakdown["optimizer_states"]


def test_hpz_secondary_is_the_measured_rise_at_the_step(measured):
    plan = predict_memory(_spec(), CASES["z3-hpz"][1], device="cpu", param_persistence_threshold=0)
    for rank in measured:
        _, between, held = rank["z3-hpz"]
        assert plan.stages[0].transient["hpz_secondary"] == held - between["params"] > 0
        assert plan.stages[0].breakdown["params"] == between["params"]


# -- pure: step-time directions -------------------------------------------------------------------------

def _hardware(**changes):
    from megazero.planner.hardware import load_hardware

    hw = load_hardware("a100-80gb", "configs/hardware")
    return hw.__class__(**{**hw.__dict__, **changes})


def _dp_seconds(lay, hw, spec=None) -> tuple[float, object]:
    """Seconds of data-parallel communication in one step (every micro-batch's and the step's, exposed or
    not: overlap off) on stage 0, and the `StepPlan`."""
    from megazero.planner.speed import predict_step

    plan = predict_step(spec or load_spec("model_specs/gpt.py:gpt-1.7b"), lay.replace(overlap_comm=False), hw)
    return plan.breakdown["dp_comm"], plan


BIG = Layout(dp=32, micro_batch=4, global_batch=512, zero=1)
SLOW = dict(internode_gbs=3.0)  # ~25 Gb/s per GPU: the networks 1-bit Adam and ZeRO++ were made for


def test_hierarchical_crosses_nodes_less_and_wins_on_a_slow_network():
    flat, flat_plan = _dp_seconds(BIG, _hardware(**SLOW))
    tiered, tiered_plan = _dp_seconds(BIG.replace(hierarchical=True), _hardware(**SLOW))
    assert tiered < flat
    assert tiered_plan.internode_bytes < flat_plan.internode_bytes
    # the two-level scheme moves the same bytes over all links, only fewer across nodes; 1e-3 covers the buckets' rounding to whole elements
    assert tiered_plan.dp_bytes == pytest.approx(flat_plan.dp_bytes, rel=1e-3)


def test_onebit_cuts_the_dp_time_and_bytes_on_a_slow_network():
    plain, plain_plan = _dp_seconds(BIG.replace(zero=0), _hardware(**SLOW))
    onebit, onebit_plan = _dp_seconds(BIG.replace(zero=0, onebit=True), _hardware(**SLOW))
    assert onebit < plain / 2  # the memory-bound passes of the reference compression (~0.15 s here) remain
    assert plain_plan.dp_bytes / onebit_plan.dp_bytes > 25  # 32 bits to ~1


def test_qwz_cuts_the_dp_time_on_a_slow_network():
    plain, plain_plan = _dp_seconds(BIG.replace(zero=3), _hardware(**SLOW))
    quant, quant_plan = _dp_seconds(BIG.replace(zero=3, quantized_weights=True), _hardware(**SLOW))
    assert quant < plain and quant_plan.dp_bytes < plain_plan.dp_bytes


def test_qgz_cuts_the_dp_time_with_few_dp_ranks_per_node():
    """qgZ's all-to-all is flat: each GPU sends the rows of every other node's ranks through its own link,
    (n−k)/n·(1 + 4/256)·P bytes, against the ring reduce-scatter's 4P·(n−1)/n spread over the k dp ranks
    of a node. With tp 4 (k = 2 dp ranks per node) that is 0.76P against 1.75P per link: qgZ wins; with
    k = 8 (tp 1) it sends more across nodes than the fp32 ring (as the runtime's CommStats count) and the
    model predicts it slower."""
    tp4 = BIG.replace(tp=4, dp=8, micro_batch=4, zero=3)
    plain, plain_plan = _dp_seconds(tp4, _hardware(**SLOW))
    quant, quant_plan = _dp_seconds(tp4.replace(quantized_gradients=True), _hardware(**SLOW))
    assert quant < plain and quant_plan.dp_bytes < plain_plan.dp_bytes
    wide, wide_plan = _dp_seconds(BIG.replace(zero=3), _hardware(**SLOW))
    wide_q, wide_q_plan = _dp_seconds(BIG.replace(zero=3, quantized_gradients=True), _hardware(**SLOW))
    assert wide_q_plan.internode_bytes > wide_plan.internode_bytes and wide_q > wide


def test_hpz_puts_the_backward_gathers_on_nvlink():
    """hpz = 8 ranks of a node (tp 1): backward's gathers on NVLink, cheaper than over dp across nodes;
    fewer bytes leave the node."""
    from megazero.planner.machine import DEFAULT_EFFICIENCY, Machine
    from megazero.planner.stage_costs import _stage3_gathers

    hw = _hardware()
    lay = BIG.replace(zero=3, hpz=8)
    mc = Machine(hw, DEFAULT_EFFICIENCY, lay)
    first, later = _stage3_gathers(lay, mc, 1e9, 32, 1, True)
    assert later == pytest.approx(mc.ring("all_gather", 2e9, 8, mc.nvlink)) and later < first
    plain, plain_plan = _dp_seconds(BIG.replace(zero=3), hw)
    hpz, hpz_plan = _dp_seconds(lay, hw)
    assert hpz < plain and hpz_plan.internode_bytes < plain_plan.internode_bytes


def test_layout_checks_and_config_mapping():
    spec = _spec()
    assert Layout(dp=4, global_batch=4, zero=1, onebit=True).problems(spec) == [
        "onebit (optimizer.type=onebit_adam) needs zero 0 (got 1): its ranks average the momentum of whole "
        "gradients, which stages 1-3 shard"]
    assert Layout(dp=4, global_batch=4, zero=2, quantized_weights=True).problems(spec) == [
        "quantized_weights: ZeRO++ needs zero=3 (got 2)"]
    assert "hpz=3 does not divide the data-parallel size dp=4" in Layout(dp=4, global_batch=4, zero=3,
                                                                         hpz=3).problems(spec)[0]
    assert "ranks_per_node=3 does not divide the world size 4" in Layout(dp=4, global_batch=4,
                                                                         ranks_per_node=3).problems(spec)[0]
    lay = Layout(dp=4, global_batch=4, zero=3, hierarchical=True, ranks_per_node=2, hpz=2, quantized_weights=True,
                 quantized_gradients=True)
    assert lay.describe().endswith("hierarchical ranks-per-node=2 qwZ hpZ2 qgZ") and not lay.problems(spec)

    from megazero.core.config import load_config
    from megazero.planner.from_config import layout_of

    cfg = load_config({"model": {"spec": "model_specs/gpt.py:debug"}},
                      ["zero.stage=3", "zero.quantized_weights=true", "zero.hpz_partition_size=2",
                       "zero.quantized_gradients=true", "comm.hierarchical=true", "parallel.ranks_per_node=2"],
                      world_size=4)
    got, why = layout_of(cfg)
    assert why == "" and (got.hierarchical, got.ranks_per_node, got.quantized_weights, got.hpz,
                          got.quantized_gradients, got.onebit) == (True, 2, True, 2, True, False)
    cfg = load_config({"model": {"spec": "model_specs/gpt.py:debug"}}, ["zero.stage=0", "optimizer.type=onebit_adam"],
                      world_size=4)
    assert layout_of(cfg)[0].onebit
