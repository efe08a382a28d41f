"""The handoff's costs over many traces: each trace tiled (:mod:`kvtrace.tiling`)
and added up per mode; what the dashboard's per-phase breakdown,
``kvlens traces --breakdown`` and ``benchmarks/handoff_tiling.py`` read."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from kvrecord import derived
from kvrecord import semconv as sc
from kvtrace import cpusplit, store
from kvtrace.tiling import KVLENS_PHASES, NOT_HANDOFF_PHASES, Breakdown, Tiling, derive, summarize, tile
from kvtrace.tracemodel import critical_ns, d_shift_ns, slowest


class HandoffCosts(NamedTuple):
    """Sums over a sample of completed traces (see :func:`handoff_costs`)."""

    #: (mode, role, phase) -> (critical seconds, overlap seconds), summed over
    #: the sample; critical seconds are the phase's exclusive share of the
    #: window (:func:`tile`), so a mode's phases never add up past its handoff
    phases: dict[tuple[str, str | None, str], tuple[float, float]]
    #: mode -> (requests in the sample, mean handoff seconds)
    requests: dict[str, tuple[int, float]]
    #: mode -> the tilings added up (what dominates, the unnamed gaps; each
    #: request's CPU-wait share of its handoff where the spans carry figures)
    breakdown: dict[str, Breakdown] = {}
    #: (mode, phase) -> (critical-path CPU wait, critical-path seconds) summed
    #: over the requests whose span of that phase carries CPU figures
    #: (:mod:`kvtrace.cpusplit`); a phase that never had figures is absent
    phase_cpu: dict[tuple[str, str], tuple[float, float]] = {}
    #: (mode, phase) -> why it has no CPU figures (the last request's reason)
    phase_cpu_unknown: dict[tuple[str, str], str] = {}


class _Row(NamedTuple):
    name: str
    role: str | None
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = {}


class _Tiled(NamedTuple):
    """A trace as :func:`kvtrace.cpusplit.handoff_cpu` reads it: its spans (derived ones marked) and its tiling."""

    spans: Sequence[_Row]
    til: Tiling

    def tiling(self) -> Tiling:
        return self.til


#: Recorded phases whose spans can carry CPU figures (the attributes a sample reads for the CPU split):
#: every one with a length, and the events a derived phase ends at (their ``kvlens.cpu.before.*``
#: readings are the derived phase's figures, :func:`kvtrace.cpucounters.derived_figures`).
CPU_PHASES = (
    frozenset(p.value for p in sc.Phase if p not in sc.POINT_PHASES and p not in derived.DERIVED_PHASES)
    - NOT_HANDOFF_PHASES
) | frozenset(to.phase.value for how in derived.DERIVED_PHASES.values() for _frm, to in how.pairs)
#: A derived row's attributes (:func:`kvtrace.cpusplit.handoff_cpu` tells them from recorded spans by this).
_DERIVED_ATTRS = {sc.ATTR_DERIVED: True}


def _add_phase_cpu(
    mode: str, t: Tiling, split: cpusplit.HandoffCpu, acc: dict, why: dict[tuple[str, str], str]
) -> None:
    """One request's per-phase CPU wait on the critical path into ``acc`` / ``why``."""
    crit: dict[str, int] = {}
    for (_, name), ns in t.phases.items():
        crit[name] = crit.get(name, 0) + ns
    for name, wait in split.phases_wait_s.items():
        if wait is None:
            why[(mode, name)] = split.notes.get(name, cpusplit.NO_FIGURES)
            continue
        w, c = acc.get((mode, name), (0.0, 0.0))
        acc[(mode, name)] = (w + wait, c + crit.get(name, 0) / 1e9)


