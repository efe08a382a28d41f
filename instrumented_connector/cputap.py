"""CPU figures on every recorded phase: the recorder as the hooks see it,
plus the thread-discovery that finds NIXL's spinning progress thread.

:class:`CpuRecorder` wraps the process's recorder (like
:class:`~instrumented_connector.taps.RankedRecorder`): a span's event gets,
for the thread that records it (the thread whose wake-up ends the phase),
its on-CPU and run-queue wait over the span (``kvlens.cpu.on_s``,
``kvlens.cpu.wait_s``) from :data:`kvrecord.cpuclock.CLOCK`'s readings
(:mod:`kvrecord.cpufigures`); the
wire phases (``write.complete``, ``read.complete``) also get NIXL's progress
threads' figures, marked as spinning. Where a figure cannot be had the event
says why (``kvlens.cpu.unknown``), never 0. Points pass through unchanged.

Cost per span event: a ring walk back to the phase's start (a few entries:
the thread reads at every hook and once per engine step) and two parses,
~2-4 µs (benchmarks/bench_recorder.py); failures are logged once and the
event goes out without figures.
"""

from __future__ import annotations

import os
import threading

from kvrecord import cpuclock, cpufigures
from kvrecord import semconv as sc

from instrumented_connector.hooks import fail

_CLOCK = cpuclock.CLOCK
_tid = threading.get_native_id
_WIRE = frozenset({sc.Phase.WRITE_COMPLETE, sc.Phase.READ_COMPLETE, "write.complete", "read.complete"})
#: Events recorded in an EngineCore just after a derived phase in its API server ended: they carry where the
#: API server's CPU wait landed (:func:`landed`), which kvtrace.cpusplit places inside that phase. P's
#: ``kv.released`` (pull: D's read-done notice, after P's answer went out: ``prefill.respond``) and D's
#: ``decode.queue`` (the request's arrival -> D's alloc, just after ``decode.intake``). Value: how far
#: before the event's start to look, ns (the phase lies before it; a whole handoff back for P's).
_LANDINGS = {
    sc.Phase.KV_RELEASED: 2_000_000_000,
    "kv.released": 2_000_000_000,
    sc.Phase.DECODE_QUEUE: 500_000_000,
    "decode.queue": 500_000_000,
}
#: Seconds to let NIXL's agent start its threads before sampling them.
SPIN_SETTLE_S = 2.0


class CpuRecorder:
    """The recorder with CPU figures on span events (module docstring).
    Each span event gets its own copy of the attributes it is handed."""

    __slots__ = ("_rec",)

    def __init__(self, rec) -> None:
        self._rec = rec

    def record(self, phase, request_id, start_ns, end_ns, outcome="ok", attrs=None) -> None:
        try:
            # a copy: hooks hand one dict to two events (descriptor.prep and the post share theirs)
            attrs = {} if attrs is None else dict(attrs)
            if end_ns > start_ns:
                figures(phase, start_ns, end_ns, attrs)
            before(start_ns, attrs)
            back = _LANDINGS.get(phase)
            if back is not None:
                landed(end_ns, attrs, end_ns - start_ns + back)
        except Exception:
            fail("cpu figures")
        self._rec.record(phase, request_id, start_ns, end_ns, outcome, attrs)

    def point(self, phase, request_id, outcome="ok", attrs=None) -> None:
        t = _CLOCK.now()
        try:
            attrs = {} if attrs is None else dict(attrs)
            before(t, attrs)
        except Exception:
            fail("cpu figures")
        self._rec.record(phase, request_id, t, t, outcome, attrs)

    def __getattr__(self, name):
        return getattr(self._rec, name)


def figures(phase, start_ns: int, end_ns: int, attrs: dict) -> dict:
    """``attrs`` with the calling thread's CPU figures over the span (and the
    progress threads' on a wire phase), or the reason there are none."""
    clock = _CLOCK
    if not clock.enabled:
        attrs[sc.ATTR_CPU_UNKNOWN] = clock.unknown
        return attrs
    tid = _tid()
    rings = clock.rings
    w = cpufigures.window(rings.get(tid), start_ns, end_ns)
    if w is None:
        attrs[sc.ATTR_CPU_UNKNOWN] = "no reading of the thread at or before the phase's start"
    else:
        attrs[sc.ATTR_CPU_ON_S] = w.on_s
        attrs[sc.ATTR_CPU_WAIT_S] = w.wait_s
        attrs[sc.ATTR_CPU_GAP_S] = w.gap_s
        attrs[sc.ATTR_CPU_TID] = tid
        up = clock.upstream
        if up is not None:
            uw = cpufigures.window(rings.get(up), start_ns, end_ns)
            if uw is not None:  # a stretch that began earlier can land in the window: at most the wall
                attrs[sc.ATTR_CPU_UP_WAIT_S] = min(uw.wait_s, (end_ns - start_ns) / 1e9)
                attrs[sc.ATTR_CPU_UP_PID] = -up
    xfer = attrs.get(sc.ATTR_NIXL_XFER_S)
    if phase in _WIRE and isinstance(xfer, (int, float)) and xfer > 0:
        # the engine loop polls for DONE: its CPU wait delays the phase only once the transfer is done
        t_done = start_ns + int(xfer * 1e9)
        if t_done < end_ns:
            nw = cpufigures.window(rings.get(tid), t_done, end_ns)
            if nw is not None:
                wall = (end_ns - t_done) / 1e9
                wait = nw.wait_s
                up = clock.upstream
                if up is not None and (uw := cpufigures.window(rings.get(up), t_done, end_ns)) is not None:
                    wait = min(wait + uw.wait_s, max(wall - nw.on_s, wait))
                attrs[sc.ATTR_CPU_NOTICED_ON_S] = nw.on_s
                attrs[sc.ATTR_CPU_NOTICED_WAIT_S] = wait
    if phase in _WIRE and clock.spinners:
        on = wait = 0.0
        seen = False
        for s in clock.spinners:
            sw = cpufigures.spinner_window(rings.get(s), start_ns, end_ns)
            if sw is not None:
                on, wait, seen = on + sw.on_s, wait + sw.wait_s, True
        if seen:
            attrs[sc.ATTR_CPU_PROGRESS_ON_S] = on
            attrs[sc.ATTR_CPU_PROGRESS_WAIT_S] = wait
            attrs[sc.ATTR_CPU_PROGRESS_SPINS] = True
    psi = cpufigures.psi_some_s(clock.psi, start_ns, end_ns)
    if psi is not None:
        attrs[sc.ATTR_CPU_PSI_SOME_S] = psi
    return attrs


