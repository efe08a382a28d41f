"""CPU or wire: a trace's handoff split into waiting for a CPU, CPU work and
the rest (docs/phases.md, "CPU or wire").

Each phase's figures come from the first source that has them
(:func:`_phase_part`). Without the kernel's record: the per-thread counters
kvlens' hooks read at phase boundaries, and their placement rules for
derived phases (:mod:`kvtrace.cpucounters`); over the handoff's tiling
(:func:`kvtrace.tiling.tile`, each ns owned by one phase), each phase
contributes its figures in proportion to the share of it that lies on the
critical path. Derived phases without figures have their time in
``unknown_s``, never counted as either.

Where the kernel's scheduler record was kept (``kvlens up --sched-trace``,
:mod:`kvtrace.schedtrace`), every phase it covers but the crossings their
threads poll for (:data:`POLLED`) takes its figures from its critical path
walked back through that record instead (:func:`kernel_figures`): the
thread that stamped its end, the threads that woke it, across processes,
up to an interrupt's wake-up (before it, off-CPU). Those figures are
exact, not bounds. Where the record kept the kernel's TCP tracepoints too,
the polled crossings get their CPU wait from it (:func:`polled_figures`: data
that had arrived, waiting for a starved reader); their CPU work stays
unknown (the pollers spin), and so does the rest of the socket stretch
(the wire, the peer and a starved sender are not told apart there).

Pure functions of a :class:`kvtrace.tracemodel.Trace`-like object.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple

from kvrecord import derived as dv
from kvrecord import semconv as sc
from kvtrace.cpucounters import PhaseCpu, derived_figures, landed_wait, noticed_figures, span_figures

#: split part -> the recorded phase it is cut from (``write.wire`` -> ``write.complete``)
_PARENT = {p.value: how.split.phase.value for p, how in dv.DERIVED_PHASES.items() if how.split is not None}
#: the transfer itself (split heads) and what follows it (split tails)
WIRE_PARTS = frozenset(p.value for p, how in dv.DERIVED_PHASES.items() if how.split is not None and how.split.head)
_NOTICED_PARTS = frozenset(
    p.value for p, how in dv.DERIVED_PHASES.items() if how.split is not None and not how.split.head
)
#: Why the transfer itself carries no CPU figures.
WIRE_NOTE = (
    "the transfer itself: the threads that move it poll (NIXL's progress thread, the engine loop checking for "
    "DONE), so their CPU wait inside it cannot be told from the wire's (a link delay and a CPU shortage both "
    "leave a poller waiting); counted as neither. Its CPU wait shows once the transfer is done (*.noticed)"
)
#: Why a derived phase carries no CPU figures.
DERIVED_NOTE = (
    "a derived phase between two processes with no reading that places its ending thread's CPU wait inside it "
    "(none near its start, the thread woken more than once since; vLLM's API server is read only by its "
    "EngineCore, once per step while it steps)"
)
#: derived phase -> its (role, recorded phase) ends, in the order tried: the thread that stamped that event's
#: start is the one the derived phase waited on
_ENDS = {
    p.value: tuple((to.role, to.phase.value) for _frm, to in how.pairs)
    for p, how in dv.DERIVED_PHASES.items()
    if how.split is None and not how.latest
}
#: derived phases whose path runs through an engine's API server (the connector's upstream thread in the
#: EngineCore): they also take that thread's wait placed inside them (:func:`landed_wait`)
_FRONTEND = frozenset({sc.Phase.PREFILL_RESPOND.value, sc.Phase.DECODE_INTAKE.value})
#: What the figures are where the thread spins (said wherever they are shown).
SPIN_NOTE = (
    "NIXL's UCX progress thread spins (polls with timeout 0): its on-CPU time includes the wait for the wire, "
    "so only its CPU wait is contention"
)


class HandoffCpu(NamedTuple):
    """A trace's handoff split (seconds; None where there is no handoff window)."""

    handoff_s: float | None
    #: waiting for a CPU (host contention), over the phases with figures
    cpu_wait_s: float | None
    #: on a CPU (work, or polling where the thread spins), over the phases with figures
    cpu_on_s: float | None
    #: critical-path time in phases without figures (derived; unknown), and the tiling's unnamed gaps
    unknown_s: float | None
    #: per phase name: its critical-path CPU wait (None: unknown, with the reason in ``notes``)
    phases_wait_s: dict[str, float | None]
    phases_on_s: dict[str, float | None]
    notes: dict[str, str]

    @property
    def off_cpu_s(self) -> float | None:
        """The rest: blocked (the wire, the peer, a lock), over the phases with figures."""
        if self.handoff_s is None or self.cpu_wait_s is None:
            return None
        return max(self.handoff_s - self.cpu_wait_s - self.cpu_on_s - (self.unknown_s or 0.0), 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "handoff_cpu_wait_s": self.cpu_wait_s,
            "handoff_cpu_on_s": self.cpu_on_s,
            "handoff_cpu_unknown_s": self.unknown_s,
            "handoff_off_cpu_s": self.off_cpu_s,
            "phases_cpu_wait_s": self.phases_wait_s,
            "phases_cpu_on_s": self.phases_on_s,
            "cpu_notes": self.notes,
        }


