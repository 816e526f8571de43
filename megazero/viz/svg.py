"""A `Timeline` as one SVG: a row per stage, labelled compute blocks, p2p bars, idle hatched, a legend.

Layout (pixels): the stage names on the left, per-stage bubble and peak in-flight micro-batches on
the right, a time axis below. The horizontal scale gives the shortest compute block `MIN_BLOCK_PX`
(unless the drawing would pass `MAX_WIDTH_PX`), so 16 stages x 64 micro-batches stay legible: the
SVG is wide and has a viewBox, so viewers zoom and scroll it. A block is labelled with its
micro-batch (and chunk, ``3c1``) only when the label fits; every block has a <title> (hover) and
data-* attributes (stage, kind, mb, chunk, start, end), and the whole `Timeline` is embedded as
JSON in ``<script type="application/json" id="schedule-data">``.
"""
from __future__ import annotations

from xml.sax.saxutils import escape

from megazero.viz.timeline import Block, Timeline, kinds_present

COLOURS = {"Forward": "#4e79a7", "Backward": "#e15759", "BackwardInput": "#f28e2b", "BackwardWeight": "#59a14f"}
TRANSFER_COLOUR = "#7f3c8d"
NAMES = {"Forward": "forward (F)", "Backward": "backward, full (B)", "BackwardInput": "backward, input grad (B)",
         "BackwardWeight": "backward, weight grad (W)"}
MIN_BLOCK_PX, MAX_WIDTH_PX = 24.0, 40000.0
ROW_H, ROW_GAP, LEFT, RIGHT, TOP, BOTTOM = 22, 6, 70, 230, 64, 36
CHAR_PX = 6.2  # width of one label character at font-size 10


def scale(timeline: Timeline) -> float:
    """Pixels per simulator time unit."""
    shortest = min((b.duration for b in timeline.blocks if b.duration > 0), default=1.0)
    px = MIN_BLOCK_PX / shortest
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
    return f"stage {b.stage}: {b.kind} micro-batch {b.mb}{chunk}{peer}, {b.start:g} -> {b.end:g} ({b.duration:g})"


def _y(stage: int) -> int:
    return TOP + stage * (ROW_H + ROW_GAP)


def _block(b: Block, px: float, chunks: int) -> str:
    x, w, y = LEFT + b.start * px, b.duration * px, _y(b.stage)
    rect = (f'<rect class="block" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_H}" fill="{fill(b, chunks)}" '
            f'stroke="#fff" stroke-width="0.5" {_data(b)}><title>{escape(hover(b))}</title></rect>')
    if w < CHAR_PX * len(b.label) + 2:
        return rect
    return rect + (f'<text class="label" x="{x + w / 2:.2f}" y="{y + ROW_H / 2 + 3.5}" text-anchor="middle">'
                   f'{escape(b.label)}</text>')


def _transfer(b: Block, px: float) -> str:
    x, w, y = LEFT + b.start * px, b.duration * px, _y(b.stage) + ROW_H - 5
    return (f'<rect class="transfer" x="{x:.2f}" y="{y}" width="{w:.2f}" height="5" fill="{TRANSFER_COLOUR}" '
            f'{_data(b)}><title>{escape(hover(b))}</title></rect>')


def _legend(timeline: Timeline) -> list[str]:
    items = [(COLOURS[k], NAMES[k]) for k in kinds_present(timeline.blocks)]
    if any(b.duration > 0 for b in timeline.transfers):
        items.append((TRANSFER_COLOUR, "p2p send / receive"))
    items.append(("url(#idle)", "idle (bubble)"))
    out, x = [], LEFT
    for colour, name in items:
        out.append(f'<rect x="{x}" y="30" width="14" height="14" fill="{colour}" stroke="#999" stroke-width="0.5"/>'
                   f'<text x="{x + 19}" y="41">{escape(name)}</text>')
        x += 30 + CHAR_PX * len(name)
    chunks = 1 + max((b.chunk for b in timeline.blocks), default=0)
    if chunks > 1:
        out.append(f'<text x="{x}" y="41">label: micro-batch, c = chunk (later chunks lighter)</text>')
    else:
        out.append(f'<text x="{x}" y="41">label: micro-batch</text>')
    return out


def _axis(timeline: Timeline, px: float, bottom: int) -> list[str]:
    step = 1.0
    while timeline.makespan / step > 40 or step * px < 40:
        step *= 2 if str(step)[0] in "15" else 2.5
    out, t = [f'<line x1="{LEFT}" y1="{bottom}" x2="{LEFT + timeline.makespan * px:.2f}" y2="{bottom}" stroke="#444"/>'], 0.0
    while t <= timeline.makespan + 1e-9:
        x = LEFT + t * px
        out.append(f'<line x1="{x:.2f}" y1="{bottom}" x2="{x:.2f}" y2="{bottom + 4}" stroke="#444"/>'
                   f'<text x="{x:.2f}" y="{bottom + 16}" text-anchor="middle">{t:g}</text>')
        t += step
    return out


def _title(timeline: Timeline) -> str:
    return f"{timeline.title}  makespan {timeline.makespan:g}  bubble {timeline.bubble:.1%} of the step"


def svg_element(timeline: Timeline, embed_data: bool = True) -> str:
    """The ``<svg>`` element (no XML declaration); `embed_data` adds the JSON ``schedule-data`` script."""
    px = scale(timeline)
    chunks = 1 + max((b.chunk for b in timeline.blocks), default=0)
    width = round(LEFT + timeline.makespan * px + RIGHT)
    bottom = _y(timeline.num_stages) - ROW_GAP + 8
    height = bottom + BOTTOM
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="schedule" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
             '<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
             '<line x1="0" y1="0" x2="0" y2="6" stroke="#cfcfcf" stroke-width="2"/></pattern>'
             '<style>.label{fill:#fff;pointer-events:none}</style></defs>',
             f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{escape(_title(timeline))}</text>']
    parts += _legend(timeline)
    for s in timeline.stages:
        y = _y(s.stage)
        parts.append(f'<text x="{LEFT - 8}" y="{y + ROW_H / 2 + 3.5}" text-anchor="end">stage {s.stage}</text>'
                     f'<rect class="idle" x="{LEFT}" y="{y}" width="{timeline.makespan * px:.2f}" height="{ROW_H}" '
                     f'fill="url(#idle)"/>'
                     f'<text class="stage-stats" x="{LEFT + timeline.makespan * px + 8:.2f}" y="{y + ROW_H / 2 + 3.5}" '
                     f'data-stage="{s.stage}" data-bubble="{s.bubble!r}" data-peak="{s.peak_inflight}">'
                     f'bubble {s.bubble:.1%}, peak in flight {s.peak_inflight}</text>')
    parts += [_block(b, px, chunks) for b in timeline.blocks]
    parts += [_transfer(b, px) for b in timeline.transfers if b.duration > 0]
    parts += _axis(timeline, px, bottom)
    if embed_data:
        parts.append(f'<script type="application/json" id="schedule-data">{timeline.to_json()}</script>')
    return "\n".join(parts + ["</svg>"])


def render_svg(timeline: Timeline) -> str:
    """A standalone SVG file's text."""
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + svg_element(timeline) + "\n"


__all__ = ["COLOURS", "render_svg", "scale", "svg_element"]
