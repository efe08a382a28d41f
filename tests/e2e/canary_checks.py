"""The canary's checks on a live mixed fleet (one push pair, one pull pair
behind one kvlens router at split push=0.5), run by the demo's test
(tests/e2e/test_e2e_demo.py) against the fleet ``kvlens demo`` keeps live:
one 4-server start for the demo and the canary together.

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

The demo's own gentle load goes through the same router meanwhile (split
requests too): every check selects the test's own requests by their trace
ids, and a count the load adds to is checked as "at least".

Old single-mode checks folded in (they need a kvlens router over several
instances, which this fleet is): the round robin within a mode naming each
request's P and D on the root span, the router's ``/health`` listing every
instance, ``stack.json`` recording each instance's mode.
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
from pathlib import Path

import httpx
import psutil

from kvrecord import semconv as sc
from proxy.sse import has_text, parse_data_line
from kvtrace import store, tracemodel

#: requests drawn at the default split (enough for >= 10 per mode in one
#: prompt-length bucket with near certainty: P(push < 10 of 60) ~ 1e-8)
N = 60
#: the binomial tolerance of the push count: 4 standard deviations
#: (a false alarm once in ~16,000 runs)
SIGMAS = 4.0
WANT_P = {"push": "p0", "pull": "p1"}
WANT_D = {"push": "d0", "pull": "d1"}


def _body(i: int, stream: bool) -> dict:
    return {
        "prompt": f"canary {i} " + "tokens " * (20 + 7 * (i % 9)),
        "max_tokens": 6,
        "ignore_eos": True,  # vLLM's: all 6 tokens, whatever the tiny model makes of them
        "temperature": 0,
        "stream": stream,
    }


def streamed(i: int) -> bool:
    """Three requests in four stream (TPOT is measured on streams); the fourth does not."""
    return i % 4 != 3


def _text_events(body: str) -> int:
    """SSE events with generated text in a streamed answer."""
    return sum(1 for line in body.splitlines() if (ev := parse_data_line(line)) is not None and has_text(ev))


def post(url: str, i: int, stream: bool, headers: dict | None = None) -> tuple[int, str, str]:
    """(status, trace id, body text) of one completion through the router."""
    sent = uuid.uuid4().hex
    with httpx.Client(timeout=180) as c:
        r = c.post(url + "/v1/completions", json=_body(i, stream), headers={"X-Request-Id": sent, **(headers or {})})
        tid = r.headers.get("x-request-id") or sent
        return r.status_code, tid, r.text


def send(url: str, n: int, *, offset: int = 0, headers: dict | None = None, workers: int = 4) -> list:
    """``n`` requests (:func:`streamed` says which stream), ``workers`` at a time."""
    with cf.ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(post, url, offset + i, streamed(i), headers) for i in range(n)]
        return [f.result() for f in futs]


def roots(db, tids: list[str], *, timeout: float = 90.0) -> dict[str, list[dict]]:
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


def cli(home: Path, db, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLENS_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", *args, "--store", db.text],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def check_fleet(url: str, manifest: dict) -> None:
    """Each instance's mode in stack.json and the router's /health, at the default split."""
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


def check_split(url: str, db) -> tuple[list, dict[str, str]]:
    """:data:`N` requests at the default split: every one answered and traced
    once, with its mode. Returns (the results, trace id -> mode drawn)."""
    results = send(url, N)
    assert all(s == 200 for s, _, _ in results), [(s, b[:200]) for s, _, b in results if s != 200]
    tids = [t for _, t, _ in results]
    assert len(set(tids)) == N
    got_roots = roots(db, tids)
    assert all(len(got_roots.get(t, [])) == 1 for t in tids), {t: len(got_roots.get(t, [])) for t in tids}
    got = _settled(db, tids)
    drawn = {}
    for i, (_status, tid, text) in enumerate(results):
        root = got_roots[tid][0]
        mode = root[sc.ATTR_MODE]
        drawn[tid] = mode
        assert root[sc.ATTR_SPLIT] == 0.5, root
        assert root[sc.ATTR_DISPATCH] == ("overlapped" if mode == "push" else "sequential"), root
        tr = got[tid]
        # P's and D's own spans agree: the trace's mode, and that mode's instances
        want = (mode, WANT_P[mode], WANT_D[mode], "ok")
        assert (tr.mode, tr.p_engine, tr.d_engine, tr.outcome) == want, (tid, tr.mode, tr.p_engine, tr.d_engine)
        assert tr.handoff_s is not None and tr.handoff_s > 0, (tid, tr.handoff_note)
        assert (root[sc.ATTR_PREFILL_ENGINE_ID], root[sc.ATTR_DECODE_ENGINE_ID]) == (WANT_P[mode], WANT_D[mode])
        # what the verdict needs: prompt tokens from P's answer, TPOT for streams (6 tokens)
        assert isinstance(root.get(sc.ATTR_TOKENS), int) and root[sc.ATTR_TOKENS] > 20, root
        if streamed(i) and _text_events(text) >= 2:  # two tokens or more: a TPOT
            assert root.get(sc.ATTR_TPOT_S) is not None and root[sc.ATTR_TPOT_S] > 0, root
    n_push = sum(m == "push" for m in drawn.values())
    tol = SIGMAS * math.sqrt(N * 0.5 * 0.5)
    assert abs(n_push - N * 0.5) <= tol, f"{n_push} of {N} drawn push at weight 0.5 (tolerance {tol:.1f})"
    return results, drawn


def check_forced_mode(url: str, db) -> None:
    """A request that names its mode: no draw, no weight; a bad mode refused."""
    s, forced, _ = post(url, 0, False, {"X-Kvlens-Mode": "pull"})
    assert s == 200
    root = roots(db, [forced])[forced][0]
    assert root[sc.ATTR_MODE] == "pull" and sc.ATTR_SPLIT not in root, root
    bad = httpx.post(url + "/v1/completions", json=_body(0, False), headers={"X-Kvlens-Mode": "both"}, timeout=30)
    assert bad.status_code == 400 and "X-Kvlens-Mode" in bad.json()["error"]["message"], bad.text


def check_verdict_and_whatif(home: Path, db, drawn: dict[str, str]) -> None:
    """``kvlens verdict --json`` on the split-assigned requests (the test's
    and the demo load's: counts at least the test's), both what-ifs."""
    tids = list(drawn)
    n_push = sum(m == "push" for m in drawn.values())
    v = cli(home, db, "verdict", "--json", "--window", "1h")
    assert v.returncode == 0, v.stderr
    verdict = json.loads(v.stdout)
    assert verdict["status"] == "ok" and verdict["selection"] == "split", verdict["message"]
    assert verdict["requests_used"] >= N, (verdict["requests_used"], N)
    counts = verdict["counts"]
    assert sum(counts["push"].values()) >= n_push and sum(counts["pull"].values()) >= N - n_push, counts
    assert set(verdict["ratios"]) == {"ttft_p50", "ttft_p90", "handoff_p50", "tpot_p50", "handoff_nowait_p50"}
    # issue 41: the real connector's spans carry CPU figures: each mode's CPU-wait share of the handoff is a
    # number, said in words, and the handoff without CPU wait gets its own stratified ratio (checked below)
    share = verdict["handoff_cpu_wait_share_p50"]
    assert all(isinstance(share[m], float) and 0 <= share[m] <= 1 for m in ("push", "pull")), share
    assert "waiting for a CPU" in verdict["cpu_words"], verdict["cpu_words"]
    streams = {m: sum(streamed(i) and drawn[t] == m for i, t in enumerate(tids)) for m in ("push", "pull")}
    for key, r in verdict["ratios"].items():
        if key == "tpot_p50" and min(streams.values()) < 10:  # TPOT only on streams (the load's too)
            assert r["status"] in ("not enough data", "resolved", "no resolvable difference"), (key, r, streams)
            continue
        assert r["status"] in ("resolved", "no resolvable difference"), (key, r)
        lo, hi = r["interval"]
        assert 0 < lo <= r["ratio"] <= hi, (key, r)
    for frm in ("pull", "push"):
        w = cli(home, db, "whatif", "--from", frm, "--json", "--window", "1h")
        assert w.returncode == 0, w.stderr
        got = json.loads(w.stdout)
        assert got["from"] == frm and got["status"] == "ok" and got["requests_used"] >= 5, got


def check_split_changed_live(url: str, db) -> None:
    """Everything to push, then back; bad weights refused."""
    assert httpx.post(url + "/admin/split", json={"push": 1.5}, timeout=30).status_code == 400
    assert httpx.post(url + "/admin/split", json={"both": 1}, timeout=30).status_code == 400
    r = httpx.post(url + "/admin/split", json={"pull": 0.0}, timeout=30)
    assert r.status_code == 200 and r.json()["split"] == {"push": 1.0, "pull": 0.0}, r.text
    live = send(url, 6, offset=100)
    assert all(s == 200 for s, _, _ in live)
    live_roots = roots(db, [t for _, t, _ in live])
    assert all(a[0][sc.ATTR_MODE] == "push" and a[0][sc.ATTR_SPLIT] == 1.0 for a in live_roots.values()), live_roots
    assert httpx.post(url + "/admin/split", json={"push": 0.5}, timeout=30).status_code == 200


def check_one_half_fails(url: str, db, manifest: dict) -> None:
    """The pull half's D killed (its PID from stack.json): push goes on, pull
    fails clearly, the router counts both (at least the test's: the demo's
    load adds its own)."""
    before = httpx.get(url + "/admin/split", timeout=30).json()
    pid = manifest["pids"]["decode-d1"]
    os.killpg(pid, signal.SIGKILL)  # each server leads its own process group
    deadline = time.monotonic() + 60
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"decode-d1 ({pid}) still running after SIGKILL"
        time.sleep(0.2)
    after_fail = send(url, 20, offset=200)
    fail_roots = roots(db, [t for _, t, _ in after_fail])
    by_mode: dict[str, list[int]] = {"push": [], "pull": []}
    for s, tid, text in after_fail:
        root = fail_roots[tid][0]
        by_mode[root[sc.ATTR_MODE]].append(s)
        if root[sc.ATTR_MODE] == "pull":
            assert s in (502, 504) and "decode" in text, (s, text[:300])
            assert root[sc.ATTR_OUTCOME] != "ok" and "decode" in root.get(sc.ATTR_ERROR, ""), root
    assert by_mode["push"] and all(s == 200 for s in by_mode["push"]), by_mode
    after = httpx.get(url + "/admin/split", timeout=30).json()
    assert after["requests"]["pull"]["failed"] - before["requests"]["pull"]["failed"] >= len(by_mode["pull"])
    assert after["requests"]["push"]["ok"] - before["requests"]["push"]["ok"] >= len(by_mode["push"])
