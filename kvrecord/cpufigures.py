"""The CPU figures of a phase, computed from :mod:`kvrecord.cpuclock`'s
readings (a thread's ring of ``(t_ns, on-CPU ns, raw schedstat)``, the PSI
ring): docs/phases.md, "CPU or wire".

* :func:`window` turns two readings into ``(on_s, wait_s)`` for one thread
  over ``[start, end]``: the last reading at or before each end (a sleeping
  thread's counters do not move, so a reading taken before it went to sleep
  stands for the start; ``gap_s`` says how far before it was).
  :func:`spinner_window` interpolates a spinning thread's counters (they
  grow with the wall clock) at any instant.
* :func:`lookback` (and :func:`before_attrs`, its span attributes): a
  thread's counters over the readings before an instant, for a derived
  phase that ends where that thread's event starts.
* :func:`landings`: where another thread's CPU wait grew (it lands when that
  thread gets a CPU) before an instant.
* :func:`psi_some_s`: the host's CPU pressure over an interval.

Each takes the ring it reads (``clock.rings.get(key)``, ``clock.psi``);
None or an empty ring gives no figure. Called off the hooks' clock, once per
recorded phase (instrumented_connector/cputap.py, proxy/telemetry.py).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from kvrecord import semconv as sc
from kvrecord.cpuclock import CpuClock, parse_psi_some_us, runs, wait_ns

_get_tid = threading.get_native_id

#: Readings a lookback examines at most (a burst of hooks can put hundreds within a millisecond).
LOOKBACK_SCAN = 16


class Window(NamedTuple):
    """One thread's counters over an interval, seconds."""

    on_s: float  # on a CPU
    wait_s: float  # runnable, waiting for a CPU
    gap_s: float  # how long before the interval's start the start reading was taken


def window(ring, start_ns: int, end_ns: int) -> Window | None:
    """A thread's on-CPU and run-queue wait over ``[start_ns, end_ns]`` from
    its ``ring``: the last readings at or before each end; None without one."""
    if not ring:
        return None
    r1 = r0 = None
    for r in reversed(ring):
        if r1 is None:
            if r[0] <= end_ns:
                r1 = r
            else:
                continue
        if r[0] <= start_ns:
            r0 = r
            break
    if r0 is None or r1 is None:
        return None
    return Window((r1[1] - r0[1]) / 1e9, (wait_ns(r1[2]) - wait_ns(r0[2])) / 1e9, (start_ns - r0[0]) / 1e9)


def lookback(ring, at_ns: int, n: int = 8, max_age_ns: int = 2_000_000_000, min_step_ns: int = 500_000):
    """A thread's counters before ``at_ns`` from its ``ring``: for up to ``n``
    earlier readings (one per burst: the oldest of those within
    ``min_step_ns`` of the burst's youngest; at most ``max_age_ns`` back),
    their age and the on-CPU, CPU wait and times put on a CPU (schedstat's
    run count) from each up to the last reading at or before ``at_ns``: four
    lists, youngest first (empty: none); seconds, the runs a count, -1 where
    that last reading is not ``at_ns``'s own (a run count then says nothing
    of ``at_ns``). A derived phase that ends where this thread's event starts
    takes its figures from here (:mod:`kvtrace.cpusplit`)."""
    ages: list[float] = []
    ons: list[float] = []
    waits: list[float] = []
    counts: list[int] = []
    if not ring:
        return ages, ons, waits, counts
    ref = None
    anchor = None  # the youngest reading of the current burst (readings within min_step_ns of it)
    oldest = None  # the burst's oldest reading so far: it stands for the burst (parsed once, when it closes)
    for k, (t, on, raw) in enumerate(reversed(ring)):
        if k >= LOOKBACK_SCAN:
            break
        if ref is None:
            if t <= at_ns:
                ref = (t, on, wait_ns(raw), runs(raw) if t == at_ns else None)
                anchor = t
            continue
        if at_ns - t > max_age_ns:
            break
        if anchor - t < min_step_ns:
            # within a burst the oldest reading stands for it: a phase that began at the burst's first
            # reading (an event stamped just before a step's reading) finds its start
            if oldest is not None:
                oldest = (t, on, raw)
            continue
        if oldest is not None:
            _entry(ref, oldest, at_ns, ages, ons, waits, counts)
        if len(ages) >= n:
            oldest = None
            break
        oldest = (t, on, raw)
        anchor = t
    if oldest is not None:
        _entry(ref, oldest, at_ns, ages, ons, waits, counts)
    return ages, ons, waits, counts


