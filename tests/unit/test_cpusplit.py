"""CPU or wire (issue 41): the per-thread schedstat clock on this kernel, the
recorder wrapper's figures, and the handoff's split over the tiling."""

from __future__ import annotations

import os
import threading
import time

import pytest

from instrumented_connector import cputap
from kvrecord import cpuclock, cpufigures
from kvrecord import semconv as sc
from kvtrace import cpucounters, cpusplit
from kvtrace.tracemodel import Trace

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
PF, KV = T0 + 50 * MS, T0 + 70 * MS
TID = "cd" * 16

needs_schedstat = pytest.mark.skipif(cpuclock.probe()[0] is not None, reason="no per-thread schedstat here")


@needs_schedstat
def test_clock_splits_work_from_sleep_on_this_kernel():
    clock = cpuclock.CpuClock()
    t0 = clock.now()
    x = 0
    for i in range(300_000):  # on a CPU
        x += i
    time.sleep(0.05)  # off a CPU: the counters do not move
    t1 = clock.now()
    w = cpufigures.window(clock.rings.get(threading.get_native_id()), t0, t1)
    wall = (t1 - t0) / 1e9
    assert w is not None and w.on_s > 0
    assert w.on_s + w.wait_s <= wall + 0.001  # closure: on + wait <= wall
    assert wall - w.on_s - w.wait_s >= 0.045  # the sleep is off-CPU
    # a reading after the end is not used for it; none before the start: unknown, not 0
    assert cpufigures.window(clock.rings.get(threading.get_native_id()), t0 - 10**9, t1) is None


@needs_schedstat
def test_spinner_found_and_interpolated():
    stop = threading.Event()
    before = cpuclock.thread_ids()
    th = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    sleeper = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    sleeper.start()
    try:
        # a busy machine may keep the spinner off a CPU for most of one sample (and its schedstat wait shows only
        # once it runs again): it is found within a few samples, the sleeper in none
        seen: list[set[int]] = []
        for _ in range(10):
            seen.append(cpuclock.find_spinners(cpuclock.thread_ids() - before, 0.3))
            if th.native_id in seen[-1]:
                break
        assert th.native_id in seen[-1] and not any(sleeper.native_id in f for f in seen), seen
        found = seen[-1]
        clock = cpuclock.CpuClock()
        clock.watch_spinners(found)
        a = clock.now()
        clock.sample()  # spinners are read once per engine step
        time.sleep(0.1)
        b = clock.now()
        clock.sample()
        time.sleep(0.1)
        c = clock.now()
        clock.sample()
        start = a + (b - a) // 2
        w = cpufigures.spinner_window(clock.rings.get(th.native_id), start, c)
        # interpolated within the readings around each end, never past the window's wall time; it spun, so the
        # window holds some of its runnable time (how much depends on how often it got a CPU since its last reading)
        wall = (c - start) / 1e9
        assert w is not None and 0 < w.on_s + w.wait_s <= wall + 1e-6, (w, wall)
    finally:
        stop.set()
        th.join(5)
        sleeper.join(5)


def test_unavailable_is_unknown_with_its_reason(monkeypatch):
    monkeypatch.setenv(cpuclock.ENV, "0")
    clock = cpuclock.CpuClock()
    assert not clock.enabled and "KVLENS_CPU_ACCOUNTING=0" in clock.unknown
    monkeypatch.setattr(cputap, "_CLOCK", clock)
    attrs = cputap.figures(sc.Phase.WRITE_POST, T0, T0 + MS, {})
    assert attrs == {sc.ATTR_CPU_UNKNOWN: clock.unknown}  # no 0s


@needs_schedstat
def test_recorder_wrapper_puts_figures_on_spans_and_lookback_on_all(monkeypatch):
    got = []

    class Sink:
        role = "prefill"

        def record(self, *a):
            got.append(a)

    clock = cpuclock.CpuClock()
    monkeypatch.setattr(cputap, "_CLOCK", clock)
    rec = cputap.CpuRecorder(Sink())
    t0 = clock.now()
    time.sleep(0.002)
    clock.sample()
    time.sleep(0.01)
    t1 = clock.now()
    rec.record(sc.Phase.WRITE_POST, "r1", t0, t1, "ok", None)
    rec.point(sc.Phase.KV_READY, "r1", "ok", None)
    attrs = got[0][5]
    assert attrs[sc.ATTR_CPU_TID] == threading.get_native_id()
    assert attrs[sc.ATTR_CPU_ON_S] + attrs[sc.ATTR_CPU_WAIT_S] <= (t1 - t0) / 1e9 + 0.001
    point = got[1][5]
    assert got[1][2] == got[1][3] and sc.ATTR_CPU_ON_S not in point  # a point: no span figures ...
    ages = point[sc.ATTR_CPU_BEFORE_AGE_S]  # ... but the thread's readings before it, youngest first
    # youngest first; the oldest is t0's, over 12 ms back (a busy host adds a young one from the record call)
    assert ages == sorted(ages) and ages[-1] > 0.009 and len(ages) == len(point[sc.ATTR_CPU_BEFORE_WAIT_S])
    assert rec.role == "prefill"  # everything else delegated
    assert os.environ.get(cpuclock.ENV, "1") != "0"


