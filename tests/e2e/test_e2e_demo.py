"""End-to-end: ``kvlens demo`` as users run it (a process; the demo starts
its own stacks, so the shared one is freed first: 2 cores), on a one-cell
grid, then its live part on a mixed fleet (one push pair and one pull pair
behind one kvlens router at split push=0.5) until SIGTERM.

The live fleet is also the canary's: the canary's checks
(tests/e2e/canary_checks.py: split near the weight, each request traced
once with its mode, ``kvlens verdict``/``whatif --json``, ``X-Kvlens-Mode``,
``/admin/split`` live, one half failing) run against the demo's router, so
the demo and the canary share one 4-server start. The order matters: the
last step kills the pull half's D (by its PID from the fleet's stack.json),
and the demo must still stop cleanly on SIGTERM, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

import canary_checks as canary
from kvtrace import store
from kvrecord.ports import free_port

pytestmark = pytest.mark.e2e

#: the closing words' heading (kvlens.demolive.closing_words)
LIVE_VERDICT = "== the live verdict: push vs pull"


def test_demo_then_live_canary(stack_factory, kvlens_home, tmp_path):
    """The bench part's report; the live part: a real Prometheus scraping the
    fleet's router and four engines (every target up, kvlens' recording rules
    loaded, exemplars of both modes), the dashboard reading it (live figures;
    in Chromium, the Overview's headline verdict on the canary's requests),
    the canary's checks on the fleet, the closing words (live verdict and
    what-if next to the grid's) once there is data and again at the end;
    SIGTERM stops it all, a dead D included, leaving no process behind."""
    stack_factory.stop()
    t0 = time.monotonic()
    dash_port = free_port()
    log = tmp_path / "demo.log"
    argv = [sys.executable, "-m", "kvlens.cli", "demo", "--qps", "4", "--input-len", "128", "--output-len", "3"]
    # one round (pull's stack, then push's): one stack start fewer than the demo's default two rounds (ABBA,
    # unit-tested in tests/unit/test_bench_rounds.py); the live fleet's 4-server start is the time it pays for
    argv += ["--num-prompts", "2", "--repeat", "1", "--warmup", "1", "--no-progress", "--seed", "77"]
    # a light load beside the canary's requests (they select their own by trace id; counts it adds to are ">=")
    argv += ["--dashboard-port", str(dash_port), "--prometheus-port", "0", "--live-interval", "3"]
    with open(log, "wb") as out:
        demo = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    kids: set[int] = set()
    try:
        text = _wait_for(log, demo, f"kvlens dashboard: http://localhost:{dash_port}", timeout_s=1500)
        laps = [("bench part and the fleet's start", time.monotonic())]
        kids = _descendants(demo.pid)
        _check_bench_part(text, kvlens_home)
        prom_url = re.search(r"Prometheus: +(http://127\.0\.0\.1:\d+)", text).group(1)
        url = re.search(r"router \(OpenAI API\): (http://\S+)/v1", text).group(1)
        manifest = json.loads(Path(re.search(r"stack: +(\S+/stack\.json)", text).group(1)).read_text())
        assert "A mixed fleet, one push pair and one pull pair" in text, text[-3000:]
        assert f"dashboard:           http://localhost:{dash_port}" in text
        db = store.StoreLocation.parse(manifest["store"])
        assert db.path.resolve() == (kvlens_home / "traces.db").resolve(), (db, kvlens_home)

        canary.check_fleet(url, manifest)
        _, drawn = canary.check_split(url, db)
        laps.append(("canary: split", time.monotonic()))
        canary.check_forced_mode(url, db)
        canary.check_verdict_and_whatif(kvlens_home, db, drawn)
        laps.append(("verdict, whatif", time.monotonic()))
        _check_prometheus(prom_url)
        laps.append(("Prometheus", time.monotonic()))
        _check_live_dashboard(prom_url, f"http://127.0.0.1:{dash_port}", kvlens_home, db, manifest)
        laps.append(("dashboard in Chromium", time.monotonic()))
        words = _wait_for(log, demo, LIVE_VERDICT, timeout_s=300)
        _check_closing_words(words[words.index(LIVE_VERDICT) :])
        canary.check_split_changed_live(url, db)
        laps.append(("closing words, /admin/split", time.monotonic()))
        kids |= _descendants(demo.pid)
        canary.check_one_half_fails(url, db, manifest)
        _wait_for(log, demo, "kvlens demo: warning: decode-d1 exited", timeout_s=120)
        laps.append(("one half fails", time.monotonic()))
    finally:
        demo.send_signal(signal.SIGTERM)
        try:
            rc = demo.wait(240)
        finally:
            if demo.poll() is None:  # must not happen; do not leak it either
                demo.kill()
                demo.wait(10)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "live load stopped (" in text and "kvlens demo: stopped" in text, text[-2000:]
    # the closing words again, after the fleet stopped: with the pull half dead, still a verdict in words
    end = text[text.index("live load stopped (") :]
    assert LIVE_VERDICT in end, end[-3000:]
    _check_closing_words(end[end.index(LIVE_VERDICT) :])
    deadline = time.monotonic() + 30
    while [k for k in kids if psutil.pid_exists(k) and psutil.Process(k).status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left behind: {[k for k in kids if psutil.pid_exists(k)]}"
        time.sleep(0.5)
    laps.append(("SIGTERM to nothing left", time.monotonic()))
    steps = ", ".join(f"{name} {t - laps[i - 1][1] if i else t - t0:.0f}s" for i, (name, t) in enumerate(laps))
    print(f"\ndemo e2e: {time.monotonic() - t0:.0f}s in all: {steps}")


def _check_closing_words(words: str) -> None:
    """The live verdict's ratios (each a figure with its interval, or an
    answer in words), the what-if both ways, the grid's verdict beside."""
    block = words.split("\nkvlens demo:", 1)[0]
    assert "requests compared:" in block and "canary: split-assigned requests" in block, block
    assert "  in short: " in block, block
    for name in ("TTFT p50", "TTFT p90", "handoff p50", "TPOT p50"):
        line = next((x for x in block.splitlines() if x.strip().startswith(name)), None)
        assert line is not None and (re.search(r"\d\.\d\d \[\d+\.\d\d-\d+\.\d\d\]", line) or "not enough data" in line)
    assert "from the " in block and "pull requests, had they run push" in block, block
    assert "push requests, had they run pull" in block, block
    assert "the grid's verdict, for comparison" in block and "Overall, push (overlapped) vs pull" in block, block
    assert " 0 push" not in block and " 0 pull" not in block, block  # both modes served: no count of 0


