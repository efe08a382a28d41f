"""End-to-end: ``kvlens dashboard`` started as users start it, loaded in the
system's headless Chromium through Playwright, screenshots saved, then
stopped with a signal and checked for orphans.

Never downloads a browser: skips when /usr/bin/chromium (or playwright) is
missing. Screenshots: the test's tmp_path and ``test-output/`` (git-ignored);
with ``KVLENS_SCREENSHOT=docs/dashboard.png`` the Overview also goes there
(tests/e2e/chromium.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvrecord.ports import free_port

REPO = Path(__file__).resolve().parents[2]

from pair_store import Pair, make_pair_store  # noqa: E402
from store_fixture import make_store  # noqa: E402

import chromium  # noqa: E402
from chromium import CHROMIUM, PAGE_URLS, open_page, screenshot_if_asked  # noqa: E402

OUT = REPO / "test-output"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} not installed")
sync_api = pytest.importorskip("playwright.sync_api")


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (from /proc)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Dashboard:
    """``python -m kvlens.cli dashboard`` on a free port, in the repo."""

    def __init__(self, store: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._logf = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvlens.cli", "dashboard", "--store", str(store), "--port", str(self.port)],
            cwd=REPO,
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.kids: set[int] = set()

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"dashboard exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/_stcore/health", timeout=1).text.strip() == "ok":
                    self.kids = descendants(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"dashboard not ready after {timeout_s}s: {self.log.read_text()[-3000:]}")

    def stop(self, sig: int) -> int:
        self.kids |= descendants(self.proc.pid)
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(20)
        finally:
            if self.proc.poll() is None:  # must not happen; do not leak it either
                self.proc.kill()
                self.proc.wait(5)
            self._logf.close()
        return rc


def save(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    OUT.mkdir(exist_ok=True)
    shutil.copy(shot, OUT / name)
    return shot


def wait_charts(page, n: int, timeout_ms: int = 45_000) -> None:
    page.wait_for_function(
        f"document.querySelectorAll('.vega-embed svg, .vega-embed canvas').length >= {n}", timeout=timeout_ms
    )


#: Every card of the page: its label, value and box top, and whether any of its parts is cut (scrolls
#: past its box): st.metric cuts a long value with CSS (text-overflow: ellipsis), so innerText alone
#: shows it whole.
CARDS_JS = """() => Array.from(document.querySelectorAll('[data-testid=stMetric]')).map(m => {
  const part = (id) => { const e = m.querySelector(`[data-testid=${id}]`); return e ? e.innerText.trim() : ''; };
  return {label: part('stMetricLabel'), value: part('stMetricValue'), top: m.getBoundingClientRect().top,
          text: m.innerText.replace(/\\n+/g, ' | '),
          cut: Array.from(m.querySelectorAll('*')).some(e => e.scrollWidth > e.clientWidth + 1
                                                         && getComputedStyle(e).overflow !== 'visible')};
})"""
#: The visible cells of every table (the grid's accessible DOM copy; a missing value is drawn
#: on the canvas as "None" and is an empty cell here).
CELLS_JS = """() => Array.from(document.querySelectorAll('[data-testid=stDataFrame] table tbody td'))
  .map(e => e.innerText)"""

#: A time unit at the end of a card label ("TTFT p50 (ms)") or after a card value ("12.3 ms").
LABEL_UNIT = re.compile(r"\((ms|s|µs|min)\)$")
VALUE_UNIT = re.compile(r"\d\s*(ms|s|µs|min)$")
#: A table figure: digits, thousands separators, decimals.
FIGURE = re.compile(r"[+-]?[\d,]+(\.\d+)?")
#: The pages, each with its title, its URL and how many charts it draws.
PAGES = {
    "overview": ("Overview: push vs pull, live", "/", 4),
    "traces": ("Traces: slowest requests", "/?page=traces&mode=push", 1),
    "compare": ("Benchmark grid", "/compare", 1),
}


def bad_text(t: str) -> bool:
    return "…" in t or "..." in t or "None" in t


def card_unit(card: dict) -> str | None:
    m = LABEL_UNIT.search(card["label"]) or VALUE_UNIT.search(card["value"])
    return m.group(1) if m else None


def mixed_units(cards: list[dict]) -> list[str]:
    """Where time cards that must read alike do not share a unit: cards in one row
    (the same top: push's and pull's columns side by side), and cards of one
    name (``TTFT p50`` in both columns)."""
    rows: dict[int, set] = {}
    names: dict[str, set] = {}
    for c in cards:
        u = card_unit(c)
        if u is None:
            continue
        rows.setdefault(round(c["top"] / 8), set()).add(u)
        names.setdefault(LABEL_UNIT.sub("", c["label"]).strip(), set()).add(u)
    return [f"row at {k * 8}px: {sorted(v)}" for k, v in rows.items() if len(v) > 1] + [
        f"{k!r}: {sorted(v)}" for k, v in names.items() if len(v) > 1
    ]


def check_cards(page, where: str) -> int:
    """Every card whole (no ellipsis, nothing cut, no None), one unit per row; the card count."""
    cards = page.evaluate(CARDS_JS)
    bad = [c for c in cards if c["cut"] or bad_text(c["text"])]
    assert not bad, f"cut or missing figures on {where}: {bad}"
    mixed = mixed_units(cards)
    assert not mixed, f"mixed units on {where}: {mixed} in {[(c['label'], c['value']) for c in cards]}"
    return len(cards)


def check_tables(page, where: str, digits: bool = True) -> None:
    """Cells whole, none empty (None), and (``digits``) no figure with more
    digits than a time can support (``9246.954`` ms: 7 significant digits)."""
    cells = page.evaluate(CELLS_JS)
    assert cells, f"no table cells read on {where}"
    bad = [c for c in cells if not c.strip() or bad_text(c)]
    assert not bad, f"empty (None) or cut cells on {where}: {bad[:10]}"
    long = [
        c for c in cells if digits and FIGURE.fullmatch(c.strip()) and len(re.sub(r"\D", "", c.lstrip("+-0.,"))) >= 7
    ]
    assert not long, f"figures with more digits than they carry on {where}: {long[:10]}"


def check_page(page, dash_url: str, name: str, width: int, tmp_path: Path) -> int:
    """One page loaded at ``width`` px: cards whole with one unit per row, tables
    clean, no Deploy button; a screenshot saved. The number of cards."""
    title, path, n_charts = PAGES[name]
    page.set_viewport_size({"width": width, "height": 1600})
    page.goto(dash_url + path, wait_until="domcontentloaded")
    page.get_by_text(title).wait_for(timeout=45_000)
    wait_charts(page, n_charts)
    page.wait_for_timeout(1500)  # let vega and the columns finish their layout
    where = f"{name} at {width}px"
    n = check_cards(page, where)
    if name != "overview" or page.locator("[data-testid=stDataFrame]").count():
        check_tables(page, where)
    assert page.locator("[data-testid=stAppDeployButton]").count() == 0, f"Deploy button on {where}"
    assert page.get_by_role("button", name="Deploy").count() == 0, f"Deploy button on {where}"
    assert "Traceback" not in page.inner_text("body")
    save(page, tmp_path, f"dashboard-{name}-{width}.png")
    return n


@pytest.fixture
def browser():
    with chromium.browser() as b:
        yield b


def xpyd_store(home: Path) -> Path:
    """The fixture's 1P1D traces plus two more pairs, as a demo with several
    instances leaves them: a P whose push handoffs take 11 s (seconds next
    to milliseconds, figures with many digits) and a D whose clock runs 5 ms
    ahead of P's (a clock window without 0)."""
    store = make_store(home, n_per_mode=40)
    make_pair_store(
        home, [Pair("p1", "d0", slow_ms=11_000.0, slow_modes=("push",)), Pair("p0", "d1", skew_ms=5.0)], n_per_mode=8
    )
    return store