def _span(name, role, start, end, **attrs):
    return {"name": name, "role": role, "start_ns": start, "end_ns": end, "outcome": "ok", "attributes": attrs}


def _trace(spans):
    summary = {
        "trace_id": TID,
        "request_id": TID,
        "mode": "push",
        "outcome": "ok",
        "start_ns": T0,
        "end_ns": T0 + 100 * MS,
        "prefill_finished_ns": PF,
        "kv_ready_ns": KV,
        "handoff_s": (KV - PF) / 1e9,
        "n_spans": len(spans),
    }
    return Trace.from_rows(summary, spans)


def test_handoff_split_over_the_tiling():
    cpu = {sc.ATTR_CPU_ON_S: 0.001, sc.ATTR_CPU_WAIT_S: 0.004}
    wire = {sc.ATTR_CPU_ON_S: 0.002, sc.ATTR_CPU_WAIT_S: 0.006, sc.ATTR_NIXL_XFER_S: 0.005}
    wire |= {sc.ATTR_CPU_NOTICED_ON_S: 0.001, sc.ATTR_CPU_NOTICED_WAIT_S: 0.002}
    wire |= {sc.ATTR_CPU_PROGRESS_ON_S: 0.009, sc.ATTR_CPU_PROGRESS_WAIT_S: 0.001, sc.ATTR_CPU_PROGRESS_SPINS: True}
    tr = _trace(
        [
            _span("prefill.finished", "prefill", PF, PF),
            _span("write.post", "prefill", PF, PF + 8 * MS, **cpu),
            _span("write.complete", "prefill", PF + 8 * MS, PF + 18 * MS, **wire),
            _span("kv.ready", "decode", KV, KV),
        ]
    )
    h = cpusplit.handoff_cpu(tr)
    assert h.handoff_s == pytest.approx(0.020)
    # write.post whole (8 ms: 4 ms wait); write.noticed (the 5 ms after NIXL's transfer) its own 2 ms wait;
    # write.wire (the transfer, its threads poll): neither, with the reason
    assert h.cpu_wait_s == pytest.approx(0.004 + 0.002)
    assert h.cpu_on_s == pytest.approx(0.001 + 0.001)
    assert h.phases_wait_s["write.wire"] is None and h.notes["write.wire"] == cpusplit.WIRE_NOTE
    assert h.phases_wait_s["write.noticed"] == pytest.approx(0.002)
    assert h.unknown_s == pytest.approx(0.005 + 0.002)  # the wire, and write.notify (no readings before kv.ready)
    assert h.off_cpu_s == pytest.approx(0.020 - 0.006 - 0.002 - 0.007)
    assert "progress thread" in h.notes
    j = tr.to_json()
    assert j["handoff_cpu_wait_s"] == pytest.approx(0.006)
    assert j["phases_s"]["write.wire"] == pytest.approx(0.005)  # derived phases in phases_s
    assert j["wire_progress_cpu_s"]["write.complete"]["wait_s"] == 0.001


def test_no_figures_is_unknown_not_zero():
    tr = _trace(
        [
            _span("prefill.finished", "prefill", PF, PF),
            _span("write.post", "prefill", PF, KV, **{sc.ATTR_CPU_UNKNOWN: "turned off"}),
            _span("kv.ready", "decode", KV, KV),
        ]
    )
    h = cpusplit.handoff_cpu(tr)
    assert h.cpu_wait_s is None and h.cpu_on_s is None and h.off_cpu_s is None
    assert h.phases_wait_s["write.post"] is None and h.notes["write.post"] == "turned off"


