"""The what-if: from one mode's traces, the other mode's handoff and TTFT
(``kvlens whatif``, the Compare page; docs/verdict.md).

A handoff is a tiling of phases (:mod:`kvtrace.tiling`). Switching mode
takes some measured phases off the critical path and puts others on it.
Per request of the measured mode the prediction keeps the phases both modes
run on the path (the handshake on first contact, the descriptor build, the
post, the engine loop noticing the transfer DONE), moves the transfer onto
the wire the other way (the request's bytes over the bandwidth measured in
the same traces), drops the phases the other mode overlaps or does not have,
and adds the phases only the other mode has, each borrowed from something
measured in the same traces (:class:`Borrowed`: the figure, its source, the
assumption in words). TTFT = the measured TTFT - the measured handoff + the
predicted one (P's queue and prefill and D's first step taken as they were).

The interval: the requests resampled (with replacement) and, for each drawn
request, each borrowed figure drawn from its measured distribution,
:data:`RESAMPLES` times; the p50 of each resample gives the interval, all
draws together the predicted distribution. Pure; no I/O.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from kvrecord import semconv as sc
from kvtrace import cpucounters, cpusplit, ranks, stats, tracemodel
from kvtrace.borrowed import Borrowed, borrowed, duration, tiled_phases
from kvtrace.tracemodel import Trace

P = sc.Phase
PUSH, PULL = sc.Mode.PUSH.value, sc.Mode.PULL.value
#: Fewest usable requests of the measured mode for a prediction.
MIN_REQUESTS = 5
RESAMPLES = 1000
#: The timestamps' resolution, seconds: a measured figure this close to an interval's end is inside it.
_NS = 1e-9
#: Newest requests of each mode one prediction reads from a store (their spans too).
MAX_TRACES = 2000

#: On the path in both modes, kept from the measured trace (its exclusive
#: share of the handoff), by the measured mode; the transfer's wire is not
#: here (it is predicted from bytes and bandwidth).
KEPT = {
    PULL: (P.HANDSHAKE, P.DESCRIPTOR_PREP, P.READ_POST, P.READ_NOTICED),
    PUSH: (P.HANDSHAKE, P.DESCRIPTOR_PREP, P.WRITE_POST, P.WRITE_NOTICED),
}
_WIRE = {PULL: (P.READ_WIRE, P.READ_COMPLETE), PUSH: (P.WRITE_WIRE, P.WRITE_COMPLETE)}
#: What leaves the critical path, by the measured mode (in words, for the report).
LEAVES = {
    PULL: "P's response path, the router's relay, D's HTTP intake, D's queue and allocation, D's scheduler-to-worker "
    "hop (prefill.respond, relay, decode.intake, decode.queue, alloc, decode.dispatch): push overlaps them with "
    "P's prefill; the READ on the wire is replaced by the WRITE",
    PUSH: "P's scheduler-to-worker hop, the writer's wake-up, the wait for the match, the completion notification "
    "(prefill.dispatch, writer.wake, match, write.notify): pull has none of them; the WRITE on the wire is "
    "replaced by the READ",
}


# ------------------------------------------------------------------ per request
@dataclass(frozen=True)
class Parts:
    """One measured request cut for the prediction (seconds; ``bytes`` None: unknown)."""

    trace_id: str
    handoff_s: float
    ttft_s: float | None
    #: the kept phases plus the other mode's own measured extras (push -> pull:
    #: D's queue; pull -> push: D's registration late for P, where it was)
    fixed_s: float
    own_wire_s: float
    bytes: int | None
    #: the CPU wait inside ``fixed_s`` and ``own_wire_s`` (kvtrace.cpusplit; None: unknown)
    fixed_wait_s: float | None = None
    wire_wait_s: float | None = None
    #: the measured handoff's whole CPU wait (None: unknown)
    handoff_wait_s: float | None = None


def parts(from_mode: str, t: Trace) -> Parts | str:
    """The request's :class:`Parts`, or why it cannot be used (a short reason)."""
    if t.outcome != sc.Outcome.OK.value or t.handoff_s is None:
        return "not completed (no handoff)"
    if t.mode != from_mode:
        return f"not {from_mode}"
    if from_mode == PUSH and t.dispatch == sc.Dispatch.SEQUENTIAL.value:
        return "sequential push (not modelled: only overlapped push)"
    if not t.spans:
        return "summary only (spans not kept)"
    tiled = tiled_phases(t)
    kept = sum(tiled.get(p.value, 0.0) for p in KEPT[from_mode])
    wire = sum(tiled.get(p.value, 0.0) for p in _WIRE[from_mode])
    queue = duration(t, P.DECODE_QUEUE)
    if queue is None:
        return "no decode.queue span"
    if from_mode == PUSH:
        extra = queue  # overlapped in push, on the path in pull
    else:  # D's intake and queue run beside P's prefill in push: any excess waits (match)
        prefill = duration(t, P.PREFILL)
        extra = 0.0 if prefill is None else max(0.0, (duration(t, P.DECODE_INTAKE) or 0.0) + queue - prefill)
    tot = ranks.transfer_totals(t.spans)
    fixed_wait, wire_wait, handoff_wait = _waits(from_mode, t, extra, queue)
    return Parts(
        t.trace_id,
        t.handoff_s,
        t.ttft_s,
        kept + extra,
        wire,
        tot.bytes if tot and tot.bytes > 0 else None,
        fixed_wait,
        wire_wait,
        handoff_wait,
    )


