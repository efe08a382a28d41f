"""Clock offsets between a P and a D engine, bounded by the messages that
cross between them, and the handoff corrected for them (docs/phases.md,
"Clocks across hosts").

The handoff ``kv.ready`` (D's clock) minus ``prefill.finished`` (P's clock)
mixes two wall clocks. Write ``theta`` for D's clock minus P's at the same
instant. A message sent at D-clock time ``s`` and received at P-clock time
``r`` was sent before it was received, so ``theta > s - r``; a message from P
(sent at ``s``, P clock) to D (received at ``r``, D clock) gives
``theta < r - s``. Each request carries one crossing each way
(docs/phases.md lists them per mode), so every request has its own interval
``[lo, hi]`` that must contain ``theta``; over a sliding window of a pair's
requests the interval is the tightest one (max of the ``lo``, min of the
``hi``). Nothing is assumed from host names or addresses: two processes on
one machine get an interval that contains 0, and then the uncorrected figure
stands.

With ``theta`` in ``[lo, hi]`` the true handoff lies in
``[raw - hi, raw - lo]``:

* interval contains 0: ``handoff = raw``, error bound ``max(-lo, hi)``;
* otherwise: ``handoff = raw - (lo + hi) / 2``, error bound ``(hi - lo) / 2``;
* no interval (a direction never crossed, or ``lo > hi`` because a clock
  stepped): the handoff is **unknown** with the reason; never clamped.

Pure functions of integers (ns); the store's writer calls :func:`settle`.
"""

from __future__ import annotations

from typing import NamedTuple

#: How far around a request the pair's other requests count for its window.
WINDOW_NS = 60 * 1_000_000_000

NOTE_NO_D2P = "unknown: no D->P message bounds the clock offset (its span is missing)"
NOTE_NO_P2D = "unknown: no P->D message bounds the clock offset"
NOTE_INCONSISTENT = "unknown: clock bounds inconsistent (a clock stepped)"
NOTE_OWN = "window inconsistent (a clock stepped); this request's own bounds used"


class Settled(NamedTuple):
    """One request's handoff against its clock interval (seconds; ``None``
    where unknown). ``offset_s``: the correction applied (0 when the
    interval contains 0); ``lo_s``/``hi_s``: the interval for D minus P."""

    handoff_s: float | None
    err_s: float | None
    offset_s: float | None
    lo_s: float | None
    hi_s: float | None
    note: str | None


def own_bounds(
    raw_ns: int, d2p_sent: int | None, d2p_recv: int | None, p2d_sent: int | None, p2d_recv: int | None
) -> tuple[int | None, int]:
    """A request's own interval (ns): ``lo`` from its D->P crossing (None if
    a side is missing), ``hi`` from its P->D crossing, never above ``raw``
    (``prefill.finished`` -> ``kv.ready`` is itself a P->D crossing)."""
    lo = d2p_sent - d2p_recv if d2p_sent is not None and d2p_recv is not None else None
    hi = raw_ns
    if p2d_sent is not None and p2d_recv is not None:
        hi = min(hi, p2d_recv - p2d_sent)
    return lo, hi


def settle(
    raw_ns: int, own: tuple[int | None, int | None], window: tuple[int | None, int | None] | None = None
) -> Settled:
    """The handoff of one request whose raw (two-clock) handoff is ``raw_ns``.

    ``own``: the request's own (lo, hi) in ns; ``window``: the pair's
    (max lo, min hi) over the sliding window (None when the engines are not
    known). The window is used when consistent, else the request's own
    interval, else the handoff is unknown."""
    note = None
    lo = hi = None
    for cand in (window, own):
        if cand is None or cand[0] is None or cand[1] is None:
            continue
        if cand[0] <= cand[1]:
            lo, hi = cand
            if cand is own and window is not None and window[0] is not None and window[1] is not None:
                note = NOTE_OWN
            break
    if lo is None or hi is None:
        have = [c for c in (window, own) if c is not None]
        if any(c[0] is not None and c[1] is not None for c in have):
            reason = NOTE_INCONSISTENT
        elif all(c[0] is None for c in have):
            reason = NOTE_NO_D2P
        else:
            reason = NOTE_NO_P2D
        return Settled(None, None, None, None, None, reason)
    if lo <= 0 <= hi:
        return Settled(raw_ns / 1e9, max(-lo, hi) / 1e9, 0.0, lo / 1e9, hi / 1e9, note)
    mid2 = lo + hi  # twice the midpoint, in ns: no float until the end
    return Settled((2 * raw_ns - mid2) / 2e9, (hi - lo) / 2e9, mid2 / 2e9, lo / 1e9, hi / 1e9, note)