def _descendants(pid: int) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    return set()


def _wait_for(log, proc, needle: str, timeout_s: float) -> str:
    """The log's text once ``needle`` is in it; fails when the process exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text(errors="replace")
        if needle in text:
            return text
        assert proc.poll() is None, f"demo exited {proc.returncode} before {needle!r}:\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"no {needle!r} after {timeout_s:.0f}s:\n{text[-4000:]}"
        time.sleep(1)


def _check_bench_part(out: str, kvlens_home) -> None:
    assert "What this measured:" in out and "Overall, push (overlapped)" in out
    assert "slowest push requests" in out and "slowest pull requests" in out
    # the report fits 120 columns (issue 43): from the table's two-line header to "rows saved to"
    head = out.rfind("\n", 0, out.index("\nmode  dispatch"))
    report = out[head + 1 : out.index("rows saved to")]
    assert "TTFT p50 push/pull" in report.splitlines()[0], report[:500]
    long = [x for x in report.splitlines() if len(x) > 120]
    assert not long, long
    conn = store.connect(kvlens_home / "traces.db", readonly=True)
    try:
        rows = store.bench_rows(conn)
    finally:
        conn.close()
    assert {(r["mode"], r["dispatch"]) for r in rows} == {
        ("pull", None),
        ("push", "overlapped"),
        ("push", "sequential"),
    }
    # stacks the demo started itself: every row says what P, D and the router used and where they ran
    for r in rows:
        assert {"prefill", "decode", "router"} <= set(r["cpu_stack"]), r["cpu_stack"]
        assert r["cpu_stack"]["prefill"] > 0 and r["cpu_stack"]["decode"] > 0, r["cpu_stack"]
        assert r["cpu_outside"] is not None and r["placement"] == "as asked", (r["cpu_outside"], r["placement"])


def _poll(what: str, fn, timeout_s: float = 120.0):
    """``fn()`` once it returns something true (Prometheus scrapes every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f}s (last: {got!r})"
        time.sleep(2)


