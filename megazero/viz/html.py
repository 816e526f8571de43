"""A `Timeline` as one self-contained HTML file: the SVG inline, hover details, zoom; no network fetches.

All CSS and JS are inline. Hovering a block shows its stage, kind, micro-batch, chunk, start, end
and duration (read from its data-* attributes; the SVG's <title>s are the fallback without JS).
A table gives each stage's bubble and peak in-flight micro-batches (for a `Comparison`: both bubbles,
their difference and where the two differ most). The `Timeline` (or the `Comparison`) is embedded as
JSON in ``<script type="application/json" id="schedule-data">``.
"""
from __future__ import annotations

from xml.sax.saxutils import escape

from megazero.viz.compare import Comparison
from megazero.viz.svg import svg_element, title
from megazero.viz.timeline import Timeline, format_bytes

_CSS = """
body{font-family:sans-serif;margin:16px;color:#222}
h1{font-size:16px;margin:0 0 6px}
.controls{margin:8px 0}
.controls button{margin-right:4px}
#scroll{overflow:auto;border:1px solid #ddd;max-height:80vh}
#tip{position:fixed;display:none;background:#222;color:#fff;padding:4px 8px;border-radius:3px;
     font-size:12px;pointer-events:none;white-space:nowrap;z-index:10}
table{border-collapse:collapse;margin-top:10px;font-size:12px}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
rect.block:hover,rect.transfer:hover{stroke:#000;stroke-width:1.5}
"""

_JS = """
(function(){
  var svg=document.querySelector('svg.schedule'), tip=document.getElementById('tip');
  var w0=svg.width.baseVal.value, h0=svg.height.baseVal.value, zoom=1;
  svg.querySelectorAll('rect.block>title,rect.transfer>title').forEach(function(t){
    t.parentNode.setAttribute('data-title', t.textContent); t.remove();});
  svg.addEventListener('mousemove', function(e){
    var r=e.target.closest('rect.block,rect.transfer');
    if(!r){tip.style.display='none';return;}
    tip.textContent=r.getAttribute('data-title');
    tip.style.left=(e.clientX+12)+'px'; tip.style.top=(e.clientY+12)+'px'; tip.style.display='block';});
  svg.addEventListener('mouseleave', function(){tip.style.display='none';});
  function set(z){zoom=z; svg.setAttribute('width', w0*z); svg.setAttribute('height', h0*z);}
  document.getElementById('zoom-in').onclick=function(){set(zoom*1.25);};
  document.getElementById('zoom-out').onclick=function(){set(zoom/1.25);};
  document.getElementById('zoom-fit').onclick=function(){
    set(document.getElementById('scroll').clientWidth/w0);};
  document.getElementById('zoom-1').onclick=function(){set(1);};
})();
"""


def _bytes(nbytes: int | None) -> str:
    return f" ({format_bytes(nbytes)})" if nbytes is not None else ""


def _compare_table(c: Comparison) -> str:
    a, b = c.plan.source, c.run.source
    rows = "".join(f"<tr><td>{d.stage}</td><td>{d.plan_bubble:.1%}</td><td>{d.run_bubble:.1%}</td>"
                   f"<td>{d.difference:+.1%}</td><td>{pa.peak_inflight}</td><td>{pb.peak_inflight}</td></tr>"
                   for d, pa, pb in zip(c.stages, c.plan.stages, c.run.stages))
    total = (f"<tr><th>all</th><td>{c.plan.bubble:.1%}</td><td>{c.run.bubble:.1%}</td>"
             f"<td>{c.run.bubble - c.plan.bubble:+.1%}</td><td></td><td></td></tr>")
    return (f"<table id='stages'><tr><th>stage</th><th>bubble {a}</th><th>bubble {b}</th><th>difference</th>"
            f"<th>peak in flight {a}</th><th>peak in flight {b}</th></tr>" + rows + total + "</table>"
            f"<p id='differs-most'>{escape(c.differs_most())}</p>")


def _table(timeline: Timeline) -> str:
    rows = "".join(f"<tr><td>{s.stage}</td><td>{s.busy:.6g}</td><td>{s.idle:.6g}</td><td>{s.bubble:.1%}</td>"
                   f"<td>{s.peak_inflight}{_bytes(s.peak_bytes)}</td><td>{s.peak_unfinished}</td></tr>"
                   for s in timeline.stages)
    total = (f"<tr><th>all</th><td>{sum(s.busy for s in timeline.stages):.6g}</td>"
             f"<td>{sum(s.idle for s in timeline.stages):.6g}</td><td>{timeline.bubble:.1%}</td><td></td><td></td></tr>")
    return ("<table id='stages'><tr><th>stage</th><th>busy</th><th>idle</th><th>bubble</th>"
            "<th>peak in flight</th><th>peak unfinished</th></tr>" + rows + total + "</table>")


def render_html(picture) -> str:
    """The HTML file's text, of a `Timeline` or a `Comparison`."""
    compare = isinstance(picture, Comparison)
    heading = title(picture) if compare else picture.summary()
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(picture.title)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>{escape(heading)}</h1>",
        '<div class="controls"><button id="zoom-out">-</button><button id="zoom-in">+</button>'
        '<button id="zoom-fit">fit width</button><button id="zoom-1">1:1</button> '
        "hover a block for details</div>",
        f'<div id="scroll">{svg_element(picture, embed_data=False)}</div>',
        '<div id="tip"></div>', _compare_table(picture) if compare else _table(picture),
        f'<script type="application/json" id="schedule-data">{picture.to_json()}</script>',
        f"<script>{_JS}</script>", "</body></html>", ""])


__all__ = ["render_html"]
