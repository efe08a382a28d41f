"""End-to-end: several P and D instances (2P2D on real vLLM, tiny model)
with tensor parallelism mixed in, pull and push, one stack start per mode:
p0 and d0 at ``--tensor-parallel-size 2`` (rank i on CPU i,
``VLLM_CPU_OMP_THREADS_BIND="0|1"``, docs/tensor-parallel.md), p1 and d1 at
TP 1, so every P -> D TP pairing (2 -> 2, 2 -> 1, 1 -> 2, 1 -> 1) is on it.
``KVLENS_TEST_TP=0`` runs the stack at TP 1 and skips the TP checks.

xPyD: the stack's own router balances over all four instances; two more
``kvlens proxy`` processes route the same instances as 2P+1D and 1P+2D.
In pull, vLLM's router sits in front of the same instances too, and its
requests carry no kvlens header at all: their traces must join P and D by
what vLLM itself passes (the request id it puts on both, the
``kv_transfer_params``), get a TTFT from the engines' own timestamps and
name >= 90 % of the handoff at the median.

TP, through a ``kvlens proxy`` over p0 (TP 2) and both D: per request one
trace with a handoff, P's two ranks and D's ranks recorded
(``kvlens.rank``), the rank the transfer waited for named, and the
handoff's unattributed share at most 10 % at the median; every rank's
worker threads on its own CPU. Pull: D's rank *i* reads P rank *i*'s KV
head (TP 2 -> 2), or D's one rank reads both (TP 2 -> 1). Push: every P rank
WRITEs its KV head to the D rank(s) holding it.

The xPyD and TP stacks were four starts, two of them the suite's longest;
folded into one per mode they are two.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import time

import httpx
import pytest

from conftest import TP_ON
from e2e_client import send_completions
from kvrecord import semconv as sc
from kvrecord.ports import free_port
from kvtrace import ranks, store, tracemodel

# the stack's start: TP 2 ranks on two cores, TP 1 instances after them (conftest.xpyd_stack)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

#: requests per router and shape: enough that round robin covers every pair
N = 8
#: requests through the TP proxy
N_TP = 6
READ_COMPLETE = sc.Phase.READ_COMPLETE.value
WRITE_COMPLETE = sc.Phase.WRITE_COMPLETE.value
KV_READY = sc.Phase.KV_READY.value


@contextlib.contextmanager
def _proxy(stack, prefills, decodes, dispatch: str):
    """A ``kvlens proxy`` over a subset of the stack's instances, writing the
    stack's store; stopped by its process group whatever happens."""
    from kvlens.stack.commands import router_argv

    port = free_port()
    # as the stack builds its own router's (per-P TP sizes included: overlapped push tells D each P's)
    argv = router_argv(
        [(p.url, p.engine_id, p.side_port, p.tp) for p in prefills],
        [(d.url, d.engine_id) for d in decodes],
        stack.mode,
        dispatch,
        "127.0.0.1",
        port,
    )
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


def _tp(stack) -> dict[str, int]:
    """engine id -> its TP size."""
    return {i.engine_id: i.tp for i in (*stack.prefills, *stack.decodes)}


#: per mode, the completion phase each rank of a role records (a TP 1 engine's carry no rank)
_DONE = {"push": {"prefill": WRITE_COMPLETE, "decode": KV_READY}, "pull": {"decode": READ_COMPLETE}}


def _all_ranks(tr: tracemodel.Trace, tp: dict[str, int]) -> bool:
    """Every rank of both engines has recorded, its completion included:
    spans arrive per process, and a rank's last one can come well after
    the trace is joined with a handoff (a push P rank's ``write.complete``
    471 ms after the other's: read before it, the trace named no straggler)."""
    seen, by_phase = ranks.tp_sizes(tr.spans), ranks.ranks_by_phase(tr.spans)
    for role, engine in (("prefill", tr.p_engine), ("decode", tr.d_engine)):
        n = tp.get(engine or "", 1)
        if seen.get(role, 1) != n:
            return False
        phase = _DONE.get(tr.mode or "", {}).get(role)
        if n > 1 and phase and len(by_phase.get((role, phase), {})) != n:
            return False
    return True


def _wait(db, trace_ids, source: str, tp: dict[str, int], *, timeout=120.0) -> dict[str, tracemodel.Trace]:
    """Until every trace is joined, settled, has its TTFT from ``source``
    (the engines' TTFT can settle before the router's root span, which ends
    after the response, arrives and replaces it) and every rank's spans."""
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
            and _all_ranks(got[t], tp)
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


def _shapes(stack):
    p, d = stack.prefills, stack.decodes
    return {"2P1D": (p, d[:1]), "1P2D": (p[:1], d)}


def _dispatch(mode: str) -> str:
    return "overlapped" if mode == "push" else "sequential"


def test_xpyd_behind_kvlens_router(xpyd_stack):
    """2P2D through the stack's router, then 2P1D and 1P2D: one trace per
    request naming its engines, every pair with its own clock interval; in
    pull, vLLM's router too (:func:`_check_vllm_router`)."""
    stack = xpyd_stack
    mode, db, dispatch = stack.mode, stack.store, _dispatch(stack.mode)
    sent = _send(stack.router_url, N, kvlens_id=True)
    mine_ids = list(sent)
    tp = _tp(stack)
    pairs = _check(_wait(db, sent, "router", tp), sent, mode, pes=("p0", "p1"), des=("d0", "d1"), ttft_source="router")
    assert len(pairs) >= 2
    for shape, (ps, ds) in _shapes(stack).items():
        with _proxy(stack, ps, ds, dispatch) as url:
            ids_ = _send(url, N, kvlens_id=True)
        mine_ids += ids_
        got = _wait(db, ids_, "router", tp)
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
    if mode == "pull":
        _check_vllm_router(stack)


