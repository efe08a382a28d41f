"""Traces as Chrome trace-event JSON, the format ui.perfetto.dev and
``chrome://tracing`` open (``kvlens traces --perfetto FILE``). Pure: trace
model records in, a list of event dicts out; the caller writes the file.

Layout of the timeline:

* **Processes**: one per (trace, role): ``router``, ``P <engine>``,
  ``D <engine>`` (``other`` for spans without a kvlens role, e.g. vLLM's
  ``llm_request``), each named with the trace's short id, and ordered trace
  by trace (``process_sort_index``), so several traces never share a track.
* **Threads**: spans carry no recording-thread attribute, so each lands on
  the thread family its hook runs on (docs/phases.md, "What is measured"):
  ``scheduler``, ``worker`` (the engine thread), ``writer`` (the NIXL writer
  thread), ``proxy`` for the router; derived phases on a ``derived`` thread
  of the side whose work they are. A span carrying a tensor-parallel rank
  (:data:`RANK_ATTR`) goes to that rank's thread. A span that would overlap
  another on its thread without nesting (which the viewers cannot draw)
  moves to a second lane of that thread (``worker #2``).
* **Events**: recorded and derived spans with a duration are complete
  events (``X``), point phases (``semconv.POINT_PHASES``) and zero-length
  spans instant events (``i``); the handoff window (``prefill.finished`` ->
  ``kv.ready``) is an ``X`` on the router process's ``handoff`` thread,
  carrying the handoff, its bound and the clock offset. Times are µs from
  the earliest span of all traces written (:func:`origin_ns`), in whole
  µs (:func:`_us`).
* **CPU or wire** (:mod:`kvtrace.cpusplit`): a recorded span with CPU
  figures gets thread-state slices on a ``<thread> cpu`` track beside its
  thread: ``cpu wait`` (runnable, waiting for a CPU), ``on cpu`` and ``off
  cpu`` of the thread that ended it, laid end to end over the span in
  proportion to the totals (their order within the span is not known; the
  args say so); a span whose figures are unknown gets one ``cpu unknown``
  slice with the reason. A wire span (``write.complete`` /
  ``read.complete``) also gets NIXL's progress thread's figures on a
  ``<thread> progress`` track, with :data:`kvtrace.cpusplit.SPIN_NOTE`.
* **Clocks**: D's spans are already on P's clock in the trace model
  (:meth:`kvtrace.tracemodel.Trace.from_rows`); nothing is shifted here.
* **Flow arrows** (``s`` / ``f``) for the messages that cross between P and
  D (:data:`MESSAGES`). A flow end on a span with a duration sits in its
  middle (``"bp": "e"``: bound to the enclosing slice, so the anchor cannot
  be a neighbour that starts or ends at the same instant); on a point phase
  it sits at the instant's own timestamp, ordered so that the viewer binds
  it to that instant (a finish just before it, a start just after it). A
  message whose receipt lies before its sending once D is on P's clock
  (possible within the clock bound) gets no arrow: the viewers drop an
  arrow that points back in time, and the trace's metadata says which were
  left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from kvtrace import cpucounters, cpusplit
from kvtrace.tracemodel import Span, Trace
from kvrecord import semconv as sc

#: Tensor-parallel rank of the recording worker, where a span carries one;
#: the key is taken from semconv once it is defined there.
RANK_ATTR: str = getattr(sc, "ATTR_RANK", "kvlens.rank")

_P, _D, _R = sc.Phase, sc.Role.DECODE.value, sc.Role.ROUTER.value
_PRE = sc.Role.PREFILL.value
#: Role -> (order within a trace, label).
ROLES = {_R: (0, "router"), _PRE: (1, "P"), _D: (2, "D"), None: (3, "other")}
#: Processes per trace (pid stride).
_STRIDE = len(ROLES)

_SCHEDULER = frozenset(
    p.value
    for p in (
        _P.PREFILL,
        _P.PREFILL_FINISHED,
        _P.DECODE_QUEUE,
        _P.REGISTRATION_STAGE,
        _P.ALLOC,
        getattr(_P, "DECODE_FIRST_STEP", _P.ALLOC),
    )
)
#: Per role, the phases its NIXL writer thread records (docs/phases.md, "What is measured").
_WRITER = {
    _PRE: frozenset(
        p.value for p in (_P.REGISTRATION_RECEIVE, _P.MATCH, _P.HANDSHAKE, _P.DESCRIPTOR_PREP, _P.WRITE_POST)
    ),
    _D: frozenset({_P.REGISTRATION_SEND.value}),
}
#: Thread families in display order (tid = position + 1, lanes after them).
THREADS = ("handoff", "proxy", "scheduler", "worker", "writer", "derived", "context")


@dataclass(frozen=True)
class Message:
    """A message between sides: sent at ``src`` (role, phase, which end of
    the span) and received at ``dst``; ``mode`` where it exists in one only."""

    name: str
    mode: str | None
    src: tuple[str, str, str]
    dst: tuple[str, str, str]


#: The messages drawn as flow arrows (docs/phases.md, "Clocks across hosts").
MESSAGES: tuple[Message, ...] = (
    Message(
        "PUSH_REG (D's registration)",
        "push",
        (_D, _P.REGISTRATION_SEND.value, "end"),
        (_PRE, _P.REGISTRATION_RECEIVE.value, "start"),
    ),
    Message(
        "WRITE done notification", "push", (_PRE, _P.WRITE_COMPLETE.value, "end"), (_D, _P.KV_READY.value, "start")
    ),
    Message(
        "P's answer to the router", "pull", (_PRE, _P.PREFILL_FINISHED.value, "end"), (_R, _P.RELAY.value, "start")
    ),
    Message("the router's request to D", "pull", (_R, _P.RELAY.value, "end"), (_D, _P.ALLOC.value, "start")),
    Message(
        "READ done notification", "pull", (_D, _P.READ_COMPLETE.value, "end"), (_PRE, _P.KV_RELEASED.value, "start")
    ),
)
#: Used when no router relay is in the trace: P's answer reaches D directly.
DIRECT_ANSWER = Message(
    "P's answer to D", "pull", (_PRE, _P.PREFILL_FINISHED.value, "end"), (_D, _P.ALLOC.value, "start")
)

#: Attribute keys whose string values could hold request text; dropped from
#: ``args`` (kvlens records none; vLLM's own spans might).
_TEXTY = ("prompt", "completion", "content", "text", "message", "input", "output")

CAT_SPAN, CAT_DERIVED, CAT_FLOW, CAT_WINDOW = "kvlens", "kvlens.derived", "kvlens.message", "kvlens.handoff"
CAT_CPU = "kvlens.cpu"
#: What a thread-state slice's place within its span means (in every one's args).
CPU_ORDER_NOTE = (
    "only the totals over the span are known (schedstat read at its ends), not when within it: "
    "the states are laid end to end in proportion, CPU wait first"
)


def origin_ns(traces: Iterable[Trace]) -> int:
    """The common origin: the earliest start among the traces (ns)."""
    starts = [t.t0_ns for t in traces]
    return min(starts) if starts else 0


def _us(ns: int, origin: int) -> int:
    """Whole µs after ``origin`` (half up, integer arithmetic). Whole
    numbers read back exactly everywhere: Perfetto turns a fractional
    ``ts`` into ``int(value * 1000)`` ns, which now and then lands a
    nanosecond early and unnests a span from the one it abuts, and readers
    that keep floats see ``ts + dur`` overshoot. A duration is the
    difference of its rounded ends, so spans that nest or abut still do; the
    exact length is in ``args.duration_ms``."""
    return (ns - origin + 500) // 1000


def _family(s: Span) -> str:
    if s.attributes.get(sc.ATTR_DERIVED):
        return "derived"
    if s.role == _R:
        return "proxy"
    if s.role not in (_PRE, _D):
        return "context"
    if s.name in _SCHEDULER:
        return "scheduler"
    return "writer" if s.name in _WRITER.get(s.role, ()) else "worker"


def _thread_name(family: str, rank: Any) -> str:
    return family if rank is None else f"{family} rank {rank}"


def _args(s: Span, trace: Trace) -> dict[str, Any]:
    args: dict[str, Any] = {"trace_id": trace.trace_id, "role": s.role, "critical_path": s.critical}
    for k in ("span_id", "parent_id", "outcome"):
        if getattr(s, k) is not None:
            args[k] = getattr(s, k)
    for k, v in s.attributes.items():
        if isinstance(v, str) and any(w in k.lower() for w in _TEXTY):
            continue
        args[k] = v
    if s.attributes.get(sc.ATTR_DERIVED):
        args["derived"] = True
    if s.role == _D and trace.clock_offset_s:
        args["clock"] = f"D's clock moved onto P's by {-trace.clock_offset_s * 1000:+.3f} ms"
    return args


class _Proc:
    """One process (a role of one trace): its threads and lanes."""

    def __init__(self, pid: int, name: str, sort_index: int):
        self.pid, self.name, self.sort_index = pid, name, sort_index
        self.tids: dict[str, int] = {}
        self.open: dict[str, list[int]] = {}  # thread name -> end_ns stack (nesting check)
        self.ends: dict[str, int] = {}  # CPU track lane -> its last slice's end (no overlap, no nesting)

    def tid(self, thread: str) -> int:
        if thread not in self.tids:
            family = thread.split(" ")[0]
            base = (THREADS.index(family) + 1) if family in THREADS else len(THREADS) + 1
            self.tids[thread] = base * 100 + sum(1 for t in self.tids if t.split(" ")[0] == family)
        return self.tids[thread]

    def place(self, thread: str, start: int, end: int) -> str:
        """The lane of ``thread`` where [start, end] nests (spans come
        sorted by start, longer first)."""
        lane, name = 1, thread
        while True:
            stack = self.open.setdefault(name, [])
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                if end > start:
                    stack.append(end)
                return name
            lane += 1
            name = f"{thread} #{lane}"

    def lane(self, track: str, start: int, end: int) -> str:
        """The first lane of ``track`` free from ``start`` on (spans come sorted by start)."""
        lane, name = 1, track
        while self.ends.get(name, start) > start:
            lane += 1
            name = f"{track} #{lane}"
        self.ends[name] = end
        return name


def _process_name(role: str | None, trace: Trace, short: str) -> str:
    label = ROLES.get(role, ROLES[None])[1]
    engine = trace.p_engine if role == _PRE else trace.d_engine if role == _D else None
    return f"{label} {engine} · {short}" if engine else f"{label} · {short}"


def _fmt_ms(s: float | None) -> str:
    return "?" if s is None else f"{s * 1000:.3f} ms"


def trace_metadata(trace: Trace, skipped: Sequence[str] = ()) -> dict[str, Any]:
    """What the file says about one trace as a whole (``otherData``, and the
    handoff window's args)."""
    return {
        "trace_id": trace.trace_id,
        "request_id": trace.request_id,
        "mode": trace.mode,
        "dispatch": trace.dispatch,
        "outcome": trace.outcome,
        "handoff_s": trace.handoff_s,
        "handoff_err_s": trace.handoff_err_s,
        "handoff_raw_s": trace.handoff_raw_s,
        "handoff_note": trace.handoff_note,
        "clock_offset_s": trace.clock_offset_s,
        "clock_interval_s": None if trace.clock_lo_s is None else [trace.clock_lo_s, trace.clock_hi_s],
        "ttft_s": trace.ttft_s,
        "ttft_source": getattr(trace, "ttft_source", None),
        "ttft_err_s": getattr(trace, "ttft_err_s", None),
        "p_engine": trace.p_engine,
        "d_engine": trace.d_engine,
        "arrows_left_out": list(skipped),
    }


class _Builder:
    """Accumulates one file's events: (sort key, event) pairs."""

    def __init__(self, origin: int):
        self.origin = origin
        self.events: list[tuple[tuple, dict[str, Any]]] = []
        self.procs: dict[int, _Proc] = {}
        self.flow_id = 0
        self.meta: list[dict[str, Any]] = []

    def add(self, ts_ns: int, rank: int, ev: dict[str, Any], dur_ns: int = 0) -> None:
        # Same instant: a flow finish just before its instant, the instant,
        # a flow start just after it, then slices longest first, then the
        # flow ends placed in the middle of slices.
        self.events.append(((ts_ns, rank, -dur_ns, len(self.events)), ev))

    def proc(self, index: int, role: str | None, trace: Trace) -> _Proc:
        pid = 1 + index * _STRIDE + ROLES.get(role, ROLES[None])[0]
        if pid not in self.procs:
            self.procs[pid] = _Proc(pid, _process_name(role, trace, trace.trace_id[:8]), pid)
        return self.procs[pid]


def _add_spans(b: _Builder, index: int, trace: Trace) -> dict[tuple[str | None, str], tuple[Span, _Proc, int]]:
    """The trace's spans as X / i events; (role, name) -> where the first of each landed."""
    where: dict[tuple[str | None, str], tuple[Span, _Proc, int]] = {}
    for s in sorted(trace.spans, key=lambda x: (x.start_ns, -(x.end_ns - x.start_ns))):
        p = b.proc(index, s.role, trace)
        point = s.point or s.end_ns <= s.start_ns
        thread = p.place(
            _thread_name(_family(s), s.attributes.get(RANK_ATTR)), s.start_ns, s.start_ns if point else s.end_ns
        )
        tid = p.tid(thread)
        derived = bool(s.attributes.get(sc.ATTR_DERIVED))
        ev: dict[str, Any] = {
            "name": s.name,
            "cat": CAT_DERIVED if derived else CAT_SPAN,
            "pid": p.pid,
            "tid": tid,
            "ts": _us(s.start_ns, b.origin),
            "args": _args(s, trace),
        }
        if point:
            ev.update(ph="i", s="t")
            b.add(s.start_ns, 1, ev)
        else:
            ev.update(ph="X", dur=_us(s.end_ns, b.origin) - ev["ts"])
            ev["args"]["duration_ms"] = (s.end_ns - s.start_ns) / 1e6
            b.add(s.start_ns, 3, ev, s.end_ns - s.start_ns)
        where.setdefault((s.role, s.name), (s, p, tid))
        if not point and not derived:
            _add_cpu(b, p, _thread_name(_family(s), s.attributes.get(RANK_ATTR)), s, trace)
    return where


def _states(s: Span, on: float, wait: float) -> list[tuple[str, float, int]]:
    """(state, seconds, ns of the span it is drawn over) for cpu wait, on cpu,
    off cpu: the span's length split in proportion to the totals (where the
    totals exceed it, e.g. several progress threads summed, off cpu is 0)."""
    dur = s.end_ns - s.start_ns
    wall = dur / 1e9
    off = max(wall - on - wait, 0.0)
    whole = max(on + wait + off, 1e-12)
    out, at = [], 0
    for state, sec in (("cpu wait", wait), ("on cpu", on), ("off cpu", off)):
        n = min(round(dur * sec / whole), dur - at)
        out.append((state, sec, n))
        at += n
    return out


def _cpu_slices(b: _Builder, p: _Proc, track: str, s: Span, states, args: dict[str, Any], prefix: str = "") -> None:
    """``states`` (:func:`_states`) end to end over ``s`` on a free lane of ``track``."""
    tid = p.tid(p.lane(track, s.start_ns, s.end_ns))
    at = s.start_ns
    for state, sec, n in states:
        if sec <= 0:  # a state the thread was never in draws nothing
            continue
        ev = {
            "name": f"{prefix}{state} {sec * 1000:.1f} ms",
            "cat": CAT_CPU,
            "ph": "X",
            "pid": p.pid,
            "tid": tid,
            "ts": _us(at, b.origin),
            "dur": _us(at + n, b.origin) - _us(at, b.origin),
            "args": {**args, "state": state, "seconds": sec, "share_of_span": sec / max(s.duration_s, 1e-12)},
        }
        b.add(at, 3, ev, n)
        at += n


def _add_cpu(b: _Builder, p: _Proc, thread: str, s: Span, trace: Trace) -> None:
    """The thread-state slices of one recorded span (module docstring, "CPU or wire")."""
    a = s.attributes
    base = {"trace_id": trace.trace_id, "phase": s.name, "span_id": s.span_id, "order": CPU_ORDER_NOTE}
    fig = cpucounters.span_figures(a)
    if fig is not None:
        args = {**base, "thread_tid": a.get(sc.ATTR_CPU_TID), "psi_some_s": a.get(sc.ATTR_CPU_PSI_SOME_S)}
        _cpu_slices(b, p, f"{thread} cpu", s, _states(s, fig.on_s, fig.wait_s), args)
    elif a.get(sc.ATTR_CPU_UNKNOWN):
        ev = {
            "name": "cpu unknown",
            "cat": CAT_CPU,
            "ph": "X",
            "pid": p.pid,
            "tid": p.tid(p.lane(f"{thread} cpu", s.start_ns, s.end_ns)),
            "ts": _us(s.start_ns, b.origin),
            "dur": _us(s.end_ns, b.origin) - _us(s.start_ns, b.origin),
            "args": {**base, "unknown": str(a[sc.ATTR_CPU_UNKNOWN])},
        }
        b.add(s.start_ns, 3, ev, s.end_ns - s.start_ns)
    on, wait = a.get(sc.ATTR_CPU_PROGRESS_ON_S), a.get(sc.ATTR_CPU_PROGRESS_WAIT_S)
    if isinstance(on, (int, float)) and isinstance(wait, (int, float)):
        args = {**base, "spins": bool(a.get(sc.ATTR_CPU_PROGRESS_SPINS)), "note": cpusplit.SPIN_NOTE}
        _cpu_slices(b, p, f"{thread} progress", s, _states(s, float(on), float(wait)), args, "progress ")


def _add_window(b: _Builder, index: int, trace: Trace, skipped: list[str]) -> None:
    p = b.proc(index, _R, trace)
    tid = p.tid("handoff")
    meta = trace_metadata(trace, skipped)
    if trace.window:
        pf, kv = trace.window
        label = (
            "handoff "
            + _fmt_ms(trace.handoff_s)
            + (f" ± {_fmt_ms(trace.handoff_err_s)}" if trace.handoff_err_s is not None else "")
        )
        b.add(
            pf,
            3,
            {
                "name": label,
                "cat": CAT_WINDOW,
                "ph": "X",
                "pid": p.pid,
                "tid": tid,
                "ts": _us(pf, b.origin),
                "dur": _us(max(kv, pf), b.origin) - _us(pf, b.origin),
                "args": meta,
            },
            max(kv - pf, 0),
        )
    b.meta.append(meta)


def _anchor(b: _Builder, where, end: tuple[str, str, str], *, start: bool):
    """(ts_ns of the message, event fields, sort rank) for one end of an arrow, or None."""
    role, name, which = end
    hit = where.get((role, name))
    if hit is None:
        return None
    s, p, tid = hit
    at = s.end_ns if which == "end" else s.start_ns
    fields: dict[str, Any] = {"pid": p.pid, "tid": tid}
    if s.point or s.end_ns <= s.start_ns:
        return at, s.start_ns, fields, (2 if start else 0)
    mid = (s.start_ns + s.end_ns) // 2
    if not start:
        fields["bp"] = "e"
    return at, mid, fields, 4


def _add_flows(b: _Builder, trace: Trace, where) -> list[str]:
    """Arrows for the trace's messages; the names of those left out."""
    skipped = []
    msgs = [m for m in MESSAGES if m.mode in (None, trace.mode)]
    if trace.mode == sc.Mode.PULL.value and (_R, _P.RELAY.value) not in where:
        msgs = [m for m in msgs if _P.RELAY.value not in (m.src[1], m.dst[1])] + [DIRECT_ANSWER]
    for m in msgs:
        a, z = _anchor(b, where, m.src, start=True), _anchor(b, where, m.dst, start=False)
        if a is None or z is None:
            continue
        if z[0] < a[0] or z[1] < a[1] or (z[1] == a[1] and z[3] <= a[3]):
            skipped.append(m.name)  # the finish would be read before the start
            continue
        b.flow_id += 1
        common = {"name": m.name, "cat": CAT_FLOW, "id": b.flow_id}
        b.add(a[1], a[3], {**common, "ph": "s", "ts": _us(a[1], b.origin), **a[2]})
        b.add(z[1], z[3], {**common, "ph": "f", "ts": _us(z[1], b.origin), **z[2]})
    return skipped


def _metadata_events(b: _Builder) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in sorted(b.procs.values(), key=lambda x: x.pid):
        out.append({"name": "process_name", "ph": "M", "pid": p.pid, "tid": 0, "args": {"name": p.name}})
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": p.pid, "tid": 0, "args": {"sort_index": p.sort_index}}
        )
        for thread, tid in sorted(p.tids.items(), key=lambda kv: kv[1]):
            out.append({"name": "thread_name", "ph": "M", "pid": p.pid, "tid": tid, "args": {"name": thread}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": p.pid, "tid": tid, "args": {"sort_index": tid}})
    return out


def convert(traces: Sequence[Trace]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The events for ``traces`` (metadata first, then by time) and the
    per-trace metadata (:func:`trace_metadata`)."""
    b = _Builder(origin_ns(traces))
    for i, t in enumerate(traces):
        where = _add_spans(b, i, t)
        skipped = _add_flows(b, t, where)
        _add_window(b, i, t, skipped)
    b.events.sort(key=lambda kv: kv[0])
    return _metadata_events(b) + [ev for _, ev in b.events], b.meta


def document(traces: Sequence[Trace]) -> dict[str, Any]:
    """The JSON object to write: ``traceEvents`` plus ``otherData`` (the
    origin in wall-clock ns and each trace's handoff, bound and clock offset)."""
    events, meta = convert(traces)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "kvlens traces --perfetto",
            "origin_unix_ns": origin_ns(traces),
            "clock": "D's spans moved onto P's clock by each trace's clock_offset_s",
            "traces": meta,
        },
    }
