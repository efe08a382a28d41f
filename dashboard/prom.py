"""Live figures from Prometheus (``--prometheus URL``) for the Overview page:
PromQL over the one HTTP client, :mod:`exporters.promapi`. Pure: plain
arguments in, :class:`dashboard.data.ModeStats` and DataFrames out, no
Streamlit (``dashboard/loaders.py`` caches it).

Calls block on the caller's thread, each query bounded by ``timeout_s``
(seconds). Label values are escaped with :func:`escape_label_value`. Any
failure raises :class:`PrometheusError` (the one class, from
:mod:`exporters.promapi`); the Overview page then falls back to the store.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pandas as pd

from dashboard import data
from dashboard import handoffhealth
from exporters import promapi
from kvtrace import tracemodel
from exporters.promapi import PrometheusError
from kvrecord import semconv as sc

__all__ = [
    "PROM_ALL_RANGE", "PrometheusError", "escape_label_value", "selector", "prom_range", "prom_query",
    "prom_overview", "prom_health",
]  # fmt: skip

#: PromQL range used when the picker says "all" (Prometheus keeps ~15 d).
PROM_ALL_RANGE = "7d"

_HIST_COLS = ["mode", "lo", "hi", "count", "link"]
_PHASE_COLS = ["mode", "role", "phase", "path", "seconds", "requests"]

Query = Callable[[str], list[tuple[dict[str, str], float]]]


def escape_label_value(value: str) -> str:
    """Escape a PromQL label value for a double-quoted string literal."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def selector(metric: str, **labels: str) -> str:
    """``metric{k="v",...}`` with escaped values (label names are ours, fixed)."""
    if not labels:
        return metric
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
    return f"{metric}{{{inner}}}"


def prom_range(range_key: str) -> str:
    """The PromQL range for a time-range picker choice (``all`` -> :data:`PROM_ALL_RANGE`)."""
    secs = data.TIME_RANGES[range_key]
    return PROM_ALL_RANGE if secs is None else range_key


def prom_query(url: str, query: str, *, client=None, timeout_s: float = 3.0) -> list[tuple[dict[str, str], float]]:
    """Instant query -> [(labels, value)]; NaN/Inf samples dropped."""
    return promapi.values(promapi.query(url, query, client=client, timeout_s=timeout_s))


def _one(res: Sequence[tuple[dict, float]]) -> float | None:
    return res[0][1] if res else None


def _dropped(q: Query, w: str) -> tuple[float | None, dict[str, float]]:
    """Spans kvlens lost over ``w`` in every process: (total, by reason).
    ``kvlens_telemetry_dropped_total`` is labelled by role and reason, not mode."""
    by = {
        labels.get("reason", sc.OTHER): v
        for labels, v in q(f"sum by (reason) (increase(kvlens_telemetry_dropped_total[{w}]))")
    }
    return (sum(by.values()) if by else None), {k: v for k, v in by.items() if v > 0}


#: vLLM's TPOT histograms (newer name first), scraped from D (job of ``kvlens up --prometheus``).
TPOT_METRICS = ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds")
DECODE_JOB = "vllm-decode"
#: kvlens' own, by mode: the router's root span's client-seen TPOT (exporters.families).
KVLENS_TPOT = "kvlens_tpot_seconds"


def _tpot(q: Query, w: str, stats: dict[str, data.ModeStats]) -> None:
    """Mean TPOT per mode over ``w``: kvlens' router's ``kvlens_tpot_seconds{mode}``
    where it has the mode's; else vLLM's on D, into the one mode that ran (vLLM's
    metrics have no mode label); otherwise the reason in ``tpot_note``."""
    mine = {labels.get("mode"): v for labels, v in q(tpot_expr(w))}
    v = None
    for m in TPOT_METRICS:
        v = _one(
            q(
                f"sum(rate({selector(m + '_sum', job=DECODE_JOB)}[{w}])) / "
                f"sum(rate({selector(m + '_count', job=DECODE_JOB)}[{w}]))"
            )
        )
        if v is not None:
            break
    ran = [m for m, s in stats.items() if (s.requests or 0) > 0]
    for mode, s in stats.items():
        if mine.get(mode) is not None:
            s.tpot_mean = mine[mode]
            s.tpot_note = f"Mean client-seen TPOT of {mode} requests at kvlens' router ({KVLENS_TPOT}) over {w}."
        elif mode not in ran:
            s.tpot_note = f"No {mode} requests in this range."
        elif v is None:
            s.tpot_note = (
                f"Prometheus has no {KVLENS_TPOT} for {mode} (no request of it had tokens timed apart, or a router "
                f"other than kvlens') and no vLLM TPOT ({TPOT_METRICS[0]}) from job {DECODE_JOB} over {w}."
            )
        elif ran == [mode]:
            s.tpot_mean, s.tpot_note = v, f"vLLM's mean TPOT on D ({DECODE_JOB}) over {w}."
        else:
            s.tpot_note = (
                f"No {KVLENS_TPOT} for {mode} over {w}, and vLLM's TPOT has no mode label while both modes ran."
            )


