"""``plan.py --calibrate``: the probe's fits recover known curves, the file it writes loads as a hardware
preset whose measured efficiency the planner uses, and the probe runs end to end on 2 ranks here."""
from __future__ import annotations

import pytest

from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout, PlanError
from megazero.planner.machine import DEFAULT_EFFICIENCY, Machine
from megazero.toolbox import calibrate, plan, probe_timing, step_probe


def test_gemm_fit_recovers_the_curve():
    peak, g, kh, mnh = 2.0e11, 0.9, 120.0, 2.0 ** 18
    rates = [(m, n, k, peak * g * k / (k + kh) * m * n / (m * n + mnh))
             for m, n in ((1024, 1024), (256, 256), (256, 1024)) for k in (32, 64, 128, 256, 512, 1024, 2048, 8192)]
    got_peak, got_g, got_kh, got_mnh = calibrate.fit_gemm(rates)
    assert got_peak == max(r for *_, r in rates)
    # the fit is a grid over gemm_k_half (then gemm_max in closed form): 1e-3 and 1.0 are the grid's resolution on exact synthetic rates
    assert got_g * got_peak == pytest.approx(g * peak, rel=1e-3) and got_kh == pytest.approx(kh, abs=1.0)
    assert got_mnh == pytest.approx(mnh, rel=1e-3)


def test_latency_fit_recovers_base_and_step():
    assert calibrate.fit_latency([(s, 10e-6 + s * 3e-6) for s in (1, 2, 3, 6, 7, 14)]) == pytest.approx((10e-6, 3e-6))


def test_the_written_file_is_a_hardware_preset_the_planner_uses(tmp_path):
    content = {"name": "probe", "peak_tflops": 0.2, "hbm_gib": 10.0, "hbm_bandwidth_tbs": 0.02, "gpus_per_node": 8,
               "nvlink_gbs": 0.5, "internode_gbs": 0.5,
               "efficiency": {"gemm_max": 0.8, "gemm_k_half": 40.0, "hbm": 1.0, "nvlink": 1.0, "internode": 1.0,
                              "kernel_us": 3.0, "collective_us": 900.0, "ring_base_us": 50.0, "nvlink_hop_us": 600.0,
                              "net_hop_us": 600.0, "host_gbs": 20.0, "pcie_gbs": 20.0}}
    path = str(tmp_path / "cpu.yaml")
    calibrate.write(path, content, 8)
    hw = load_hardware(path, "configs/hardware")
    mc = Machine(hw, DEFAULT_EFFICIENCY, Layout(precision="fp32"))
    assert mc.eff.gemm_max == 0.8 and mc.eff.nvlink_hop_us == 600.0 and mc.peak == pytest.approx(0.1e12)
    assert mc.latency("all_gather", 8) == pytest.approx((50 + 7 * 600) * 1e-6)
    (tmp_path / "bad.yaml").write_text(open(path).read().replace("gemm_k_half", "gemm_khalf"))
    with pytest.raises(PlanError, match="efficiency.gemm_khalf is not a field; did you mean 'gemm_k_half'"):
        load_hardware(str(tmp_path / "bad.yaml"), "configs/hardware")


def test_calibrate_runs_on_two_ranks_and_plans_with_its_file(tmp_path, capsys):
    out = str(tmp_path / "here.yaml")
    assert plan.main(["--calibrate", out, "--ranks", "2", "--repeats", "1"]) == 0
    hw = load_hardware(out, "configs/hardware")
    eff = dict(hw.efficiency)
    assert hw.gpus_per_node == 2 and hw.peak_tflops > 0 and hw.nvlink_gbs > 0
    assert 0 < eff["gemm_max"] <= 1.5 and eff["nvlink_hop_us"] >= 0
    # gloo's collectives cost CPU (copies, reductions, wake-ups), less than a core per rank while they last
    assert 0 < eff["comm_cpu"] <= 2.0 and eff["collective_us"] >= 0
    # a step's compute over its kernels' timed alone: near 1 (a step neither free nor several times its kernels)
    assert 0.5 < eff["in_step"] < 2.5
    capsys.readouterr()
    assert plan.main(["gpt:debug", "--hardware", out, "--gpus", "2", "--global-batch", "4", "--pp", "2",
                      "--precision", "fp32"], hardware_dir="configs/hardware", spec_dir="model_specs") in (0, 1)
    assert "step" in capsys.readouterr().out


def test_in_step_scales_every_compute_second_and_nothing_else():
    from megazero.planner.speed import COMPUTE, predict_step
    from megazero.core.spec import ModelSpec

    hw = load_hardware("a100-80gb", "configs/hardware")
    layout = Layout(tp=2, global_batch=4, micro_batch=1, recompute="selective")
    plain = Machine(hw, DEFAULT_EFFICIENCY, layout)
    slow = Machine(hw, DEFAULT_EFFICIENCY.replace(in_step=1.25, host_op_us=3.0), layout)
    hosted = Machine(hw, DEFAULT_EFFICIENCY.replace(host_op_us=3.0), layout)
    assert slow.gemm(512, 1024, 256) == pytest.approx(1.25 * plain.gemm(512, 1024, 256))
    assert slow.flops(1e12, 0.5) == pytest.approx(1.25 * plain.flops(1e12, 0.5))
    assert slow.mem(1e8, 3) == pytest.approx(1.25 * plain.mem(1e8, 3))
    assert slow.host(100) == pytest.approx(1.25 * hosted.host(100))
    nbytes = 1e8
    assert slow.ring("all_reduce", nbytes, 2, slow.link(1, 2)) == plain.ring("all_reduce", nbytes, 2, plain.link(1, 2))
    assert slow.latency("all_gather", 2) == plain.latency("all_gather", 2)
    assert slow.all_to_all(nbytes, 2, 1) == plain.all_to_all(nbytes, 2, 1)
    assert slow.dp_collective("reduce_scatter", nbytes, 2, 1) == plain.dp_collective("reduce_scatter", nbytes, 2, 1)
    spec = ModelSpec(name="t", layers=2, hidden=512, heads=8, seq_len=256, vocab=1024)
    base = predict_step(spec, layout, hw).breakdown
    scaled = predict_step(spec, layout, hw, efficiency=DEFAULT_EFFICIENCY.replace(in_step=1.25)).breakdown
    for part in COMPUTE:
        assert scaled[part] == pytest.approx(1.25 * base[part]), part
    assert base["recompute"] > 0 and base["optimizer"] > 0
    # the collectives keep their time; slower weight GEMMs hide more of backward's all-reduce
    assert 0 < scaled["tp_comm"] <= base["tp_comm"]