def _waits(from_mode: str, t: Trace, extra: float, queue: float) -> tuple[float | None, float | None, float | None]:
    """The CPU wait in the kept phases plus the carried extra, in the wire,
    and in the whole measured handoff (:mod:`kvtrace.cpusplit`); None where a
    phase the prediction carries has no figures."""
    cpu = cpusplit.handoff_cpu(t)
    if cpu.cpu_wait_s is None:
        return None, None, None
    pw = cpu.phases_wait_s

    def total(phases) -> float | None:
        # the transfer itself has a CPU wait only from the kernel's record with its TCP tracepoints
        # (cpusplit.polled_figures); without it none is removed from it (cpusplit.WIRE_NOTE)
        vals = [
            pw[p.value]
            for p in phases
            if p.value in pw and not (p.value in cpusplit.WIRE_PARTS and pw[p.value] is None)
        ]
        return None if any(v is None for v in vals) else sum(vals)

    kept, wire = total(KEPT[from_mode]), total(_WIRE[from_mode])
    q = next((s for s in t.spans if s.name == P.DECODE_QUEUE.value and not s.attributes.get(sc.ATTR_DERIVED)), None)
    qfig = cpucounters.span_figures(q.attributes) if q is not None else None
    if extra > 0 and qfig is None:
        return None, wire, cpu.cpu_wait_s
    extra_wait = 0.0 if extra <= 0 else min(qfig.wait_s * min(extra / queue, 1.0) if queue > 0 else 0.0, extra)
    return None if kept is None else kept + extra_wait, wire, cpu.cpu_wait_s


# ------------------------------------------------------------------ the prediction
@dataclass(frozen=True)
class Figure:
    """A predicted figure: the p50 with its interval, and the distribution's p10/p90."""

    p50: float | None = None
    lo: float | None = None
    hi: float | None = None
    p10: float | None = None
    p90: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "p50_s": self.p50,
            "interval_s": None if self.lo is None else [self.lo, self.hi],
            "p10_s": self.p10,
            "p90_s": self.p90,
        }


@dataclass(frozen=True)
class WhatIf:
    """What :func:`predict` found (``status`` ``ok`` or ``not enough data`` with ``note``)."""

    from_mode: str
    to_mode: str
    status: str
    note: str | None = None
    used: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    handoff: Figure = Figure()
    ttft: Figure = Figure()
    #: the handoff with CPU wait removed (kept phases and wire less their own CPU wait), and that plus the
    #: target mode's expected CPU wait on this host (``measured_to["expected_cpu_wait_s"]``)
    handoff_nowait: Figure = Figure()
    handoff_expected_wait: Figure = Figure()
    measured_from: dict[str, float | None] = field(default_factory=dict)
    measured_to: dict[str, Any] = field(default_factory=dict)
    borrowed: tuple[Borrowed, ...] = ()
    requests: tuple[tuple[str, float, float, float | None], ...] = ()

    def assumptions(self) -> list[str]:
        common = [
            f"leaves the critical path: {LEAVES[self.from_mode]}",
            "kept as measured: the handshake on first contact, the descriptor build, the post, the engine loop "
            "noticing the transfer done (the same NIXL calls, by the other side)",
            "the transfer's wire: the request's bytes over the bandwidth measured in the same traces "
            "(its own transfer time where bytes or bandwidth are unknown)",
            "TTFT: measured TTFT - measured handoff + predicted handoff (P's queue and prefill and D's first "
            "step as they were; the load each side sees is taken as unchanged)",
            "time no phase names (unattributed) in the measured handoff is left out",
            "with CPU wait removed: the kept phases and the wire less their own measured CPU wait (kvtrace.cpusplit); "
            "the borrowed figures are derived phases without figures, taken as measured; with the expected wait: "
            "that plus the target mode's median CPU wait measured on this host (the measured mode's where the "
            "target has no traces here)",
        ]
        if self.from_mode == PULL:
            common.append(
                "push's registration is in time: where D's intake and queue took longer than P's queue and "
                "prefill, the excess stays on the path (P waits for D's registration: match)"
            )
        else:
            common.append("D's queue, measured while push overlapped it, is paid on the path in pull")
        return common + [f"{b.name}: {b.assumption}" for b in self.borrowed]

    def to_json(self) -> dict[str, Any]:
        return {
            "from": self.from_mode,
            "to": self.to_mode,
            "status": self.status,
            "note": self.note,
            "requests_used": self.used,
            "skipped": self.skipped,
            "predicted": {
                "handoff": self.handoff.to_json(),
                "ttft": self.ttft.to_json(),
                "handoff_nowait": self.handoff_nowait.to_json(),
                "handoff_expected_wait": self.handoff_expected_wait.to_json(),
            },
            "measured_from": self.measured_from,
            "measured_to": self.measured_to,
            "borrowed": [b.to_json() for b in self.borrowed],
            "assumptions": self.assumptions(),
            "requests": [
                {"trace_id": t, "measured_handoff_s": h, "predicted_handoff_s": p, "predicted_ttft_s": f}
                for t, h, p, f in self.requests
            ],
        }