def _longest(spans: Iterable[Any]) -> dict[tuple[str | None, str], Any]:
    """(role, name) -> the longest recorded span (the slowest TP rank's)."""
    out: dict[tuple[str | None, str], Any] = {}
    for s in spans:
        if (s.attributes or {}).get(sc.ATTR_DERIVED):
            continue
        k = (s.role, s.name)
        if k not in out or s.end_ns - s.start_ns > out[k].end_ns - out[k].start_ns:
            out[k] = s
    return out


def kernel_figures(sched: Any, name: str, start_ns: int, end_ns: int, tid: int | None) -> PhaseCpu | None:
    """A phase's figures from the kernel's record (:class:`kvtrace.schedtrace.Timeline`):
    its critical path walked back from ``tid``, the thread that stamped its
    end (:func:`ending_tid`). None where the record does not cover the phase,
    no thread is known, or the phase is a crossing its threads poll for
    (:data:`POLLED`: the transfer itself, push's notification). What the walk does not reach is off-CPU:
    waiting for an interrupt's wake-up (the wire, a peer on another host, a
    timer)."""
    if sched is None or tid is None or name in POLLED or end_ns <= start_ns or not sched.covers(start_ns, end_ns):
        return None
    w = sched.walk(tid, start_ns, end_ns)
    return PhaseCpu(w.on_ns / 1e9, w.wait_ns / 1e9)


def polled_figures(sched: Any, name: str, span: Any, tgids: frozenset[int], rec: Mapping) -> PhaseCpu | None:
    """A polled crossing's figures (``span``: its interval) from the kernel's
    record with its TCP tracepoints; None where the record lacks them or
    does not cover the stretch. CPU wait: how long data that had reached a
    socket of the request's engines (``tgids``) waited there for a reader
    that waited for a CPU, and the thread that answered a message its
    process had read waited for one before its answer (:meth:`kvtrace.schedtrace.Timeline.starved_ns`).
    The transfer itself (``*.wire``, ended where NIXL saw it done): that,
    over the whole stretch. A crossing a thread of ours stamps the end of
    (``write.notify``, D's engine loop noticing P's notification): that, up
    to the last read from a socket in that thread's process (the
    notification taken in by its progress thread); from there to the end
    its critical path walked back from that thread (:func:`kernel_figures`'
    walk: the engine loop late to notice, or working), its CPU work counted.
    The socket stretch's rest is ``unknown_s``, not off-CPU: data on the
    wire, the peer's own work, a sender starved while its socket had room
    with no message to answer all leave the socket empty, and the record
    does not tell them apart (CPU contention measured 30-40
    ms of it per crossing on one host, where there is no wire to speak of:
    docs/phases.md)."""
    start, end = span.start_ns, span.end_ns
    if sched is None or not getattr(sched, "net", False) or end <= start or not sched.covers(start, end):
        return None
    tid = ending_tid(name, None, [rec.get(e) for e in _ENDS[name]]) if name in _ENDS else None
    pid = sched.tgid.get(tid) if tid is not None else None
    got = sched.last_read((pid,), start, end) if pid is not None else None
    if got is None:
        starved = sched.starved_ns(tgids, start, end)
        return PhaseCpu(0.0, starved / 1e9, unknown_s=(end - start - starved) / 1e9)
    starved, w = sched.starved_ns(tgids, start, got), sched.walk(tid, got, end)
    return PhaseCpu(w.on_ns / 1e9, (starved + w.wait_ns) / 1e9, unknown_s=(got - start - starved) / 1e9)


