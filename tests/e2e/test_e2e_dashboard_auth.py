"""End-to-end: ``kvlens dashboard`` with a token and TLS (issue 33, item 2),
signed into from the system's headless Chromium (Playwright) as a user would:
the login form first, then a link with ``?token=`` that the dashboard strips;
a wrong token gets the form back and nothing of the dashboard. Stopped with
SIGTERM and checked for orphans. Skips like the other browser test when
Chromium or Playwright is missing; never downloads a browser.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvrecord.guard import parent_death_signal
from kvrecord.ports import free_port
from store_fixture import make_store
from tlscerts import make_tls
from test_e2e_dashboard_browser import CHROMIUM, OUT, alive, browser, descendants  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TOKEN = "e2e-" + secrets.token_hex(16)


def _dies_with_us() -> None:
    """In the child: SIGTERM when this test process dies, so an interrupted run leaves no server behind."""
    parent_death_signal(signal.SIGTERM)


pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} not installed")


def _start(tmp_path: Path):
    tls = make_tls(tmp_path / "tls")
    store = make_store(tmp_path / "home", n_per_mode=10)
    port = free_port()
    env = {**os.environ, "KVLENS_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    argv = [
        sys.executable, "-m", "kvlens.cli", "dashboard", "--store", str(store), "--port", str(port),
        "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
    ]  # fmt: skip
    logf = open(tmp_path / "dashboard.log", "wb")
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=logf,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=_dies_with_us,
    )
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "dashboard not ready"
        try:
            if httpx.get(url + "/_stcore/health", verify=False, timeout=2, trust_env=False).text == "ok":
                return proc, logf, url
        except httpx.HTTPError:
            time.sleep(0.3)


def test_a_browser_signs_in_to_the_dashboard(tmp_path, browser):  # noqa: F811
    proc, logf, url = _start(tmp_path)
    kids = descendants(proc.pid)
    try:
        # the TLS itself is checked against its CA in tests/unit/test_dashboard_auth.py; Chromium
        # has no per-test trust store, so it is told to accept the test's certificate
        ctx = browser.new_context(ignore_https_errors=True, viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        page.goto(url + "/", wait_until="domcontentloaded")
        page.get_by_role("button", name="Sign in").wait_for(timeout=30_000)
        assert "Overview" not in page.inner_text("body")
        OUT.mkdir(exist_ok=True)
        page.screenshot(path=str(OUT / "dashboard-sign-in.png"))
        page.fill("input[name=token]", "wrong-token")
        page.click("input[type=submit]")
        page.get_by_text("That token is not this dashboard's.").wait_for(timeout=30_000)
        assert "Overview" not in page.inner_text("body")
        page.fill("input[name=token]", TOKEN)
        page.click("input[type=submit]")
        page.get_by_text("Overview: push vs pull, live").wait_for(timeout=60_000)
        assert TOKEN not in page.url
        cookie = {c["name"]: c for c in ctx.cookies()}["kvlens_session"]
        assert (
            cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
        )
        ctx.close()

        # a link with the token: the dashboard sets the cookie and drops the token from the address
        ctx = browser.new_context(ignore_https_errors=True, viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        page.goto(f"{url}/?page=compare&token={TOKEN}", wait_until="domcontentloaded")
        page.get_by_text("Benchmark grid").first.wait_for(timeout=60_000)
        assert TOKEN not in page.url and "token=" not in page.url
        assert "Traceback" not in page.inner_text("body")
        ctx.close()

        # no open redirect (issue 42, item 1): a page whose path Chromium would read as another host once
        # it strips the tab (/<TAB>/evil.example/ -> //evil.example/), signed into with the form and with
        # ?token=: Chromium stays on the dashboard
        for how in ("form", "link"):
            ctx = browser.new_context(ignore_https_errors=True, viewport={"width": 1400, "height": 1000})
            page = ctx.new_page()
            seen = []
            page.on("request", lambda req: seen.append(req.url))
            if how == "form":
                page.goto(url + "/%09/evil.example/", wait_until="domcontentloaded")
                page.fill("input[name=token]", TOKEN)
                page.click("input[type=submit]")
            else:
                page.goto(f"{url}/%09/evil.example/?token={TOKEN}", wait_until="domcontentloaded")
            page.get_by_text("Overview: push vs pull, live").wait_for(timeout=60_000)
            assert page.url.startswith(url + "/") and "evil" not in page.url, (how, page.url)
            assert not [u for u in seen if urlsplit(u).hostname == "evil.example"], (how, seen)
            ctx.close()
    finally:
        kids |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            logf.close()
    assert rc == 0, (tmp_path / "dashboard.log").read_text()[-3000:]
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "orphaned dashboard processes"
    assert TOKEN not in (tmp_path / "dashboard.log").read_text()