def test_dashboard_in_chromium(tmp_path, browser):
    store = xpyd_store(tmp_path / "home")
    dash = Dashboard(store, tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        assert dash.kids, "streamlit child not found"
        page = browser.new_page(viewport={"width": 1600, "height": 2000})
        page.goto(dash.url, wait_until="domcontentloaded")
        page.get_by_text("Overview: push vs pull, live").wait_for(timeout=45_000)
        page.get_by_text("Push (NixlPushConnector)").wait_for(timeout=45_000)
        wait_charts(page, 4)
        assert page.get_by_text("Pull (NixlConnector)").is_visible()
        body = page.inner_text("body")
        assert "handoff p99" in body and "Traceback" not in body
        # what dominates each mode's handoff, in words, side by side (issue 14)
        assert "push: " in body and "pull: " in body and body.count("% of the handoff is") >= 2
        # the handoff per (P, D) pair, the slow instance first
        page.get_by_text("Handoff per (P, D) pair").wait_for(timeout=45_000)
        page.wait_for_timeout(1500)  # let vega finish layout before the picture
        save(page, tmp_path, "dashboard.png")
        for width in (1280, 1920):
            assert check_page(page, dash.url, "overview", width, tmp_path) >= 18
            assert check_page(page, dash.url, "traces", width, tmp_path) >= 6
            assert "write.complete" in page.inner_text("body") or page.locator(".vega-embed").count() >= 1
            check_page(page, dash.url, "compare", width, tmp_path)
        # every page at its own URL (Streamlit serves its default page at "/" only)
        for path, heading in PAGE_URLS.items():
            open_page(page, dash.url + path, heading)
            assert page.url.split("?")[0].rstrip("/").endswith(path), (path, page.url)
        open_page(page, dash.url + "/", PAGE_URLS["/overview"])  # the root opens the Overview, at its URL
        assert page.url.split("?")[0].endswith("/overview"), page.url
        open_page(page, dash.url + "/overview?page=traces&mode=pull", PAGE_URLS["/traces"])  # ?page= wins
        open_page(page, dash.url + "/overview", PAGE_URLS["/overview"])
        page.get_by_text("Push (NixlPushConnector)").wait_for(timeout=45_000)
        wait_charts(page, 4)
        page.wait_for_timeout(1500)
        screenshot_if_asked(page)
        page.close()
    finally:
        rc = dash.stop(signal.SIGINT)
    assert rc == 0, dash.log.read_text()[-3000:]
    time.sleep(0.5)
    assert not [k for k in dash.kids if alive(k)], "orphaned dashboard processes"


def test_the_checks_catch_cut_cards_and_mixed_units():
    """What the page checks reject, on cards as the browser reads them."""
    card = {"label": "TTFT p50 (s)", "value": "0.55", "top": 100.0, "text": "", "cut": False}
    assert mixed_units([card, {**card, "label": "TTFT p50 (ms)", "value": "362", "top": 101.0}])
    assert mixed_units([card, {**card, "label": "TTFT p50", "value": "362 ms", "top": 400.0}])
    assert mixed_units([{**card, "label": "handoff", "value": "9.25 s"}, {**card, "label": "TTFT", "value": "12.3 ms"}])
    assert not mixed_units(
        [
            card,
            {**card, "label": "TTFT p99 (s)", "value": "12.6"},
            {**card, "label": "req/s", "value": "1.5"},
            {**card, "label": "mode", "value": "push"},
        ]
    )
    assert bad_text("9.25 s…") and not bad_text("9,247")


def test_dashboard_missing_store_and_sigterm(tmp_path, browser):
    dash = Dashboard(tmp_path / "nowhere" / "traces.db", tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        # a fresh server's first request at a page's own URL (Streamlit's legacy pages/ runner answers it)
        open_page(page, dash.url + "/overview", PAGE_URLS["/overview"])
        page.get_by_text("No trace store at").first.wait_for(timeout=45_000)
        assert "Traceback" not in page.inner_text("body")
        page.close()
    finally:
        rc = dash.stop(signal.SIGTERM)
    assert rc == 0
    assert "no trace store" in dash.log.read_text()
    time.sleep(0.5)
    assert not [k for k in dash.kids if alive(k)]


#: The waterfall's lane labels (its y axis: SVG text in the chart's axis group).
LANES_JS = """() => Array.from(document.querySelectorAll('.vega-embed svg [aria-roledescription=axis] text'))
  .map(t => t.textContent).filter(t => t.includes(' · '))"""


def test_traces_page_lanes_per_rank_in_chromium(tmp_path, browser):
    """A trace recorded by two TP ranks per side (real rank processes through
    their sidecars, tests/rank_store.py): the Traces page names the ranks and
    the straggler, draws one lane per rank, and folds them with the toggle."""
    from rank_store import make_rank_store

    home = tmp_path / "home"
    home.mkdir()
    tr = make_rank_store(home)
    dash = Dashboard(home / "traces.db", tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        page = browser.new_page(viewport={"width": 1280, "height": 1600})
        page.goto(f"{dash.url}/?page=traces&trace={tr.trace_id}", wait_until="domcontentloaded")
        page.get_by_text("Tensor parallel: D 2 ranks, P 2 ranks.").wait_for(timeout=45_000)
        wait_charts(page, 1)
        page.wait_for_timeout(1500)
        body = page.inner_text("body")
        assert "Straggler: D rank 1 finished read.complete last, 4.00 ms after rank 0" in body, body[-3000:]
        check_cards(page, "traces (TP ranks) at 1280px")
        lanes = page.evaluate(LANES_JS)
        for want in (
            "decode r0 · read.complete",
            "decode r1 · read.complete",
            "decode r1 · kv.ready",
            "prefill r0 · kv.released",
            "prefill r1 · kv.released",
            "prefill · prefill",
        ):
            assert want in lanes, (want, lanes)
        assert lanes.index("decode r0 · kv.ready") < lanes.index("decode r1 · descriptor.prep"), lanes  # by rank
        save(page, tmp_path, "dashboard-traces-ranks-1280.png")
        page.get_by_text("One lane per TP rank").click()  # collapse: a phase's ranks in one lane
        page.wait_for_function(f"({LANES_JS})().includes('decode · read.complete')", timeout=45_000)
        lanes = page.evaluate(LANES_JS)
        assert not [lane for lane in lanes if " r0 " in lane or " r1 " in lane], lanes
        page.close()
    finally:
        rc = dash.stop(signal.SIGINT)
    assert rc == 0, dash.log.read_text()[-3000:]


def test_stuck_list_and_partial_trace_in_chromium(tmp_path, browser):
    """Issue 37: while handoffs are stuck (their ``handoff.open`` snapshots
    written through the connector's real pipeline, the last one seconds ago),
    the Overview's health strip and "Stuck now" list show them, each links to
    its partial trace, and the Traces page says which side waits, in which
    phase, since when. The real-vLLM fault tests (test_e2e_faults.py,
    test_e2e_health.py) check ``kvlens traces --open`` on real stuck requests."""
    from health_store import add_health_traces

    home = tmp_path / "home"
    store = make_store(home, n_per_mode=8, bench=False)
    add_health_traces({"kvlens_home": str(home), "kvlens_metrics": "off"}, time.time_ns())
    dash = Dashboard(store, tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        page = browser.new_page(viewport={"width": 1440, "height": 1800})
        open_page(page, dash.url + "/overview", PAGE_URLS["/overview"])
        page.get_by_text("Handoff health").first.wait_for(timeout=60_000)
        stuck = page.locator('.st-key-ov_stuck a[href*="traces"]')
        stuck.first.wait_for(timeout=60_000)
        # push_stuck and pull_stuck; the abandoned one (last reported 10 min ago) is not "stuck now"
        want = {("push", "awaiting_kv"), ("pull", "awaiting_read")}
        # Streamlit sends the page's elements one by one: read until both rows are in (a clean-clone run
        # read right after the first row's anchors appeared, and saw the pull row only)
        deadline = time.monotonic() + 60
        while True:
            # a page link renders as more than one anchor (its icon's and its text's): the texts that say who waits
            texts = [stuck.nth(i).inner_text() for i in range(stuck.count())]
            found = {
                m.groups()
                for t in texts
                for m in re.finditer(r"([0-9a-f]{12})\S* (push|pull): .*? waiting in (\w+)", t)
            }
            if {(mode, phase) for _, mode, phase in found} == want or time.monotonic() > deadline:
                break
            page.wait_for_timeout(500)
        assert {(mode, phase) for _, mode, phase in found} == want, texts
        assert len({tid for tid, _, _ in found}) == 2, texts
        save(page, tmp_path, "dashboard-stuck.png")
        stuck.filter(has_text="waiting in awaiting_kv").first.click()
        page.get_by_text("Partial trace: the handoff has not ended.").first.wait_for(timeout=60_000)
        body = page.inner_text("body")
        assert "D (decode) waiting in" in body and "Traceback" not in body, body[:3000]
        page.close()
    finally:
        rc = dash.stop(signal.SIGTERM)
    assert rc == 0, dash.log.read_text()[-3000:]
