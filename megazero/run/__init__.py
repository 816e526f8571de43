"""L4, running: the trainer CLI and loop, launch, and what a run reports.

- `train`: ``python -m megazero.run.train CONFIG [key=value ...]`` (under torchrun) and its loop;
- `launch`: reads torchrun / Slurm variables, initialises the default process group;
- `metrics`, `trace`, `memory`: what a run reports (`memory`'s meters are also the dry run's and the
  planner benchmark's, so that they measure what the trainer reports).

Checkpoints are in `megazero.checkpoint`, the long-run checks in `megazero.resilience`, the tools' back
ends in `megazero.toolbox`. Import the submodules directly; this file imports nothing.
"""
