"""A `Timeline` as one self-contained HTML file: the SVG inline, hover details, zoom; no network fetches.

All CSS and JS are inline. Hovering a block shows its stage, kind, micro-batch, chunk, start, end
and duration (read from its data-* attributes; the SVG's <title>s are the fallback without JS).
A table gives each stage's bubble and peak in-flight micro-batches. The `Timeline` is embedded as
JSON in ``<script type="application/json" id="schedule-data">``.
"""
from __future__ import annotations

from xml.sax.saxutils import escape

from megazero.viz.svg import svg_element
from megazero.viz.timeline import Timeline

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


def _table(timeline: Timeline) -> str:
    rows = "".join(f"<tr><td>{s.stage}</td><td>{s.busy:g}</td><td>{s.idle:g}</td><td>{s.bubble:.1%}</td>"
                   f"<td>{s.peak_inflight}</td><td>{s.peak_unfinished}</td></tr>" for s in timeline.stages)
    total = (f"<tr><th>all</th><td>{sum(s.busy for s in timeline.stages):g}</td>"
             f"<td>{sum(s.idle for s in timeline.stages):g}</td><td>{timeline.bubble:.1%}</td><td></td><td></td></tr>")
    return ("<table id='stages'><tr><th>stage</th><th>busy</th><th>idle</th><th>bubble</th>"
            "<th>peak in flight</th><th>peak unfinished</th></tr>" + rows + total + "</table>")


def render_html(timeline: Timeline) -> str:
    """The HTML file's text."""
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(timeline.title)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>{escape(timeline.summary())}</h1>",
        '<div class="controls"><button id="zoom-out">-</button><button id="zoom-in">+</button>'
        '<button id="zoom-fit">fit width</button><button id="zoom-1">1:1</button> '
        "hover a block for details</div>",
        f'<div id="scroll">{svg_element(timeline, embed_data=False)}</div>',
        '<div id="tip"></div>', _table(timeline),
        f'<script type="application/json" id="schedule-data">{timeline.to_json()}</script>',
        f"<script>{_JS}</script>", "</body></html>", ""])


__all__ = ["render_html"]
