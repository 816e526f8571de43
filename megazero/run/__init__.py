"""L4, running: the trainer CLI and loop, launch, checkpoints, metrics, traces, memory reports.

- `train`: ``python -m megazero.run.train CONFIG [key=value ...]`` (under torchrun) and its loop;
- `launch`: reads torchrun / Slurm variables, initialises the default process group;
- `checkpoint`: save and load (reshardable) checkpoints;
- `metrics`, `trace`, `memory`: what a run reports;
- `model_facts`: what each rank of a TP x PP layout holds, from the meta-device build (for the planner).

Import the submodules directly; this file imports nothing.
"""