def before_attrs(clock: CpuClock, at_ns: int, attrs: dict) -> dict:
    """``attrs`` with the calling thread's :func:`lookback` before ``at_ns``
    (from ``clock``'s readings) as span attributes (``kvlens.cpu.before.*``),
    where there is one."""
    if clock.enabled:
        tid = _get_tid()
        ages, ons, waits, counts = lookback(clock.rings.get(tid), at_ns)
        if ages:
            attrs[sc.ATTR_CPU_BEFORE_AGE_S] = ages
            attrs[sc.ATTR_CPU_BEFORE_ON_S] = ons
            attrs[sc.ATTR_CPU_BEFORE_WAIT_S] = waits
            attrs[sc.ATTR_CPU_BEFORE_RUNS] = counts
            attrs[sc.ATTR_CPU_BEFORE_TID] = tid
    return attrs


def landings(ring, at_ns: int, max_age_ns: int = 2_000_000_000, n: int = 48, scan: int = 768):
    """Where the CPU wait in ``ring`` grew before ``at_ns`` (another thread's,
    read once per step: :meth:`kvrecord.cpuclock.CpuClock.watch_upstream`):
    for each pair of consecutive readings between which it grew, youngest
    first, the older's and the newer's age and the growth, seconds (three
    lists), and the newest reading's age (None: no reading): a wait still
    running then has not landed, so a phase after it is not covered.
    Another thread's wait lands when it gets a CPU, so each growth is
    waiting that ended between the two readings; :mod:`kvtrace.cpusplit`
    places it inside a phase from these bounds. At most ``n`` pairs,
    ``scan`` readings and ``max_age_ns`` back."""
    lo: list[float] = []
    hi: list[float] = []
    grew: list[float] = []
    newest = None
    if not ring:
        return lo, hi, grew, newest
    newer = None
    for k, r in enumerate(reversed(ring)):
        t = r[0]
        if k >= scan or at_ns - t > max_age_ns:
            break
        if t > at_ns:
            continue
        if newest is None:
            newest = (at_ns - t) / 1e9
        w = r[3] if len(r) > 3 else wait_ns(r[2])
        if newer is not None and newer[1] > w:
            lo.append((at_ns - t) / 1e9)
            hi.append((at_ns - newer[0]) / 1e9)
            grew.append((newer[1] - w) / 1e9)
            if len(lo) >= n:
                break
        newer = (t, w)
    return lo, hi, grew, newest


def spinner_window(ring, start_ns: int, end_ns: int) -> Window | None:
    """A spinning thread's counters over ``[start_ns, end_ns]`` from its
    ``ring``, each end interpolated between the readings around it (a spinner
    is always runnable: its counters grow with the wall clock); None where
    the ring does not hold both ends."""
    if not ring:
        return None
    a = _interp(ring, start_ns)
    b = _interp(ring, end_ns)
    if a is None or b is None:
        return None
    # another thread's schedstat wait grows only when that thread gets a CPU (the whole stretch at once):
    # a stretch that began before the window can land in it, so the figures are bounded by the wall
    wall = (end_ns - start_ns) / 1e9
    on = min(max(b[0] - a[0], 0.0) / 1e9, wall)
    return Window(on, min(max(b[1] - a[1], 0.0) / 1e9, wall - on), 0.0)


def psi_some_s(psi, start_ns: int, end_ns: int) -> float | None:
    """The host's PSI ``some`` time over ``[start_ns, end_ns]`` from the PSI
    ring ``psi`` (last readings at or before each end)."""
    r1 = r0 = None
    for t, raw in reversed(psi):
        if r1 is None:
            if t <= end_ns:
                r1 = raw
            else:
                continue
        if t <= start_ns:
            r0 = raw
            break
    if r0 is None or r1 is None:
        return None
    return (parse_psi_some_us(r1) - parse_psi_some_us(r0)) / 1e6


def _entry(ref, r, at_ns: int, ages: list, ons: list, waits: list, counts: list) -> None:
    """One :func:`lookback` entry: reading ``r``'s age before ``at_ns`` and the counters from it up to ``ref``."""
    t, on, raw = r
    ages.append((at_ns - t) / 1e9)
    ons.append((ref[1] - on) / 1e9)
    waits.append((ref[2] - wait_ns(raw)) / 1e9)
    counts.append(-1 if ref[3] is None else ref[3] - runs(raw))


def _interp(ring, t_ns: int) -> tuple[float, float] | None:
    """Counters (on, wait) at ``t_ns``, linear between the readings around it;
    None where no reading lies on one side of it."""
    after = None
    for t, on0, raw in reversed(ring):
        if t <= t_ns:
            w0 = wait_ns(raw)
            if t == t_ns:
                return float(on0), float(w0)
            if after is None:
                return None
            t1, on1, w1 = after
            f = (t_ns - t) / (t1 - t)
            return on0 + f * (on1 - on0), w0 + f * (w1 - w0)
        after = (t, on0, wait_ns(raw))
    return None