#: The roles whose spans the engines record (the router's ``relay`` carries its loop's thread: not an engine).
_ENGINE_ROLES = frozenset({sc.Role.PREFILL.value, sc.Role.DECODE.value})


def engine_tgids(sched: Any, spans: Iterable[Any]) -> frozenset[int]:
    """The processes of the threads that recorded ``spans`` (their ``kvlens.cpu.tid``), per the kernel's record:
    the request's engines (their workers, on P and on D); the router's sockets (HTTP) are not the transfer's."""
    out = set()
    for s in spans:
        if s.role not in _ENGINE_ROLES:
            continue
        tid = (s.attributes or {}).get(sc.ATTR_CPU_TID)
        if isinstance(tid, int) and (pid := sched.tgid.get(tid)) is not None:
            out.add(pid)
    return frozenset(out)


def ending_tid(name: str, own: Any, ends: Iterable[Any]) -> int | None:
    """The thread that stamped phase ``name``'s end: a recorded phase's own
    (``own``'s ``kvlens.cpu.tid``); a derived phase's, the thread that
    stamped the start of the first of ``ends`` (recorded spans or None) that
    names it."""
    if name not in _ENDS:
        tid = ((own.attributes or {}) if own is not None else {}).get(sc.ATTR_CPU_TID)
        return tid if isinstance(tid, int) and tid > 0 else None
    for e in ends:
        if e is None:
            continue
        a = e.attributes or {}
        # decode.queue starts at the request's arrival, stamped by the engine's API server (its main thread);
        # elsewhere the thread whose readings before the start the event carries stamped it
        keys = (sc.ATTR_CPU_UP_PID,) if e.name in _UP_STAMPED else (sc.ATTR_CPU_BEFORE_TID, sc.ATTR_CPU_TID)
        for k in keys:
            tid = a.get(k)
            if isinstance(tid, int) and tid > 0:
                return tid
    return None


#: Phases the kernel's record is not walked for: the transfer itself, and push's notification crossing to D
#: (``write.notify``: D's worker polls for it every step); their threads poll, so a wait while the data or the
#: notification was still on the wire cannot be told from one that delayed noticing it (:data:`WIRE_NOTE`)
POLLED = WIRE_PARTS | {sc.Phase.WRITE_NOTIFY.value}
#: recorded phases whose start is stamped by the engine's upstream thread (``kvlens.cpu.up.pid``'s main
#: thread), not by the thread that ends them: vLLM's ``Request.arrival_time``, set in the API server
_UP_STAMPED = frozenset({sc.Phase.DECODE_QUEUE.value})
#: Said of a polled crossing whose CPU wait comes from the kernel's record with its TCP tracepoints.
NET_NOTE = (
    "from the kernel's record with its TCP tracepoints (kvlens up --sched-trace): CPU wait is the time data that "
    "had reached a socket of the request's engines (tcp_probe) waited there while the thread that then read it "
    "(tcp_rcv_space_adjust) waited for a CPU, and the time the thread that answered a message its process had read "
    "waited for one before its answer (the first send on that socket since: sock_send_length); the rest of that stretch is "
    "unknown, not off-CPU: the wire, the peer's own work and a sender starved while its socket had room without a "
    "message to answer are not told apart there. The "
    "pollers spin: their CPU work is not told from their polling. In push's notification, from its read on D the "
    "engine loop's path is walked (CPU work, CPU wait, off-CPU)"
)
#: Said of a phase whose figures come from the kernel's record.
KERNEL_NOTE = (
    "from the kernel's scheduler record (kvlens up --sched-trace): its critical path walked back through "
    "wake-ups from the thread that ended it; before an interrupt's wake-up, off-CPU"
)


def _kernel_part(
    sched: Any, role: str | None, name: str, ns: int, src: Any, derived: Mapping, rec: Mapping
) -> tuple[float, float] | None:
    """The kernel's (CPU wait, CPU work) of ``ns`` of phase ``name`` on the
    critical path (its share of the phase's walk), or None where the record
    has none for it (:func:`kernel_figures`). A split tail (``read.noticed``)
    is walked from its parent's end back over its own stretch."""
    if name in POLLED:
        return None
    # a split tail or a derived phase: its own interval; a recorded phase: its span
    span = derived.get((role, name)) if name in _NOTICED_PARTS or name in _ENDS else src
    if span is None:
        return None
    tid = ending_tid(name, src, [rec.get(e) for e in _ENDS.get(name, ())])
    kf = kernel_figures(sched, name, span.start_ns, span.end_ns, tid)
    return None if kf is None else _scaled(kf, _share(ns, span), ns)


