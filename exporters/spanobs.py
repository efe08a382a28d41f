"""What one span observes, decided once per (name, mode, role, outcome).

:class:`~exporters.metrics.PhaseMetricsProcessor` runs for every span the
collector takes (tens of thousands a second), so the work that depends only
on a span's name and its mode, role and outcome attributes (closing the
labels, finding the labelled children, choosing the phase's other metrics)
is done once per such key: :func:`plan` returns ``(mode, observe, more)``,
which the processor caches. ``observe(duration_s, trace_id)`` observes the
phase histogram; ``more`` is None, or ``more(attributes, duration_s,
trace_id)`` observes the phase's other metrics (:class:`_More`), the CPU
figures of every phase a connector thread records with a length included
(:data:`CPU_PHASES`; ``kvlens_phase_cpu_*_seconds_total``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from exporters.families import Families
from exporters.fasthistogram import FastHistogram, adder, observe_trace, trace_observer
from kvrecord import derived as dv
from kvrecord import semconv as sc
from kvtrace import kvuse, ranks

#: Per-rank transfer phases observed by rank (``kvlens_rank_phase_duration_seconds``).
_RANK_PHASES = frozenset(
    p.value for p in (sc.Phase.WRITE_POST, sc.Phase.WRITE_COMPLETE, sc.Phase.READ_POST, sc.Phase.READ_COMPLETE)
)
#: Phases whose spans can carry CPU figures (``kvlens.cpu.*``): every phase a
#: connector thread records with a length (not the router's, no point, no derived one).
CPU_PHASES = frozenset(
    p.value
    for p in sc.Phase
    if p not in sc.POINT_PHASES and p not in dv.DERIVED_PHASES and p not in (sc.Phase.REQUEST, sc.Phase.RELAY)
)
#: The rank label's closed set: 0..MAX_RANK_LABEL-1 (TP sizes up to 64), else ``_OTHER``.
MAX_RANK_LABEL = 64


def label_table(enum_cls) -> dict[str, str]:
    return {m.value: m.value for m in enum_cls}


_MODES = label_table(sc.Mode)
ROLE_LABELS = label_table(sc.Role)
_PHASES = label_table(sc.Phase)
_OUTCOMES = label_table(sc.Outcome)
_DISPATCHES = label_table(sc.Dispatch)


def closed_label(value: Any, table: Mapping[str, str], enum_cls) -> str:
    """Closed label value: O(1) for plain strings, :func:`semconv.closed` otherwise."""
    try:
        return table[value]
    except (KeyError, TypeError):  # str-enum members hash by name; lists are unhashable
        return sc.closed(value, enum_cls)


def _num(v: Any) -> float | None:
    if type(v) is int or type(v) is float:  # the usual case, in two checks
        return float(v)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _rank_label(rank: object) -> str:
    return str(rank) if isinstance(rank, int) and 0 <= rank < MAX_RANK_LABEL else sc.OTHER


Plan = tuple  # (mode, observe, more | None, the FastHistogram child | None)


def _observe_nothing(d: float, tid: Any) -> None:
    pass


def plan(fam: Families, owner: Any, name: Any, mode: Any, role: Any, outcome: Any) -> Plan:
    """``(mode, observe, more)`` of a span named ``name`` whose mode, role and
    outcome attributes are these (as they came: they are closed here).
    ``owner``: the processor, whose ``link_gbps`` is read at each transfer."""
    if name == sc.SPAN_HANDOFF_OPEN:  # a partial trace, not a phase: no duration series (exporters.handoffhealth)
        return closed_label(mode, _MODES, sc.Mode), _observe_nothing, None, None
    phase = closed_label(name, _PHASES, sc.Phase)
    mode = closed_label(mode, _MODES, sc.Mode)
    role = closed_label(role, ROLE_LABELS, sc.Role)
    outcome = closed_label(outcome, _OUTCOMES, sc.Outcome)
    child = fam.child(fam.phase, (mode, role, phase, outcome))
    observe = trace_observer(child)
    m = _More(fam, owner, phase, mode, role, outcome)
    more: Callable[[Mapping[str, Any], float, Any], None] | None = None
    if phase == "request":
        more = m.request
    elif phase == "write.complete" or phase == "read.complete":
        more = m.complete
    elif phase in _RANK_PHASES:
        more = m.rank
    elif phase == "decode.first_step":
        more = m.first_step
    elif mode == "push":
        if phase == "registration.receive":
            m.gauges = (adder(fam.regs_waiting, 1),)
        elif phase == "match":
            m.gauges = (adder(fam.regs_waiting, -1), adder(fam.prefills_waiting, -1))
        elif phase == "prefill.finished" and outcome == "ok":
            m.gauges = (adder(fam.prefills_waiting, 1),)
        more = m.push if m.gauges else None
    if phase in CPU_PHASES:
        more = _with_cpu(more, m.cpu)
    return mode, observe, more, child if type(child) is FastHistogram else None


def _with_cpu(more: Callable | None, cpu: Callable) -> Callable:
    """``more`` followed by the CPU figures' counters (``cpu`` alone where there is no ``more``)."""
    if more is None:
        return cpu

    def both(a: Mapping[str, Any], d: float, tid: Any) -> None:
        more(a, d, tid)
        cpu(a, d, tid)

    return both


