"""``plan.py --calibrate``: the probe's fits recover known curves, the file it writes loads as a hardware
preset whose measured efficiency the planner uses, and the probe runs end to end on 2 ranks here."""
from __future__ import annotations

import pytest

from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout, PlanError
from megazero.planner.machine import DEFAULT_EFFICIENCY, Machine
from megazero.run import calibrate, plan


def test_gemm_fit_recovers_the_curve():
    peak, g, kh, mnh = 2.0e11, 0.9, 120.0, 2.0 ** 18
    rates = [(m, n, k, peak * g * k / (k + kh) * m * n / (m * n + mnh))
             for m, n in ((1024, 1024), (256, 256), (256, 1024)) for k in (32, 64, 128, 256, 512, 1024, 2048, 8192)]
    got_peak, got_g, got_kh, got_mnh = calibrate.fit_gemm(rates)
    assert got_peak == max(r for *_, r in rates)
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
    capsys.readouterr()
    assert plan.main(["gpt:debug", "--hardware", out, "--gpus", "2", "--global-batch", "4", "--pp", "2",
                      "--precision", "fp32"], hardware_dir="configs/hardware", spec_dir="model_specs") in (0, 1)
    assert "step" in capsys.readouterr().out


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
            engine, data = calibrate.tiny_engine(f"model_specs/{flavor}.py:debug", layers, policy, **extra)
            engine.train_batch(data)
            with calibrate.OpCount() as count:
                engine.train_batch(data)
            counts.append(count.n)
        return (counts[1] - counts[0]) / 2

    spec = load_spec(f"model_specs/{flavor}.py:debug")
    fwd, bwd, _ = host_ops(spec, Layout())
    _, _, again = host_ops(spec, Layout(recompute="full"))
    assert per_block("none") == pytest.approx(fwd + bwd, rel=0.1)
    assert per_block("full") == pytest.approx(fwd + bwd + again, rel=0.1)
