"""megazero.viz and tools/visualize_schedule.py: what the pictures show is what the simulator measured.

For each schedule and several (P, M, v), the blocks and bubbles are read back out of the SVG and the
HTML (their embedded JSON and each block's data-* attributes) and compared with `simulate`'s spans,
idle time and peaks; the Chrome trace has one X event per compute block; the command line prints one
line on stderr and exits 2 on bad input. Pure and fast (no torch, no processes, no browser).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from megazero.core.instructions import COMPUTE
from megazero.core.schedules import get_schedule
from megazero.core.simulate import Costs, simulate
from megazero.viz import svg as svg_mod
from megazero.viz.chrome import chrome_trace
from megazero.viz.html import render_html
from megazero.viz.svg import render_svg
from megazero.viz.text import render_text
from megazero.viz.timeline import from_simulation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = "{http://www.w3.org/2000/svg}"

CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for p in (2, 4) for m in (4, 8)]
CASES += [("interleaved", p, m, 2) for p in (2, 4) for m in (4, 8)] + [("interleaved", 2, 4, 3)]
COSTS = [None, Costs(1.0, 2.0, 1.0, 0.25)]


def _tool():
    spec = importlib.util.spec_from_file_location("visualize_schedule", os.path.join(ROOT, "tools", "visualize_schedule.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _simulated(name, p, m, v, costs):
    result = simulate(get_schedule(name, p, m, v, costs), costs)
    return result, from_simulation(result, f"{name}: p={p} m={m} v={v}")


def _expected_blocks(result):
    return [(s, type(sp.instr).__name__, sp.instr.mb, sp.instr.chunk, sp.start, sp.end)
            for s, spans in enumerate(result.timeline) for sp in spans if isinstance(sp.instr, COMPUTE)]


def _from_data(data):
    return [(b["stage"], b["kind"], b["mb"], b["chunk"], b["start"], b["end"]) for b in data["blocks"]]


def _from_attrs(attrs):
    return [(int(a["data-stage"]), a["data-kind"], int(a["data-mb"]), int(a["data-chunk"]),
             float(a["data-start"]), float(a["data-end"])) for a in attrs]


def _check_data(data, result):
    assert _from_data(data) == _expected_blocks(result)
    assert data["num_stages"] == result.num_stages and data["makespan"] == result.makespan
    assert data["bubble"] == result.bubble_fraction
    assert [s["bubble"] for s in data["stages"]] == [i / result.makespan for i in result.idle]
    assert [s["peak_inflight"] for s in data["stages"]] == list(result.peak_inflight)
    assert [s["peak_unfinished"] for s in data["stages"]] == list(result.peak_unfinished)
    assert len(data["transfers"]) == sum(1 for spans in result.timeline for sp in spans if hasattr(sp.instr, "peer"))


class _Collect(HTMLParser):
    """The block rects' attributes and the schedule-data JSON of an HTML page."""

    def __init__(self):
        super().__init__()
        self.blocks, self.data, self._in_data = [], None, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "rect" and attrs.get("class") == "block":
            self.blocks.append(attrs)
        self._in_data = tag == "script" and attrs.get("id") == "schedule-data"

    def handle_data(self, text):
        if self._in_data:
            self.data = json.loads(text)
            self._in_data = False


@pytest.mark.parametrize("costs", COSTS, ids=["unit", "1-2-1-p2p"])
@pytest.mark.parametrize("name,p,m,v", CASES, ids=lambda x: str(x))
def test_svg_shows_the_simulated_blocks_and_bubbles(name, p, m, v, costs):
    result, timeline = _simulated(name, p, m, v, costs)
    root = ET.fromstring(render_svg(timeline).split("\n", 1)[1])
    assert root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"
    data = json.loads(root.find(f".//{NS}script[@id='schedule-data']").text)
    _check_data(data, result)
    assert _from_attrs([r.attrib for r in root.iter(f"{NS}rect") if r.get("class") == "block"]) == _expected_blocks(result)
    stats = [t for t in root.iter(f"{NS}text") if t.get("class") == "stage-stats"]
    assert [float(t.get("data-bubble")) for t in stats] == [i / result.makespan for i in result.idle]
    assert [t.text for t in stats] == [f"bubble {i / result.makespan:.1%}, peak in flight {k}"
                                       for i, k in zip(result.idle, result.peak_inflight, strict=True)]
    titles = root.findall(f".//{NS}rect[@class='block']/{NS}title")
    assert len(titles) == len(data["blocks"]) and all("micro-batch" in t.text for t in titles)
    transfers = [r for r in root.iter(f"{NS}rect") if r.get("class") == "transfer"]
    assert len(transfers) == (0 if costs is None else len(data["transfers"]))  # p2p drawn when it takes time