@needs_schedstat
def test_two_events_handed_one_dict_keep_their_own_figures(monkeypatch):
    """descriptor.prep and the post are recorded with one attribute dict: each
    span keeps its own figures (a 38 µs prep showed the post's 25 ms before)."""
    got = []

    class Sink:
        def record(self, *a):
            got.append(a)

    clock = cpuclock.CpuClock()
    monkeypatch.setattr(cputap, "_CLOCK", clock)
    rec = cputap.CpuRecorder(Sink())
    t0 = clock.now()
    t1 = clock.now()
    x = 0
    for i in range(200_000):
        x += i
    t2 = clock.now()
    shared = {sc.ATTR_BLOCKS: 3}
    rec.record(sc.Phase.DESCRIPTOR_PREP, "r", t0, t1, "ok", shared)
    rec.record(sc.Phase.WRITE_POST, "r", t1, t2, "ok", shared)
    prep, post = got[0][5], got[1][5]
    assert prep is not post and sc.ATTR_CPU_ON_S not in shared
    assert prep[sc.ATTR_CPU_ON_S] <= (t1 - t0) / 1e9 + 0.001 < post[sc.ATTR_CPU_ON_S]


def test_derived_phase_takes_the_ending_threads_readings():
    """write.notify ends at D's kv.ready: the readings of the thread that
    stamped it, the nearest before the phase's start, scaled to its length."""
    lb = {
        sc.ATTR_CPU_BEFORE_AGE_S: [0.0005, 0.0012, 0.004],
        sc.ATTR_CPU_BEFORE_ON_S: [0.0001, 0.0002, 0.0008],
        sc.ATTR_CPU_BEFORE_WAIT_S: [0.0003, 0.0009, 0.003],
    }
    wc = {sc.ATTR_CPU_ON_S: 0.0, sc.ATTR_CPU_WAIT_S: 0.0}
    tr = _trace(
        [
            _span("prefill.finished", "prefill", PF, PF),
            _span("write.post", "prefill", PF, PF + 18 * MS, **wc),
            _span("write.complete", "prefill", PF + 18 * MS, KV - MS, **wc),
            _span("kv.ready", "decode", KV, KV, **lb),  # write.notify: the last 1 ms
        ]
    )
    h = cpusplit.handoff_cpu(tr)
    # 1 ms long: the reading 1.2 ms back (0.2 ms further: within half the length + 1 ms), scaled 1/1.2
    assert h.phases_wait_s["write.notify"] == pytest.approx(0.0009 / 1.2)
    assert h.cpu_wait_s == pytest.approx(0.0009 / 1.2)
    far = {k: v[2:] for k, v in lb.items()}  # only a reading 4 ms back: too far for a 1 ms phase
    assert cpucounters.derived_figures(MS, [type("S", (), {"attributes": far})()]) is None


@needs_schedstat
def test_upstream_thread_of_another_process_is_read_per_step(tmp_path):
    """The engine's upstream thread (a worker's EngineCore, an EngineCore's API
    server) lives in another process: its wait is read from schedstat."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.001)"])
    try:
        clock = cpuclock.CpuClock()
        key = clock.watch_upstream(child.pid)
        assert key == -child.pid and clock.upstream == key

        def read_once() -> None:  # a reading preempted past 50 µs is dropped (a busy host): try again
            n = len(clock.rings[key])
            for _ in range(200):
                clock.sample()
                if len(clock.rings[key]) > n:
                    return
            raise AssertionError("no upstream reading kept in 200 tries")

        read_once()
        t0 = time.time_ns()
        time.sleep(0.05)
        read_once()
        t1 = time.time_ns()
        w = cpufigures.window(clock.rings.get(key), t0, t1)
        assert w is not None and w.wait_s >= 0 and w.on_s >= 0
    finally:
        child.kill()
        child.wait(10)
    assert cpuclock.CpuClock().watch_upstream(child.pid) is None  # gone: nothing to read, no error


def test_upstream_wait_adds_to_the_phase_capped_by_its_off_cpu_time():
    a = {sc.ATTR_CPU_ON_S: 0.002, sc.ATTR_CPU_WAIT_S: 0.001, sc.ATTR_CPU_UP_WAIT_S: 0.004}
    assert cpucounters.span_figures(a, 0.010).wait_s == pytest.approx(0.005)
    assert cpucounters.span_figures(a, 0.004).wait_s == pytest.approx(0.002)  # 10 ms - 2 ms on-CPU caps it
    assert cpucounters.span_figures(a).wait_s == pytest.approx(0.001)  # the thread's own, where the wall is not given


@needs_schedstat
def test_a_thread_that_exits_costs_only_its_own_readings():
    """The spinner a clock watches exits: the clock stops reading it and keeps
    working (a failed read never turns the figures off)."""
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    clock = cpuclock.CpuClock()
    clock.watch_spinners({th.native_id})
    clock.sample()
    stop.set()
    th.join(5)
    time.sleep(0.05)
    clock.sample()
    assert clock.enabled and th.native_id not in clock.spinners
    t0 = clock.now()
    t1 = clock.now()
    assert cpufigures.window(clock.rings.get(threading.get_native_id()), t0, t1) is not None
