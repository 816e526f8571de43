"""A `Timeline` (or a `Comparison`) as one SVG: a row per stage, labelled compute blocks, p2p bars,
idle hatched, a legend. A `Comparison` draws two rows per stage, the plan's above the run's, on one
time axis, and says where they differ most under the legend.

Layout (pixels): the stage names on the left, per-stage bubble and peak in-flight micro-batches (and
their activation bytes when known) on the right, a time axis below. The horizontal scale gives the shortest compute block `MIN_BLOCK_PX`
(unless the drawing would pass `MAX_WIDTH_PX`), so 16 stages x 64 micro-batches stay legible: the
SVG is wide and has a viewBox, so viewers zoom and scroll it. A block is labelled with its
micro-batch (and chunk, ``3c1``) only when the label fits; every block has a <title> (hover) and
data-* attributes (stage, kind, mb, chunk, start, end; lane 0 = plan, 1 = run in a comparison), and the
whole `Timeline` (or `Comparison.to_dict`) is embedded as JSON in ``<script type="application/json" id="schedule-data">``.
"""
from __future__ import annotations

import math
from xml.sax.saxutils import escape

from megazero.viz.compare import Comparison
from megazero.viz.timeline import Block, StageSummary, Timeline, format_bytes, kinds_present

COLOURS = {"Forward": "#4e79a7", "Backward": "#e15759", "BackwardInput": "#f28e2b", "BackwardWeight": "#59a14f",
           "LoadMicroBatch": "#bab0ac", "ReduceGrads": "#9c755f", "OptimizerStep": "#76b7b2"}
TRANSFER_COLOUR = "#7f3c8d"
NAMES = {"Forward": "forward (F)", "Backward": "backward, full (B)", "BackwardInput": "backward, input grad (B)",
         "BackwardWeight": "backward, weight grad (W)", "LoadMicroBatch": "load micro-batch",
         "ReduceGrads": "gradient reduction (R)", "OptimizerStep": "optimizer step (O)"}
MIN_BLOCK_PX, MAX_WIDTH_PX = 24.0, 40000.0
ROW_H, ROW_GAP, GROUP_GAP, LEFT, RIGHT, TOP, BOTTOM = 22, 6, 10, 70, 230, 64, 36
CHAR_PX = 6.2  # width of one label character at font-size 10


def scale(timeline: Timeline) -> float:
    """Pixels per time unit: the shortest F, B or W block gets `MIN_BLOCK_PX`, or room for the longest
    label (``63c1``), unless the drawing would pass `MAX_WIDTH_PX`."""
    compute = [b for b in timeline.blocks if b.duration > 0 and b.mb >= 0 and b.kind != "LoadMicroBatch"]
    shortest = min((b.duration for b in compute), default=1.0)
    longest = max((len(b.label) for b in compute), default=1)
    px = max(MIN_BLOCK_PX, CHAR_PX * longest + 4) / shortest
    return min(px, MAX_WIDTH_PX / timeline.makespan) if timeline.makespan else px