@pytest.mark.parametrize("name,p,m,v", CASES, ids=lambda x: str(x))
def test_html_is_self_contained_and_shows_the_simulated_blocks(name, p, m, v):
    result, timeline = _simulated(name, p, m, v, None)
    page = render_html(timeline)
    collect = _Collect()
    collect.feed(page)
    _check_data(collect.data, result)
    assert _from_attrs(collect.blocks) == _expected_blocks(result)
    assert f"<td>{result.bubble_fraction:.1%}</td>" in page  # the total bubble as printed
    assert page.count('id="schedule-data"') == 1
    for fetch in ("http://", "https://", "src=", "<link", "@import"):  # no network fetches
        assert fetch not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


@pytest.mark.parametrize("costs", COSTS, ids=["unit", "1-2-1-p2p"])
@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1), ("interleaved", 4, 8, 2)])
def test_chrome_trace_has_one_x_event_per_compute_block(name, p, m, v, costs):
    result, timeline = _simulated(name, p, m, v, costs)
    trace = json.loads(json.dumps(chrome_trace(timeline)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in xs if e["cat"] == "compute"]
    assert [(e["tid"], e["args"]["kind"], e["args"]["mb"], e["args"]["chunk"], e["args"]["start"], e["args"]["end"])
            for e in compute] == _expected_blocks(result)
    assert all(e["ts"] == e["args"]["start"] * 1000 and e["dur"] == pytest.approx((e["args"]["end"] - e["args"]["start"]) * 1000)
               for e in compute)
    if costs is None:
        assert len(xs) == len(compute)
    assert {e["tid"] for e in xs} == set(range(p))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {s: f"stage {s}" for s in range(p)}


def test_labels_only_where_they_fit_at_16_stages_64_microbatches():
    result, timeline = _simulated("interleaved", 16, 64, 2, None)
    root = ET.fromstring(render_svg(timeline).split("\n", 1)[1])
    rects = [r for r in root.iter(f"{NS}rect") if r.get("class") == "block"]
    assert len(rects) == 16 * 64 * 2 * 2
    labels = [t for t in root.iter(f"{NS}text") if t.get("class") == "label"]
    assert 0 < len(labels) <= len(rects)
    shortest = min(float(r.get("width")) for r in rects)
    assert shortest >= svg_mod.MIN_BLOCK_PX - 0.01
    children = list(root)
    for i, child in enumerate(children):  # a label follows its block and fits inside it
        if child.get("class") == "label":
            rect = children[i - 1]
            assert rect.get("class") == "block"
            assert len(child.text) * svg_mod.CHAR_PX + 2 <= float(rect.get("width"))
            assert child.text == (f"{rect.get('data-mb')}c{rect.get('data-chunk')}" if rect.get("data-chunk") != "0"
                                  else rect.get("data-mb"))
    assert float(root.get("width")) > 16 * 64  # wide; viewers zoom with the viewBox


def test_text_grid_is_todays():
    _, timeline = _simulated("1f1b", 4, 8, 1, None)
    assert render_text(timeline).split("\n")[:5] == [
        "1f1b: p=4 m=8 v=1  makespan 33  bubble 27.3% of the step  peak in-flight micro-batches per stage [4, 3, 2, 1]",
        "stage 0 0123......AA4BB5CC6DD7EE.FF.GG.HH",
        "stage 1 .012....AA3BB4CC5DD6EE7FF.GG.HH..",
        "stage 2 ..01..AA2BB3CC4DD5EE6FF7GG.HH....",
        "stage 3 ...0AA1BB2CC3DD4EE5FF6GG7HH......",
    ]


def test_cli_writes_svg_html_and_chrome_trace(tmp_path, capsys):
    tool = _tool()
    svg, page, trace = tmp_path / "s.svg", tmp_path / "s.html", tmp_path / "t.json"
    assert tool.main(["--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--costs", "1,1,1,0.1",
                      "--out", str(svg), "--chrome-trace", str(trace)]) == 0
    assert tool.main(["--schedule", "interleaved", "-p", "2", "-m", "4", "--chunks", "2", "--out", str(page),
                      "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {svg}" in out and f"wrote {trace}" in out and "stage 1 " in out  # --format text with --out
    result = simulate(get_schedule("zb-h1", 4, 8, 1, Costs(p2p=0.1)), Costs(p2p=0.1))
    data = json.loads(ET.parse(svg).getroot().find(f".//{NS}script[@id='schedule-data']").text)
    _check_data(data, result)
    assert sum(e.get("cat") == "compute" for e in json.loads(trace.read_text())["traceEvents"]) == len(data["blocks"])
    collect = _Collect()
    collect.feed(page.read_text())
    _check_data(collect.data, simulate(get_schedule("interleaved", 2, 4, 2)))


def test_cli_keeps_the_positional_schedule(capsys):
    assert _tool().main(["gpipe", "-p", "3", "-m", "5"]) == 0
    assert capsys.readouterr().out.split("\n")[1] == "stage 0 01234......AABBCCDDEE"


@pytest.mark.parametrize("argv,words", [
    (["--schedule", "1f1bb"], "unknown pipeline schedule '1f1bb'"),
    (["--schedule", "interleaved", "-p", "4", "-m", "2", "-v", "2"], "m=2 < p=4"),
    (["--schedule", "interleaved", "-p", "4", "-m", "6", "-v", "2"], "multiple of num_stages"),
    (["--schedule", "gpipe", "-v", "2"], "only applies to the 'interleaved' schedule"),
    (["--costs", "1,x,1"], "expected numbers F,B,W[,P2P]"),
    (["--costs", "1,1"], "expected 3 or 4 numbers"),
    (["--costs", "0,1,1"], "F and B must be > 0"),
    (["--costs", "1,1,1,-1"], "W and P2P >= 0"),
    (["--out", "x.gif"], "must be FILE.svg, FILE.html, FILE.png or FILE.pdf"),
    (["1f1b", "--schedule", "gpipe"], "two schedules given"),
    (["--schedule", "missing.csv", "-p", "2", "-m", "2"], "cannot read pipeline schedule file 'missing.csv'"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert _tool().main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("visualize_schedule: ") and words in lines[0], captured.err


def test_cli_keeps_the_measured_grid(tmp_path, capsys):
    for rank, events in enumerate([[("F0", 0, 10), ("B0", 30, 20)], [("F0", 10, 10), ("B0", 20, 10)]]):
        trace = {"traceEvents": [{"name": n, "ph": "X", "ts": ts, "dur": dur, "args": {"step": 1, "mb": 0}}
                                 for n, ts, dur in events], "metadata": {"rank": rank, "stage": rank}}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(trace))
    assert _tool().main(["--trace", str(tmp_path), "--width", "5"]) == 0
    assert capsys.readouterr().out.split("\n")[:3] == ["measured step 1: 0.1 ms over 5 columns",
                                                       "r0  s0 0..AA", "r1  s1 .0A.."]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_html_script_parses(tmp_path):
    """A syntax check of the page's inline script (not a render: the headless-browser test is separate)."""
    from megazero.viz.html import _JS
    (tmp_path / "page.js").write_text(_JS)
    subprocess.run(["node", "--check", str(tmp_path / "page.js")], check=True, timeout=30)
