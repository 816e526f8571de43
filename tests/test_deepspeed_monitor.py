"""DeepSpeed's monitor, comms-logger and flops-profiler config sections under megazero: the engine's
events in CSV files (DeepSpeed's names and layout) and TensorBoard, both engines; `comms_logger` turning
on `megazero.comm`'s logger with the engine's own collectives in its summary; the flops profiler's
counts against the analytic FLOPs of the model's GEMMs. 2 gloo ranks."""
import csv
import os

import pytest
import torch

from tests.harness import run_ranks

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _module_worker(out_dir, stage):
    import torch.distributed as dist

    import megazero as deepspeed

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = dict(BASE, zero_optimization={"stage": stage},
               csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "csvjob"},
               tensorboard={"enabled": True, "output_path": out_dir, "job_name": "tbjob"},
               comms_logger={"enabled": True, "prof_all": True},
               flops_profiler={"enabled": True, "profile_step": 1, "output_file": os.path.join(out_dir, "flops.txt")})
    engine, *_ = deepspeed.initialize(model=net, config=cfg)
    means = []
    for step in range(3):
        total = 0.0
        for m in range(2):
            g = torch.Generator().manual_seed(10 * step + 2 * m + dist.get_rank())
            loss = engine(torch.randn(2, 8, generator=g)).square().mean()
            engine.backward(loss)
            engine.step()
            total += loss.item()
        means.append(total / 2)
    engine.monitor.write_events([("Custom/value", 1.5, 7)])  # a user's own event, as DeepSpeed's engine.monitor takes it
    summary = deepspeed.comm.log_summary(return_dict=True)
    deepspeed.comm.configure(enabled=False)
    return {"means": means, "lr": engine.get_lr()[0], "engine": summary["engine"], "samples": engine.global_samples}


def _read_csv(path):
    with open(path) as f:
        return list(csv.reader(f))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_module_engine_writes_deepspeeds_events(stage, tmp_path):
    got = run_ranks(_module_worker, 2, str(tmp_path), stage, timeout=120)
    rows = _read_csv(tmp_path / "csvjob" / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"]
    # rank 0's mean loss of each step, at the global samples before it (DeepSpeed's backward writes it): 0, 8, 16
    assert [int(r[0]) for r in rows[1:]] == [0, 8, 16]
    # the csv holds the fp32 mean as text: fp32 rounding (6e-8) and the printed digits, within 1e-6
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(got[0]["means"], rel=1e-6)
    assert _read_csv(tmp_path / "csvjob" / "Custom_value.csv") == [["step", "value"], ["7", "1.5"]]  # rank 0 only
    lrs = _read_csv(tmp_path / "csvjob" / "Train_Samples_lr.csv")
    assert [int(r[0]) for r in lrs[1:]] == [8, 16, 24] and float(lrs[-1][1]) == pytest.approx(got[0]["lr"])
    assert not os.path.exists(tmp_path / "csvjob" / "Train_Samples_loss_scale.csv")  # fp32: no loss scale
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tbjob"))
    events.Reload()
    scalars = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in scalars] == [0, 8, 16]
    # TensorBoard stores scalars as fp32: 6e-8 relative rounding, within 1e-6
    assert [e.value for e in scalars] == pytest.approx(got[0]["means"], rel=1e-6)
    # comms_logger: the engine's own collectives (counted, not timed) join megazero.comm's summary
    engine = got[0]["engine"]
    reduction = "dp/all_reduce" if stage == 0 else "dp/reduce_scatter"
    assert engine[reduction]["calls"] >= 3 and engine[reduction]["bytes"] > 0
    # the flops profiler: the first forward of step 1 (after one completed step), rank 0: 2 x b x (8x16 + 16x4)
    text = (tmp_path / "flops.txt").read_text()
    assert "Profile Summary at step 1" in text and "fwd MACs per GPU:" in text
    assert "fwd flops per GPU:" in text and "768.00" in text.split("fwd flops per GPU:")[1].split("\n")[0]


def _pipe_worker(out_dir):
    import megazero as deepspeed
    from megazero.pipe import PipelineModule

    torch.manual_seed(0)
    net = PipelineModule(layers=[torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)], num_stages=2,
                         loss_fn=torch.nn.MSELoss())
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g).half(),  # fp16 data for an fp16 model,
                                          torch.randn(32, 2, generator=g).half())  # as DeepSpeed's pipeline wants
    cfg = dict(BASE, fp16={"enabled": True, "initial_scale_power": 4},
               csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "pipe"})
    engine, *_ = deepspeed.initialize(model=net, config=cfg, training_data=data)
    return [engine.train_batch() for _ in range(2)]


def test_the_pipeline_engine_writes_deepspeeds_events(tmp_path):
    losses = run_ranks(_pipe_worker, 2, str(tmp_path), timeout=120)[0]
    rows = _read_csv(tmp_path / "pipe" / "Train_Samples_train_loss.csv")
    assert [int(r[0]) for r in rows[1:]] == [4, 8]  # global batch 2 x 2 x dp 1, after each step
    # the csv holds the fp32 mean as text: fp32 rounding (6e-8) and the printed digits, within 1e-6
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    scale = _read_csv(tmp_path / "pipe" / "Train_Samples_loss_scale.csv")  # fp16: the module was cast, as DeepSpeed
    assert scale[0] == ["step", "loss_scale"] and float(scale[1][1]) == 16.0


def test_missing_monitor_packages_and_the_profiler_on_a_pipeline_are_refused(monkeypatch):
    import importlib.util

    import megazero
    from megazero.core.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match="log.wandb.enabled .*'wandb' package is not installed"):
        megazero.initialize(model=torch.nn.Linear(2, 2), config=dict(BASE, wandb={"enabled": True}))
    from megazero.pipe import PipelineModule

    with pytest.raises(ConfigError, match="log.flops_profiler.enabled"):
        megazero.initialize(model=PipelineModule([torch.nn.Linear(2, 2)], num_stages=1, loss_fn=torch.nn.MSELoss()),
                            config=dict(BASE, flops_profiler={"enabled": True}))


def test_get_model_profile_counts_the_gemms():
    from megazero.profiling.flops_profiler import FlopsProfiler, get_model_profile

    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    flops, macs, params = get_model_profile(net, input_shape=(5, 32), print_profile=False, as_string=False)
    assert flops == 2 * 5 * (32 * 64 + 64 * 10) and macs == flops / 2
    assert params == 32 * 64 + 64 + 64 * 10 + 10
    prof = FlopsProfiler(net)  # DeepSpeed's class, driven by hand
    prof.start_profile()
    net(torch.randn(5, 32))
    prof.stop_profile()
    assert prof.get_total_flops() == flops and prof.get_total_duration() > 0
    assert "Sequential.0" in prof.report(top_modules=2)