def before(at_ns: int, attrs: dict) -> dict:
    """``attrs`` with the calling thread's readings before ``at_ns``
    (:func:`kvrecord.cpufigures.lookback`), unless the hook already
    gave those of the thread that stamped ``at_ns`` (``writer.wake``)."""
    if sc.ATTR_CPU_BEFORE_AGE_S not in attrs:
        cpufigures.before_attrs(_CLOCK, at_ns, attrs)
    return attrs


def landed(at_ns: int, attrs: dict, max_age_ns: int = 2_000_000_000) -> dict:
    """``attrs`` with where the API server's main thread's CPU wait landed
    up to ``max_age_ns`` before ``at_ns`` (:func:`kvrecord.cpufigures.landings`),
    (:func:`watch_upstream` finds it: an EngineCore's parent, a worker's grandparent)."""
    up = _CLOCK.frontend
    if _CLOCK.enabled and up is not None:
        lo, hi, grew, newest = cpufigures.landings(_CLOCK.rings.get(up), at_ns, max_age_ns)
        if newest is not None:  # empty lists: read, and it waited for no CPU
            attrs[sc.ATTR_CPU_UP_LANDED_LO_S] = lo
            attrs[sc.ATTR_CPU_UP_LANDED_HI_S] = hi
            attrs[sc.ATTR_CPU_UP_LANDED_WAIT_S] = grew
            attrs[sc.ATTR_CPU_UP_LANDED_NEWEST_S] = newest
            attrs[sc.ATTR_CPU_UP_PID] = -up
    return attrs


def lookback_attrs(at_ns: int) -> dict:
    """The calling thread's readings before ``at_ns`` as span attributes, for
    a hook whose event another thread records (``start_load_kv`` stamps
    ``writer.wake``'s start; the writer thread records it)."""
    return before(at_ns, {})


def _is_vllm(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"vllm" in f.read().lower()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def watch_upstream(frontend: bool = False) -> None:
    """Read this process's parent's main thread once per step, where the
    parent is a vLLM process (a worker's EngineCore, an EngineCore's API
    server): the thread the engine waits on, blocked. And the API server's
    (:meth:`kvrecord.cpuclock.CpuClock.watch_frontend`): ``frontend``, this
    process runs the scheduler (an EngineCore): its parent; else (a worker,
    the scheduler elsewhere) its grandparent, until a scheduler here says
    otherwise (a one-process executor builds its worker first)."""
    if not _CLOCK.enabled:
        return
    try:
        ppid = os.getppid()
        if _is_vllm(ppid):
            _CLOCK.watch_upstream(ppid)
        api = ppid if frontend else _parent(ppid)
        if (frontend or _CLOCK.frontend is None) and api > 1 and _is_vllm(api):
            _CLOCK.watch_frontend(api)
    except Exception:
        fail("upstream thread")


def watch_new_threads(before: set[int]) -> None:
    """After a NIXL agent was built: in a short-lived daemon thread, wait
    :data:`SPIN_SETTLE_S`, then watch the threads born since ``before`` that
    spin (NIXL's UCX progress thread polls with timeout 0) at every reading.
    Nothing to do where schedstat cannot be read."""
    if not _CLOCK.enabled:
        return

    def run() -> None:
        try:
            threading.Event().wait(SPIN_SETTLE_S)
            new = cpuclock.thread_ids() - before - {_tid()}
            spin = cpuclock.find_spinners(new)
            if spin:
                _CLOCK.watch_spinners(spin | _CLOCK.spinners)
        except Exception:
            fail("progress-thread discovery")

    try:
        threading.Thread(target=run, name="kvlens-spinfind", daemon=True).start()
    except Exception:
        fail("progress-thread discovery")
