"""CPU or wire (issue 41): placing a thread's CPU wait in time where no
reading lies at a derived phase's start: schedstat's run count (one run
since a reading: the wait lies just before it) and where another thread's
wait landed between per-step readings (an EngineCore reading its API
server). The arithmetic is exact on made-up rings; the kernel's own
counters are checked in test_cpusplit.py."""

from __future__ import annotations

import collections

import pytest

from kvrecord import cpuclock, cpufigures
from kvrecord import semconv as sc
from kvtrace import cpucounters, cpusplit
from kvtrace.tracemodel import Trace

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
TID = "ab" * 16


def _ring(*readings):
    """(t_ns, on ns, wait ns, runs) -> a ring as the clock keeps it (raw schedstat text)."""
    return collections.deque((t, on, f"{on} {wait} {runs}\n".encode()) for t, on, wait, runs in readings)


def _clock(key, *readings):
    clock = cpuclock.CpuClock()
    clock.rings[key] = _ring(*readings)
    return clock


def test_lookback_gives_the_runs_since_each_reading_only_from_a_reading_at_its_instant():
    c = _clock(7, (T0, 0, 0, 10), (T0 + 5 * MS, MS, 0, 10), (T0 + 40 * MS, 3 * MS, 20 * MS, 11))
    ages, ons, waits, runs = cpufigures.lookback(c.rings.get(7), T0 + 40 * MS)
    assert ages == pytest.approx([0.035, 0.040])
    assert waits == pytest.approx([0.020, 0.020]) and ons == pytest.approx([0.002, 0.003])
    assert runs == [1, 1]  # put on a CPU once since either (the wake-up that took the last reading)
    # no reading at the instant itself: the runs say nothing of it
    assert cpufigures.lookback(c.rings.get(7), T0 + 41 * MS)[3] == [-1, -1]


