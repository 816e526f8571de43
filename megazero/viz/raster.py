"""A `Timeline` or a `Comparison` as PNG or PDF, drawn with matplotlib (``pip install megazero[viz]``).

The same picture as the SVG: rows per stage (plan above run in a comparison), blocks coloured by kind
and lighter per chunk, labelled when the label fits, p2p bars along the bottom of a row, idle time
hatched, per-row bubble and peak in flight on the right, a legend and a time axis. The figure grows
with the step (`svg.scale`'s pixels per time unit), up to `MAX_INCHES` wide; past that, labels that
no longer fit are left out, and the SVG or HTML (zoomable) is the better format.
"""
from __future__ import annotations

from megazero.viz.compare import Comparison
from megazero.viz.svg import COLOURS, NAMES, TRANSFER_COLOUR, fill, lanes, scale, stats, title
from megazero.viz.timeline import kinds_present

DPI = 100
MAX_INCHES = 60.0
ROW = 0.32  # inches per row


class MissingExtra(RuntimeError):
    """matplotlib is not installed (the `viz` extra)."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise MissingExtra("PNG and PDF need matplotlib: pip install 'megazero[viz]' "
                          "(or write FILE.svg / FILE.html, which need nothing)") from None
    return Figure, FigureCanvasAgg, Patch


def render_raster(picture, path: str) -> None:
    """Write `picture` (a `Timeline` or a `Comparison`) to `path` (.png or .pdf)."""
    Figure, FigureCanvasAgg, Patch = _matplotlib()  # no pyplot: no global backend or figure registry
    rows = lanes(picture)
    compare = len(rows) > 1
    stages = rows[0][1].num_stages
    makespan = max(t.makespan for _, t in rows) or 1.0
    px = min(scale(t) for _, t in rows)
    width = min(MAX_INCHES, max(8.0, makespan * px / DPI + 3.5))
    height = 1.6 + ROW * stages * len(rows) * 1.25
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    chunks = 1 + max((b.chunk for _, t in rows for b in t.blocks), default=0)
    per_inch = makespan / max(width - 3.5, 1.0)  # time units per inch of plot
    ticks, names = [], []
    for lane, (tag, tl) in enumerate(rows):
        for st in tl.stages:
            y = -(st.stage * len(rows) + lane) - (0.35 * st.stage if compare else 0)
            ticks.append(y + 0.4)
            names.append(f"stage {st.stage}" + (f" {tag}" if tag else ""))
            ax.broken_barh([(0, tl.makespan)], (y, 0.8), facecolor="#f4f4f4", hatch="///", edgecolor="#cfcfcf",
                           linewidth=0)
            ax.text(makespan * 1.01, y + 0.4, stats(st), va="center", fontsize=7)
        for b in tl.blocks:
            y = -(b.stage * len(rows) + lane) - (0.35 * b.stage if compare else 0)
            ax.broken_barh([(b.start, b.duration)], (y, 0.8), facecolor=fill(b, chunks), edgecolor="white",
                           linewidth=0.3)
            if b.duration / per_inch > 0.075 * len(b.label) + 0.04:  # about 7 pt characters
                ax.text(b.start + b.duration / 2, y + 0.4, b.label, ha="center", va="center", fontsize=6,
                        color="white")
        for b in tl.transfers:
            if b.duration > 0:
                y = -(b.stage * len(rows) + lane) - (0.35 * b.stage if compare else 0)
                ax.broken_barh([(b.start, b.duration)], (y, 0.18), facecolor=TRANSFER_COLOUR, linewidth=0)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xlim(0, makespan * 1.0)
    ax.set_xlabel(rows[-1][1].unit or "time units", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    blocks = [b for _, t in rows for b in t.blocks]
    handles = [Patch(facecolor=COLOURS[k], label=NAMES[k]) for k in kinds_present(blocks)]
    if any(b.duration > 0 for _, t in rows for b in t.transfers):
        handles.append(Patch(facecolor=TRANSFER_COLOUR, label="p2p send / receive"))
    handles.append(Patch(facecolor="#f4f4f4", hatch="///", edgecolor="#cfcfcf", label="idle (bubble)"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=min(len(handles), 5), fontsize=7,
              frameon=False)
    heading = title(picture)
    if isinstance(picture, Comparison):
        heading += "\n" + picture.differs_most()
    fig.suptitle(heading, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 0.97, 1))
    fig.savefig(path)


__all__ = ["MissingExtra", "render_raster"]