class _Part(NamedTuple):
    """One tiled phase's part of the split over its ``ns`` on the path (seconds): ``wait_s`` None is unknown."""

    wait_s: float | None
    on_s: float = 0.0
    #: False: the CPU work is not read (an API server's, the pollers'); ``on_s`` still counts in the total
    on_known: bool = True
    #: the part of it that is neither (only a lower bound was placed)
    rest_unknown_s: float = 0.0
    #: said of the phase (``cpu_notes``), where there is something to say
    note: str | None = None


def _share(ns: int, span: Any) -> float:
    """The share of ``span`` that its ``ns`` on the critical path are."""
    return min(ns / max(span.end_ns - span.start_ns, 1), 1.0)


def _scaled(fig: PhaseCpu, share: float, ns: int) -> tuple[float, float]:
    """``fig`` scaled to ``share`` of its stretch, within the ``ns`` on the path: (wait, on)."""
    w = min(fig.wait_s * share, ns / 1e9)
    return w, min(fig.on_s * share, ns / 1e9 - w)


class _Sources(NamedTuple):
    """What one trace's phases take their figures from."""

    sched: Any
    #: (role, name) -> the longest recorded span (:func:`_longest`)
    rec: dict
    #: (role, name) -> the derived span (split parts and derived phases)
    derived: dict
    #: the request's engines' processes, where the record kept the TCP tracepoints (:func:`engine_tgids`)
    tgids: frozenset[int]


def _phase_part(src: _Sources, role: str | None, name: str, ns: int) -> _Part:
    """Phase ``name``'s part, from the first source that has it: the record's
    TCP tracepoints for a polled crossing (:func:`polled_figures`), else the
    transfer unknown (:data:`WIRE_NOTE`); the kernel's walk
    (:func:`_kernel_part`); the counters after NIXL's transfer
    (:func:`noticed_figures`); the ending span's counters, or a derived
    phase's placement rules (:func:`derived_figures`, :func:`landed_wait`)."""
    own = src.rec.get((role, _PARENT.get(name, name)))
    span = src.derived.get((role, name)) if name in POLLED and src.tgids else None
    pf = polled_figures(src.sched, name, span, src.tgids, src.rec) if span is not None else None
    if pf is not None:  # the pollers spin: their work is not told from their polling
        share = _share(ns, span)
        w, o = _scaled(pf, share, ns)
        # the socket stretch's rest is neither: the wire, the peer's turn-around, a starved sender are not told
        # apart there; only the engine loop's walked tail of write.notify is off-CPU where it is not the figures
        return _Part(
            w, o, on_known=False, rest_unknown_s=min(pf.unknown_s * share, max(ns / 1e9 - w - o, 0.0)), note=NET_NOTE
        )
    if name in WIRE_PARTS:
        return _Part(None, note=WIRE_NOTE)
    kp = _kernel_part(src.sched, role, name, ns, own, src.derived, src.rec) if src.sched is not None else None
    if kp is not None:  # the kernel's record, where it covers the phase, first
        return _Part(kp[0], kp[1], note=KERNEL_NOTE)
    if name in _NOTICED_PARTS and own is not None and (nf := noticed_figures(own)) is not None:
        fig, dur_s = nf
        return _Part(*_scaled(fig, min(ns / 1e9 / dur_s, 1.0) if dur_s > 0 else 1.0, ns))
    fig = span_figures(own.attributes or {}, (own.end_ns - own.start_ns) / 1e9) if own is not None else None
    on_known = True
    if own is None and name in _ENDS and (role, name) in src.derived:
        d = src.derived[(role, name)]
        fig = derived_figures(d.end_ns - d.start_ns, [src.rec.get(e) for e in _ENDS[name]])
        if name in _FRONTEND:
            up = landed_wait(d.start_ns, d.end_ns, [s for (r, _n), s in src.rec.items() if r == role])
            if up is not None:
                d_s = (d.end_ns - d.start_ns) / 1e9
                if fig is None:
                    fig, on_known = PhaseCpu(0.0, up, False), False  # the API server's CPU work is not read
                else:
                    fig = PhaseCpu(fig.on_s, min(fig.wait_s + up, max(d_s - fig.on_s, fig.wait_s)), False)
        if fig is not None:
            own = d
    if fig is None:
        if own is None:
            return _Part(None, note=DERIVED_NOTE)
        return _Part(None, note=str((own.attributes or {}).get(sc.ATTR_CPU_UNKNOWN) or "no CPU figures recorded"))
    w, o = _scaled(fig, _share(ns, own), ns)
    # where only a lower bound is placed, the rest is neither
    return _Part(w, o, on_known, 0.0 if fig.rest_known else max(ns / 1e9 - w - o, 0.0))