def handoff_costs(
    traces: Iterable[Sequence[Any]],
    spans: Iterable[Sequence[Any]],
    attrs: Mapping[tuple, Mapping[str, Any]] | None = None,
) -> HandoffCosts:
    """Split each trace's handoff among its phases by the rule above (derived
    phases included), summed per (mode, role, phase), and add the tilings up
    per mode. ``traces`` / ``spans``: rows in ``store.SAMPLE_TRACE_COLUMNS`` /
    ``store.SAMPLE_SPAN_COLUMNS`` order; ``attrs``: the attributes of the
    spans a derivation reads (NIXL's time on write/read.complete), keyed by
    the span row (``store.attributes_of``)."""
    attrs = attrs or {}
    traces = list(traces)
    # D's times go onto P's clock (kv.ready and D's spans), as in Trace.from_rows
    window = {tid: (mode, pf, kv - d_shift_ns(off), d_shift_ns(off)) for tid, mode, pf, kv, _, off in traces}
    by_trace: dict[str, list[_Row]] = {}
    over: dict[tuple[str, str | None, str], int] = {}
    for tid, role, name, start, end in spans:
        w = window.get(tid)
        if w is None or name in NOT_HANDOFF_PHASES or name not in KVLENS_PHASES:
            continue
        d = w[3] if role == sc.Role.DECODE.value else 0
        row = _Row(name, role, start - d, end - d, attrs.get((tid, role, name, start, end), {}))
        by_trace.setdefault(tid, []).append(row)
        key = (w[0], role, name)
        over[key] = over.get(key, 0) + (end - start) - critical_ns(name, row.start_ns, row.end_ns, w[1], w[2])
    crit: dict[tuple[str, str | None, str], int] = {}
    tilings: list[tuple[str, Tiling]] = []
    splits: list[tuple[str, cpusplit.HandoffCpu]] = []
    phase_cpu: dict[tuple[str, str], tuple[float, float]] = {}
    phase_why: dict[tuple[str, str], str] = {}
    for tid, (mode, pf, kv, _) in window.items():
        rows = by_trace.get(tid, [])
        rows.sort(key=lambda r: r.start_ns)
        derived = [_Row(*d, _DERIVED_ATTRS) for d in derive(rows)]
        for r in derived:
            if r.name in NOT_HANDOFF_PHASES:  # P's hold follows the handoff: neither cost nor overlap
                continue
            key = (mode, r.role, r.name)
            over[key] = over.get(key, 0) + (r.end_ns - r.start_ns) - critical_ns(r.name, r.start_ns, r.end_ns, pf, kv)
        rows += derived
        t = tile(rows, (pf, kv))
        if t is None:
            continue
        tilings.append((mode, t))
        for (role, name), ns in t.phases.items():
            crit[(mode, role, name)] = crit.get((mode, role, name), 0) + ns
        split = cpusplit.handoff_cpu(_Tiled(rows, t))
        splits.append((mode, split))
        _add_phase_cpu(mode, t, split, phase_cpu, phase_why)
    per_mode: dict[str, list[float]] = {}
    for _, mode, _, _, h, _ in traces:
        m = per_mode.setdefault(mode, [0, 0.0])
        m[0] += 1
        m[1] += h
    groups = summarize(tilings)
    for mode, split in splits:
        if mode in groups:
            groups[mode].add_cpu(split.cpu_wait_s, split.handoff_s, cpusplit.unknown_reason(split))
    return HandoffCosts(
        phases={k: (crit.get(k, 0) / 1e9, max(over.get(k, 0), 0) / 1e9) for k in set(crit) | set(over)},
        requests={m: (int(n), tot / n) for m, (n, tot) in per_mode.items()},
        breakdown=groups,
        phase_cpu=phase_cpu,
        phase_cpu_unknown={k: v for k, v in phase_why.items() if k not in phase_cpu},
    )


#: Newest completed traces a breakdown reads (as the dashboard's sample).
BREAKDOWN_SAMPLE = 5_000


def breakdown(
    conn, *, limit: int = BREAKDOWN_SAMPLE, by_dispatch: bool = False, derived: bool = True, **filters: Any
) -> dict[str, Breakdown]:
    """The newest ``limit`` completed traces matching ``filters``
    (``store.TraceFilter`` fields) tiled and added up per mode (and per
    ``mode/dispatch`` as well with ``by_dispatch``; ``derived=False``:
    recorded phases only). ``kvlens traces --breakdown`` prints it;
    ``benchmarks/handoff_tiling.py`` compares stores (before / after) with it.
    Tiling needs spans: requests kept as their summary only (``--keep
    sampled``) are left out, and :func:`summary_only` says how many."""
    filters.pop("completed", None)
    filters.pop("with_spans", None)
    trs = slowest(conn, limit, order="start", completed=True, with_spans=True, **filters)
    pairs: list[tuple[str, Tiling | None]] = []
    cpu = []
    for t in trs:
        til = t.tiling(derived=derived)
        keys = [t.mode or "?"] + ([f"{t.mode}/{t.dispatch}"] if by_dispatch and t.dispatch else [])
        pairs += [(k, til) for k in keys]
        cpu.append((keys, cpusplit.handoff_cpu(t)))
    out = summarize(pairs)
    for keys, hc in cpu:  # each request's CPU-wait share of its handoff (the median is the summary's)
        for k in keys:
            if k in out:
                out[k].add_cpu(hc.cpu_wait_s, hc.handoff_s, cpusplit.unknown_reason(hc))
    return out


def summary_only(conn, **filters: Any) -> int:
    """Completed requests matching ``filters`` whose spans were not kept
    (what :func:`breakdown` cannot tile; 0 under ``--keep all``)."""
    filters.pop("completed", None)
    return store.count_summary_only(conn, **filters)


def sample_costs(conn, *, since_ns: int | None, until_ns: int | None, limit: int) -> HandoffCosts:
    """:func:`handoff_costs` over the newest ``limit`` completed traces that
    started in [since_ns, until_ns] (the dashboard's per-phase breakdown)."""
    traces, spans = store.handoff_sample(
        conn, since_ns=since_ns, until_ns=until_ns, limit=limit, exclude_phases=NOT_HANDOFF_PHASES
    )
    split = {how.split.phase.value for how in derived.DERIVED_PHASES.values() if how.split is not None}
    # the CPU figures (kvlens.cpu.*) ride on every recorded phase with a length: their attributes too
    return handoff_costs(traces, spans, store.attributes_of(conn, [t[0] for t in traces], split | CPU_PHASES))
