"""Tiling a handoff: the derived phases, the exclusive split of the handoff
window among the phases, and what dominates it, in words.

Part of the one trace model (:mod:`kvtrace.tracemodel` re-exports all of
it; docs/phases.md, "Critical path"): where no one process sees an
interval, its phase is **derived** here from two recorded timestamps
(``derived.DERIVED_PHASES``, :func:`derive`) and then treated like any
recorded phase. Spans may overlap (``match`` holds ``writer.wake``), so the
handoff is split exclusively (:func:`tile`): each stretch of the window goes
to the critical span that covers it and started last (the most specific;
ties to the shorter one; a waiting phase such as ``match`` only where
nothing else is named), and what no named span covers is *unattributed*,
with the two timestamps around it named. :func:`summarize` adds tilings up
per mode and :func:`dominant_words` says what dominates in one sentence: the
sentence ``kvlens traces`` and the dashboard's Overview both print.

Pure functions of span-like objects (``name``, ``role``, ``start_ns``,
``end_ns``); no I/O.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from kvtrace.ranks import rank_in
from kvrecord import derived
from kvrecord import semconv as sc

#: Phases that are never a part of the handoff (the root contains it; P's
#: prefill precedes it; P's hold of the blocks follows it).
NOT_HANDOFF_PHASES: frozenset[str] = frozenset({sc.Phase.REQUEST.value, sc.Phase.PREFILL.value, sc.Phase.KV_HOLD.value})
POINT_NAMES = frozenset(p.value for p in sc.POINT_PHASES)
#: kvlens' own phases; any other span in a trace (vLLM's ``llm_request``,
#: joined by ``traceparent``) is context, never handoff cost.
KVLENS_PHASES = frozenset(p.value for p in sc.Phase)
DERIVED_NAMES = frozenset(p.value for p in derived.DERIVED_PHASES)
_WAITING = frozenset(p.value for p in sc.WAITING_PHASES)
#: Derived phases that are parts of a recorded one (``write.wire`` + ``write.noticed``
#: = ``write.complete``): a sum of durations must not count both.
SPLIT_PHASES: frozenset[str] = frozenset(p.value for p, how in derived.DERIVED_PHASES.items() if how.split)

#: The label of handoff time no phase accounts for (never a Phase).
UNATTRIBUTED = "unattributed"


# ------------------------------------------------------------------ derived phases
class Derived(NamedTuple):
    """One derived phase of a trace (:func:`derived_spans`)."""

    name: str
    role: str
    start_ns: int
    end_ns: int
    #: the TP rank of the span it was cut from (a :class:`semconv.Split`), else None
    rank: int | None = None
    #: the release's outcome for ``kv.hold`` (``expired``: the lease ran out), else None
    outcome: str | None = None


def derive(spans: Sequence[Any]) -> list[tuple[str, str, int, int]]:
    """The derived phases (``derived.DERIVED_PHASES``) a trace's recorded
    spans allow: ``(name, role, start_ns, end_ns)`` tuples, pure
    (:func:`derived_spans` with the rank and outcome left out)."""
    return [tuple(d[:4]) for d in derived_spans(spans)]  # type: ignore[misc]


#: DERIVED_PHASES as plain values (enum ``.value`` look-ups cost, per trace and phase): (phase, role, the
#: ``unless`` phase or None, latest, pairs of ((role, phase), 1 for its end / 0 for its start: an index into
#: a :data:`_Groups` tuple), the split as ((role, phase), attr, head) or None).
_PLAN = tuple(
    (
        phase.value,
        how.role,
        how.unless.value if how.unless is not None else None,
        how.latest,
        tuple(tuple(((e.role, e.phase.value), int(e.end == "end")) for e in pair) for pair in how.pairs),
        None if how.split is None else ((how.role, how.split.phase.value), how.split.attr, how.split.head),
    )
    for phase, how in derived.DERIVED_PHASES.items()
)

#: The recorded phases :func:`derived_spans` reads (a store read can leave
#: a trace's other spans out), and those whose attributes it reads (splits).
DERIVATION_ATTRIBUTES = frozenset(split[0][1] for *_, split in _PLAN if split is not None)
DERIVATION_INPUTS = (
    DERIVATION_ATTRIBUTES | {k[1] for p in _PLAN for pair in p[4] for k, _ in pair} | {p[2] for p in _PLAN if p[2]}
)
#: A trace's recorded spans by (role, name): (start_ns, end_ns, outcome, attributes) tuples in the trace's order.
_Groups = Mapping[tuple[str | None, str], Sequence[tuple]]
#: ``Derived`` built from all its fields at C speed (its generated ``__new__`` costs twice as much per phase).
_new = tuple.__new__


def derived_spans(spans: Sequence[Any]) -> list[Derived]:
    """The derived phases a trace's recorded spans allow, pure.

    ``spans``: objects with ``name``, ``role``, ``start_ns``, ``end_ns``
    (``attributes``, ``outcome`` where there are), already on one clock
    (D's moved onto P's). Per phase the first (from, to) pair the trace has
    both ends of is used: the interval starts at the latest ``from``
    timestamp (several workers may record it) and ends at the earliest
    ``to`` at or after it (the latest ``to`` of every pair for a
    ``latest`` phase: ``kv.hold`` ends at P's last release); none is derived
    when the order is reversed (a clock mismatch) or the interval is empty,
    nor where the trace holds the phase's ``unless`` phase (``router.hop``
    where kvlens' router recorded its ``relay``). A :class:`semconv.Split`
    phase is cut from each span it names (:func:`_splits`)."""
    groups: dict[Any, list[tuple]] = {}
    for s in spans:
        if s.name not in DERIVED_NAMES:
            item = (s.start_ns, s.end_ns, getattr(s, "outcome", None), getattr(s, "attributes", None))
            groups.setdefault((s.role, s.name), []).append(item)
    return derived_from(groups)


def derived_from(groups: _Groups) -> list[Derived]:
    """:func:`derived_spans` of a trace's recorded spans grouped (:data:`_Groups`): each phase looks
    its ends up instead of scanning the trace once per phase and end (the handoff resolver derives every request)."""
    out: list[Derived] = []
    for phase, role, unless, latest, pairs, split in _PLAN:
        if unless is not None and unless in {n for _, n in groups}:
            continue  # held by any role
        if split is not None:
            cut = groups.get(split[0])
            if cut:
                _splits(cut, phase, role, split[1], split[2], out)
        elif latest:
            d = _latest(groups, phase, role, pairs)
            if d is not None:
                out.append(d)
        else:
            for (ka, ia), (kb, ib) in pairs:
                froms, tos = groups.get(ka), groups.get(kb)
                if not froms or not tos:
                    continue  # no span of one end: nothing to look for
                # the latest from, the earliest to at or after it (one span each, mostly: no list built)
                t0 = froms[0][ia] if len(froms) == 1 else max([s[ia] for s in froms])
                t1 = tos[0][ib] if len(tos) == 1 else min([t for t in [s[ib] for s in tos] if t >= t0], default=t0)
                if t1 > t0:
                    out.append(_new(Derived, (phase, role, t0, t1, None, None)))
                break
    return out


def _splits(spans: Sequence[tuple], name: str, role: str, attr: str, head: bool, out: list[Derived]) -> None:
    """The split's part of each of ``spans`` (one per rank), onto ``out``.

    The write/read.complete spans run from the request's last post to the
    engine loop seeing DONE; NIXL's xferDuration runs from each post, so
    start + duration puts the wire's end on our clock to within the post's
    own length (``write.post``: the first post may have left that much
    earlier). Summed over several transfers of one rank it can exceed the
    span (they ran side by side): clipped, the wire then holds the span."""
    for start, end, _, attrs in spans:
        if end <= start:
            continue
        attrs = attrs or {}
        x = attrs.get(attr)
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not x > 0:
            continue  # telemetry unavailable: the completion span keeps its time
        cut = min(start + round(float(x) * 1e9), end)
        a, b = (start, cut) if head else (cut, end)
        if b > a:
            out.append(Derived(name, role, a, b, rank_in(attrs)))


def _latest(groups: _Groups, name: str, role: str, pairs: tuple) -> Derived | None:
    """``from`` (the latest of every pair's) -> the latest ``to`` of every
    pair the trace has, where that is later; the outcome of the span that
    gave the ``to`` (``kv.hold``: how P let go; the first of equal ones)."""
    t0 = t1 = outcome = None
    for (ka, ia), (kb, ib) in pairs:
        froms, tos = groups.get(ka), groups.get(kb)
        if froms and tos:
            f = froms[0][ia] if len(froms) == 1 else max([s[ia] for s in froms])
            if t0 is None or f > t0:
                t0 = f
            for s in tos:
                if t1 is None or s[ib] > t1:
                    t1, outcome = s[ib], s[2]
    if t0 is None or t1 <= t0:
        return None  # none, or P let go before D reported the KV ready: no hold
    return Derived(name, role, t0, t1, None, outcome)


def release_of(spans: Iterable[Any]) -> Any | None:
    """P's last release of the request's blocks (the recorded span a
    ``kv.hold`` would end at: ``kv.released``, P's ``write.complete``, or
    the lease's ``expired`` point), whenever it was; None without one."""
    ends = {(b.role, b.phase.value) for _, b in derived.DERIVED_PHASES[sc.Phase.KV_HOLD].pairs}
    rel = [s for s in spans if (s.role, s.name) in ends and s.name not in DERIVED_NAMES]
    return max(rel, key=lambda s: s.end_ns) if rel else None


def release_json(spans: Sequence[Any], kv_ready_ns: int | None) -> dict[str, Any] | None:
    """When P let go of the request's blocks against D's ``kv.ready`` (both
    on P's clock), for ``kvlens traces --json``: ``by`` (the release span),
    its ``outcome`` (``expired``: the lease ran out), ``after_kv_ready_s``
    (negative: P let go before D reported the KV ready, as push usually
    does) and ``hold_s`` (the ``kv.hold`` phase, null without one); None
    without a release or a kv.ready."""
    rel = release_of(spans)
    if rel is None or kv_ready_ns is None:
        return None
    hold = [s for s in spans if s.name == sc.Phase.KV_HOLD.value]
    return {
        "by": rel.name,
        "outcome": getattr(rel, "outcome", None),
        "after_kv_ready_s": (rel.end_ns - kv_ready_ns) / 1e9,
        "hold_s": (hold[0].end_ns - hold[0].start_ns) / 1e9 if hold else None,
    }


class Tiling(NamedTuple):
    """One trace's handoff split exclusively by phase (see :func:`tile`)."""

    #: the handoff window's length, ns
    handoff_ns: int
    #: (role, phase) -> ns of the window this phase holds (each ns counted once)
    phases: dict[tuple[str | None, str], int]
    #: unnamed stretches: (timestamp before, timestamp after, ns), the
    #: timestamps named ``P:prefill.finished``, ``router:relay.end``, ...
    gaps: tuple[tuple[str, str, int], ...]

    @property
    def named_ns(self) -> int:
        """The union of the named critical intervals, ns."""
        return sum(self.phases.values())

    @property
    def unattributed_ns(self) -> int:
        return max(self.handoff_ns - self.named_ns, 0)

    @property
    def unattributed_share(self) -> float:
        return self.unattributed_ns / self.handoff_ns if self.handoff_ns > 0 else 0.0


_LANE = {sc.Role.ROUTER.value: "router", sc.Role.PREFILL.value: "P", sc.Role.DECODE.value: "D"}


def _label(role: str | None, name: str, which: str | None) -> str:
    return f"{_LANE.get(role or '', role or '?')}:{name}{'' if which is None else '.' + which}"


def tile(spans: Iterable[Any], window: tuple[int, int] | None) -> Tiling | None:
    """Split the handoff ``window`` among ``spans`` (recorded and derived,
    on one clock; objects with ``name``, ``role``, ``start_ns``, ``end_ns``).

    Every stretch between two consecutive span boundaries inside the window
    goes to the critical span covering it that started last (ties: the
    shorter, then a split part such as ``write.wire`` over its whole); a waiting phase (``semconv.WAITING_PHASES``: ``match``, P
    waiting for D) only gets what no other phase covers, since what it
    waits for is named there. Overlapping spans never count twice and the phases sum to
    the union of the named critical intervals; stretches no span covers are
    returned as gaps, named by the two timestamps around them. ``None``
    without a window."""
    if window is None:
        return None
    pf, kv = window
    if kv <= pf:
        return Tiling(0, {}, ())
    spans = list(spans)
    ivs = []  # (clipped start, clipped end, role, name, start)
    marks: list[tuple[int, str]] = [
        (pf, _label(sc.Role.PREFILL.value, sc.Phase.PREFILL_FINISHED.value, None)),
        (kv, _label(sc.Role.DECODE.value, sc.Phase.KV_READY.value, None)),
    ]
    for s in spans:
        if s.name in NOT_HANDOFF_PHASES or s.name not in KVLENS_PHASES:
            continue
        if s.start_ns == s.end_ns or s.name in POINT_NAMES:
            marks.append((s.start_ns, _label(s.role, s.name, None)))
            continue
        marks += [(s.start_ns, _label(s.role, s.name, "start")), (s.end_ns, _label(s.role, s.name, "end"))]
        a, b = max(s.start_ns, pf), min(s.end_ns, kv)
        if b > a:
            ivs.append((a, b, s.role, s.name, s.start_ns))
    cuts = sorted({t for t, _ in marks if pf <= t <= kv} | {t for a, b, *_ in ivs for t in (a, b)})
    label_at: dict[int, str] = {}
    for t, lab in marks:  # the window's ends first, then spans in the caller's order
        label_at.setdefault(t, lab)
    phases: dict[tuple[str | None, str], int] = {}
    gaps = []
    for lo, hi in zip(cuts, cuts[1:]):
        owner, best = None, None
        for a, b, role, name, start in ivs:
            if a <= lo and b >= hi:
                # doing over waiting, then the latest start (the span's own, not clipped), the shorter,
                # then a part over its whole (a wire that fills its completion span names it)
                rank = (name not in _WAITING, start, a - b, name in SPLIT_PHASES)
                if best is None or rank > best:
                    owner, best = (a, b, role, name), rank
        if owner is None:
            gaps.append((label_at.get(lo, "?"), label_at.get(hi, "?"), hi - lo))
        else:
            key = (owner[2], owner[3])
            phases[key] = phases.get(key, 0) + hi - lo
    return Tiling(kv - pf, phases, tuple(gaps))


# ------------------------------------------------------------------ in words
@dataclass
class Breakdown:
    """Tilings of one group of traces (a mode) added up."""

    key: str
    requests: int = 0
    #: summed handoff, ns
    handoff_ns: int = 0
    #: phase -> summed exclusive ns (roles merged: one phase name, one share)
    phases: dict[str, int] = field(default_factory=dict)
    #: each request's unattributed share of its handoff
    unattributed_shares: list[float] = field(default_factory=list)
    #: (timestamp before, timestamp after) -> the unnamed stretches between them, ns
    gaps: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    #: False where ``handoff_ns`` is only the sum of the phases (Prometheus
    #: durations): then nothing can be said about unattributed time
    handoff_known: bool = True
    #: each request's CPU-wait share of its handoff, where its phases carry CPU
    #: figures (:func:`kvtrace.costs.breakdown` and :func:`~kvtrace.costs.handoff_costs` add them; :mod:`kvtrace.cpusplit`)
    cpu_wait_shares: list[float] = field(default_factory=list)
    #: requests without CPU figures, by the reason
    cpu_unknown: dict[str, int] = field(default_factory=dict)

    def add_cpu(self, wait_s: float | None, handoff_s: float | None, why: str) -> None:
        """One request's CPU wait over its handoff (``None``: unknown, ``why``)."""
        if wait_s is None or not handoff_s or handoff_s <= 0:
            self.cpu_unknown[why] = self.cpu_unknown.get(why, 0) + 1
        else:
            self.cpu_wait_shares.append(min(wait_s / handoff_s, 1.0))

    @property
    def median_cpu_wait_share(self) -> float | None:
        """The CPU-wait share of the handoff at the median over the requests with figures (None: none had)."""
        return statistics.median(self.cpu_wait_shares) if self.cpu_wait_shares else None

    def add(self, t: Tiling) -> None:
        if t.handoff_ns <= 0:
            return
        self.requests += 1
        self.handoff_ns += t.handoff_ns
        for (_, name), ns in t.phases.items():
            self.phases[name] = self.phases.get(name, 0) + ns
        self.unattributed_shares.append(t.unattributed_share)
        for a, b, ns in t.gaps:
            self.gaps.setdefault((a, b), []).append(ns)

    @property
    def unattributed_ns(self) -> int:
        return max(self.handoff_ns - sum(self.phases.values()), 0)

    @property
    def median_unattributed_share(self) -> float | None:
        """The acceptance figure: the unattributed share of the handoff at the median over requests."""
        return statistics.median(self.unattributed_shares) if self.unattributed_shares else None

    def shares(self) -> list[tuple[str, float]]:
        """(phase or ``unattributed``, share of the summed handoff), largest first."""
        if self.handoff_ns <= 0:
            return []
        out = [(name, ns / self.handoff_ns) for name, ns in self.phases.items() if ns > 0]
        if self.unattributed_ns > 0:
            out.append((UNATTRIBUTED, self.unattributed_ns / self.handoff_ns))
        return sorted(out, key=lambda x: (-x[1], sc.PHASE_ORDER.get(x[0], 99)))

    def top_gaps(self, n: int = 5) -> list[tuple[str, str, int, int, int]]:
        """The unnamed stretches holding the most time: (before, after,
        count, summed ns, median ns), largest sum first."""
        rows = [(a, b, len(v), sum(v), int(statistics.median(v))) for (a, b), v in self.gaps.items()]
        return sorted(rows, key=lambda r: -r[3])[:n]


def summarize(tilings: Iterable[tuple[str, Tiling | None]]) -> dict[str, Breakdown]:
    """Add ``(key, tiling)`` pairs up per key (a mode, or ``mode/dispatch``)."""
    out: dict[str, Breakdown] = {}
    for key, t in tilings:
        if t is not None:
            out.setdefault(key, Breakdown(key)).add(t)
    return out


def phase_words(name: str) -> str:
    """A phase in words (``semconv.PHASE_WORDS``), with its span name."""
    if name == UNATTRIBUTED:
        return "unattributed"
    return f"{sc.PHASE_WORDS.get(name, name)} ({name})"


def dominant_words(b: Breakdown | None, key: str | None = None, top: int = 3) -> str:
    """What dominates a group's handoff, in one line: ``"pull: 71 % of the
    handoff is D's scheduler queue (decode.queue), then 12 % ..., 9 % ...;
    unattributed 3 % (median per request 2 %)"``. Shares are of the summed
    handoff time over the group's requests."""
    key = key or (b.key if b is not None else "?")
    if b is None or not b.requests:
        return f"{key}: no completed handoff to break down"
    shares = [x for x in b.shares() if x[0] != UNATTRIBUTED]
    if not shares:
        return f"{key}: no named phase on the critical path ({b.requests} requests)"
    head, rest = shares[0], shares[1:top]
    text = f"{key}: {_pct(head[1])} of the handoff is {phase_words(head[0])}"
    if rest:
        text += ", then " + ", ".join(f"{_pct(v)} {phase_words(n)}" for n, v in rest)
    if not b.handoff_known:
        return text + " (mean phase durations; their overlap unknown)"
    un = b.unattributed_ns / b.handoff_ns if b.handoff_ns else 0.0
    med = b.median_unattributed_share
    return text + f"; unattributed {_pct(un)}" + (f" (median per request {_pct(med)})" if med is not None else "")


def _pct(v: float) -> str:
    return f"{v * 100:.0f} %"