def _figure(draws: "Any") -> Figure:
    """From ``draws`` (resamples x requests): the p50 of each resample; their
    median is the predicted p50, their 2.5/97.5 percentiles its interval;
    p10/p90 of all draws (the predicted distribution)."""
    import numpy as np

    if np.isnan(draws).all():
        return Figure()
    p50s = np.nanpercentile(draws, 50, axis=1)
    mid, lo, hi = np.nanpercentile(p50s, [50, 2.5, 97.5])
    p10, p90 = np.nanpercentile(draws, [10, 90])
    return Figure(float(mid), float(lo), float(hi), float(p10), float(p90))


def _measured(handoffs: Iterable[float | None], ttfts: Iterable[float | None]) -> dict[str, float | None]:
    h, f = list(handoffs), list(ttfts)
    return {
        "n": sum(v is not None for v in h),
        "handoff_p50_s": stats.percentile(h, 50),
        "ttft_p50_s": stats.percentile(f, 50),
    }


def predict(
    from_mode: str, traces: Iterable[Trace], others: Iterable[Trace] = (), *, resamples: int = RESAMPLES, seed: int = 0
) -> WhatIf:
    """The other mode's handoff and TTFT for each of ``traces`` (of
    ``from_mode``); ``others``: measured traces of the other mode, if any,
    for the comparison (``measured_to``, and whether it lies in the interval)."""

    if from_mode not in (PUSH, PULL):
        raise ValueError(f"from_mode must be push or pull, got {from_mode!r}")
    to_mode = PULL if from_mode == PUSH else PUSH
    traces = list(traces)
    got = [(t, parts(from_mode, t)) for t in traces]
    usable = [p for _, p in got if isinstance(p, Parts)]
    skipped: dict[str, int] = {}
    for _, p in got:
        if isinstance(p, str):
            skipped[p] = skipped.get(p, 0) + 1
    ok_others = [t for t in others if t.mode == to_mode and t.outcome == sc.Outcome.OK.value]
    base = dict(
        from_mode=from_mode,
        to_mode=to_mode,
        used=len(usable),
        skipped=skipped,
        measured_from=_measured((p.handoff_s for p in usable), (p.ttft_s for p in usable)),
        measured_to=_measured((t.handoff_s for t in ok_others), (t.ttft_s for t in ok_others)),
    )
    if len(usable) < MIN_REQUESTS:
        why = f"{len(usable)} usable {from_mode} requests, {MIN_REQUESTS} needed"
        return WhatIf(status=stats.NOT_ENOUGH, note=why, **base)
    pools = borrowed(from_mode, [t for t, p in got if isinstance(p, Parts)])
    base["borrowed"] = tuple(pools)
    missing = [b.name for b in pools[:2] if not b.values]
    if missing:
        why = f"no {from_mode} trace gives {', '.join(missing)}"
        return WhatIf(status=stats.NOT_ENOUGH, note=why, **base)
    h, f, rows, nw = _simulate(usable, pools, resamples, seed)
    # the target mode's expected CPU wait on this host: its own measured median where it ran here, else the
    # measured mode's (the same host, the same contention)
    # each measured request of the target mode split once (with a kernel record the split walks it)
    to_split = [(t, cpusplit.handoff_cpu(t).cpu_wait_s) for t in ok_others]
    to_waits = [w for _, w in to_split if w is not None]
    from_waits = [p.handoff_wait_s for p in usable if p.handoff_wait_s is not None]
    expected = stats.percentile(to_waits or from_waits, 50)
    ew = Figure()
    if expected is not None and nw.p50 is not None:
        ew = Figure(*(None if v is None else v + expected for v in (nw.p50, nw.lo, nw.hi, nw.p10, nw.p90)))
    mt = dict(base.pop("measured_to"))
    measured = {
        "handoff": [t.handoff_s for t in ok_others],
        "ttft": [t.ttft_s for t in ok_others],
        "handoff_nowait": [t.handoff_s - w for t, w in to_split if t.handoff_s is not None and w is not None],
    }
    mt["handoff_nowait_p50_s"] = stats.percentile(measured["handoff_nowait"], 50)
    mt["expected_cpu_wait_s"] = expected
    mt["expected_cpu_wait_from"] = to_mode if to_waits else from_mode if from_waits else None
    for key, fig in (("handoff", h), ("ttft", f), ("handoff_nowait", nw)):
        m = mt.get(f"{key}_p50_s")
        mt[f"{key}_in_interval"] = None if m is None or fig.lo is None else bool(fig.lo - _NS <= m <= fig.hi + _NS)
        mt[f"{key}_error"] = None if m is None or fig.p50 is None or m <= 0 else (fig.p50 - m) / m
        # the error a prediction exact in distribution would show here from sampling alone (stats.sampling_floor)
        mt[f"{key}_floor"] = stats.sampling_floor(measured[key], n_b=len(usable), resamples=resamples, seed=seed)
    return WhatIf(
        status="ok",
        handoff=h,
        ttft=f,
        handoff_nowait=nw,
        handoff_expected_wait=ew,
        requests=rows,
        measured_to=mt,
        **base,
    )


