"""The schedule HTML in a real headless browser (Debian's Chromium driven by Playwright).

Each page must load from a file with no network, log no console error or warning and throw nothing,
render every block of its embedded data as a visible rectangle, show a block's details on hover, and
zoom. Cases: planned 1F1B, interleaved and ZB-H1; 16 stages x 64 micro-batches interleaved (the size
that must stay legible); a planned-vs-measured comparison; the planner's prediction for a config.

Chromium comes from the system (``apt-get install chromium``; `MEGAZERO_CHROMIUM` names another
binary). `.ci/run` installs it and sets ``MEGAZERO_REQUIRE_BROWSER=1``, which turns a missing browser
into a failure; elsewhere the test is skipped with the reason. `MEGAZERO_SCREENSHOT_DIR` keeps a
screenshot of every page.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megazero.core.schedules import get_schedule
from megazero.core.simulate import Costs, simulate
from megazero.viz.compare import compare
from megazero.viz.html import render_html
from megazero.viz.measured import MeasuredStep
from megazero.viz.sources import planned, planned_for
from megazero.viz.timeline import from_simulation
from tests.test_viz_measured import write_traces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def _chromium() -> str | None:
    return os.environ.get("MEGAZERO_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = "playwright is not installed (pip install -e .[test])" if sync_playwright is None else (
        "no Chromium (apt-get install chromium, or MEGAZERO_CHROMIUM=/path/to/chrome)" if exe is None else None)
    if missing:
        if os.environ.get("MEGAZERO_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MEGAZERO_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=FLAGS)
        yield b
        b.close()


def _pages(tmp_path):
    costs = Costs(1.0, 2.0, 1.0, 0.1)
    pages = {
        "1f1b": planned("1f1b", 4, 8, 1),
        "interleaved": planned("interleaved", 4, 8, 2, costs),
        "zb-h1": planned("zb-h1", 4, 8, 1, costs),
        "interleaved-16x64": planned("interleaved", 16, 64, 2, costs),
    }
    result = simulate(get_schedule("1f1b", 4, 8, 1, costs), costs)
    index = next(i for i, sp in enumerate(result.timeline[1]) if repr(sp.instr) == "B2")
    write_traces(tmp_path / "run", result, shift=(1, index, 1.5))
    step = MeasuredStep.load(str(tmp_path / "run"))
    pages["compare"] = compare(planned_for(step), step.timeline())
    pages["measured"] = step.timeline()
    pages["plan-vs-sim"] = compare(from_simulation(result, unit="ms"), step.timeline())
    return pages


def _blocks(picture) -> int:
    data = picture.to_dict()
    if "plan" in data:
        return len(data["plan"]["blocks"]) + len(data["run"]["blocks"])
    return len(data["blocks"])


def test_html_renders_in_a_headless_browser(browser, tmp_path):
    shots = os.environ.get("MEGAZERO_SCREENSHOT_DIR")
    for name, picture in _pages(tmp_path).items():
        path = tmp_path / f"{name}.html"
        path.write_text(render_html(picture))
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        problems, requests = [], []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        assert problems == [], (name, problems)
        assert all(url.startswith("file://") for url in requests), (name, requests)  # no network fetch
        counts = page.evaluate("""() => {
            const rects = [...document.querySelectorAll('svg.schedule rect.block')];
            const shown = rects.filter(r => { const b = r.getBoundingClientRect(); return b.width > 0 && b.height > 0; });
            const data = JSON.parse(document.getElementById('schedule-data').textContent);
            return {rects: rects.length, shown: shown.length, stats: document.querySelectorAll('text.stage-stats').length,
                    rows: document.querySelectorAll('#stages tr').length, keys: Object.keys(data)};
        }""")
        expected = _blocks(picture)
        assert counts["rects"] == counts["shown"] == expected, (name, counts, expected)
        lanes = 2 if "plan" in counts["keys"] else 1
        assert counts["stats"] == picture.num_stages * lanes and counts["rows"] == picture.num_stages + 2
        block = page.locator("svg.schedule rect.block").nth(3)
        block.scroll_into_view_if_needed()
        block.hover()
        tip = page.locator("#tip")
        assert tip.is_visible() and tip.inner_text() == block.get_attribute("data-title"), name
        assert "stage" in tip.inner_text() and "->" in tip.inner_text()
        width = page.evaluate("document.querySelector('svg.schedule').getBoundingClientRect().width")
        page.click("#zoom-in")
        zoomed = page.evaluate("document.querySelector('svg.schedule').getBoundingClientRect().width")
        # the browser's layout rounds widths to device pixels: 1e-3 of a ~1000 px width is one pixel
        assert zoomed == pytest.approx(width * 1.25, rel=1e-3), name
        page.click("#zoom-fit")
        fit, room = page.evaluate("[document.querySelector('svg.schedule').getBoundingClientRect().width, "
                                  "document.getElementById('scroll').clientWidth]")
        # one pixel: the browser's layout rounds widths to whole device pixels
        assert fit == pytest.approx(room, abs=1.0), name
        assert problems == [], (name, problems)
        if shots:
            page.click("#zoom-1")
            os.makedirs(shots, exist_ok=True)
            page.screenshot(path=os.path.join(shots, f"{name}.png"), full_page=False)
        page.close()


def test_embedded_data_survives_the_browser(browser, tmp_path):
    """What the browser parses from the page equals the Timeline the page was written from."""
    picture = planned("zb-h1", 4, 8, 1, Costs(1.0, 2.0, 1.0, 0.1))
    path = tmp_path / "zb.html"
    path.write_text(render_html(picture))
    page = browser.new_page()
    page.goto(path.as_uri())
    data = page.evaluate("JSON.parse(document.getElementById('schedule-data').textContent)")
    assert data == json.loads(json.dumps(picture.to_dict()))
    attrs = page.evaluate("""() => [...document.querySelectorAll('svg.schedule rect.block')].map(r =>
        [+r.dataset.stage, r.dataset.kind, +r.dataset.mb, +r.dataset.chunk, +r.dataset.start, +r.dataset.end])""")
    assert attrs == [[b.stage, b.kind, b.mb, b.chunk, b.start, b.end] for b in picture.blocks]
    page.close()
