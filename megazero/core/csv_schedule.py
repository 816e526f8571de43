"""The CSV format of a pipeline schedule (pure text <-> instructions; no torch).

One row per stage: the stage index, a comma, then that stage's actions separated by spaces, in
the short forms the instructions print as. Lines starting with ``#`` and blank lines are
ignored; a ``stage,actions`` header is optional; stages may come in any order but each of
0..p-1 exactly once. Example (1F1B, p=2, m=3)::

    stage,actions
    0,F0 F1 B0 F2 B1 B2
    1,F0 B0 F1 B1 F2 B2

Compute-only rows (``F3``, ``F3c1`` for chunk 1, ``B3``, ``W3``) are the usual form: the sends,
receives, loads and the final ReduceGrads, OptimizerStep are derived by
`schedules.build_programs`, which orders the blocking transfers so they cannot deadlock. A ``B3``
whose micro-batch chunk also has a ``W3`` on that stage is an input-grad-only backward (zero
bubble). Rows may instead spell out complete programs (``RA0<0 F0 SA0>2 ... Reduce Step``);
then every row must, and they are used as written. `schedules.from_csv` validates either kind
with the simulator.
"""
from __future__ import annotations

from typing import Sequence

from megazero.core.instructions import COMPUTE, Instruction, ScheduleError, parse_action, render, split_backwards

HEADER = "stage,actions"


def _parse_row(lineno: int, line: str) -> tuple[int, tuple[Instruction, ...]]:
    stage_text, sep, actions = line.partition(",")
    if not sep:
        raise ScheduleError(f"line {lineno}: expected 'stage,actions' (e.g. '0,F0 F1 B0 B1'), got {line!r}")
    try:
        stage = int(stage_text.strip())
    except ValueError:
        raise ScheduleError(f"line {lineno}: stage {stage_text.strip()!r} is not an integer") from None
    parsed = []
    for position, token in enumerate(actions.split()):
        try:
            parsed.append(parse_action(token))
        except ScheduleError as exc:
            raise ScheduleError(f"line {lineno} (stage {stage}), action {position}: {exc}") from None
    if not parsed:
        raise ScheduleError(f"line {lineno}: stage {stage} has no actions")
    return stage, split_backwards(parsed)


def parse_csv(text: str) -> tuple[tuple[tuple[Instruction, ...], ...], bool]:
    """Parse a CSV schedule into per-stage instruction rows (stage order) and whether they are
    explicit programs (True) or compute orders that still need communication (False)."""
    rows: dict[int, tuple[Instruction, ...]] = {}
    explicit_rows: dict[int, bool] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#") or line.replace(" ", "").lower() == HEADER:
            continue
        stage, actions = _parse_row(lineno, line)
        if stage in rows:
            raise ScheduleError(f"line {lineno}: stage {stage} appears twice")
        rows[stage] = actions
        explicit_rows[stage] = any(not isinstance(ins, COMPUTE) for ins in actions)
    if not rows:
        raise ScheduleError("the schedule has no stage rows (expected lines like '0,F0 F1 B0 B1')")
    p = len(rows)
    if sorted(rows) != list(range(p)):
        missing = sorted(set(range(max(rows) + 1)) - set(rows))
        raise ScheduleError(f"stages must be numbered 0..{p - 1} without gaps; missing stage {missing[0]}")
    explicit = set(explicit_rows.values())
    if len(explicit) > 1:
        full = sorted(s for s, e in explicit_rows.items() if e)
        raise ScheduleError(f"stage {full[0]} spells out sends/receives but other stages list only F/B/W; "
                            f"either every row is a complete program or none is")
    return tuple(rows[s] for s in range(p)), explicit.pop()


def to_csv(programs: Sequence[Sequence[Instruction]], compute_only: bool = True) -> str:
    """CSV text for `programs` (inverse of `parse_csv`); by default only the F/B/W actions, which
    `schedules.from_csv` completes into the same programs for schedules built by `build_programs`."""
    lines = [HEADER]
    for stage, program in enumerate(programs):
        actions = [ins for ins in program if isinstance(ins, COMPUTE)] if compute_only else list(program)
        lines.append(f"{stage},{render(actions)}")
    return "\n".join(lines) + "\n"
