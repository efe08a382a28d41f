"""End-to-end: ``kvlens bench`` on the session's shared real stacks (a small
grid, push overlapped + sequential and pull), then ``kvlens demo`` with its
own stacks on a one-cell grid, and its live part (Prometheus, the dashboard)
until SIGTERM.

The shared stacks come from ``tests/conftest.py`` (one alive at a time), so
the bench is pointed at their routers (``bench_routers`` / ``--proxy``)
instead of starting its own. Pull runs first: push rows then carry their
push/pull ratios when they are written.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from kvtrace import store
from kvtrace.benchrows import ROW_KEYS
from kvrecord.ids import new_trace_id
from kvlens.bench.grid import BenchOptions
from kvlens.bench.report import describe, print_report
from kvlens.bench.runner import bench_routers, new_run
from conftest import PULL_STACK_KW
from kvrecord.ports import free_port

pytestmark = pytest.mark.e2e

QPS = [2.0, 6.0]
INPUT_LENS = [64, 512]
OUTPUT_LEN = 4
NUM_PROMPTS = 4


def _store_path(stack) -> store.StoreLocation:
    return stack.store


def _sequential_url(stack) -> str:
    return stack.sequential_router_url


@pytest.fixture(scope="module")
def grid_run(stack_factory, tmp_path_factory):
    """One bench run over pull, then push (overlapped + sequential): pull runs
    first (a push row's ratio and interval need its cell's pull row), on the
    pull pair still up from the tests before (conftest's _STACK_ORDER); the
    push pair it starts is the push_stack fixture's, used by the tests after."""
    out = tmp_path_factory.mktemp("bench")
    pull = stack_factory.get("pull", **PULL_STACK_KW)  # the pull_stack fixture's pair
    opts = BenchOptions(
        qps=QPS,
        input_lens=INPUT_LENS,
        output_len=OUTPUT_LEN,
        num_prompts=NUM_PROMPTS,
        seed=int.from_bytes(new_trace_id()[:8].encode(), "big") % 10_000,  # fresh prompts: shared stacks cache prefixes
        warmup=1,
        trace_wait_s=60.0,
        store=_store_path(pull),
        json_path=out / "rows.jsonl",
        progress=False,
    )
    run = new_run(opts)
    bench_routers([pull.router_url], opts, run=run)
    push = stack_factory.get("push")
    bench_routers([push.router_url, _sequential_url(push)], opts, run=run)
    return run


def test_every_row_present_and_sane(grid_run):
    rows = grid_run.rows
    variants = {("pull", None), ("push", "overlapped"), ("push", "sequential")}
    got = {(r["mode"], r["dispatch"], r["input_len"], r["qps"]) for r in rows}
    assert got == {(m, d, il, q) for m, d in variants for il in INPUT_LENS for q in QPS}
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert r["completed"] + r["failed"] == r["num_prompts"] == NUM_PROMPTS, r
        assert r["completed"] > 0 and r["output_len"] == OUTPUT_LEN
        for k in (
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "handoff_p50_s",
            "handoff_p99_s",
            "req_per_s",
            "e2e_p50_s",
        ):
            assert r[k] is not None and r[k] > 0, (k, r)
        # TPOT: a number only from requests whose tokens arrived apart; the
        # row counts the rest (a starved host can deliver all tokens at once)
        assert 0 <= r["tpot_untimed"] <= r["completed"], r
        if r["tpot_untimed"] < r["completed"]:
            assert r["tpot_mean_s"] is not None and r["tpot_mean_s"] > 0, r
        else:
            assert r["tpot_mean_s"] is None and r["tpot_note"], r
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["handoff_p50_s"] <= r["handoff_p99_s"]
        assert r["ttft_p50_s"] <= r["e2e_p50_s"]
        assert r["handoff_p50_s"] < r["e2e_p99_s"]  # the handoff is part of the request
        assert r["output_tokens_mean"] == OUTPUT_LEN  # ignore_eos: exactly output_len tokens
        # what the machine did: routers given by URL, so the stack's processes are not known
        assert r["cpu_busy"] > 0 and r["cpu_not_bench"] is not None and r["cpu_stack"] is None, r
        # prompts of input_len tokens (decode/encode round trips can miss by one)
        assert abs(r["prompt_tokens_mean"] - r["input_len"]) <= 1
        assert r["handoff_n"] == r["completed"] and r["traces_in_store"] == r["num_prompts"]


def test_ratios_computed_from_rows(grid_run):
    rows = grid_run.rows
    pull = {(r["input_len"], r["qps"]): r for r in rows if r["mode"] == "pull"}
    for r in rows:
        if r["mode"] == "pull":
            assert r["ttft_p50_push_over_pull"] is None
            continue
        p = pull[(r["input_len"], r["qps"])]
        assert r["ttft_p50_push_over_pull"] == pytest.approx(r["ttft_p50_s"] / p["ttft_p50_s"])
        assert r["handoff_p50_push_over_pull"] == pytest.approx(r["handoff_p50_s"] / p["handoff_p50_s"])
    words = describe(rows)
    assert any(w.startswith("Overall, push (overlapped)") for w in words)
    assert any(w.startswith("Overall, push (sequential)") for w in words)


def test_rows_readable_from_store_and_json(grid_run):
    conn = store.connect(grid_run.store, readonly=True)
    try:
        saved = store.bench_rows(conn, grid_run.run_id)
    finally:
        conn.close()
    assert len(saved) == len(grid_run.rows) == 12
    key = lambda r: (r["mode"], r["dispatch"] or "", r["input_len"], r["qps"])  # noqa: E731
    for s, r in zip(sorted(saved, key=key), sorted(grid_run.rows, key=key)):
        for k in ROW_KEYS:
            assert s[k] == pytest.approx(r[k]) if isinstance(r[k], float) else s[k] == r[k]
        assert s["ttft_p50_push_over_pull"] == r["ttft_p50_push_over_pull"]  # written with the ratio
    lines = grid_run.json_path.read_text().splitlines()
    assert len(lines) == 12
    for line in lines:
        obj = json.loads(line)
        assert set(ROW_KEYS) <= set(obj)


def test_cross_checks_hold(grid_run, capsys):
    cc = print_report(grid_run)
    out = capsys.readouterr().out
    assert "client TTFT vs router span TTFT" in out and "push/pull" in out
    assert cc.completed == cc.ok_traces_in_store  # completed requests = ok traces of the run
    assert cc.traces_in_store == cc.sent == 12 * NUM_PROMPTS
    assert cc.handoff_missing == 0
    assert cc.n_compared == cc.completed
    # the router is one local hop from the client: its TTFT is close to ours
    assert cc.ttft_rel_diff_p50 < 0.25
    assert cc.ttft_diff_p50_s > -0.005  # the client cannot see the first token before the router sends it


def test_cli_bench_on_running_router(push_stack, tmp_path, capsys):
    from kvlens.cli import main

    push = push_stack
    jp = tmp_path / "one.jsonl"
    rc = main(
        [
            "bench",
            "--proxy",
            push.router_url,
            "--qps",
            "4",
            "--input-len",
            "128",
            "--output-len",
            "3",
            "--num-prompts",
            "3",
            "--warmup",
            "0",
            "--store",
            _store_path(push).text,
            "--json",
            str(jp),
            "--seed",
            "4242",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    (row,) = [json.loads(x) for x in jp.read_text().splitlines()]
    assert (row["mode"], row["dispatch"], row["completed"] + row["failed"]) == ("push", "overlapped", 3)
    assert "mode" in out and "completed requests" in out
    # --modes contradicting the router: refused before any load
    assert main(["bench", "--proxy", push.router_url, "--modes", "pull"]) == 2
    assert "serves push" in capsys.readouterr().err


def test_demo_then_live(stack_factory, kvlens_home, tmp_path):
    """``kvlens demo`` as users run it (a process; the demo starts its own
    stacks, so the shared one is freed first: 2 cores): the bench part's
    report, then the live part: a real Prometheus scraping the last stack
    (every target up, kvlens' recording rules loaded, exemplars stored), the
    dashboard reading it (the live cards have figures: request rate, lost
    spans), and SIGTERM stops it all, leaving no process behind."""
    stack_factory.stop()
    dash_port = free_port()
    log = tmp_path / "demo.log"
    argv = [sys.executable, "-m", "kvlens.cli", "demo", "--qps", "4", "--input-len", "128", "--output-len", "3"]
    argv += ["--num-prompts", "2", "--warmup", "1", "--no-progress", "--seed", "77"]
    argv += ["--dashboard-port", str(dash_port), "--prometheus-port", "0", "--live-interval", "1"]
    with open(log, "wb") as out:
        demo = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    kids: set[int] = set()
    try:
        text = _wait_for(log, demo, f"kvlens dashboard: http://localhost:{dash_port}", timeout_s=1200)
        kids = _descendants(demo.pid)
        _check_bench_part(text, kvlens_home)
        prom_url = re.search(r"Prometheus: +(http://127\.0\.0\.1:\d+)", text).group(1)
        mode = re.search(r"live\. The (push|pull) stack keeps serving", text).group(1)
        assert f"dashboard:           http://localhost:{dash_port}" in text
        _check_prometheus(prom_url, mode)
        _check_live_dashboard(prom_url, mode, f"http://127.0.0.1:{dash_port}")
        kids |= _descendants(demo.pid)
    finally:
        demo.send_signal(signal.SIGTERM)
        try:
            rc = demo.wait(180)
        finally:
            if demo.poll() is None:  # must not happen; do not leak it either
                demo.kill()
                demo.wait(10)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "live load stopped (" in text and "kvlens demo: stopped" in text, text[-2000:]
    deadline = time.monotonic() + 30
    while [k for k in kids if psutil.pid_exists(k) and psutil.Process(k).status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left behind: {[k for k in kids if psutil.pid_exists(k)]}"
        time.sleep(0.5)


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
    assert "CPU outside" in out
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


def _check_prometheus(url: str, mode: str) -> None:
    from exporters import promapi

    def all_up():
        t = promapi.targets_health(url)
        jobs = {x["labels"]["job"] for x in t}
        return (
            t
            if {"kvlens-router", "vllm-prefill", "vllm-decode"} <= jobs and all(x["health"] == "up" for x in t)
            else None
        )

    _poll("every target of P, D and the router up", all_up)
    groups = httpx.get(url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = {r["name"]: r["health"] for g in groups for r in g["rules"]}
    assert "kvlens:handoff_seconds:p50_1m" in rules and set(rules.values()) == {"ok"}, rules
    now = time.time()
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


def _check_live_dashboard(prom_url: str, mode: str, dash_url: str) -> None:
    """The Overview's live figures from the dashboard's own Prometheus loader,
    and (with Chromium) the page as it is drawn: read from Prometheus, the
    live mode's request rate and lost spans are figures, not "-"."""
    from dashboard import prom

    def live():
        stats = prom.prom_overview(prom_url, "1h")[0][mode]
        return stats if (stats.req_per_s or 0) > 0 and stats.dropped is not None and stats.requests else None

    s = _poll("live figures from Prometheus", live)
    assert s.dropped == 0 and s.handoff["p50"] is not None, s

    import chromium

    if chromium.missing():
        return

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
        page.close()


#: label and value of every card on the page (the first column: push's, then pull's)
CARDS_JS = """() => Array.from(document.querySelectorAll('[data-testid=stMetric]')).map(m => {
  const part = (id) => { const e = m.querySelector(`[data-testid=${id}]`); return e ? e.innerText.trim() : ''; };
  return {label: part('stMetricLabel'), value: part('stMetricValue')};
})"""
