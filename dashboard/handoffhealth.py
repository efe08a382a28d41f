"""The Overview's handoff health from the trace store (docs/handoff-health.md): the
requests stuck now (:func:`stuck_table`) and the strip's figures
(:func:`health_from_store`); the Prometheus side is :func:`dashboard.prom.prom_health`.
Pure: plain arguments in, DataFrames and :class:`Figure` s out, no Streamlit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dashboard.data import TIME_RANGES, traces_link
from kvrecord import semconv as sc
from kvtrace import store, stuck

#: A handoff still open and reported within this many seconds is "stuck now"
#: (its process re-reports it every few seconds: docs/handoff-health.md).
STUCK_FRESH_S = 60
#: The stuck list's columns (:func:`stuck_table`).
STUCK_COLUMNS = (
    "trace_id",
    "request_id",
    "mode",
    "waiting",
    "phase",
    "since_ns",
    "age_s",
    "last_seen_ago_s",
    "seen_ns",
    "registration_timeout",
    "link",
)


@dataclass
class Figure:
    """One figure of the health strip: a count or seconds; ``value`` None with
    ``unknown`` saying why kvlens cannot know it (shown as "unknown", never 0),
    or None without ``unknown`` when there is nothing to measure (an age with
    nothing open: "none")."""

    value: float | None
    help: str = ""
    unknown: str | None = None


#: The strip's figures, in display order: key -> label.
HEALTH_FIGURES = {
    "open": "open now",
    "oldest_s": "oldest open",
    "stale": "stale",
    "expired": "expired",
    "failed": "failed",
    "reg_timeouts": "registration timeouts",
}

STUCK_HELP = (
    "Handoffs open on a side right now: a partial trace (handoff.open) reported in the last "
    f"{STUCK_FRESH_S} s and no span ending that side yet (`kvlens traces --open`)."
)


def stuck_table(path: str | Path, now_ns: int, fresh_s: float = STUCK_FRESH_S) -> pd.DataFrame:
    """The handoffs stuck now (:func:`kvtrace.stuck.stuck`, reported in the last
    ``fresh_s``), oldest first: :data:`STUCK_COLUMNS`, ``link`` to the partial trace
    on the Traces page."""
    with store.reading(path) as c:
        sides = stuck.stuck(c, since_ns=now_ns - int(fresh_s * 1e9))
    rows = []
    for o in sides:
        j = o.to_json(now_ns)
        rows.append(
            {
                "trace_id": o.trace_id,
                "request_id": o.request_id,
                "mode": o.mode,
                "waiting": f"{o.side} ({o.role})",
                "phase": o.phase,
                "since_ns": o.since_ns,
                "age_s": j["age_s"],
                "last_seen_ago_s": j["last_seen_ago_s"],
                "seen_ns": o.seen_ns,
                "registration_timeout": o.registration_timeout,
                "link": traces_link(trace=o.trace_id),
            }
        )
    return pd.DataFrame(rows, columns=list(STUCK_COLUMNS))


def health_from_store(
    window: pd.DataFrame, stuck_df: pd.DataFrame, range_key: str, now_ns: int | None = None
) -> dict[str, Figure]:
    """The strip from the trace store: the open ones from the partial traces,
    the rest counted over the range's traces (``window``: :func:`window_traces`
    rows; each trace counted once by its worst outcome, so a stale trace, which
    also expired at the lease, counts as stale only). Registration timeouts are
    unknown here: the summary rows do not hold the flag. Ages at ``now_ns``
    (default: now; the stuck table may be a few seconds old, its starts are not)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    counts = window["outcome"].value_counts().to_dict() if len(window) else {}
    over = f"traces that started in the last {range_key}" if TIME_RANGES.get(range_key) else "every trace in the store"
    oldest = max((now_ns - int(stuck_df["since_ns"].min())) / 1e9, 0.0) if len(stuck_df) else None
    return {
        "open": Figure(float(len(stuck_df)), STUCK_HELP),
        "oldest_s": Figure(oldest, "Age of the oldest handoff stuck now (its side's own clock)."),
        "stale": Figure(
            float(counts.get(sc.Outcome.STALE.value, 0)),
            f"Requests whose KV moved after P released it at the lease, of the {over}: possibly served from "
            "reused memory.",
        ),
        "expired": Figure(
            float(counts.get(sc.Outcome.EXPIRED.value, 0)),
            f"Requests whose KV lease ran out on P before D took the KV, of the {over} (a stale one counts as stale).",
        ),
        "failed": Figure(
            float(counts.get(sc.Outcome.FAILED.value, 0) + counts.get(sc.Outcome.TIMEOUT.value, 0)),
            f"Requests whose handoff failed or timed out, of the {over}.",
        ),
        "reg_timeouts": Figure(
            None,
            "Push registrations that hit vLLM's soft watchdog on D.",
            unknown="the trace store's summaries do not hold it; start the dashboard with --prometheus "
            "(kvlens_registration_timeouts_total)",
        ),
    }