def _lighter(colour: str, amount: float) -> str:
    """`colour` mixed with white by `amount` in [0, 1] (later chunks are lighter)."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def fill(block: Block, chunks: int) -> str:
    base = COLOURS.get(block.kind, TRANSFER_COLOUR)
    return _lighter(base, 0.45 * block.chunk / (chunks - 1)) if chunks > 1 else base


def _data(b: Block) -> str:
    attrs = {"stage": b.stage, "kind": b.kind, "mb": b.mb, "chunk": b.chunk, "start": repr(b.start), "end": repr(b.end)}
    if b.peer is not None:
        attrs["peer"] = b.peer
    return " ".join(f'data-{k}="{v}"' for k, v in attrs.items())


def hover(b: Block) -> str:
    """The hover text of a block."""
    chunk = f" chunk {b.chunk}" if b.chunk else ""
    peer = f" {'to' if b.kind.startswith('Send') else 'from'} stage {b.peer}" if b.peer is not None else ""
    what = f"{b.kind} micro-batch {b.mb}{chunk}{peer}" if b.mb >= 0 else b.kind
    return f"stage {b.stage}: {what}, {b.start:.6g} -> {b.end:.6g} ({b.duration:.4g})"


def lanes(picture) -> list[tuple[str, Timeline]]:
    """The timelines a picture draws, each with its row tag: one untagged row per stage for a
    `Timeline`; for a `Comparison` the plan's row above the run's, per stage."""
    if isinstance(picture, Comparison):
        return [(picture.plan.source, picture.plan), (picture.run.source, picture.run)]
    return [("", picture)]


class _Frame:
    """Where rows and times go: row (stage, lane) -> y, time -> x."""

    def __init__(self, picture):
        self.lanes = lanes(picture)
        self.compare = len(self.lanes) > 1
        self.left = LEFT + (70 if self.compare else 0)
        self.top = TOP + (18 if self.compare else 0)
        self.num_stages = self.lanes[0][1].num_stages
        self.makespan = max(t.makespan for _, t in self.lanes)
        self.px = min(scale(t) for _, t in self.lanes)
        if self.makespan:
            self.px = min(self.px, MAX_WIDTH_PX / self.makespan)
        self.chunks = 1 + max((b.chunk for _, t in self.lanes for b in t.blocks), default=0)

    def y(self, stage: int, lane: int = 0) -> float:
        row = stage * len(self.lanes) + lane
        return self.top + row * (ROW_H + ROW_GAP) + stage * (GROUP_GAP if self.compare else 0)

    def x(self, t: float) -> float:
        return self.left + t * self.px

    @property
    def bottom(self) -> float:
        return self.y(self.num_stages) - ROW_GAP - (GROUP_GAP if self.compare else 0) + 8


def _block(b: Block, fr: _Frame, lane: int) -> str:
    x, w, y = fr.x(b.start), b.duration * fr.px, fr.y(b.stage, lane)
    tag = f' data-lane="{lane}"' if fr.compare else ""
    rect = (f'<rect class="block" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_H}" fill="{fill(b, fr.chunks)}" '
            f'stroke="#fff" stroke-width="0.5" {_data(b)}{tag}><title>{escape(hover(b))}</title></rect>')
    if w < CHAR_PX * len(b.label) + 2:
        return rect
    return rect + (f'<text class="label" x="{x + w / 2:.2f}" y="{y + ROW_H / 2 + 3.5}" text-anchor="middle">'
                   f'{escape(b.label)}</text>')


def _transfer(b: Block, fr: _Frame, lane: int) -> str:
    x, w, y = fr.x(b.start), b.duration * fr.px, fr.y(b.stage, lane) + ROW_H - 5
    tag = f' data-lane="{lane}"' if fr.compare else ""
    return (f'<rect class="transfer" x="{x:.2f}" y="{y}" width="{w:.2f}" height="5" fill="{TRANSFER_COLOUR}" '
            f'{_data(b)}{tag}><title>{escape(hover(b))}</title></rect>')


def _legend(fr: _Frame) -> tuple[list[str], float]:
    """The legend's elements and the x where it ends."""
    blocks = [b for _, t in fr.lanes for b in t.blocks]
    items = [(COLOURS[k], NAMES[k]) for k in kinds_present(blocks)]
    if any(b.duration > 0 for _, t in fr.lanes for b in t.transfers):
        measured = any(t.source == "measured" for _, t in fr.lanes)
        items.append((TRANSFER_COLOUR, "p2p send / receive" + (" (measured: mostly waiting)" if measured else "")))
    items.append(("url(#idle)", "idle (bubble)"))
    out, x = [], LEFT
    for colour, name in items:
        out.append(f'<rect x="{x}" y="30" width="14" height="14" fill="{colour}" stroke="#999" stroke-width="0.5"/>'
                   f'<text x="{x + 19}" y="41">{escape(name)}</text>')
        x += 30 + CHAR_PX * len(name)
    note = "label: micro-batch, c = chunk (later chunks lighter)" if fr.chunks > 1 else "label: micro-batch"
    out.append(f'<text x="{x}" y="41">{note}</text>')
    return out, x + CHAR_PX * len(note)