def _check_prometheus(url: str) -> None:
    """Prometheus scrapes the fleet's router and all four engines; kvlens'
    rules loaded; handoff exemplars with a trace id, of both modes."""
    from exporters import promapi

    def all_up():
        t = promapi.targets_health(url)
        jobs = [x["labels"]["job"] for x in t]
        want = {"kvlens-router": 1, "vllm-prefill": 2, "vllm-decode": 2}
        return t if all(jobs.count(j) >= n for j, n in want.items()) and all(x["health"] == "up" for x in t) else None

    _poll("every target of the router, both P and both D up", all_up)
    groups = httpx.get(url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = {r["name"]: r["health"] for g in groups for r in g["rules"]}
    assert "kvlens:handoff_seconds:p50_1m" in rules and set(rules.values()) == {"ok"}, rules
    now = time.time()
    for mode in ("push", "pull"):
        _poll(
            f"{mode} handoff exemplars with a trace id",
            lambda: [
                e
                for s in promapi.query_exemplars(
                    url, f'kvlens_handoff_seconds_bucket{{mode="{mode}"}}', now - 900, time.time()
                )
                for e in s["exemplars"]
                if len(e["labels"].get("trace_id", "")) == 32
            ],
        )


def _check_live_dashboard(prom_url: str, dash_url: str, kvlens_home, db, manifest: dict) -> None:
    """The Overview's live figures from the dashboard's own Prometheus loader
    (each mode's request rate and lost spans are figures, not "-"), and the
    page as it is drawn in a real Chromium: its headline is the live verdict
    on the canary's split-assigned requests, its live cards have figures,
    and what issue 43 asks of them (:func:`_check_figures_agree`); the
    Compare page shows no ratio without its interval."""
    from dashboard import prom

    for mode in ("push", "pull"):

        def live():
            stats = prom.prom_overview(prom_url, "1h")[0][mode]
            return stats if (stats.req_per_s or 0) > 0 and stats.dropped is not None and stats.requests else None

        s = _poll(f"{mode}'s live figures from Prometheus", live)
        assert s.dropped == 0 and s.handoff["p50"] is not None, (mode, s)

    import chromium

    assert chromium.missing() is None, chromium.missing()  # make setup installs Chromium and Playwright

    def serving() -> bool:  # "kvlens dashboard: URL" is printed before Streamlit listens
        try:
            return httpx.get(dash_url + "/_stcore/health", timeout=5).text.strip() == "ok"
        except httpx.HTTPError:
            return False

    _poll("the dashboard serving", serving, timeout_s=300)
    with chromium.browser() as b:
        page = b.new_page(viewport={"width": 1600, "height": 1400})
        # the dashboard shares the 2 cores with the live stack, its load and Prometheus: its first
        # page can take minutes there (seen: over 45 s), so wait for the page itself, not a clock
        try:
            chromium.open_page(page, dash_url + "/overview", chromium.PAGE_URLS["/overview"], timeout_ms=300_000)
        except Exception:
            page.screenshot(path=str(chromium.REPO / "test-output" / "demo-live-failed.png"), full_page=True)
            raise
        _poll("the Overview reading Prometheus", lambda: f"Source: Prometheus at {prom_url}" in page.inner_text("body"))
        page.get_by_text("Verdict, last 1h").first.wait_for(timeout=300_000)
        body = page.inner_text("body")
        assert "canary: split-assigned requests" in body and "TTFT p50 push/pull" in body, body[:3000]
        cards: dict[str, str] = {}

        def drawn() -> bool:  # the fragment redraws every 5 s: read until the live cards are there
            cards.clear()
            cards.update({c["label"]: c["value"] for c in page.evaluate(CARDS_JS)})
            return all(cards.get(label) not in (None, "", "-") for label in ("req/s", "lost spans"))

        try:
            _poll("the live cards drawn with figures", drawn, timeout_s=60)
        except AssertionError as e:
            raise AssertionError(f"{e}: {cards}") from None
        page.wait_for_timeout(3000)  # let the charts finish
        chromium.screenshot_if_asked(page)
        _check_figures_agree(page, kvlens_home, db, manifest)
        assert not _bare_ratios(page.inner_text("body")), page.inner_text("body")[:3000]
        chromium.open_page(page, dash_url + "/compare", chromium.PAGE_URLS["/compare"], timeout_ms=300_000)
        page.get_by_text("Push against pull, last 1h").first.wait_for(timeout=300_000)
        body = page.inner_text("body")
        assert not _bare_ratios(body), body[:3000]
        page.close()
    _check_compare_tables(db)


#: A push/pull ratio in text, not followed by its interval (``0.96 [0.68-1.45]``).
_BARE_RATIO = re.compile(r"push\s*(?:/|÷)\s*pull[^\d\n]{0,30}?(\d+\.\d+)(?!\d|\s*\[\d)")


def _bare_ratios(text: str) -> list[str]:
    return [m.group(0) for m in _BARE_RATIO.finditer(text)]


def _card_s(cards: list[dict], name: str) -> list[float | None]:
    """The values of the cards named ``name`` (``handoff p50 (ms)``), in seconds (None: "-")."""
    out = []
    for c in cards:
        label = c["label"]
        if label.rsplit(" (", 1)[0] != name:
            continue
        scale = 1e-3 if label.endswith("(ms)") else 1.0
        v = c["value"].replace(",", "")
        out.append(None if v in ("", "-") else float(v) * scale)
    return out


def _check_figures_agree(page, kvlens_home, db, manifest: dict) -> None:
    """Issue 43, on the demo's own fleet, as Chromium shows the Overview:
    TPOT per mode is a number; each mode's req/s covers the data's age, not
    the 1 h range (the window the page names, checked against the fleet's age
    from the store), and is within 30 % of the load the fleet served in that
    window (its requests in the store: the gentle load's and the canary's);
    the handoff p50/p90 agree with ``kvlens traces`` over the same 1 h within 10 %."""
    from datetime import datetime

    import numpy as np

    # the cards and the text of one drawing (the body redraws every 5 s)
    snap = page.evaluate(f"() => ({{cards: ({CARDS_JS})(), body: document.body.innerText}})")
    cards, body = snap["cards"], snap["body"]
    tpot = [c["value"] for c in cards if c["label"].startswith("TPOT")]
    assert len(tpot) == 2 and all(v not in ("", "-") for v in tpot), cards
    rates = [float(c["value"].replace(",", "")) for c in cards if c["label"] == "req/s"]
    # the window each rate covers, as the page says it, and when the page was drawn
    windows = [int(m[0] or 0) * 60 + int(m[1]) for m in re.findall(r"rate over the last (?:(\d+) min )?(\d+) s", body)]
    drawn = datetime.strptime(re.search(r"Updated (\d\d:\d\d:\d\d)", body).group(1), "%H:%M:%S")
    drawn_ns = datetime.now().replace(hour=drawn.hour, minute=drawn.minute, second=drawn.second).timestamp() * 1e9
    drawn_ns -= 86400e9 if drawn_ns > time.time_ns() + 60e9 else 0  # drawn before midnight, read after
    started = datetime.strptime(manifest["started_at"], "%Y-%m-%dT%H:%M:%S%z").timestamp() * 1e9
    with store.reading(db) as conn:
        traces = store.slowest(conn, 10_000, order="start")
    fleet_age_s = (drawn_ns - min(r["start_ns"] for r in traces if (r["start_ns"] or 0) >= started)) / 1e9
    assert len(windows) == 2 and len(rates) == 2, (windows, rates, body[:3000])
    for mode, shown, win, t in zip(("push", "pull"), rates, windows, tpot):
        # the window is the data's age (not the 1 h range): the fleet's, less Prometheus' later start
        assert 0.6 * fleet_age_s - 5 <= win <= fleet_age_s + 10, (mode, win, fleet_age_s)
        n = sum(r["mode"] == mode and drawn_ns - win * 1e9 <= r["start_ns"] <= drawn_ns + 1e9 for r in traces)
        served = n / win
        print(
            f"\ndemo e2e: {mode} req/s on the Overview {shown} over the last {win} s (the fleet {fleet_age_s:.0f} s "
            f"old) vs {served:.3f} served then ({n} requests in the store); TPOT {t} ms"
        )
        # Issue 43's 30 %: the store holds the demo's requests, so the page counts them there (Prometheus'
        # increase() read a series this young +48 % in a clean-clone run: dashboard.data.exact_from_store)
        assert 0.7 * served <= shown <= 1.3 * served, (mode, shown, served, win, cards)
    assert "Handoff percentiles from the trace store" in body
    for mode, p50, p90 in zip(
        ("push", "pull"), _card_s(cards, "handoff p50"), _card_s(cards, "handoff p90"), strict=True
    ):
        out = canary.cli(kvlens_home, db, "traces", "--json", "--since", "1h", "--mode", mode, "--slowest", "10000")
        assert out.returncode == 0, out.stderr
        h = [d["handoff_s"] for d in map(json.loads, out.stdout.splitlines()) if d.get("handoff_s") is not None]
        want = np.percentile(h, [50, 90])
        print(f"demo e2e: {mode} handoff p50/p90 on the Overview {p50:.4f}/{p90:.4f} s vs kvlens traces {want[0]:.4f}/"
              f"{want[1]:.4f} s ({len(h)} requests)")  # fmt: skip
        assert abs(p50 - want[0]) <= 0.1 * want[0] and abs(p90 - want[1]) <= 0.1 * want[1], (mode, p50, p90, want)


def _check_compare_tables(db) -> None:
    """The Compare page's tables on the demo's store (Streamlit draws them on a
    canvas, so they are read through AppTest, the same page code): the grid's
    ratios each beside its interval, the live window's only as the verdict's."""
    from streamlit.testing.v1 import AppTest

    saved = sys.argv
    sys.argv = ["app.py", "--store", db.text]
    try:
        at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py"), default_timeout=300)
        at.query_params["page"] = "compare"
        at.run()
    finally:
        sys.argv = saved
    assert not at.exception, [e.value for e in at.exception]
    tables = [d.value for d in at.dataframe]
    grid, verdict = tables[0], next(t for t in tables if "push/pull" in t.columns)
    for c in [c for c in grid.columns if "÷" in c]:
        assert f"{c.split(' ')[0].replace('_', ' ').replace('ttft', 'TTFT')} 95% CI" in grid.columns, grid.columns
    assert not any("÷" in str(x) for t in tables[2:] for x in list(t.columns) + list(t.get("mode", ()))), tables
    for r in verdict.to_dict("records"):
        assert re.fullmatch(r"\d+\.\d\d-\d+\.\d\d", r["95 % interval"]) or "not enough data" in r["verdict"], r


#: label and value of every card on the page (the first column: push's, then pull's)
CARDS_JS = """() => Array.from(document.querySelectorAll('[data-testid=stMetric]')).map(m => {
  const part = (id) => { const e = m.querySelector(`[data-testid=${id}]`); return e ? e.innerText.trim() : ''; };
  return {label: part('stMetricLabel'), value: part('stMetricValue')};
})"""
