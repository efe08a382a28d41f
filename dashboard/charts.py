"""The dashboard's charts (Altair): DataFrames in, chart specs out; no
loading and no Streamlit, so a chart can be built and checked on its own.

Colours: one fixed colour per Phase (``data.phase_colors``) on every chart,
blue for push and orange for pull. Times on the axes are ms.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from dashboard import data

#: push blue, pull orange, on every chart.
MODE_COLORS = {"push": "#4c78a8", "pull": "#f58518"}
_MODE_SCALE = alt.Scale(domain=list(MODE_COLORS), range=list(MODE_COLORS.values()))


def phase_color_scale() -> alt.Scale:
    """The one colour scale over every Phase (and ``unattributed``)."""
    domain, rng = data.phase_colors()
    return alt.Scale(domain=domain, range=rng)


def handoff_hist_chart(h: pd.DataFrame, mode: str, x_max: float | None) -> alt.Chart:
    """One mode's handoff histogram (``data.handoff_histogram`` rows); a bar links to its traces.
    ``x_max`` (s): a shared x scale, so push and pull compare."""
    d = h[h["mode"] == mode].assign(lo_ms=lambda x: x["lo"] * 1e3, hi_ms=lambda x: x["hi"] * 1e3)
    x_scale = alt.Scale(domain=[0, x_max * 1e3]) if x_max else alt.Undefined
    return (
        alt.Chart(d, title="handoff distribution (click a bar: its traces)")
        .mark_bar(color=MODE_COLORS.get(mode, MODE_COLORS["pull"]), cursor="pointer", stroke="white", strokeWidth=0.5)
        .encode(
            x=alt.X("lo_ms:Q", title="handoff (ms)", scale=x_scale),
            x2="hi_ms:Q",
            y=alt.Y("count:Q", title="requests"),
            y2=alt.datum(0),
            href="link:N",
            tooltip=[
                alt.Tooltip("lo_ms:Q", title="from ms", format=".2f"),
                alt.Tooltip("hi_ms:Q", title="to ms", format=".2f"),
                alt.Tooltip("count:Q"),
            ],
        )
        .properties(height=230)
    )


def phase_chart(ph: pd.DataFrame, mode: str, path: str, x_max: float | None, title: str) -> alt.Chart:
    """One stacked bar: mean ms per request of each phase on ``path``."""
    d = ph[(ph["mode"] == mode) & (ph["path"] == path)].assign(ms=lambda x: x["seconds"] * 1e3, bar=mode)
    present = sorted(set(d["phase"]), key=data.phase_rank)
    x_scale = alt.Scale(domain=[0, x_max * 1e3]) if x_max else alt.Undefined
    return (
        alt.Chart(d, title=title)
        .mark_bar()
        .encode(
            y=alt.Y("bar:N", title=None, axis=None),
            x=alt.X("sum(ms):Q", title="ms per request (mean)", stack="zero", scale=x_scale),
            color=alt.Color(
                "phase:N",
                scale=phase_color_scale(),
                legend=alt.Legend(title=None, orient="bottom", columns=2, labelLimit=0, values=present),
            ),  # whole phase names in a half-width column
            order=alt.Order("rank:Q"),
            tooltip=[
                "phase:N",
                "role:N",
                alt.Tooltip("ms:Q", title="ms / request", format=".3f"),
                alt.Tooltip("requests:Q", title="over requests"),
            ],
        )
        # fit-x: the width follows the column, the height is the plot's own (legend below it)
        .properties(height=40, autosize=alt.AutoSizeParams(type="fit-x", contains="padding"))
    )


def _waterfall_tooltip(spans: pd.DataFrame) -> list:
    """A span's tooltip: phase, role, times, critical, outcome, its rank (TP) and attributes."""
    attr_cols = [c for c in spans.columns if c.startswith("attr_")]
    return (
        [
            alt.Tooltip("phase:N"),
            alt.Tooltip("role:N"),
            alt.Tooltip("start_ms:Q", title="start (ms)", format=".3f"),
            alt.Tooltip("duration_ms:Q", title="duration (ms)", format=".3f"),
            alt.Tooltip("critical:N", title="on critical path"),
            alt.Tooltip("outcome:N"),
        ]
        + ([alt.Tooltip("rank:Q", title="TP rank")] if "rank" in spans and spans["rank"].notna().any() else [])
        + [alt.Tooltip(f"{c}:N", title=c[5:]) for c in attr_cols]
    )


