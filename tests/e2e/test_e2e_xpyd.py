"""End-to-end: several P and D instances (2P2D on real vLLM, tiny model)
behind kvlens' router in the 2P1D and 1P2D shapes, push and pull, and
behind vLLM's own router (``vllm-router`` from PyPI, pull).

One stack start per mode: the 2P2D stack's own router balances over all
four instances; two more ``kvlens proxy`` processes route the same
instances as 2P+1D and 1P+2D. In pull, vLLM's router sits in front of the
same instances too, and its requests carry no kvlens header at all: their
traces must join P and D by what vLLM itself passes (the request id it
puts on both, the ``kv_transfer_params``), get a TTFT from the engines'
own timestamps and name >= 90 % of the handoff at the median.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from kvtrace import store, tracemodel
from kvrecord.ports import free_port
from e2e_client import send_completions

pytestmark = pytest.mark.e2e

#: requests per router and shape: enough that round robin covers every pair
N = 8


@contextlib.contextmanager
def _proxy(stack, prefills, decodes, dispatch: str):
    """A ``kvlens proxy`` over a subset of the stack's instances, writing the
    stack's store; stopped by its process group whatever happens."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "kvlens.cli",
        "proxy",
        "--mode",
        stack.mode,
        "--dispatch",
        dispatch,
        "--port",
        str(port),
    ]
    for p in prefills:
        argv += ["--prefill", p.url, "--prefill-engine-id", p.engine_id, "--prefill-side-port", str(p.side_port)]
    for d in decodes:
        argv += ["--decode", d.url, "--decode-engine-id", d.engine_id]
    env = {**os.environ, "KVLENS_HOME": str(stack.kvlens_home)}
    log = open(os.path.join(str(stack.log_dir), f"proxy-{port}.log"), "wb")
    # a group of its own in our session: a session of its own would get a few % of the CPU next to the
    # stack's spinning NIXL threads (kvrecord/children.py)
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"kvlens proxy exited {proc.returncode}; see {log.name}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "kvlens proxy not healthy in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _send(url: str, n: int, *, kvlens_id: bool) -> list[str]:
    return send_completions(url, n, tag="xpyd", kvlens_id=kvlens_id)


def _wait(db, trace_ids, source: str, *, timeout=90.0) -> dict[str, tracemodel.Trace]:
    """Until every trace is joined, settled and has its TTFT from ``source``
    (the engines' TTFT can settle before the router's root span, which ends
    after the response, arrives and replaces it)."""
    deadline = time.time() + timeout
    while True:
        with store.reading(db) as conn:
            got = tracemodel.find(conn, trace_ids)
        done = all(
            t in got
            and got[t].handoff_s is not None
            and got[t].ttft_s is not None
            and got[t].ttft_source == source
            and got[t].half is None
            for t in trace_ids
        )
        if done or time.time() > deadline:
            return got
        time.sleep(0.5)


def _check(got, trace_ids, mode, *, pes, des, ttft_source):
    assert set(got) == set(trace_ids), f"{len(set(trace_ids) - set(got))} requests without a trace"
    pairs = set()
    for tid in trace_ids:
        tr = got[tid]
        assert tr.mode == mode and tr.outcome == "ok", (tid, tr.mode, tr.outcome)
        assert tr.half is None, (tid, tr.p_engine, tr.d_engine)
        assert tr.handoff_s is not None and tr.handoff_s > 0, (tid, tr.handoff_note)
        assert tr.ttft_s is not None and tr.ttft_source == ttft_source, (tid, tr.ttft_source)
        pairs.add((tr.p_engine, tr.d_engine))
    assert {p for p, _ in pairs} == set(pes) and {d for _, d in pairs} == set(des), pairs
    return pairs