def _axis(fr: _Frame) -> list[str]:
    bottom, makespan = fr.bottom, fr.makespan
    step = 10.0 ** math.floor(math.log10(makespan / 40)) if makespan > 0 else 1.0
    while makespan / step > 40 or step * fr.px < 40:
        step *= 2.5 if str(step).lstrip("0.")[0] == "2" else 2
    out = [f'<line x1="{fr.left}" y1="{bottom}" x2="{fr.x(makespan):.2f}" y2="{bottom}" stroke="#444"/>']
    i = 0
    while i * step <= makespan + 1e-9:
        t = i * step
        out.append(f'<line x1="{fr.x(t):.2f}" y1="{bottom}" x2="{fr.x(t):.2f}" y2="{bottom + 4}" stroke="#444"/>'
                   f'<text x="{fr.x(t):.2f}" y="{bottom + 16}" text-anchor="middle">{t:.6g}</text>')
        i += 1
    unit = fr.lanes[-1][1].unit or "time units"
    out.append(f'<text x="{fr.x(makespan) + 8:.2f}" y="{bottom + 16}">{escape(unit)}</text>')
    return out


def stats(st: StageSummary) -> str:
    """The text right of a row: bubble and peak in flight (with its bytes when known)."""
    peak = f"{st.peak_inflight}" + (f" ({format_bytes(st.peak_bytes)})" if st.peak_bytes is not None else "")
    return f"bubble {st.bubble:.1%}, peak in flight {peak}"


def title(picture) -> str:
    """The picture's first line."""
    if isinstance(picture, Comparison):
        unit = picture.run.unit and " " + picture.run.unit
        return (f"{picture.title}  makespan {picture.plan.makespan:.4g}{unit} {picture.plan.source}, "
                f"{picture.run.makespan:.4g}{unit} measured  bubble {picture.plan.bubble:.1%} / {picture.run.bubble:.1%}")
    unit = picture.unit and " " + picture.unit
    return f"{picture.heading}  makespan {picture.makespan:.6g}{unit}  bubble {picture.bubble:.1%} of the step"


def svg_element(picture, embed_data: bool = True) -> str:
    """The ``<svg>`` element (no XML declaration) of a `Timeline` or a `Comparison`; `embed_data`
    adds the JSON ``schedule-data`` script."""
    fr = _Frame(picture)
    legend, legend_end = _legend(fr)
    heading = title(picture)
    differs = picture.differs_most() if isinstance(picture, Comparison) else ""
    width = round(max(fr.x(fr.makespan) + RIGHT + (40 if any(s.peak_bytes for _, t in fr.lanes for s in t.stages) else 0),
                      legend_end + 10, LEFT + 7.8 * len(heading) + 10, LEFT + CHAR_PX * len(differs) + 10))
    height = round(fr.bottom + BOTTOM)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="schedule" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
             '<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
             '<line x1="0" y1="0" x2="0" y2="6" stroke="#cfcfcf" stroke-width="2"/></pattern>'
             '<style>.label{fill:#fff;pointer-events:none}</style></defs>',
             f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{escape(heading)}</text>']
    parts += legend
    if differs:
        parts.append(f'<text class="differs-most" x="{LEFT}" y="62">{escape(differs)}</text>')
    for lane, (tag, tl) in enumerate(fr.lanes):
        for st in tl.stages:
            y = fr.y(st.stage, lane)
            name = f"stage {st.stage}" + (f" {tag}" if tag else "")
            parts.append(f'<text x="{fr.left - 8}" y="{y + ROW_H / 2 + 3.5}" text-anchor="end">{escape(name)}</text>'
                         f'<rect class="idle" x="{fr.left}" y="{y}" width="{tl.makespan * fr.px:.2f}" '
                         f'height="{ROW_H}" fill="url(#idle)"/>'
                         f'<text class="stage-stats" x="{fr.x(fr.makespan) + 8:.2f}" y="{y + ROW_H / 2 + 3.5}" '
                         f'data-stage="{st.stage}" data-lane="{lane}" data-bubble="{st.bubble!r}" '
                         f'data-peak="{st.peak_inflight}">{escape(stats(st))}</text>')
    for lane, (_, tl) in enumerate(fr.lanes):
        parts += [_block(b, fr, lane) for b in tl.blocks]
        parts += [_transfer(b, fr, lane) for b in tl.transfers if b.duration > 0]
    parts += _axis(fr)
    if embed_data:
        parts.append(f'<script type="application/json" id="schedule-data">{picture.to_json()}</script>')
    return "\n".join(parts + ["</svg>"])


def render_svg(picture) -> str:
    """A standalone SVG file's text (a `Timeline` or a `Comparison`)."""
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + svg_element(picture) + "\n"


__all__ = ["COLOURS", "lanes", "render_svg", "scale", "stats", "svg_element", "title"]