def _critical_band(critical_ms: tuple[float, float], handoff: str | None) -> list:
    """The critical window shaded, labelled with the handoff."""
    label = f"critical path (handoff {handoff or f'{critical_ms[1] - critical_ms[0]:,.1f} ms'})"
    band = pd.DataFrame([{"from_ms": critical_ms[0], "to_ms": critical_ms[1], "label": label}])
    return [
        alt.Chart(band)
        .mark_rect(color="#e45756", opacity=0.12)
        .encode(x="from_ms:Q", x2="to_ms:Q", tooltip=["label:N"]),
        alt.Chart(band)
        .mark_text(align="left", dx=3, dy=-6, color="#b22222", fontWeight="bold", baseline="bottom")
        .encode(x="from_ms:Q", y=alt.value(0), text="label:N"),
    ]


def waterfall_chart(
    spans: pd.DataFrame, critical_ms: tuple[float, float] | None, handoff: str | None = None, per_rank: bool = False
) -> alt.LayerChart:
    """One trace's spans (``data.trace_detail``) as lanes per role · phase, bars and
    ◆ points, critical-path spans outlined and the critical window (ms) shaded;
    ``handoff``: the handoff as the page shows it (default: the window's width in ms);
    ``per_rank``: one lane per TP rank (``rank_lane``) instead of the ranks together."""
    if per_rank and "rank_lane" in spans:  # a role's ranks together, each rank's phases in time order
        spans = spans.assign(lane=spans["rank_lane"], _r=spans["rank"].fillna(-1)).sort_values(
            ["role_rank", "_r", "start_ms", "phase_rank"], kind="stable"
        )
    lanes = list(dict.fromkeys(spans["lane"]))
    tooltip = _waterfall_tooltip(spans)
    y = alt.Y("lane:N", sort=lanes, title=None, axis=alt.Axis(labelLimit=260))
    color = alt.Color("phase:N", scale=phase_color_scale(), legend=alt.Legend(title="phase"))
    layers = []
    if critical_ms is not None:
        layers += _critical_band(critical_ms, handoff)
    bars = spans[~spans["point"]]
    points = spans[spans["point"]]
    layers.append(
        alt.Chart(bars)
        .mark_bar(height=14, cornerRadius=2)
        .encode(
            x=alt.X("start_ms:Q", title="ms since the request reached the router"),
            x2="end_ms:Q",
            y=y,
            color=color,
            opacity=alt.condition("datum.critical", alt.value(1.0), alt.value(0.45)),
            stroke=alt.condition("datum.critical", alt.value("#b22222"), alt.value(None)),
            strokeWidth=alt.condition("datum.critical", alt.value(2), alt.value(0)),
            tooltip=tooltip,
        )
    )
    layers.append(
        alt.Chart(points)
        .mark_point(shape="diamond", size=160, filled=True)
        .encode(
            x="start_ms:Q",
            y=y,
            color=color,
            stroke=alt.condition("datum.critical", alt.value("#b22222"), alt.value("#333333")),
            strokeWidth=alt.value(1.5),
            tooltip=tooltip,
        )
    )
    return alt.layer(*layers).properties(height=max(180, 30 * len(lanes) + 40))


def bench_chart(df: pd.DataFrame) -> alt.Chart:
    """Handoff p50 / p99 (ms) against QPS, one line per mode and dispatch, one column per input length."""
    long = df.melt(
        id_vars=["mode", "dispatch", "input_len", "qps"],
        value_vars=["handoff_p50_s", "handoff_p99_s"],
        var_name="stat",
        value_name="s",
    ).dropna(subset=["s"])
    long["ms"] = long["s"] * 1e3
    long["dispatch"] = long["dispatch"].fillna("n/a")
    long["stat"] = long["stat"].str.replace("handoff_", "").str.replace("_s", "")
    long["series"] = long["mode"] + " " + long["dispatch"] + " " + long["stat"]
    return (
        alt.Chart(long, title="handoff vs QPS, per mode (solid p50, dashed p99)")
        .mark_line(point=True)
        .encode(
            x=alt.X("qps:Q", title="QPS"),
            y=alt.Y("ms:Q", title="handoff (ms)"),
            color=alt.Color("mode:N", scale=_MODE_SCALE, title="mode"),
            strokeDash=alt.StrokeDash("stat:N", title="percentile", sort=["p50", "p99"]),
            shape=alt.Shape("dispatch:N", title="dispatch"),
            detail="series:N",
            column=alt.Column("input_len:O", title="input length (tokens)"),
            tooltip=["mode:N", "dispatch:N", "stat:N", "input_len:O", "qps:Q", alt.Tooltip("ms:Q", format=".2f")],
        )
        .properties(width=360, height=260)
    )
