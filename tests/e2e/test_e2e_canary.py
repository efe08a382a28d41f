"""End-to-end: a canary on real vLLM. One push pair and one pull pair
(``kvlens up --mode push,pull``: four vLLM servers) behind one kvlens router
at its default split, push=0.5. One stack start, many checks on it, in one
test (the order matters: the last step kills the pull half's D):

* every request is answered, and traced once, with the mode its draw gave
  (the root span's ``kvlens.mode`` and ``kvlens.split``, P's and D's spans
  from that mode's instances); the share of push lies within a binomial
  tolerance of the weight, not at a fixed count;
* the router records what the verdict needs on its root span: the prompt
  tokens (from P's answer) and, for streams, the client-seen TPOT;
* ``kvlens verdict --json`` reads the canary's requests (selection
  ``split``) and gives the four ratios with their intervals and the counts
  per mode and bucket; ``kvlens whatif --from pull --json`` and
  ``--from push`` run on the same traces;
* a request may name its mode (``X-Kvlens-Mode``): no draw, no weight on its
  root span;
* ``/admin/split`` changes the split live (the engines keep running), and
  refuses a bad weight;
* one half failing loses nothing of the other: with the pull half's D
  killed, the push requests go on answering, the pull ones fail with a
  clear error naming the decode side, and the router counts them.

Old single-mode checks folded in here (they need a kvlens router over
several instances, which this stack is): the round robin within a mode
naming each request's P and D on the root span, the stack's ``/health``
listing every instance, ``stack.json`` recording each instance's mode.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from kvrecord import semconv as sc
from kvlens.sse import has_text, parse_data_line
from kvtrace import store, tracemodel

pytestmark = pytest.mark.e2e

#: requests drawn at the default split (enough for >= 10 per mode in one
#: prompt-length bucket with near certainty: P(push < 10 of 60) ~ 1e-8)
N = 60
#: the binomial tolerance of the push count: 4 standard deviations
#: (a false alarm once in ~16,000 runs)
SIGMAS = 4.0


def _body(i: int, stream: bool) -> dict:
    return {
        "prompt": f"canary {i} " + "tokens " * (20 + 7 * (i % 9)),
        "max_tokens": 6,
        "ignore_eos": True,  # vLLM's: all 6 tokens, whatever the tiny model makes of them
        "temperature": 0,
        "stream": stream,
    }


def _streamed(i: int) -> bool:
    """Three requests in four stream (TPOT is measured on streams); the fourth does not."""
    return i % 4 != 3


def _text_events(body: str) -> int:
    """SSE events with generated text in a streamed answer."""
    return sum(1 for line in body.splitlines() if (ev := parse_data_line(line)) is not None and has_text(ev))


def _post(url: str, i: int, stream: bool, headers: dict | None = None) -> tuple[int, str, str]:
    """(status, trace id, body text) of one completion through the router."""
    sent = uuid.uuid4().hex
    with httpx.Client(timeout=180) as c:
        r = c.post(url + "/v1/completions", json=_body(i, stream), headers={"X-Request-Id": sent, **(headers or {})})
        tid = r.headers.get("x-request-id") or sent
        return r.status_code, tid, r.text


def _send(url: str, n: int, *, offset: int = 0, headers: dict | None = None, workers: int = 4) -> list:
    """``n`` requests (:func:`_streamed` says which stream), ``workers`` at a time."""
    with cf.ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(_post, url, offset + i, _streamed(i), headers) for i in range(n)]
        return [f.result() for f in futs]


def _roots(db, tids: list[str], *, timeout: float = 90.0) -> dict[str, list[dict]]:
    """trace id -> the attributes of each of its root spans, once every
    trace has one (or at ``timeout``)."""
    deadline = time.time() + timeout
    while True:
        with store.reading(db) as conn:
            got = store.attributes_of(conn, tids, (sc.Phase.REQUEST.value,))
        out: dict[str, list[dict]] = {}
        for (tid, _role, _name, _t0, _t1), a in got.items():
            out.setdefault(tid, []).append(a)
        if all(t in out for t in tids) or time.time() > deadline:
            return out
        time.sleep(0.5)


def _settled(db, tids: list[str], *, timeout: float = 120.0) -> dict[str, tracemodel.Trace]:
    """The traces once each is joined with its handoff and router TTFT."""
    deadline = time.time() + timeout
    while True:
        with store.reading(db) as conn:
            got = tracemodel.find(conn, tids)
        done = all(
            t in got and got[t].handoff_s is not None and got[t].ttft_source == "router" and got[t].half is None
            for t in tids
        )
        if done or time.time() > deadline:
            return got
        time.sleep(0.5)


def _cli(stack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLENS_HOME": str(stack.kvlens_home)}
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", *args, "--store", stack.store.text],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _headline_in_chromium(stack, tmp_path) -> None:
    """The dashboard on the canary's store, as users start it, opens with the
    live verdict on these split-assigned requests (a real Chromium)."""
    from chromium import PAGE_URLS, browser, missing, open_page
    from test_e2e_dashboard_browser import Dashboard

    assert missing() is None, missing()  # make setup installs Chromium and Playwright
    dash = Dashboard(stack.store.text, tmp_path / "dashboard.log")
    try:
        dash.wait_ready()
        with browser() as b:
            page = b.new_page()
            open_page(page, dash.url + "/overview", PAGE_URLS["/overview"])
            page.get_by_text("Verdict, last 1h").first.wait_for(timeout=90_000)
            body = page.inner_text("body")
            assert "canary: split-assigned requests" in body and "TTFT p50 push/pull" in body, body[:3000]
    finally:
        assert dash.stop(signal.SIGTERM) == 0, dash.log.read_text()[-3000:]


@pytest.fixture
def canary_stack(stack_factory):
    """One push pair (p0 -> d0, overlapped) and one pull pair (p1 -> d1)
    behind one kvlens router at push=0.5."""
    return stack_factory.get("push,pull")


def test_canary_push_and_pull_behind_one_router(canary_stack, stack_factory, tmp_path):
    stack = canary_stack
    url, db = stack.router_url, stack.store
    t_start = time.monotonic()

    # -- the stack: each instance's mode in stack.json and /health
    manifest = json.loads((stack.log_dir / "stack.json").read_text())
    assert manifest["mode"] == "push,pull" and manifest["modes"] == ["push", "pull"]
    modes = {i["engine_id"]: i["mode"] for r in ("prefill", "decode") for i in manifest["instances"][r]}
    assert modes == {"p0": "push", "d0": "push", "p1": "pull", "d1": "pull"}, modes
    ports = [i["port"] for r in ("prefill", "decode") for i in manifest["instances"][r]]
    sides = [i["side_channel_port"] for r in ("prefill", "decode") for i in manifest["instances"][r]]
    assert len(set(ports)) == 4 and len(set(sides)) == 4, (ports, sides)
    health = httpx.get(url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["mode"] == "push,pull", health
    assert health["split"] == {"push": 0.5, "pull": 0.5}, health
    assert set(health["instances"]["prefill"]) == {"p0", "p1"}, health

    # -- N requests at the default split: every one answered and traced once, with its mode
    results = _send(url, N)
    assert all(s == 200 for s, _, _ in results), [(s, b[:200]) for s, _, b in results if s != 200]
    tids = [t for _, t, _ in results]
    assert len(set(tids)) == N
    roots = _roots(db, tids)
    assert all(len(roots.get(t, [])) == 1 for t in tids), {t: len(roots.get(t, [])) for t in tids}
    got = _settled(db, tids)
    want_p = {"push": "p0", "pull": "p1"}
    want_d = {"push": "d0", "pull": "d1"}
    drawn = {}
    for (status, tid, _), i in zip(results, range(N)):
        root = roots[tid][0]
        mode = root[sc.ATTR_MODE]
        drawn[tid] = mode
        assert root[sc.ATTR_SPLIT] == 0.5, root
        assert root[sc.ATTR_DISPATCH] == ("overlapped" if mode == "push" else "sequential"), root
        tr = got[tid]
        # P's and D's own spans agree: the trace's mode, and that mode's instances
        assert (tr.mode, tr.p_engine, tr.d_engine, tr.outcome) == (mode, want_p[mode], want_d[mode], "ok"), (
            tid,
            tr.mode,
            tr.p_engine,
            tr.d_engine,
        )
        assert tr.handoff_s is not None and tr.handoff_s > 0, (tid, tr.handoff_note)
        assert (root[sc.ATTR_PREFILL_ENGINE_ID], root[sc.ATTR_DECODE_ENGINE_ID]) == (want_p[mode], want_d[mode])
        # what the verdict needs: prompt tokens from P's answer, TPOT for streams (6 tokens)
        assert isinstance(root.get(sc.ATTR_TOKENS), int) and root[sc.ATTR_TOKENS] > 20, root
        if _streamed(i) and _text_events(results[i][2]) >= 2:  # two tokens or more: a TPOT
            assert root.get(sc.ATTR_TPOT_S) is not None and root[sc.ATTR_TPOT_S] > 0, root
    n_push = sum(m == "push" for m in drawn.values())
    tol = SIGMAS * math.sqrt(N * 0.5 * 0.5)
    assert abs(n_push - N * 0.5) <= tol, f"{n_push} of {N} drawn push at weight 0.5 (tolerance {tol:.1f})"

    # -- a request that names its mode: no draw, no weight
    s, forced, _ = _post(url, 0, False, {"X-Kvlens-Mode": "pull"})
    assert s == 200
    root = _roots(db, [forced])[forced][0]
    assert root[sc.ATTR_MODE] == "pull" and sc.ATTR_SPLIT not in root, root
    bad = httpx.post(url + "/v1/completions", json=_body(0, False), headers={"X-Kvlens-Mode": "both"}, timeout=30)
    assert bad.status_code == 400 and "X-Kvlens-Mode" in bad.json()["error"]["message"], bad.text

    # -- the verdict and the what-if on these traces
    v = _cli(stack, "verdict", "--json", "--window", "1h")
    assert v.returncode == 0, v.stderr
    verdict = json.loads(v.stdout)
    assert verdict["status"] == "ok" and verdict["selection"] == "split", verdict["message"]
    assert verdict["requests_used"] == N, (verdict["requests_used"], N)
    counts = verdict["counts"]
    assert sum(counts["push"].values()) == n_push and sum(counts["pull"].values()) == N - n_push, counts
    assert set(verdict["ratios"]) == {"ttft_p50", "ttft_p90", "handoff_p50", "tpot_p50"}
    streams = {m: sum(_streamed(i) and drawn[t] == m for i, t in enumerate(tids)) for m in ("push", "pull")}
    for key, r in verdict["ratios"].items():
        if key == "tpot_p50" and min(streams.values()) < 10:  # TPOT only on streams
            assert r["status"] == "not enough data", (key, r, streams)
            continue
        assert r["status"] in ("resolved", "no resolvable difference"), (key, r)
        lo, hi = r["interval"]
        assert 0 < lo <= r["ratio"] <= hi, (key, r)
    for frm in ("pull", "push"):
        w = _cli(stack, "whatif", "--from", frm, "--json", "--window", "1h")
        assert w.returncode == 0, w.stderr
        assert isinstance(json.loads(w.stdout), dict)
    _headline_in_chromium(stack, tmp_path)

    # -- the split changed live: everything to push, then back; bad weights refused
    assert httpx.post(url + "/admin/split", json={"push": 1.5}, timeout=30).status_code == 400
    assert httpx.post(url + "/admin/split", json={"both": 1}, timeout=30).status_code == 400
    r = httpx.post(url + "/admin/split", json={"pull": 0.0}, timeout=30)
    assert r.status_code == 200 and r.json()["split"] == {"push": 1.0, "pull": 0.0}, r.text
    live = _send(url, 6, offset=100)
    assert all(s == 200 for s, _, _ in live)
    live_roots = _roots(db, [t for _, t, _ in live])
    assert all(a[0][sc.ATTR_MODE] == "push" and a[0][sc.ATTR_SPLIT] == 1.0 for a in live_roots.values()), live_roots
    assert httpx.post(url + "/admin/split", json={"push": 0.5}, timeout=30).status_code == 200

    # -- one half fails: the pull half's D killed; push goes on, pull fails clearly, counted
    before = httpx.get(url + "/admin/split", timeout=30).json()
    d1 = next(c for c in stack.children if c.name == "decode-d1")
    os.killpg(d1.proc.pid, signal.SIGKILL)
    d1.proc.wait(30)
    after_fail = _send(url, 20, offset=200)
    fail_roots = _roots(db, [t for _, t, _ in after_fail])
    by_mode: dict[str, list[int]] = {"push": [], "pull": []}
    for s, tid, text in after_fail:
        root = fail_roots[tid][0]
        by_mode[root[sc.ATTR_MODE]].append(s)
        if root[sc.ATTR_MODE] == "pull":
            assert s in (502, 504) and "decode" in text, (s, text[:300])
            assert root[sc.ATTR_OUTCOME] != "ok" and "decode" in root.get(sc.ATTR_ERROR, ""), root
    assert by_mode["push"] and all(s == 200 for s in by_mode["push"]), by_mode
    after = httpx.get(url + "/admin/split", timeout=30).json()
    assert after["requests"]["pull"]["failed"] - before["requests"]["pull"]["failed"] == len(by_mode["pull"])
    assert after["requests"]["push"]["ok"] - before["requests"]["push"]["ok"] == len(by_mode["push"])
    print(f"\ncanary e2e: checks took {time.monotonic() - t_start:.0f}s after a {stack.startup_s:.0f}s start")
    stack_factory.stop()  # the stack is broken now: the next user starts a fresh one
