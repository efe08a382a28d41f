"""The bench row: the one schema of a ``kvlens bench`` result and the one
push/pull ratio rule, shared by the bench (which writes rows) and the
dashboard (which reads them back from the store).

A row is a plain dict, one per (variant, grid cell). The bench writes it to
the store (``store.save_bench_rows``) and, with ``--json``, as one JSON line;
every row has at least :data:`ROW_KEYS` (figures are None where nothing was
measured) plus the stored ratios (:data:`STORED_RATIOS`). Times are seconds.

Push/pull ratio: a push row's figure divided by the pull row's figure of the
same cell (:data:`CELL_KEYS`); < 1 means push was faster. Pull rows, cells
without a pull row and missing figures get None.

Intervals: each stored ratio has a bootstrap 95 % confidence interval
(``<ratio key>_lo`` / ``_hi``, computed by the bench over the cell's requests
and rounds) and a verdict (:func:`verdict`, ``<metric>_verdict``): a winner
only where the interval excludes 1. ``rounds`` is how many rounds the row
pools (``kvlens bench --repeat``); a row without it predates intervals.

Pure functions, no I/O; safe from any thread.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from kvrecord.semconv import Mode

#: Which variant ran: ``mode`` (push / pull) and the push ``dispatch`` (None for pull).
VARIANT_KEYS = ("mode", "dispatch")
#: The grid cell; push and pull rows of the same cell are compared.
CELL_KEYS = ("input_len", "output_len", "qps")
#: Counts and figures (seconds; ``req_per_s`` in requests per second).
FIGURE_KEYS = (
    "num_prompts", "completed", "failed", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_untimed",
    "handoff_p50_s", "handoff_p99_s", "req_per_s",
)  # fmt: skip
#: Figures a push row can be compared with pull on.
RATIO_METRICS = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "handoff_p50_s", "handoff_p99_s")
#: The confidence level of the stored intervals.
CI_LEVEL = 0.95


def ratio_key(metric: str) -> str:
    """The row key of a metric's push/pull ratio: ``ttft_p50_s`` -> ``ttft_p50_push_over_pull``."""
    return f"{metric.removesuffix('_s')}_push_over_pull"


def interval_keys(metric: str) -> tuple[str, str]:
    """The row keys of the bounds of a metric's push/pull interval:
    ``ttft_p50_s`` -> (``ttft_p50_push_over_pull_lo``, ``..._hi``)."""
    return f"{ratio_key(metric)}_lo", f"{ratio_key(metric)}_hi"


def verdict_key(metric: str) -> str:
    """The row key of a metric's verdict: ``ttft_p50_s`` -> ``ttft_p50_verdict``."""
    return f"{metric.removesuffix('_s')}_verdict"


#: Ratios every written row carries (key -> metric), None on pull rows.
STORED_RATIOS = {ratio_key(m): m for m in ("ttft_p50_s", "handoff_p50_s")}
#: Rounds pooled, then the bounds of each stored ratio's interval (None where there is none).
INTERVAL_KEYS = ("rounds",) + tuple(k for m in STORED_RATIOS.values() for k in interval_keys(m))
#: Keys every row has, in display order: the ``--json`` contract and the dashboard's bench table.
ROW_KEYS = VARIANT_KEYS + CELL_KEYS + FIGURE_KEYS + INTERVAL_KEYS

#: Verdicts (:func:`verdict`).
PUSH_LOWER = "push lower"
PULL_LOWER = "pull lower"
NO_DIFFERENCE = "no resolvable difference"
NOT_ENOUGH_DATA = "not enough data"


def verdict(lo: float | None, hi: float | None) -> str:
    """The one reading of a push/pull interval: a side is lower only where
    the whole interval is on its side of 1; an interval that contains 1 is
    :data:`NO_DIFFERENCE`, a missing one :data:`NOT_ENOUGH_DATA`."""
    if _missing(lo) or _missing(hi):
        return NOT_ENOUGH_DATA
    if hi < 1.0:
        return PUSH_LOWER
    if lo > 1.0:
        return PULL_LOWER
    return NO_DIFFERENCE


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None when either is missing (None or NaN) or den is not > 0."""
    if _missing(num) or _missing(den) or not den > 0:
        return None
    return float(num) / float(den)


def cell_key(row: Mapping[str, Any]) -> tuple:
    """The row's grid cell as comparable numbers (256 and 256.0 are one cell)."""
    return tuple(None if _missing(row.get(k)) else float(row[k]) for k in CELL_KEYS)


def pull_by_cell(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
    """The pull row of each cell (:func:`cell_key` -> row); the first one when a cell has several."""
    pull: dict[tuple, Mapping[str, Any]] = {}
    for r in rows:
        if r.get("mode") == Mode.PULL.value:
            pull.setdefault(cell_key(r), r)
    return pull


def push_over_pull(
    rows: Sequence[Mapping[str, Any]], metrics: Sequence[str] = RATIO_METRICS
) -> list[dict[str, float | None]]:
    """The push/pull ratios of each row, in the rows' order: ``{metric: ratio}``
    for every metric in ``metrics``. Each push dispatch is compared with the
    (first) pull row of its cell."""
    pull = pull_by_cell(rows)
    out = []
    for r in rows:
        p = pull.get(cell_key(r)) if r.get("mode") == Mode.PUSH.value else None
        out.append({m: ratio(r.get(m), p.get(m)) if p is not None else None for m in metrics})
    return out


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set the :data:`STORED_RATIOS` keys on every row (None where there is no
    ratio). Returns ``rows`` (mutated)."""
    for r, rs in zip(rows, push_over_pull(rows, tuple(STORED_RATIOS.values()))):
        for key, metric in STORED_RATIOS.items():
            r[key] = rs[metric]
    return rows