def tpot_expr(w: str) -> str:
    """Mean client-seen TPOT by mode over ``w`` (kvlens' router's histogram)."""
    return f"sum by (mode) (rate({KVLENS_TPOT}_sum[{w}])) / sum by (mode) (rate({KVLENS_TPOT}_count[{w}]))"


def age_expr(w: str) -> str:
    """Seconds since the first sample of ``kvlens_requests_total`` within ``w``
    (any mode: the data's age, the same for both columns), to a subquery step
    of ``w``/3600 (1 s up to 1 h: finer than a scrape, so the first step that
    sees a sample sees the first one; a 5 s step read a 37 s old fleet's age 5 s short)."""
    step = max(1, int(data.TIME_RANGES.get(w) or 7 * 86400) // 3600)
    return f"time() - min(min_over_time(timestamp(kvlens_requests_total)[{w}:{step}s]))"


def _data_age(q: Query, w: str) -> float | None:
    """:func:`age_expr`; None when there is no sample in ``w``."""
    return _one(q(age_expr(w)))


def _mode_stats(
    q: Query, mode: str, w: str, dropped: tuple[float | None, dict[str, float]], age: float | None = None
) -> data.ModeStats:
    """Handoff / TTFT quantiles, request rate and outcomes of one mode over
    ``w`` (the rate over ``age`` seconds where that is shorter)."""
    ms = data.ModeStats(mode=mode, pct_source="histogram")
    hb = selector("kvlens_handoff_seconds_bucket", mode=mode)
    # handoff pXX = histogram_quantile(q, sum by (le) (rate(kvlens_handoff_seconds_bucket{mode=m}[w])))
    for name, qq in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        ms.handoff[name] = _one(q(f"histogram_quantile({qq}, sum by (le) (rate({hb}[{w}])))"))
    tb = selector("kvlens_ttft_seconds_bucket", mode=mode)
    for name, qq in (("p50", 0.5), ("p99", 0.99)):
        ms.ttft[name] = _one(q(f"histogram_quantile({qq}, sum by (le) (rate({tb}[{w}])))"))
    ms.ttft["mean"] = _one(
        q(
            f"sum(rate({selector('kvlens_ttft_seconds_sum', mode=mode)}[{w}])) / "
            f"sum(rate({selector('kvlens_ttft_seconds_count', mode=mode)}[{w}]))"
        )
    )
    req = selector("kvlens_requests_total", mode=mode)
    ms.outcomes = {o: 0.0 for o in data.OUTCOMES}
    for labels, v in q(f"sum by (outcome) (increase({req}[{w}]))"):
        ms.outcomes[labels.get("outcome", sc.OTHER)] = v
    ms.requests = sum(ms.outcomes.values())
    # requests over the range, or over the data's age where it is shorter (rate() divides by the range)
    if age is not None:
        ms.rate_window_s = min(float(data.TIME_RANGES.get(w) or 7 * 86400), max(age, 1.0))
        ms.req_per_s = ms.requests / ms.rate_window_s
    ms.dropped, ms.dropped_by_reason = dropped[0], dict(dropped[1])
    return ms


def _mode_phases(q: Query, mode: str, w: str) -> list[tuple]:
    """Mean seconds per (role, phase) of one mode: rate(_sum) / rate(_count).

    Prometheus has per-phase durations, not their position against
    prefill.finished, so push's registration.* phases count as overlap
    (PUSH_OVERLAP_PHASES) and every other phase as critical path."""
    overlap = {p.value for p in sc.PUSH_OVERLAP_PHASES}
    # the wire / noticed parts of write/read.complete: the whole is counted already
    skip = {p.value for p in sc.POINT_PHASES} | set(tracemodel.NOT_HANDOFF_PHASES) | set(tracemodel.SPLIT_PHASES)
    ps = selector("kvlens_phase_duration_seconds_sum", mode=mode)
    pc = selector("kvlens_phase_duration_seconds_count", mode=mode)
    rows = []
    for labels, v in q(f"sum by (role, phase) (rate({ps}[{w}])) / sum by (role, phase) (rate({pc}[{w}]))"):
        ph = labels.get("phase", sc.OTHER)
        if ph in skip or v <= 0:
            continue
        path = data.OVERLAP if mode == sc.Mode.PUSH.value and ph in overlap else data.CRITICAL
        rows.append((mode, labels.get("role", ""), ph, path, v, None))
    return rows


def _mode_hist(q: Query, mode: str, w: str) -> list[tuple]:
    """Handoff histogram of one mode from the cumulative ``le`` buckets' increase over ``w``."""
    hb = selector("kvlens_handoff_seconds_bucket", mode=mode)
    cum = sorted(
        (float(labels["le"]), v)
        for labels, v in q(f"sum by (le) (increase({hb}[{w}]))")
        if labels.get("le") not in (None, "+Inf")
    )
    rows = []
    prev_le, prev_v = 0.0, 0.0
    for le, v in cum:
        if v - prev_v > 0:
            rows.append(
                (mode, prev_le, le, v - prev_v, data.traces_link(mode=mode, min_handoff=prev_le, max_handoff=le))
            )
        prev_le, prev_v = le, v
    return rows


def prom_overview(
    url: str, range_key: str, *, timeout_s: float = 3.0
) -> tuple[dict[str, data.ModeStats], pd.DataFrame, pd.DataFrame]:
    """(stats per mode, phase breakdown, handoff histogram) from Prometheus,
    in the shapes the store path gives (``stats_from_traces``,
    ``phase_breakdown``, ``handoff_histogram``). One connection for all queries."""
    w = prom_range(range_key)
    stats: dict[str, data.ModeStats] = {}
    phases: list[tuple] = []
    hist: list[tuple] = []
    with promapi.client(timeout_s) as c:

        def q(expr: str) -> list[tuple[dict[str, str], float]]:
            return prom_query(url, expr, client=c)

        # labelled by role and reason (not mode): the same all-process figures show in both columns
        dropped = _dropped(q, w)
        age = _data_age(q, w)
        for mode in data.MODES:
            stats[mode] = _mode_stats(q, mode, w, dropped, age)
            phases += _mode_phases(q, mode, w)
            hist += _mode_hist(q, mode, w)
        _tpot(q, w, stats)
    ph_df = pd.DataFrame(phases, columns=_PHASE_COLS)
    if len(ph_df):
        ph_df["rank"] = ph_df["phase"].map(data.phase_rank)
        ph_df = ph_df.sort_values(["mode", "path", "rank"]).reset_index(drop=True)
    return stats, ph_df, pd.DataFrame(hist, columns=_HIST_COLS)


def _absent(metric: str) -> str:
    return f"Prometheus has no {metric} series (P and D not scraped, or a kvlens connector from before handoff health)"


def prom_health(url: str, range_key: str, *, timeout_s: float = 3.0) -> dict[str, handoffhealth.Figure]:
    """The Overview's health strip (:data:`dashboard.data.HEALTH_FIGURES`) from
    Prometheus: open now and the oldest open age from the gauges (summed over
    every instance; NaN "oldest" gauges of idle sides dropped), the rest as
    ``increase()`` over the range (extrapolated, so rounded). A figure whose
    metric has no series is unknown, with the reason; never 0."""
    w = prom_range(range_key)
    out: dict[str, handoffhealth.Figure] = {}
    with promapi.client(timeout_s) as c:

        def q(expr: str) -> list[tuple[dict[str, str], float]]:
            return prom_query(url, expr, client=c)

        def count(key: str, metric: str, expr: str, help_: str) -> None:
            v = _one(q(expr))
            out[key] = (
                handoffhealth.Figure(None, help_, unknown=_absent(metric))
                if v is None
                else handoffhealth.Figure(round(v), help_)
            )

        count(
            "open",
            "kvlens_handoffs_open",
            "sum(kvlens_handoffs_open)",
            "Handoffs open now on every scraped instance, both sides (sum of kvlens_handoffs_open).",
        )
        # time() - oldest start; "> 0" drops the NaN of sides with nothing open
        oldest = _one(q("time() - min(kvlens_handoff_oldest_open_start_timestamp_seconds > 0)"))
        help_ = "Age of the oldest open handoff on any instance (time() - kvlens_handoff_oldest_open_start_timestamp_seconds)."
        if oldest is not None:
            out["oldest_s"] = handoffhealth.Figure(max(oldest, 0.0), help_)
        elif out["open"].unknown:
            out["oldest_s"] = handoffhealth.Figure(
                None, help_, unknown=_absent("kvlens_handoff_oldest_open_start_timestamp_seconds")
            )
        else:
            out["oldest_s"] = handoffhealth.Figure(None, help_)
        count(
            "stale",
            "kvlens_kv_stale_total",
            f"sum(increase(kvlens_kv_stale_total[{w}]))",
            f"Requests whose KV moved after P released it at the lease, over {w}: possibly served from reused memory.",
        )
        count(
            "expired",
            "kvlens_handoff_outcomes_total",
            f'sum(increase(kvlens_handoff_outcomes_total{{role="prefill",outcome="expired"}}[{w}]))',
            f"Handoffs whose KV lease ran out on P, over {w} (P's outcomes).",
        )
        count(
            "failed",
            "kvlens_handoff_outcomes_total",
            f'sum(increase(kvlens_handoff_outcomes_total{{role="decode",outcome=~"failed|timeout"}}[{w}]))',
            f"Handoffs that failed or timed out on D (the KV never arrived, or failed), over {w}.",
        )
        count(
            "reg_timeouts",
            "kvlens_registration_timeouts_total",
            f"sum(increase(kvlens_registration_timeouts_total[{w}]))",
            f"Push registrations that hit vLLM's soft watchdog on D, over {w}.",
        )
    return out
