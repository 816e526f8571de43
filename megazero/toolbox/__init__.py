"""L4, the tools' back ends (the command lines in tools/ are thin over these).

- `plan` (tools/plan.py): memory and step-time predictions, ``--search``, ``--calibrate``;
  `model_facts`: what each rank of a TP x PP layout holds, from the meta-device build;
- `calibrate` (plan.py --calibrate): this machine measured into a hardware file; `step_probe`: its
  probes of megazero's own step; `probe_timing`: how the probes time;
- `dry_run` (tools/dry_run.py): one step of any layout on the meta device, recorded and compared;
- `parity` and `parity_matrix` (tools/check_parity.py): layouts trained against the single-process run,
  and the generated matrix of them.

Import the submodules directly; this file imports nothing.
"""
