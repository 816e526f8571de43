"""L0, pure: what can be computed without a process group (never imports torch).

- `config/`: the typed schema, YAML / dotlist / DeepSpeed-JSON loading, validation, `explain`;
- `topology`: the PP x DP x TP grid: rank <-> coordinates, the rank lists of each axis' groups;
- `spec`: `ModelSpec`, the architecture of a transformer LM, and spec files (pure data);
- `instructions`, `schedules`, `simulate`, `csv_schedule`: pipeline programs as data and the
  simulator that runs them together (bubble, peaks in flight, deadlocks);
- `partition`: layers -> pipeline stages;
- `flat_buffer`: ZeRO's shard and bucket index arithmetic.

Import the submodules directly; this file imports nothing.
"""
