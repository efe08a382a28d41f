"""CPU or wire (issue 41), known answers on the real stacks the suite starts
anyway: CPU contention injected while a stack serves must show up as CPU
wait in the phases, not as off-CPU (the wire), and requests after it come
back; every phase's figures close (on + wait <= wall).

The link-delay answer (a delay must show up outside CPU wait) is in
``test_e2e_links.py``, on the links stack.

Contention: one SCHED_FIFO process per CPU holding it 30 ms of every 40 ms
(tests/cpuhog.py); a plain busy process per CPU beside it, reported only
(with autogroups it moves the handoff little: docs/phases.md).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_client import send_completions

from kvtrace import cpucounters, cpusplit, schedtrace, store, tracemodel

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
N = 12
#: the share of the rise in the phases with figures that must appear as CPU wait, by mode. Push's phases
#: are its own threads' (measured here: 96 % of a 63 ms rise; 84 % of 190 ms on a busier machine). Pull's path
#: runs through threads kvlens reads too seldom: prefill.respond (P's API server, read by P's worker once per
#: ~30-40 ms step under the hog, and the router's loop, woken every 100 ms by uvicorn's tick) gets only the wait
#: placed in it for sure, its rest counting as unknown; read.wire (the transfer itself: its threads poll) counts
#: as neither. Pull's share varies widely from run to run on this shared 2-core machine: 15-110 % over seven
#: runs taken as the difference of two medians (the rules changing between them), 53 % and 35 % with each
#: request's own part with figures (its median, as below). 0.35 (set from one 66 % run) failed at 34.8 %, then
#: 0.25 failed at 15 % (2026-12-07): pull's counters-only share is reported, not asserted; the kernel's record
#: answers for pull (MIN_SHARE_KERNEL). docs/phases.md, "CPU or wire".
MIN_SHARE = {"push": 0.70}
#: the same share with the kernel's scheduler record (``kvlens up --sched-trace``, kvtrace.schedtrace): each
#: phase's critical path walked across threads and processes, the API server and the router's loop included,
#: and the transfer's reader starved while data waited, or the thread answering a message its process read
#: (the TCP tracepoints); the rest of a polled crossing's socket stretch (the wire, the peer's own work, a
#: sender starved with no message to answer: not told apart) is unknown, outside the
#: part with figures. The issue's 70 % for both. Before that rest was unknown (it was counted off-CPU, as the
#: wire's), pull read 67-101 % over seven runs and was held to 55 %, and a CI run read push at 63 % (1.1 ms of
#: write.wire's rise seen); with it (2026-12-07) pull 85 %, push 100 %, and with the replies a process owed
#: (Timeline.turns) pull 99 % and 99 %, push 100 % and 97 %. docs/phases.md, "Known answers".
MIN_SHARE_KERNEL = {"push": 0.70, "pull": 0.70}


def _traces(db, ids, timeout=90.0) -> dict[str, tracemodel.Trace]:
    deadline = time.time() + timeout
    while True:
        conn = store.connect(db, readonly=True)
        try:
            got = tracemodel.find(conn, ids)
        finally:
            conn.close()
        done = [t for t in got.values() if t.handoff_s is not None and t.kv_ready_ns is not None]
        if len(done) == len(ids) or time.time() > deadline:
            return {t.trace_id: t for t in done}
        time.sleep(0.5)


def _hogs(seconds: float, fifo: bool) -> list[subprocess.Popen]:
    procs = []
    for cpu in sorted(os.sched_getaffinity(0)):
        argv = [sys.executable, str(REPO / "tests" / "cpuhog.py"), "--cpu", str(cpu), "--seconds", str(seconds)]
        p = subprocess.Popen(argv + (["--fifo"] if fifo else []), stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready", "hog did not start"
    return procs


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _batch(stack, tag: str) -> dict:
    ids = send_completions(stack.router_url, N, tag=tag, base_tokens=60, step_tokens=5)
    trs = _traces(stack.store, ids)
    assert len(trs) == N, f"{tag}: {len(trs)} of {N} traces complete"
    return _figures(trs)


def _figures(trs: dict, sched=None) -> dict:
    """A batch's medians: from the per-thread counters, or with ``sched`` the kernel's record."""
    splits = [cpusplit.handoff_cpu(t, sched) for t in trs.values()]
    unknown_by_phase: dict[str, list[float]] = {}
    for t, h in zip(trs.values(), splits):
        for (_role, name), ns in t.tiling().phases.items():
            if h.phases_wait_s.get(name) is None:
                unknown_by_phase.setdefault(name, []).append(ns / 1e9)
    return {
        "unknown_phases": {k: round(statistics.median(v) * 1e3, 1) for k, v in unknown_by_phase.items()},
        "handoff": statistics.median(h.handoff_s for h in splits),
        "wait": statistics.median(h.cpu_wait_s for h in splits),
        "unknown": statistics.median(h.unknown_s for h in splits),
        # per request, the part of the handoff with figures (CPU wait + work + off-CPU): its median, not the
        # difference of two medians (the unknown part varies from 0 to 160 ms per request under the hog)
        "known": statistics.median(h.handoff_s - h.unknown_s for h in splits),
        "traces": trs,
        "splits": splits,
    }


def _closure(trs) -> None:
    """On every span with figures: on-CPU + CPU wait <= wall + 1 ms, off-CPU >= 0."""
    n = 0
    for t in trs.values():
        for s in t.spans:
            fig = cpucounters.span_figures(s.attributes)
            if fig is None:
                continue
            n += 1
            wall = (s.end_ns - s.start_ns) / 1e9
            gap = s.attributes.get("kvlens.cpu.gap_s") or 0.0
            assert fig.on_s >= 0 and fig.wait_s >= 0, (s.name, fig)
            assert fig.on_s + fig.wait_s <= wall + gap + 0.001, (s.name, fig, wall, gap)
    assert n > 0, "no span carries CPU figures"


def _contention(stack, mode: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("SCHED_FIFO needs root (CI runs as root)")
    folder = Path(stack.log_dir) / f"sched-{mode}"
    with stack.record_sched(folder):  # the kernel's record of the three batches (kvlens up --sched-trace)
        before = _batch(stack, f"{mode} cpu before")
        _closure(before["traces"])
        hogs = _hogs(120, fifo=True)
        try:
            during = _batch(stack, f"{mode} cpu fifo")
        finally:
            _stop(hogs)
        after = _batch(stack, f"{mode} cpu after")
    _kernel_answer(schedtrace.load(folder), mode, before, during)
    plain = _hogs(120, fifo=False)
    try:
        busy = _batch(stack, f"{mode} cpu plain")
    finally:
        _stop(plain)
    figs = {
        k: {f: round(v[f] * 1e3, 1) for f in ("handoff", "wait", "unknown", "known")}
        for k, v in (("before", before), ("fifo", during), ("after", after), ("plain", busy))
    }
    print(f"{mode} CPU contention, handoff p50 / CPU wait p50 / unknown p50 / with figures p50 (ms): {figs}")
    print(f"{mode} phases without figures under contention (median ms): {during['unknown_phases']}")
    rise = during["handoff"] - before["handoff"]
    assert rise > 0, f"the FIFO hog did not slow the handoff: {figs}"
    wait_rise = during["wait"] - before["wait"]
    # of the rise in the phases that carry figures (the rest is derived phases in processes kvlens does not run
    # in: pull's prefill.respond is vLLM's API server; counted as unknown, never as either), >= 70 % is CPU wait
    measured_rise = during["known"] - before["known"]
    assert measured_rise > 0, f"{mode}: the part with figures did not grow: {figs}"
    print(f"{mode}: CPU wait rose {wait_rise * 1e3:.1f} ms of a {rise * 1e3:.1f} ms rise ({wait_rise / rise:.0%}), "
          f"{wait_rise / measured_rise:.0%} of the {measured_rise * 1e3:.1f} ms in phases with figures")  # fmt: skip
    if mode in MIN_SHARE:
        assert wait_rise >= MIN_SHARE[mode] * measured_rise, f"{mode}: CPU wait rose {wait_rise:.4f} s: {figs}"
    else:
        # pull, counters alone: reported, not asserted. The hog's delay lands in phases whose waiting thread the
        # counters do not read: the API server's decode.intake / decode.dispatch (+5.0 ms of a 120 ms rise left
        # with figures in one run), or D's decode.queue, whose engine loop sleeps while the API server that
        # feeds it waits for a CPU (3.5 -> 32.8 ms with 6.3 ms placed as wait in a clean clone's suite: 15 % of
        # the part with figures, against 92 % in another run). The kernel's record (above) is pull's answer.
        print(f"pull, counters alone: {wait_rise / measured_rise:.0%} of the {measured_rise * 1e3:.1f} ms rise in "
              f"phases with figures (not asserted: see MIN_SHARE)")  # fmt: skip
    # after the contention the handoff comes back (well under the contended p50)
    assert after["handoff"] < before["handoff"] + rise / 2, figs
    _closure(during["traces"])


def _polled(figs: dict) -> dict:
    """The polled crossings' median CPU wait (ms) where the record's TCP tracepoints gave one."""
    got: dict[str, list[float]] = {}
    for h in figs["splits"]:
        for name, w in h.phases_wait_s.items():
            if w is not None and h.notes.get(name) == cpusplit.NET_NOTE:
                got.setdefault(name, []).append(w)
    return {k: round(statistics.median(v) * 1e3, 1) for k, v in got.items()}


def _by_phase(figs: dict) -> dict:
    """Per phase: its median time on the path, CPU wait and CPU work (ms; None: unknown), and where its figures
    came from (K: the kernel's walk, N: the TCP tracepoints, c: the counters, -: none): what a failure needs."""
    got: dict[str, dict[str, list]] = {}
    for t, h in zip(figs["traces"].values(), figs["splits"]):
        for (_r, name), ns in t.tiling().phases.items():
            g = got.setdefault(name, {"path": [], "wait": [], "on": [], "src": set()})
            g["path"].append(ns / 1e6)
            w, o, note = h.phases_wait_s.get(name), h.phases_on_s.get(name), h.notes.get(name)
            g["wait"].append(w * 1e3 if w is not None else None)
            g["on"].append(o * 1e3 if o is not None else None)
            g["src"].add({cpusplit.KERNEL_NOTE: "K", cpusplit.NET_NOTE: "N"}.get(note, "c" if w is not None else "-"))

    def med(v):
        v = [x for x in v if x is not None]
        return round(statistics.median(v), 1) if v else None

    return {k: (med(g["path"]), med(g["wait"]), med(g["on"]), "".join(sorted(g["src"]))) for k, g in got.items()}


def _kernel_answer(sched, mode: str, before: dict, during: dict) -> None:
    """The known answer with the kernel's record: >= 70 % of the rise in the part with figures is CPU wait,
    and every phase's walked figures close (on-CPU + CPU wait <= its time on the path)."""
    kb, kd = _figures(before["traces"], sched), _figures(during["traces"], sched)
    for h, t in zip(kd["splits"], during["traces"].values()):
        path = {name: ns / 1e9 for (_r, name), ns in t.tiling().phases.items()}
        for name, w in h.phases_wait_s.items():
            if w is not None and h.notes.get(name) in (cpusplit.KERNEL_NOTE, cpusplit.NET_NOTE):
                assert w + (h.phases_on_s.get(name) or 0.0) <= path[name] + 1e-6, (name, w, path[name])
    figs = {k: {f: round(v[f] * 1e3, 1) for f in ("handoff", "wait", "unknown", "known")} for k, v in
            (("before", kb), ("fifo", kd))}  # fmt: skip
    known_rise = kd["known"] - kb["known"]
    wait_rise = kd["wait"] - kb["wait"]
    print(f"{mode} with the kernel's record, handoff / CPU wait / unknown / with figures p50 (ms): {figs}; "
          f"CPU wait rose {wait_rise * 1e3:.1f} ms of {known_rise * 1e3:.1f} ms with figures "
          f"({wait_rise / known_rise:.0%}), of a {(kd['handoff'] - kb['handoff']) * 1e3:.1f} ms rise "
          f"({wait_rise / (kd['handoff'] - kb['handoff']):.0%} of it); "
          f"phases without figures (median ms): {kd['unknown_phases']}; polled crossings' CPU wait from the TCP "
          f"tracepoints (median ms, before / fifo): {_polled(kb)} / {_polled(kd)}")  # fmt: skip
    print(f"{mode} per phase with the kernel's record, (path, CPU wait, CPU work) median ms and source, before: "
          f"{_by_phase(kb)}; fifo: {_by_phase(kd)}")  # fmt: skip
    assert known_rise > 0, figs
    assert wait_rise >= MIN_SHARE_KERNEL[mode] * known_rise, (mode, figs)


def test_push_cpu_contention_is_cpu_wait(push_stack):
    _contention(push_stack, "push")


def test_pull_cpu_contention_is_cpu_wait(pull_stack):
    _contention(pull_stack, "pull")
