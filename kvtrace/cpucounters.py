"""A phase's CPU figures from the per-thread counters kvlens' hooks read
at phase boundaries (:mod:`kvrecord.cpuclock`, docs/phases.md "CPU or
wire"): the source :mod:`kvtrace.cpusplit` takes them from where the
kernel's scheduler record was not kept or does not cover a phase.

Every recorded phase with a length carries the CPU figures of the thread
that ended it (:mod:`kvrecord.cpuclock`, ``kvlens.cpu.on_s`` /
``kvlens.cpu.wait_s``): the thread whose wake-up the phase waited for. Over
the handoff's tiling (:func:`kvtrace.tiling.tile`, each ns owned by one
phase), each phase contributes its figures in proportion to the share of it
that lies on the critical path; a split part (``write.wire`` /
``write.noticed`` of ``write.complete``) takes its share of the span it was
cut from. A derived phase that ends where a recorded event starts
(``prefill.dispatch`` at ``writer.wake``, ``decode.dispatch`` at
``descriptor.prep``, ``write.notify`` at ``kv.ready``) takes the figures of
the thread that stamped that start, from its readings before it
(``kvlens.cpu.before.*``): where the thread was put on a CPU once since a
reading before the phase's start (a blocked thread woken by the phase's
end), its wait lies just before that run, so the part of it that must lie
inside the phase counts (:func:`derived_figures`); else the reading nearest
before the phase's start, scaled to the phase's length (its share of that
stretch). ``prefill.respond`` (P's answer through its API server to the
router's ``relay``) takes the router's event loop's this way, and
``prefill.respond`` / ``decode.intake`` also take the engine's API server's
wait that must lie inside them, from where it landed between the
EngineCore's per-step readings of it (:func:`landed_wait`). Derived phases
with neither have no figures: their time is ``unknown_s``, never counted as
either. Where a placement rule gave the figures they are a lower bound (the
path's other threads are not all read): the rest of the phase is
``unknown_s`` too, not off-CPU.

Pure functions of spans (their ``start_ns``, ``end_ns``, ``attributes``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple

from kvrecord import semconv as sc

#: A reading before a derived phase's start counts when it lies within this share of the phase's length
#: (plus :data:`GAP_SLACK_S`) before it: further back, the thread's figures are mostly another stretch's.
GAP_SHARE = 0.5
GAP_SLACK_S = 0.001


class PhaseCpu(NamedTuple):
    """One phase's CPU figures on the critical path (seconds)."""

    on_s: float
    wait_s: float
    #: False: the figures are the part placed for sure (a lower bound: :func:`derived_figures`' one-run rule,
    #: :func:`landed_wait`); the phase's rest is unknown, not off-CPU (threads on its path were not all read)
    rest_known: bool = True
    #: the part of the stretch that is neither, a figure of its own (:func:`kvtrace.cpusplit.polled_figures`: the
    #: time its crossing's data was not waiting in a socket for a starved reader, the wire, the peer and a
    #: starved sender alike); the rest beyond it and the figures is off-CPU
    unknown_s: float = 0.0


def span_figures(attrs: Mapping[str, Any], wall_s: float | None = None) -> PhaseCpu | None:
    """A recorded span's own figures, or None (unknown). With ``wall_s``, its
    critical-path wait: the ending thread's plus the upstream thread's
    (``kvlens.cpu.up.wait_s``: the engine thread the ending thread waits on,
    blocked, while it waits for a CPU), at most the span's off-CPU remainder
    (both at once would count twice)."""
    on, wait = attrs.get(sc.ATTR_CPU_ON_S), attrs.get(sc.ATTR_CPU_WAIT_S)
    if not (isinstance(on, (int, float)) and isinstance(wait, (int, float))):
        return None
    up = attrs.get(sc.ATTR_CPU_UP_WAIT_S)
    if wall_s is not None and isinstance(up, (int, float)) and up > 0:
        wait = min(float(wait) + float(up), max(wall_s - float(on), float(wait)))
    return PhaseCpu(float(on), float(wait))