def _pair_windows(db, pairs, trace_ids):
    """Each (P, D) pair's settled clock interval comes from its own traces
    (this test's: the session's other stacks share the store and engine ids)."""
    with store.reading(db) as conn:
        rows = [
            r
            for r in store.slowest(conn, 10_000, order="start", trace_ids=trace_ids)
            if (r["p_engine"], r["d_engine"]) in pairs
        ]
    for pair in pairs:
        mine = [r for r in rows if (r["p_engine"], r["d_engine"]) == pair]
        assert mine and all(r["clock_lo_s"] is not None and r["clock_lo_s"] <= r["clock_hi_s"] for r in mine), pair


def _shapes(stack, dispatch):
    p, d = stack.prefills, stack.decodes
    return {"2P1D": (p, d[:1]), "1P2D": (p[:1], d)}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_xpyd_behind_kvlens_router(mode, xpyd_stacks):
    """2P2D through the stack's router, then 2P1D and 1P2D: one trace per
    request naming its engines, every pair with its own clock interval."""
    stack = xpyd_stacks(mode)
    db = stack.store
    dispatch = "overlapped" if mode == "push" else "sequential"
    sent = _send(stack.router_url, N, kvlens_id=True)
    mine_ids = list(sent)
    pairs = _check(_wait(db, sent, "router"), sent, mode, pes=("p0", "p1"), des=("d0", "d1"), ttft_source="router")
    assert len(pairs) >= 2
    for shape, (ps, ds) in _shapes(stack, dispatch).items():
        with _proxy(stack, ps, ds, dispatch) as url:
            ids_ = _send(url, N, kvlens_id=True)
        mine_ids += ids_
        got = _wait(db, ids_, "router")
        pairs |= _check(
            got, ids_, mode, pes=[x.engine_id for x in ps], des=[x.engine_id for x in ds], ttft_source="router"
        )
        assert all(got[t].spans and any(s.name == "relay" for s in got[t].spans) or mode == "push" for t in ids_)
    assert pairs == {(p, d) for p in ("p0", "p1") for d in ("d0", "d1")}
    _pair_windows(db, pairs, mine_ids)
    # the dashboard's per-pair view: one row per pair of this mode, each with its figures
    from dashboard.pairs import pair_table

    table = pair_table(db, None, None)
    mine = table[(table["mode"] == mode) & table["p_engine"].isin(["p0", "p1"]) & table["d_engine"].isin(["d0", "d1"])]
    assert set(zip(mine["p_engine"], mine["d_engine"])) == pairs, mine
    assert mine["handoff_p50_s"].notna().all()
    # the CLI filters by engine: only p1's requests
    with store.reading(db) as conn:
        only = tracemodel.slowest(conn, 1000, order="start", p_engine="p1", mode=mode, trace_ids=mine_ids)
    assert only and all(t.p_engine == "p1" for t in only) and len(only) < len(mine_ids)


def test_pull_behind_vllm_router(xpyd_stacks):
    """vLLM's router (round robin over 2 P and 2 D) in front of the pull
    instances: every answered request one joined trace with a handoff and
    the engines' TTFT (with its bound), the hop through vllm-router named
    as router.hop, >= 90 % of the handoff named at the median."""
    stack = xpyd_stacks("pull")
    assert stack.vllm_router_url
    sent = _send(stack.vllm_router_url, N, kvlens_id=False)
    got = _wait(stack.store, sent, "engines")
    _check(got, sent, "pull", pes=("p0", "p1"), des=("d0", "d1"), ttft_source="engines")
    shares = []
    for tid in sent:
        tr = got[tid]
        assert tr.request_id and "___prefill_addr_" in tr.request_id, tr.request_id
        assert tr.ttft_err_s is not None and tr.ttft_s > tr.handoff_s
        names = {s.name for s in tr.spans}
        assert "relay" not in names and {"router.hop", "decode.first_step"} <= names, names
        shares.append(tr.tiling().unattributed_share)
    assert statistics.median(shares) <= 0.10, shares
    with store.reading(stack.store) as conn:
        halves = tracemodel.slowest(conn, 100, order="start", half="decode") + tracemodel.slowest(
            conn, 100, order="start", half="prefill"
        )
    assert not [t for t in halves if t.trace_id in sent]