class _More:
    """The metrics a span of one (phase, mode, role, outcome) has beyond its
    duration. Labelled children are bound on first use (a series appears
    when first observed, as ``fam.child`` at the observation would)."""

    __slots__ = ("fam", "owner", "phase", "mode", "role", "outcome", "gauges", "slots", "ttft", "cpu_incs")

    def __init__(self, fam: Families, owner: Any, phase: str, mode: str, role: str, outcome: str) -> None:
        self.fam, self.owner = fam, owner
        self.phase, self.mode, self.role, self.outcome = phase, mode, role, outcome
        self.gauges: tuple = ()
        self.slots: list = [None] * 4  # see complete, request, first_step
        self.ttft: dict[str, Callable] = {}  # closed dispatch -> observe
        self.cpu_incs: tuple | None = None  # (wait, on, span) children's inc, bound at the first figures

    def _slot(self, i: int, metric: Any, key: tuple, hist: bool = True) -> Any:
        """``slots[i]``, bound on first use: the observe of ``metric``'s child ``key`` (or its ``inc()``)."""
        child = self.fam.child(metric, key)
        self.slots[i] = got = trace_observer(child) if hist else adder(child, 1)
        return got

    def rank(self, a: Mapping[str, Any], d: float, tid: Any) -> None:
        """A per-rank transfer phase: by rank where TP > 1."""
        if (a.get(sc.ATTR_TP_SIZE) or 1) > 1:
            fam = self.fam
            key = (self.mode, self.role, self.phase, _rank_label(a.get(sc.ATTR_RANK)))
            observe_trace(fam.child(fam.rank_phase, key), d, tid)

    def complete(self, a: Mapping[str, Any], d: float, tid: Any) -> None:
        """write/read.complete: by rank, bytes, descriptors, bandwidth (or implausible), expired leases."""
        if (a.get(sc.ATTR_TP_SIZE) or 1) > 1:
            self.rank(a, d, tid)
        fam, slots = self.fam, self.slots
        b, n, x = _num(a.get(sc.ATTR_BYTES)), _num(a.get(sc.ATTR_DESCRIPTORS)), _num(a.get(sc.ATTR_NIXL_XFER_S))
        if b is not None and b > 0:  # 0: NIXL telemetry unavailable
            (slots[0] or self._slot(0, fam.xfer_bytes, (self.mode, self.role)))(b, tid)
        if n is not None and n > 0:
            (slots[1] or self._slot(1, fam.xfer_desc, (self.mode, self.role)))(n, tid)
        g = ranks.gbps(b, x)  # per rank: bytes / NIXL's own time; above the link it is no fact
        if g is not None:
            if g > self.owner.link_gbps:
                (slots[3] or self._slot(3, fam.xfer_implausible, (self.mode, self.role), False))()
            else:
                (slots[2] or self._slot(2, fam.xfer_gbps, (self.mode, self.role)))(g, tid)
        if self.phase == "write.complete" and self.outcome == "expired" and self.mode == "push":
            fam.prefills_waiting.dec()

    def request(self, a: Mapping[str, Any], d: float, tid: Any) -> None:
        """The router's root span: the request count, its TTFT and its TPOT."""
        fam = self.fam
        (self.slots[0] or self._slot(0, fam.requests, (self.mode, self.outcome), False))()
        tpot = _num(a.get(sc.ATTR_TPOT_S))
        if tpot is not None and tpot >= 0:
            (self.slots[1] or self._slot(1, fam.tpot, (self.mode,)))(tpot, tid)
        ttft = _num(a.get(sc.ATTR_TTFT_S))
        if ttft is not None and ttft >= 0:
            disp = closed_label(a.get(sc.ATTR_DISPATCH), _DISPATCHES, sc.Dispatch)
            observe = self.ttft.get(disp)
            if observe is None:  # bounded: dispatch is closed
                observe = self.ttft[disp] = trace_observer(fam.child(fam.ttft, (self.mode, disp)))
            observe(ttft, tid)

    def first_step(self, a: Mapping[str, Any], d: float, tid: Any) -> None:
        """D's first step: KV recomputed (0 recomputed tokens, the rule, cannot be)."""
        if a.get(sc.ATTR_KV_RECOMPUTED_TOKENS) and kvuse.is_recomputed(a):
            (self.slots[0] or self._slot(0, self.fam.kv_recomputed, (self.mode,), False))()

    def cpu(self, a: Mapping[str, Any], d: float, tid: Any) -> None:
        """The span's CPU figures (``kvlens.cpu.wait_s`` / ``on_s``), where it
        carries them: a span whose figures are unknown adds to no counter, so
        the share the recording rule reads stays over measured spans only.
        The figures run from the thread's last reading at or before the
        span's start (``kvlens.cpu.gap_s`` before it) to its end. A blocked
        thread's counters do not move in that gap (D's ``decode.queue``: an
        idle engine, gaps of seconds), a busy one's do (P's ``write.complete``:
        the worker polls, 5 ms of wait over a 2 ms span with a 4 ms gap). So
        the time counted is the shortest stretch that holds the figures: the
        span, or on-CPU + wait where they exceed it, at most span + gap. The
        share stays a fraction (CI read 1.33 for pull with the span alone)
        and an idle gap does not dilute it."""
        wait, on = _num(a.get(sc.ATTR_CPU_WAIT_S)), _num(a.get(sc.ATTR_CPU_ON_S))
        if wait is None or on is None or wait < 0 or on < 0:
            return
        if on + wait > d:
            gap = _num(a.get(sc.ATTR_CPU_GAP_S))
            d = min(on + wait, d + gap) if gap is not None and gap > 0 else d
        incs = self.cpu_incs
        if incs is None:
            fam, key = self.fam, (self.mode, self.role, self.phase)
            incs = self.cpu_incs = tuple(fam.child(c, key).inc for c in (fam.cpu_wait, fam.cpu_on, fam.cpu_span))
        incs[0](wait)
        incs[1](on)
        incs[2](d)

    def push(self, a: Mapping[str, Any], d: float, tid: Any) -> None:
        """Push's waiting gauges (see :mod:`exporters.metrics`)."""
        for f in self.gauges:
            f()
