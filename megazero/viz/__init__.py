"""L0, pure: pictures of pipeline schedules (never imports torch).

- `timeline`: the drawing's data model, built from a `simulate` result: one row per pipeline
  stage, compute blocks (F, B or B-input, W) with micro-batch and chunk, p2p spans, idle time,
  per-stage bubble and peak in-flight micro-batches. Every renderer reads only this;
- `svg`: one SVG file (legend, labelled blocks, wide with a viewBox);
- `html`: one self-contained HTML file (the SVG inline, hover details, no network fetches);
- `chrome`: a Chrome trace (Perfetto / chrome://tracing), one thread per stage;
- `text`: the character grid of `tools/visualize_schedule.py --format text`.

The SVG and the HTML embed the timeline as JSON (``id="schedule-data"``) and every block carries
data-* attributes, so what a picture shows can be read back and checked against the simulator.
Import the submodules directly.
"""
