"""CPU or wire on the Overview's "where the handoff goes" (pure, no Streamlit):
each mode's CPU-wait share of the handoff (the median over requests) and each
phase's CPU-wait share of its critical-path time, from the same sample of
traces as the per-phase breakdown (:func:`kvtrace.costs.sample_costs`, split
by :mod:`kvtrace.cpusplit`). Where a figure cannot be had it is "unknown"
with the reason, never 0."""

from __future__ import annotations

from typing import Any

from kvrecord import semconv as sc
from kvtrace import costs, cpusplit

#: Why there is no CPU split where the page's phases come from Prometheus.
FROM_PROMETHEUS = (
    "the per-request CPU figures come from the trace store's spans; these phases are Prometheus' "
    "(its share: kvlens:handoff_cpu_wait_share:ratio_5m)"
)

HELP = (
    "CPU wait: the thread that ended each phase was runnable but waiting for a CPU (schedstat: host contention), "
    "over the part of the phase on the critical path. The handoff's share is per request, the median shown; a "
    "phase's share is of its critical-path time in the requests whose span carried CPU figures. Derived phases "
    "span two threads or processes and have none. " + cpusplit.SPIN_NOTE + "."
)


def cpu_attrs(hc: costs.HandoffCosts, modes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per mode, the figures :func:`cpu_words` says (plain JSON: a DataFrame's ``attrs``)."""
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        b = hc.breakdown.get(mode)
        phases = {name: (w / c if c > 0 else None) for (m, name), (w, c) in sorted(hc.phase_cpu.items()) if m == mode}
        out[mode] = {
            "median": None if b is None else b.median_cpu_wait_share,
            "known": 0 if b is None else len(b.cpu_wait_shares),
            "unknown": {} if b is None else dict(b.cpu_unknown),
            "phases": {k: v for k, v in phases.items() if v is not None},
            "phases_unknown": {name: why for (m, name), why in hc.phase_cpu_unknown.items() if m == mode},
        }
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %" if x < 0.1 else f"{x * 100:.0f} %"


def cpu_words(attrs: dict[str, Any] | None, mode: str) -> str:
    """One mode's CPU-wait shares in words (markdown); "unknown (why)" where none can be had."""
    if attrs is None:
        return f"**CPU wait:** unknown ({FROM_PROMETHEUS})."
    c = attrs.get(mode)
    if not c or (not c["known"] and not c["unknown"]):
        return "**CPU wait:** unknown (no completed handoff in this range)."
    if not c["known"]:
        why = max(c["unknown"], key=c["unknown"].get)
        return f"**CPU wait:** unknown ({why})."
    rest = sum(c["unknown"].values())
    text = (
        f"**CPU wait:** {_pct(c['median'])} of the handoff at the median request was threads waiting for a CPU "
        f"({c['known']} requests with CPU figures"
        + (f"; {rest} without: {max(c['unknown'], key=c['unknown'].get)}" if rest else "")
        + ")."
    )
    order = sorted(c["phases"], key=lambda n: sc.PHASE_ORDER.get(n, 99))
    if order:
        text += " Per phase, of its critical-path time: " + ", ".join(f"{n} {_pct(c['phases'][n])}" for n in order)
        text += "."
    by_why: dict[str, list[str]] = {}
    for name, why in sorted(c["phases_unknown"].items(), key=lambda kv: sc.PHASE_ORDER.get(kv[0], 99)):
        by_why.setdefault(why, []).append(name)
    for why, names in by_why.items():
        text += f" Unknown: {', '.join(names)} ({why})."
    return text
