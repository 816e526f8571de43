"""L0, pure: pictures of pipeline schedules (never imports torch). ``python -m megazero.viz``.

- `timeline`: the drawing's data model: one row per pipeline stage, compute blocks (F, B or B-input,
  W; loads, gradient reductions and optimizer steps when they take time) with micro-batch and chunk,
  p2p spans, idle time, per-stage bubble, peak in-flight micro-batches and their bytes. Every renderer
  reads only this (or a `compare.Comparison` of two);
- `sources`: where the times come from: planned (the simulator), predicted (a training config through
  the planner), the plan of a measured step (its programs at its measured costs);
- `measured`: a run's per-rank traces as one step on one time axis;
- `compare`: a plan above a measurement, per-stage bubbles and where they differ most;
- `svg`, `html`, `raster`: one SVG (legend, labelled blocks, a viewBox); one self-contained HTML (the
  SVG inline, hover details, zoom, no network fetches); PNG / PDF through matplotlib (an extra);
- `chrome`: a Chrome trace (Perfetto / chrome://tracing), one thread per stage;
- `text`: the character grid of ``--format text``;
- `cli`: the command line (also `tools/visualize_schedule.py`).

The SVG and the HTML embed the timeline as JSON (``id="schedule-data"``) and every block carries
data-* attributes, so what a picture shows can be read back and checked against the simulator.
Import the submodules directly.
"""