def test_lookback_keeps_the_oldest_reading_of_a_burst():
    """decode.dispatch starts at D's alloc stamp; the step's own reading follows 0.2 ms later: the phase's
    start reading must not be dropped for the younger one (then the next lay a whole idle stretch back)."""
    c = _clock(7, (T0 - 900 * MS, 0, 0, 5), (T0, 0, 0, 6), (T0 + MS // 5, MS // 5, 0, 6), (T0 + 6 * MS, MS, 4 * MS, 7))
    ages, _ons, waits, runs = cpufigures.lookback(c.rings.get(7), T0 + 6 * MS)
    assert ages == pytest.approx([0.006, 0.906]) and waits == pytest.approx([0.004, 0.004]) and runs == [1, 2]


def test_landings_bound_where_another_threads_wait_ended():
    key = -4242
    c = _clock(
        key,
        (T0, 0, 5 * MS, 1),
        (T0 + 2 * MS, 0, 5 * MS, 1),  # no growth: not a landing
        (T0 + 4 * MS, 0, 9 * MS, 2),  # 4 ms ended in (2, 4] ms
        (T0 + 6 * MS, 0, 10 * MS, 3),  # 1 ms ended in (4, 6] ms
    )
    lo, hi, grew, newest = cpufigures.landings(c.rings.get(key), T0 + 10 * MS)
    assert lo == pytest.approx([0.006, 0.008]) and hi == pytest.approx([0.004, 0.006])  # youngest first
    assert grew == pytest.approx([0.001, 0.004]) and newest == pytest.approx(0.004)
    # read, but no growth before 3 ms
    assert cpufigures.landings(c.rings.get(key), T0 + 3 * MS) == ([], [], [], pytest.approx(0.001))
    assert cpufigures.landings(c.rings.get(-1), T0) == ([], [], [], None)  # no such ring


class _S:
    def __init__(self, attrs, end_ns=0):
        self.attributes = attrs
        self.end_ns = end_ns


def test_one_run_places_the_wait_however_far_back_the_reading_is():
    lb = {
        sc.ATTR_CPU_BEFORE_AGE_S: [0.050],
        sc.ATTR_CPU_BEFORE_ON_S: [0.002],
        sc.ATTR_CPU_BEFORE_WAIT_S: [0.020],
        sc.ATTR_CPU_BEFORE_RUNS: [1],
    }
    # a 30 ms phase: the run began at most 2 ms before its end, the 20 ms wait just before that: all inside
    assert cpucounters.derived_figures(30 * MS, [_S(lb)]) == pytest.approx((0.002, 0.020, False, 0.0))
    # a 10 ms phase: only the 8 ms before the run's earliest start must be inside it
    assert cpucounters.derived_figures(10 * MS, [_S(lb)]) == pytest.approx((0.002, 0.008, False, 0.0))
    # put on a CPU three times since: the wait may lie anywhere; that reading is too far back for the old rule
    assert cpucounters.derived_figures(10 * MS, [_S({**lb, sc.ATTR_CPU_BEFORE_RUNS: [3]})]) is None
    assert cpucounters.derived_figures(10 * MS, [_S({**lb, sc.ATTR_CPU_BEFORE_RUNS: [-1]})]) is None


def test_landed_wait_counts_what_must_lie_inside_the_phase():
    end = T0 + 100 * MS  # the carrier (P's kv.released) ends here; ages are before it
    s, e = T0 + 10 * MS, T0 + 40 * MS
    landed = {  # youngest first: the wait that ended in
        # [60, 61] ms: after the phase;
        # [39, 45] ms: 3 ms that may have ended at 45 ms (42..45): nothing certain;
        # [20, 22] ms: 6 ms that began at 14 ms or later: inside;
        # [12, 13] ms: 5 ms that may have begun at 7 ms: 2 ms must be inside
        sc.ATTR_CPU_UP_LANDED_LO_S: [0.040, 0.061, 0.080, 0.088],
        sc.ATTR_CPU_UP_LANDED_HI_S: [0.039, 0.055, 0.078, 0.087],
        sc.ATTR_CPU_UP_LANDED_WAIT_S: [0.001, 0.003, 0.006, 0.005],
        sc.ATTR_CPU_UP_LANDED_NEWEST_S: 0.010,
    }
    assert cpucounters.landed_wait(s, e, [_S({}, end), _S(landed, end)]) == pytest.approx(0.006 + 0.002)
    assert cpucounters.landed_wait(s, e, [_S({}, end)]) is None
    # no reading after the phase's end (an idle EngineCore): a wait then running had not landed: unknown
    assert cpucounters.landed_wait(s, e, [_S({**landed, sc.ATTR_CPU_UP_LANDED_NEWEST_S: 0.065}, end)]) is None
    # read all along and no growth: it waited for no CPU (0, known)
    quiet = {k: [] for k in (sc.ATTR_CPU_UP_LANDED_LO_S, sc.ATTR_CPU_UP_LANDED_HI_S, sc.ATTR_CPU_UP_LANDED_WAIT_S)}
    assert cpucounters.landed_wait(s, e, [_S({**quiet, sc.ATTR_CPU_UP_LANDED_NEWEST_S: 0.010}, end)]) == 0.0
    # nothing certain, but a growth may overlap the phase (its readings 30 ms apart around the start): unknown
    wide = {**quiet, sc.ATTR_CPU_UP_LANDED_NEWEST_S: 0.010}
    wide |= {
        sc.ATTR_CPU_UP_LANDED_LO_S: [0.095],
        sc.ATTR_CPU_UP_LANDED_HI_S: [0.065],
        sc.ATTR_CPU_UP_LANDED_WAIT_S: [0.02],
    }
    assert cpucounters.landed_wait(s, e, [_S(wide, end)]) is None


def _span(name, role, start, end, **attrs):
    return {"name": name, "role": role, "start_ns": start, "end_ns": end, "outcome": "ok", "attributes": attrs}


def test_pull_respond_takes_the_routers_and_the_api_servers_wait():
    pf, relay, q, kv = T0 + 50 * MS, T0 + 80 * MS, T0 + 82 * MS, T0 + 90 * MS
    router = {  # the router's loop: one run since a reading as P's request went out, 35 ms back
        sc.ATTR_CPU_BEFORE_AGE_S: [0.035],
        sc.ATTR_CPU_BEFORE_ON_S: [0.001],
        sc.ATTR_CPU_BEFORE_WAIT_S: [0.008],
        sc.ATTR_CPU_BEFORE_RUNS: [1],
    }
    released = kv + 5 * MS
    api = {  # P's API server: 12 ms of wait ended in [70, 72] ms (inside prefill.respond, 50..80 ms)
        sc.ATTR_CPU_UP_LANDED_LO_S: [(released - (T0 + 70 * MS)) / 1e9],
        sc.ATTR_CPU_UP_LANDED_HI_S: [(released - (T0 + 72 * MS)) / 1e9],
        sc.ATTR_CPU_UP_LANDED_WAIT_S: [0.012],
        sc.ATTR_CPU_UP_LANDED_NEWEST_S: 0.001,
    }
    spans = [
        _span("prefill.finished", "prefill", pf, pf),
        _span("relay", "router", relay, relay + MS, **router),
        _span("decode.queue", "decode", q, q + 2 * MS, **{sc.ATTR_CPU_ON_S: 0.001, sc.ATTR_CPU_WAIT_S: 0.0}),
        _span("kv.ready", "decode", kv, kv),
        _span("kv.released", "prefill", released, released, **api),
    ]
    summary = {
        "trace_id": TID,
        "request_id": TID,
        "mode": "pull",
        "outcome": "ok",
        "start_ns": T0,
        "end_ns": T0 + 100 * MS,
        "prefill_finished_ns": pf,
        "kv_ready_ns": kv,
        "handoff_s": (kv - pf) / 1e9,
        "n_spans": len(spans),
    }
    h = cpusplit.handoff_cpu(Trace.from_rows(summary, spans))
    assert h.phases_wait_s["prefill.respond"] == pytest.approx(0.008 + 0.012)
    assert h.phases_on_s["prefill.respond"] == pytest.approx(0.001)  # the router's; the API server's is not read
    # a lower bound: the rest of the 30 ms is unknown, not off-CPU (P's output thread is not read)
    # (+ relay's 1 ms and decode.intake's 1 ms: no figures; the 6 ms from decode.queue's end to kv.ready: unnamed)
    assert h.unknown_s == pytest.approx((0.030 - 0.020 - 0.001) + 0.001 + 0.001 + 0.006)
    # without the router's readings: the API server's wait alone, its CPU work unknown (not 0)
    spans[1] = _span("relay", "router", relay, relay + MS)
    h = cpusplit.handoff_cpu(Trace.from_rows(summary, spans))
    assert h.phases_wait_s["prefill.respond"] == pytest.approx(0.012)
    assert h.phases_on_s["prefill.respond"] is None and "prefill.respond" not in h.notes


def test_recorder_puts_landings_on_the_engine_cores_later_events_only(monkeypatch):
    """P's kv.released and D's decode.queue carry where the API server's wait landed, where the process reads
    it (an EngineCore: its parent; a worker: its grandparent)."""
    from instrumented_connector import cputap

    got = []

    class Sink:
        def record(self, *a):
            got.append(a[5])

    up = -4242
    c = _clock(up, (T0, 0, 0, 1), (T0 + 2 * MS, 0, 3 * MS, 2))
    c.upstream = -1  # the parent read for up.wait_s: not the API server
    monkeypatch.setattr(cputap, "_CLOCK", c)
    rec = cputap.CpuRecorder(Sink())
    rec.record(sc.Phase.KV_RELEASED, "r", T0 + 5 * MS, T0 + 5 * MS)
    assert sc.ATTR_CPU_UP_LANDED_WAIT_S not in got[-1]  # the API server not read here
    c.frontend = up
    rec.record(sc.Phase.KV_RELEASED, "r", T0 + 5 * MS, T0 + 5 * MS)
    assert got[-1][sc.ATTR_CPU_UP_LANDED_WAIT_S] == pytest.approx([0.003])
    assert got[-1][sc.ATTR_CPU_UP_LANDED_LO_S] == pytest.approx([0.005]) and got[-1][sc.ATTR_CPU_UP_PID] == 4242
    assert got[-1][sc.ATTR_CPU_UP_LANDED_NEWEST_S] == pytest.approx(0.003)
    rec.record(sc.Phase.DECODE_QUEUE, "r", T0 + 3 * MS, T0 + 5 * MS)
    assert got[-1][sc.ATTR_CPU_UP_LANDED_HI_S] == pytest.approx([0.003])
    rec.record(sc.Phase.WRITE_POST, "r", T0 + 3 * MS, T0 + 5 * MS)
    assert sc.ATTR_CPU_UP_LANDED_WAIT_S not in got[-1]  # other events: none


def test_the_api_server_is_read_once_where_it_is_the_upstream():
    import os

    c = cpuclock.CpuClock()
    me = os.getpid()
    assert c.watch_frontend(me) == -me and c.frontend == -me  # a process of its own: its own ring
    assert c.watch_upstream(me) == -me and c._front is None and c.frontend == -me  # now the upstream's ring serves
    for _ in range(200):  # read once per step (a reading preempted past 50 µs is dropped: a busy host)
        c.sample()
        if c.rings[-me]:
            break
    assert c.rings[-me] and len(c.rings[-me][0]) == 4  # its wait parsed as it is read


def test_a_workers_api_server_is_its_grandparent():
    import os

    from instrumented_connector import cputap

    assert cputap._parent(os.getpid()) == os.getppid()  # /proc/<pid>/stat's 4th field, past the command's ")"
