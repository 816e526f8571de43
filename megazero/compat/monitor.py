"""DeepSpeed's monitors (`engine.monitor`): the engine's events, (name, value, global samples), written
by global rank 0 to TensorBoard (`log.tensorboard`, DeepSpeed's ``tensorboard`` section; needs the
`tensorboard` package: ``pip install megazero[monitor]``), CSV files (`log.csv_monitor`: one
``<output_path>/<job_name>/<name with _ for />.csv`` per event, header ``step,<last name part>``, as
DeepSpeed's) and Weights & Biases (`log.wandb`; needs `wandb`). The engines write
``Train/Samples/train_loss`` (the step's mean loss over its micro-batches on rank 0),
``Train/Samples/lr`` and, with fp16, ``Train/Samples/loss_scale`` once per step, which reads the
loss on the host: one synchronisation per step, only while a monitor is on. Local: no communication."""
from __future__ import annotations

import csv
import importlib.util
import os


def check_installed(log_cfg) -> None:
    """Refuse, before any process group exists, a monitor whose package is missing, naming the key."""
    for key, package, extra in (("tensorboard", "tensorboard", "megazero[monitor]"), ("wandb", "wandb", "wandb")):
        if getattr(log_cfg, key).enabled and importlib.util.find_spec(package) is None:
            raise ImportError(f"log.{key}.enabled (DeepSpeed: {key}.enabled): the {package!r} package is not "
                              f"installed; pip install {extra}, or turn it off")


class CsvMonitor:
    def __init__(self, section):
        self.log_dir = os.path.join(section.output_path, section.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.started: set[str] = set()

    def write_events(self, events) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+", newline="") as f:
                writer = csv.writer(f)
                if filename not in self.started:
                    self.started.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])


class TensorBoardMonitor:
    def __init__(self, section):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(section.output_path, section.job_name))

    def write_events(self, events) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()


class WandbMonitor:
    def __init__(self, section):
        import wandb

        self.wandb = wandb
        wandb.init(project=section.project, group=section.group, entity=section.team)

    def write_events(self, events) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)


class MonitorMaster:
    """Every enabled monitor of a `LogConfig`, on global rank 0 only (`rank`); DeepSpeed's class."""

    def __init__(self, log_cfg, rank: int):
        self.writers = []
        if rank == 0:
            for key, cls in (("tensorboard", TensorBoardMonitor), ("csv_monitor", CsvMonitor),
                             ("wandb", WandbMonitor)):
                if getattr(log_cfg, key).enabled:
                    self.writers.append(cls(getattr(log_cfg, key)))
        self.enabled = any(getattr(log_cfg, k).enabled for k in ("tensorboard", "csv_monitor", "wandb"))

    def write_events(self, events) -> None:
        for w in self.writers:
            w.write_events(events)