def noticed_figures(span: Any) -> tuple[PhaseCpu, float] | None:
    """A completion span's figures after NIXL's transfer ended, and that
    stretch's length in seconds (None: not recorded)."""
    a = span.attributes or {}
    on, wait, xfer = a.get(sc.ATTR_CPU_NOTICED_ON_S), a.get(sc.ATTR_CPU_NOTICED_WAIT_S), a.get(sc.ATTR_NIXL_XFER_S)
    if not all(isinstance(v, (int, float)) for v in (on, wait, xfer)):
        return None
    return PhaseCpu(float(on), float(wait)), max((span.end_ns - span.start_ns) / 1e9 - float(xfer), 0.0)


def derived_figures(dur_ns: int, ends: Iterable[Any]) -> PhaseCpu | None:
    """A derived phase's figures from the readings before the first of
    ``ends`` (recorded spans, or None) that has one before the phase's start
    (module docstring); None: unknown. Where the thread ran once, without a
    break, from its wake-up to the phase's end (``kvlens.cpu.before.runs``
    of 1: one run since that reading), its wait lies just before that run,
    which began at most its on-CPU time before the end: the part of the wait
    that must lie inside the phase counts, however far back the reading is.
    Otherwise the reading must lie near the start (:data:`GAP_SHARE`) and its
    figures are scaled to the phase's length."""
    dur = dur_ns / 1e9
    for e in ends:
        a = (e.attributes or {}) if e is not None else {}
        ages, ons, waits = (
            a.get(k) for k in (sc.ATTR_CPU_BEFORE_AGE_S, sc.ATTR_CPU_BEFORE_ON_S, sc.ATTR_CPU_BEFORE_WAIT_S)
        )
        if not ages or not ons or not waits:
            continue
        runs = a.get(sc.ATTR_CPU_BEFORE_RUNS) or ()
        for i, (age, on, wait) in enumerate(zip(ages, ons, waits)):
            if age + 1e-6 >= dur:
                if i < len(runs) and runs[i] in (0, 1):
                    w = min(max(dur - on, 0.0), max(wait, 0.0))
                    return PhaseCpu(min(max(on, 0.0), dur - w), w, False)
                if age - dur > GAP_SHARE * dur + GAP_SLACK_S:
                    return None  # the nearest reading before the start is too far back
                share = dur / age if age > 0 else 1.0
                return PhaseCpu(max(on, 0.0) * share, max(wait, 0.0) * share)
        return None  # no reading far enough back
    return None


def landed_wait(start_ns: int, end_ns: int, carriers: Iterable[Any]) -> float | None:
    """The CPU wait of an engine's API server that lies inside ``[start_ns,
    end_ns]`` for sure, from where it landed (``kvlens.cpu.up.landed.*`` on
    the first of ``carriers``, recorded spans of that engine, that has them);
    None: unknown. A growth between two readings is waiting that ended when
    the thread got a CPU, between them; it began at most its own length
    before: the part that lies in the phase wherever it ended counts.
    Unknown where no reading followed the phase's end (a wait then running
    had not landed: an idle EngineCore reads nothing), or where nothing is
    certain but a growth may overlap the phase (readings too far apart)."""
    for c in carriers:
        a = c.attributes or {}
        lo, hi, grew = (
            a.get(k) for k in (sc.ATTR_CPU_UP_LANDED_LO_S, sc.ATTR_CPU_UP_LANDED_HI_S, sc.ATTR_CPU_UP_LANDED_WAIT_S)
        )
        newest = a.get(sc.ATTR_CPU_UP_LANDED_NEWEST_S)
        if lo is None or hi is None or grew is None or not isinstance(newest, (int, float)):
            continue
        if c.end_ns - int(newest * 1e9) < end_ns:
            return None
        dur = (end_ns - start_ns) / 1e9
        total = 0.0
        maybe = False
        for lo_s, hi_s, g in zip(lo, hi, grew):
            t_lo = c.end_ns - int(lo_s * 1e9)
            t_hi = c.end_ns - int(hi_s * 1e9)
            total += max(0.0, min(g, (t_lo - start_ns) / 1e9, (end_ns - t_hi) / 1e9 + g, dur))
            maybe = maybe or (t_hi >= start_ns and t_lo - int(g * 1e9) <= end_ns)
        if total <= 0.0 and maybe:
            return None
        return min(total, dur)
    return None