def test_interleaved_times_every_kernel_once_per_round():
    """`_interleaved`: each round runs every sample's calls in turn, after a barrier; each median is per call."""
    order, clock = [], iter(range(1000))
    samples = [(lambda: order.append("a"), 2), (lambda: order.append("b"), 1)]
    barriers = []
    got = probe_timing.interleaved(samples, 3, lambda: None, lambda: barriers.append(1), lambda: next(clock))
    assert order == ["a", "b"] + ["a", "a", "b"] * 3 and len(barriers) == 6
    assert got == [0.5, 1.0]  # the fake clock ticks once per read: 1 tick over 2 calls, 1 over 1


def test_a_hardware_file_refuses_in_step_zero(tmp_path):
    path = tmp_path / "cpu.yaml"
    calibrate.write(str(path), {"name": "x", "peak_tflops": 0.2, "hbm_gib": 10.0, "hbm_bandwidth_tbs": 0.02,
                                "gpus_per_node": 1, "nvlink_gbs": 0.5, "internode_gbs": 0.5,
                                "efficiency": {"in_step": 0.0}}, 1)
    with pytest.raises(PlanError, match="efficiency.in_step=0 must be > 0"):
        load_hardware(str(path), "configs/hardware")


def test_in_step_is_the_probe_models_step_over_its_prediction(monkeypatch):
    """`probe_in_step` divides the probe model's measured step (here: a stand-in 0.5 s) by the planner's step for
    that model on the given hardware; the probe model is none of the CPU benchmark's."""
    import benchmarks.planner_cpu as bench
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, spec_of
    from megazero.planner.hardware import FIELDS, Hardware
    from megazero.planner.speed import predict_step

    content = {"name": "probe", "peak_tflops": 0.2, "hbm_gib": 10.0, "hbm_bandwidth_tbs": 0.02, "gpus_per_node": 1,
               "nvlink_gbs": 0.5, "internode_gbs": 0.5,
               "efficiency": {"gemm_max": 0.8, "gemm_k_half": 40.0, "hbm": 0.6, "host_op_us": 5.0, "kernel_us": 3.0}}
    monkeypatch.setattr(step_probe, "median_seconds", lambda *a, **k: 0.5)
    got = step_probe.probe_in_step(content, repeats=1)
    config = step_probe.tiny_config(step_probe._debug_spec("gpt.py"), micro_batch=2, micro_batches=4, zero=1,
                                     **step_probe.PROBE_MODEL)
    run = load_run_config(config, world_size=1)
    hw = Hardware(**{k: content[k] for k in FIELDS}, efficiency=tuple(sorted(content["efficiency"].items())))
    assert got == pytest.approx(0.5 / predict_step(spec_of(run), layout_of(run)[0], hw).step_time_s)
    shape = ("hidden", "seq_len")
    assert all(tuple(step_probe.PROBE_MODEL[k] for k in shape) != tuple(m[k] for k in shape)
               for m in (bench.GPT, bench.LLAMA))


@pytest.mark.parametrize("flavor,extra", [("gpt", {}), ("llama", {"kv_heads": 2, "ffn_hidden": 48})])
def test_the_planners_operator_counts_are_megazeros(flavor, extra):
    """block_cost.HOST_OPS (what a CPU's host time per operator is multiplied by) against a count of one
    step's operators with 2 and 4 blocks (their difference: two blocks, forward and backward, one micro-batch),
    without recompute and with full recompute (one more forward per block)."""
    from megazero.core.spec import load_spec
    from megazero.planner.block_cost import host_ops

    def per_block(policy):
        counts = []
        for layers in (2, 4):
            engine, data = step_probe.tiny_engine(f"model_specs/{flavor}.py:debug", layers, policy, **extra)
            engine.train_batch(data)
            with step_probe.OpCount() as count:
                engine.train_batch(data)
            counts.append(count.n)
        return (counts[1] - counts[0]) / 2

    spec = load_spec(f"model_specs/{flavor}.py:debug")
    fwd, bwd, _ = host_ops(spec, Layout())
    _, _, again = host_ops(spec, Layout(recompute="full"))
    # operator counts of a real step against the planner's table: 10% allows ops the table lumps together (views, copies); an extra forward under recompute exceeds it
    assert per_block("none") == pytest.approx(fwd + bwd, rel=0.1)
    assert per_block("full") == pytest.approx(fwd + bwd + again, rel=0.1)
