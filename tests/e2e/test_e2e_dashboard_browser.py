"""End-to-end: ``kvlens dashboard`` started as users start it, loaded in the
system's headless Chromium through Playwright, screenshots saved, then
stopped with a signal and checked for orphans.

Never downloads a browser: skips when /usr/bin/chromium (or playwright) is
missing. Screenshots: the test's tmp_path and ``test-output/`` (git-ignored).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]

from store_fixture import make_store  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OUT = REPO / "test-output"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} not installed")
sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            cwd=REPO, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
        f"document.querySelectorAll('.vega-embed svg, .vega-embed canvas').length >= {n}", timeout=timeout_ms)


#: Each Overview card: its text, and whether any of its parts is cut (scrolls past its box):
#: st.metric cuts a long value with CSS (text-overflow: ellipsis), so innerText alone shows it whole.
CARDS_JS = """() => Array.from(document.querySelectorAll('[data-testid=stMetric]')).map(m => ({
  text: m.innerText.replace(/\\n+/g, ' | '),
  cut: Array.from(m.querySelectorAll('*')).some(e => e.scrollWidth > e.clientWidth + 1
                                                 && getComputedStyle(e).overflow !== 'visible')}))"""
#: The visible cells of every table (the grid's accessible DOM copy; a missing value is drawn
#: on the canvas as "None" and is an empty cell here).
CELLS_JS = """() => Array.from(document.querySelectorAll('[data-testid=stDataFrame] table tbody td'))
  .map(e => e.innerText)"""


def bad_text(t: str) -> bool:
    return "…" in t or "..." in t or "None" in t


def check_overview(page, width: int, tmp_path: Path) -> None:
    """The Overview at ``width`` px: every card whole (no ellipsis, nothing cut, no None)."""
    page.set_viewport_size({"width": width, "height": 1600})
    page.wait_for_timeout(1500)  # let the columns re-flow
    cards = page.evaluate(CARDS_JS)
    save(page, tmp_path, f"overview-{width}.png")
    assert len(cards) >= 18, cards
    bad = [c for c in cards if c["cut"] or bad_text(c["text"])]
    assert not bad, f"cut or missing figures at {width}px: {bad}"


def check_tables(page, where: str) -> None:
    cells = page.evaluate(CELLS_JS)
    assert cells, f"no table cells read on {where}"
    bad = [c for c in cells if not c.strip() or bad_text(c)]
    assert not bad, f"empty (None) or cut cells on {where}: {bad[:10]}"


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def test_dashboard_in_chromium(tmp_path, browser):
    store = make_store(tmp_path / "home", n_per_mode=40)
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
        assert page.locator('[data-testid="stMetric"]').count() >= 18
        body = page.inner_text("body")
        assert "handoff p99" in body and "Traceback" not in body
        # what dominates each mode's handoff, in words, side by side (issue 14)
        assert "push: " in body and "pull: " in body and body.count("% of the handoff is") >= 2
        page.wait_for_timeout(1500)  # let vega finish layout before the picture
        save(page, tmp_path, "dashboard.png")
        for width in (1280, 1920):
            check_overview(page, width, tmp_path)
        page.set_viewport_size({"width": 1600, "height": 2000})

        page.goto(dash.url + "/?page=traces&mode=push", wait_until="domcontentloaded")
        page.get_by_text("Traces: slowest requests").wait_for(timeout=45_000)
        wait_charts(page, 1)
        page.wait_for_timeout(1500)
        assert "write.complete" in page.inner_text("body") or page.locator(".vega-embed").count() >= 1
        check_tables(page, "Traces")
        save(page, tmp_path, "dashboard-traces.png")

        page.goto(dash.url + "/compare", wait_until="domcontentloaded")
        page.get_by_text("Benchmark grid").wait_for(timeout=45_000)
        wait_charts(page, 1)
        page.wait_for_timeout(1500)
        check_tables(page, "Compare")
        save(page, tmp_path, "dashboard-compare.png")
        page.close()
    finally:
        rc = dash.stop(signal.SIGINT)
    assert rc == 0, dash.log.read_text()[-3000:]
    time.sleep(0.5)
    assert not [k for k in dash.kids if alive(k)], "orphaned dashboard processes"


def test_dashboard_missing_store_and_sigterm(tmp_path, browser):
    dash = Dashboard(tmp_path / "nowhere" / "traces.db", tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(dash.url, wait_until="domcontentloaded")
        page.get_by_text("No trace store at").first.wait_for(timeout=45_000)
        assert "Traceback" not in page.inner_text("body")
        page.close()
    finally:
        rc = dash.stop(signal.SIGTERM)
    assert rc == 0
    assert "no trace store" in dash.log.read_text()
    time.sleep(0.5)
    assert not [k for k in dash.kids if alive(k)]