def handoff_cpu(trace: Any, sched: Any = None) -> HandoffCpu:
    """The split of ``trace``'s handoff (its :meth:`tiling`). ``sched``: the
    kernel's record of the host's threads (:func:`kvtrace.schedtrace.load`;
    default the trace's own ``sched``), where one was kept: every phase it
    covers but the crossings their threads poll for (:data:`POLLED`) takes
    its figures from the walk (:func:`kernel_figures`), and those their CPU
    wait from its TCP tracepoints where it kept them (:func:`polled_figures`);
    the counters' rules stand for the rest (:func:`_phase_part`)."""
    if sched is None:
        sched = getattr(trace, "sched", None)
    tiling = trace.tiling()
    if tiling is None or tiling.handoff_ns <= 0:
        return HandoffCpu(None, None, None, None, {}, {}, {})
    rec = _longest(trace.spans)
    derived = {(s.role, s.name): s for s in trace.spans if (s.attributes or {}).get(sc.ATTR_DERIVED)}
    tgids = engine_tgids(sched, rec.values()) if sched is not None and getattr(sched, "net", False) else frozenset()
    sources = _Sources(sched, rec, derived, tgids)
    wait = on = unknown = 0.0
    known = False
    pw: dict[str, float | None] = {}
    po: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for (role, name), ns in tiling.phases.items():
        part = _phase_part(sources, role, name, ns)
        if part.note is not None:
            notes[name] = part.note
        if part.wait_s is None:
            unknown += ns / 1e9
            pw.setdefault(name, None)
            po.setdefault(name, None)
            continue
        wait, on, unknown, known = wait + part.wait_s, on + part.on_s, unknown + part.rest_unknown_s, True
        pw[name] = (pw.get(name) or 0.0) + part.wait_s
        if part.on_known:
            po[name] = (po.get(name) or 0.0) + part.on_s
        else:
            po.setdefault(name, None)
    unknown += tiling.unattributed_ns / 1e9
    if any((s.attributes or {}).get(sc.ATTR_CPU_PROGRESS_SPINS) for s in rec.values()):
        notes["progress thread"] = SPIN_NOTE
    handoff = tiling.handoff_ns / 1e9
    if not known:
        return HandoffCpu(handoff, None, None, unknown, pw, po, notes)
    return HandoffCpu(handoff, wait, on, unknown, pw, po, notes)


def wire_progress(trace: Any) -> dict[str, dict[str, float]]:
    """Wire phases' progress-thread figures (on, wait), by phase name: informational (:data:`SPIN_NOTE`)."""
    out = {}
    for (_role, name), s in _longest(trace.spans).items():
        a = s.attributes or {}
        if a.get(sc.ATTR_CPU_PROGRESS_WAIT_S) is not None:
            out[name] = {"on_s": a.get(sc.ATTR_CPU_PROGRESS_ON_S), "wait_s": a.get(sc.ATTR_CPU_PROGRESS_WAIT_S)}
    return out


#: Why a handoff has no CPU split where its phases name no reason of their own.
NO_FIGURES = "no phase on the critical path carries CPU figures"


def unknown_reason(split: HandoffCpu) -> str:
    """Why ``split``'s CPU figures are unknown, in a few words: the reason a
    recorded phase gave (``kvlens.cpu.unknown``), else :data:`NO_FIGURES`
    (every phase derived), or "no handoff window"."""
    if split.handoff_s is None:
        return "no handoff window"
    for note in split.notes.values():
        if note not in (DERIVED_NOTE, SPIN_NOTE):
            return note
    return NO_FIGURES