def _check_vllm_router(stack) -> None:
    """vLLM's router (round robin over 2 P and 2 D) in front of the pull
    instances: every answered request one joined trace with a handoff and
    the engines' TTFT (with its bound), the hop through vllm-router named
    as router.hop, >= 90 % of the handoff named at the median."""
    assert stack.vllm_router_url
    sent = _send(stack.vllm_router_url, N, kvlens_id=False)
    got = _wait(stack.store, sent, "engines", _tp(stack))
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


def _ranks(tr: tracemodel.Trace, role: str) -> set[int]:
    return {r for s in tr.spans if s.role == role and (r := ranks.rank_of(s)) is not None}


def _check_stragglers(tid: str, tr: tracemodel.Trace, mode: str, d_ranks: int) -> None:
    """The rank the transfer waited for is named, per the mode's TP mapping
    (P at TP 2)."""
    late = {(st.role, st.phase): st for st in ranks.stragglers(tr.spans)}
    for st in late.values():
        assert st.ranks >= 2 and 0 <= st.rank < st.ranks and st.lag_s >= 0, (tid, st)
    if mode == "push":  # every P rank WRITEs its KV head; P's write.complete waits for the last
        assert ("prefill", WRITE_COMPLETE) in late, (tid, sorted(late))
        if d_ranks == 2:  # and D's kv.ready for the last of its two ranks
            assert ("decode", KV_READY) in late, (tid, sorted(late))
        return
    if d_ranks == 2:  # pull TP 2 -> 2: D rank i reads P rank i; the rank D waited for
        assert ("decode", READ_COMPLETE) in late, (tid, sorted(late))
        return
    # pull TP 2 -> 1: no second D rank to wait for; its one rank read both P ranks' KV
    assert ("decode", READ_COMPLETE) not in late, (tid, late)
    remote = {
        r
        for s in tr.spans
        if s.role == "decode" and s.name == sc.Phase.READ_POST.value
        for r in (s.attributes or {}).get(sc.ATTR_REMOTE_RANKS) or ()
    }
    assert remote == {0, 1}, (tid, remote)


@pytest.mark.skipif(not TP_ON, reason="KVLENS_TEST_TP=0")
def test_every_rank_in_every_trace(xpyd_stack):
    """P TP 2 -> D TP 2 and TP 1, through a proxy over p0 and both D."""
    stack = xpyd_stack
    mode, tp = stack.mode, _tp(stack)
    p0 = stack.prefills[0]
    assert (p0.engine_id, p0.tp) == ("p0", 2) and sorted(tp[d.engine_id] for d in stack.decodes) == [1, 2], tp
    d_tp = {d.engine_id: d.tp for d in stack.decodes}
    with _proxy(stack, [p0], stack.decodes, _dispatch(mode)) as url:
        sent = send_completions(url, N_TP, tag="tp", base_tokens=40, step_tokens=16, timeout=300)
    got = _wait(stack.store, sent, "router", tp)
    assert set(got) == set(sent), f"{len(set(sent) - set(got))} requests without a trace"
    shares, ds = [], set()
    for tid in sent:
        tr = got[tid]
        assert tr.mode == mode and tr.outcome == "ok" and tr.half is None, (tid, tr.outcome, tr.half)
        assert tr.handoff_s is not None and tr.handoff_s > 0, (tid, tr.handoff_note)
        assert tr.p_engine == "p0" and tr.d_engine in d_tp, (tr.p_engine, tr.d_engine)
        ds.add(tr.d_engine)
        assert _ranks(tr, "prefill") == {0, 1}, (tid, sorted(s.name for s in tr.spans if s.role == "prefill"))
        want = set(range(d_tp[tr.d_engine]))
        assert _ranks(tr, "decode") == want or (want == {0} and not _ranks(tr, "decode")), (tid, tr.d_engine)
        _check_stragglers(tid, tr, mode, d_tp[tr.d_engine])
        tiling = tr.tiling()
        assert tiling is not None, tid
        shares.append(tiling.unattributed_share)
    assert ds == set(d_tp), ds  # every D served
    assert statistics.median(shares) <= 0.10, shares


def _affinity(tid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:  # the thread ended meanwhile
        return None


@pytest.mark.skipif(not TP_ON, reason="KVLENS_TEST_TP=0")
def test_each_rank_runs_on_its_own_cpu(xpyd_stack):
    """After start-up every TP worker's threads are on its rank's CPU list
    (vLLM's CPU NIXL worker had moved them all to the last core)."""
    psutil = pytest.importorskip("psutil")
    from kvlens.stack.pinning import parse_rank_cpu_lists

    checked = 0
    for c in xpyd_stack.children:
        lists = parse_rank_cpu_lists(c.env.get("VLLM_CPU_OMP_THREADS_BIND"))
        if lists is None or len(lists) < 2:
            continue
        seen = {}
        for proc in psutil.Process(c.proc.pid).children(recursive=True):
            cmd = " ".join(proc.cmdline())
            for rank in range(len(lists)):
                if cmd.startswith(f"VLLM::Worker_TP{rank}"):
                    seen[rank] = {a for t in proc.threads() if (a := _affinity(t.id)) is not None}
        assert sorted(seen) == list(range(len(lists))), (c.name, sorted(seen))
        for rank, sets in seen.items():
            assert sets == {frozenset(lists[rank])}, (c.name, rank, sets)
        checked += 1
    assert checked == 2, checked  # p0 and d0
