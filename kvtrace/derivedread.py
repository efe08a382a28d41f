"""The derived phases of many traces at once, read from the few spans they
need: the metrics' once-per-request read (:func:`derived_of`, re-exported by
:mod:`kvtrace.tracemodel`, whose rules it applies)."""

from __future__ import annotations

from itertools import groupby
from operator import itemgetter
from typing import Mapping, Sequence

from kvrecord import semconv as sc
from kvtrace import store
from kvtrace.tiling import DERIVATION_ATTRIBUTES, DERIVATION_INPUTS, Derived, derived_from


def d_shift_ns(clock_offset_s: float | None) -> int:
    """Nanoseconds to subtract from D's timestamps to put them on P's clock."""
    return round(clock_offset_s * 1e9) if clock_offset_s else 0


#: Where a held row (``store.SPAN_COLUMNS`` tuple) keeps what :func:`derived_of` reads.
_NAME, _ROLE, _START, _END, _OUTCOME, _ATTRS = map(
    store.SPAN_COLUMNS.index, ("name", "role", "start_ns", "end_ns", "outcome", "attributes")
)


def derived_of(
    conn, clock_offsets: Mapping[str, float | None], held: Mapping[str, Sequence[tuple]] | None = None
) -> dict[str, list[Derived]]:
    """The derived phases of each trace in ``clock_offsets`` (trace id -> its ``clock_offset_s``), as
    :meth:`Trace.from_rows` derives them (D's spans moved onto P's clock) but from the few spans they need
    (:data:`DERIVATION_INPUTS`), only the split phases' attributes decoded: the metrics' once-per-request
    read, a fraction of :func:`find`'s cost. ``held``: span rows (``store.SPAN_COLUMNS`` tuples) of requests
    whose spans the store does not keep (:meth:`kvtrace.store.Keeper.unkept_rows`), read instead for those."""
    held = held or {}
    decode = sc.Role.DECODE.value
    in_store = [t for t in clock_offsets if t not in held]
    stored: dict[str, list[Derived]] = {}
    rows = store.named_spans(conn, in_store, DERIVATION_INPUTS, DERIVATION_ATTRIBUTES) if in_store else ()
    for tid, spans in groupby(rows, itemgetter(0)):  # one trace after another, each by start, end
        shift, groups = d_shift_ns(clock_offsets[tid]), {}
        for _, name, role, t0, t1, outcome, attrs in spans:
            d = shift if role == decode else 0
            groups.setdefault((role, name), []).append((t0 - d, t1 - d, outcome, attrs))
        stored[tid] = derived_from(groups)
    return {  # each trace grouped and derived in its turn: none of that outlives it (fewer objects for the GC)
        t: derived_from(_held_groups(held[t], d_shift_ns(off))) if t in held else stored.get(t, [])
        for t, off in clock_offsets.items()
    }


def _held_groups(rows: Sequence[tuple], shift: int) -> dict[tuple, list[tuple]]:
    """One trace's held rows grouped as :func:`derived_of` groups a store read's, ordered like it."""
    decode = sc.Role.DECODE.value
    groups: dict[tuple, list[tuple]] = {}
    for r in rows:
        name = r[_NAME]
        if name in DERIVATION_INPUTS:
            role = r[_ROLE]
            d = shift if role == decode else 0
            attrs = None
            if name in DERIVATION_ATTRIBUTES:  # not yet encoded while held; decoded as the store reads it if it is
                attrs = r[_ATTRS] if type(r[_ATTRS]) is dict else store.span_dict(r)["attributes"]
            groups.setdefault((role, name), []).append((r[_START] - d, r[_END] - d, r[_OUTCOME], attrs))
    for g in groups.values():
        if len(g) > 1:
            g.sort(key=itemgetter(0, 1))  # stable, as the store's ORDER BY start_ns, end_ns (one role: one shift)
    return groups
