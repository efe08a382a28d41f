"""The system's headless Chromium through Playwright, for the browser tests
(tests/e2e/test_e2e_dashboard_browser.py, the demo's live part in
tests/e2e/test_e2e_bench.py). Never downloads a browser: :func:`missing`
says why one cannot run here, and the tests skip.

``KVLENS_SCREENSHOT=docs/dashboard.png``: :func:`screenshot_if_asked` also
saves the Overview there (relative paths from the repository root), the
picture the docs show.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterator

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_ENV = "KVLENS_SCREENSHOT"
#: the picture's size: the cards of both modes and the first charts, at a laptop's width
SCREENSHOT_VIEWPORT = {"width": 1440, "height": 1100}
REPO = Path(__file__).resolve().parents[2]

#: Each page's URL and the heading it opens with (its ``st.title``).
PAGE_URLS = {
    "/overview": "Overview: push vs pull, live",
    "/compare": "Compare: push vs pull",
    "/traces": "Traces: slowest requests",
}


def missing() -> str | None:
    """Why Chromium cannot run here, or None."""
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not installed"
    if importlib.util.find_spec("playwright") is None:
        return "playwright not installed"
    return None


@contextlib.contextmanager
def browser() -> Iterator:
    """A headless Chromium (closed at the end), started here rather than by
    Playwright: Playwright starts it in a session of its own, and with the
    kernel's autogroups a session of its own gets a few % of the CPU next to
    a stack's spinning NIXL threads (kvrecord/children.py; measured: the
    Overview's first page 31-68 s instead of 4.5 s). In this process's
    session it competes as these tests do; Playwright attaches over CDP."""
    from playwright.sync_api import sync_playwright

    from kvrecord.children import ChildProcess

    profile = Path(tempfile.mkdtemp(prefix="kvlens-chromium-"))
    argv = [CHROMIUM, *CHROMIUM_ARGS, "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"]
    # its own group (stopped whole: renderers, GPU process), SIGKILL when this process's thread dies
    child = ChildProcess(argv, log=profile / "chromium.log", group="group", death_signal=signal.SIGKILL).start()
    try:
        port = _devtools_port(profile, child)
        with sync_playwright() as p:
            b = p.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
            try:
                yield b
            finally:
                b.close()
    finally:
        child.stop(10.0)
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(profile: Path, child, timeout_s: float = 120.0) -> int:
    """The port Chromium chose (``--remote-debugging-port=0`` writes it to
    the profile's DevToolsActivePort file)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert child.poll() is None, (profile / "chromium.log").read_text(errors="replace")[-2000:]
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((profile / "DevToolsActivePort").read_text().split()[0])
        time.sleep(0.1)
    raise AssertionError(f"Chromium wrote no DevToolsActivePort in {timeout_s:.0f} s")


def open_page(page, url: str, heading: str, timeout_ms: int = 45_000) -> str:
    """Load ``url`` and wait for the page's own heading (an ``h1``); its body
    text. Fails when Streamlit answers "Page not found" instead."""
    page.goto(url, wait_until="domcontentloaded")
    page.get_by_role("heading", name=heading, level=1).wait_for(timeout=timeout_ms)
    body = page.inner_text("body")
    assert "Page not found" not in body and "Traceback" not in body, (url, body[:2000])
    return body


def screenshot_if_asked(page) -> Path | None:
    """Save ``page`` to ``$KVLENS_SCREENSHOT`` (relative: from the repository root) when it is set."""
    where = os.environ.get(SCREENSHOT_ENV)
    if not where:
        return None
    path = Path(where) if os.path.isabs(where) else REPO / where
    path.parent.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size(SCREENSHOT_VIEWPORT)
    page.wait_for_timeout(2000)  # let the columns and vega redo their layout at this width
    page.screenshot(path=str(path), full_page=False)
    return path