def _simulate(usable: Sequence[Parts], pools: Sequence[Borrowed], resamples: int, seed: int):
    """(handoff :class:`Figure`, TTFT :class:`Figure`, per-request rows, handoff
    with CPU wait removed :class:`Figure`). Each draw is one request's kept
    phases plus each borrowed figure drawn from its measured values and its
    bytes over a drawn bandwidth; without CPU wait, the kept phases and the
    wire less their own measured CPU wait (a request without figures: NaN,
    left out). The resamples draw the requests with replacement; a request's
    own row is the median of ``resamples`` draws for it alone."""
    import numpy as np

    def arr(f):
        return np.array([np.nan if (v := f(p)) is None else v for p in usable], dtype=float)

    fixed, own_wire, nbytes = arr(lambda p: p.fixed_s), arr(lambda p: p.own_wire_s), arr(lambda p: p.bytes)
    rest = arr(lambda p: None if p.ttft_s is None else p.ttft_s - p.handoff_s)
    fixed_nw = fixed - arr(lambda p: p.fixed_wait_s)
    # the wire's share left without its CPU wait (1 where the wire took no time)
    wire_keep = np.where(
        own_wire > 0, (own_wire - arr(lambda p: p.wire_wait_s)) / np.where(own_wire > 0, own_wire, 1), 1.0
    )
    step, extra, bw = (np.asarray(b.values, dtype=float) for b in pools)
    gen = np.random.default_rng(seed)

    def draw(idx):
        added = step[gen.integers(0, step.size, idx.shape)] + extra[gen.integers(0, extra.size, idx.shape)]
        wire = own_wire[idx]
        if bw.size:  # bytes over a drawn bandwidth where the request's bytes are known
            wire = np.where(np.isnan(nbytes[idx]), wire, nbytes[idx] / bw[gen.integers(0, bw.size, idx.shape)])
        return fixed[idx] + added + wire, fixed_nw[idx] + added + wire * wire_keep[idx]

    n = len(usable)
    idx = gen.integers(0, n, size=(resamples, n))
    handoff, nowait = draw(idx)
    h, f, nw = _figure(handoff), _figure(rest[idx] + handoff), _figure(nowait)
    own = np.median(draw(np.broadcast_to(np.arange(n), (resamples, n)))[0], axis=0)
    rows = tuple(
        (p.trace_id, p.handoff_s, float(x), None if np.isnan(r) else float(r + x)) for p, x, r in zip(usable, own, rest)
    )
    return h, f, rows, nw


def from_store(conn, since_ns: int | None, from_mode: str, limit: int = MAX_TRACES, sched: Any = None) -> WhatIf:
    """:func:`predict` over the window's newest ``limit`` completed requests of
    ``from_mode`` (with their spans), against the other mode's measured ones
    in the same window (runs on the caller's thread; three reads). ``sched``:
    the kernel's scheduler record, where one was kept: the CPU split of both
    sides walks it (:func:`kvtrace.cpusplit.handoff_cpu`)."""
    other = PULL if from_mode == PUSH else PUSH
    mine = tracemodel.slowest(conn, limit, order="start", since_ns=since_ns, mode=from_mode, completed=True)
    # with their spans: their CPU wait is the measured side of the prediction without it
    theirs = tracemodel.slowest(conn, limit, order="start", since_ns=since_ns, mode=other, completed=True)
    if sched is not None:
        mine = [dataclasses.replace(t, sched=sched) for t in mine]
        theirs = [dataclasses.replace(t, sched=sched) for t in theirs]
    return predict(from_mode, mine, theirs)
