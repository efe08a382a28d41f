"""Dashboard tests: pure loaders (dashboard/data.py), the pages through
Streamlit's AppTest, the Prometheus path against a local fake Prometheus
HTTP API, and the ``kvlens dashboard`` command line.

The store is written through the real pipeline (tests/store_fixture.py).
Set ``KVLENS_TEST_STORE`` to a store from a real vLLM run to run the page
checks against it too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]

from fakes import FakePrometheus  # noqa: E402
from store_fixture import make_store  # noqa: E402

from dashboard import benchdata  # noqa: E402
from dashboard import data  # noqa: E402
from dashboard import loaders  # noqa: E402
from dashboard import prom as dashboard_prom  # noqa: E402
from kvtrace import costs, store  # noqa: E402
from kvrecord import semconv as sc  # noqa: E402

APP = str(REPO / "dashboard" / "app.py")


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("kvlens_home"), n_per_mode=30)


@pytest.fixture
def app(monkeypatch):
    """``app(store, prometheus=None, **query_params)`` -> a run AppTest."""
    from streamlit.testing.v1 import AppTest

    def make(path, prometheus: str | None = None, run: bool = True, **qp):
        argv = ["app.py", "--store", str(path)] + (["--prometheus", prometheus] if prometheus else [])
        monkeypatch.setattr(sys, "argv", argv)
        at = AppTest.from_file(APP, default_timeout=60)
        for k, v in qp.items():
            at.query_params[k] = v
        if run:
            at.run()
        return at

    return make


def charts(at) -> list[dict]:
    return [json.loads(e.proto.spec) for e in at.main if getattr(e, "type", "") == "vega_lite_chart"]


def chart_titles(at) -> list[str]:
    out = []
    for s in charts(at):
        t = s.get("title")
        out.append(t.get("text") if isinstance(t, dict) else t)
    return out


def metric(at, label: str) -> list[str]:
    """The values of the cards labelled ``label``, with or without the row's unit (``handoff p50 (ms)``)."""
    return [m.value for m in at.metric if m.label == label or m.label.rsplit(" (", 1)[0] == label]


def ms(col) -> pd.Series:
    """A display column (text, "-" when missing) back to numbers."""
    return pd.to_numeric(col.replace("-", None).str.replace(",", ""), errors="coerce")


def no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


# ------------------------------------------------------------------ loaders
def test_fixture_store_is_grouped_into_traces(store_path):
    with store.reading(store_path) as conn:
        rows = store.slowest(conn, 10_000, order="start")
    n_spans: dict[str, list[int]] = {}
    for r in rows:
        n_spans.setdefault(r["mode"], []).append(r["n_spans"])
    assert len(n_spans["push"]) == 30 and len(n_spans["pull"]) == 30
    assert min(n_spans["push"]) >= 9 and min(n_spans["pull"]) >= 7  # router + P + D spans folded into one trace


def test_stats_and_histogram(store_path):
    df = data.window_traces(store_path, None, None)
    stats = data.stats_from_traces(df, None)
    for mode in data.MODES:
        s = stats[mode]
        assert s.requests == 30
        assert 0 < s.handoff["p50"] <= s.handoff["p90"] <= s.handoff["p99"]
        assert s.ttft["p50"] > s.handoff["p50"]
        assert sum(s.outcomes.values()) == 30
    assert stats["pull"].outcomes["failed"] == 3 and stats["push"].outcomes["timeout"] == 2
    h = data.handoff_histogram(df)
    assert set(h["mode"]) == {"push", "pull"}
    assert h.groupby("mode")["count"].sum().to_dict() == {"push": 28, "pull": 27}  # completed handoffs
    assert all(link.startswith("./?page=traces&mode=") and "min_handoff=" in link for link in h["link"])


def test_phase_breakdown_splits_push_overlap(store_path):
    ph = data.phase_breakdown(store_path, None, None)
    push = ph[ph["mode"] == "push"]
    over = set(push.loc[push["path"] == data.OVERLAP, "phase"])
    assert "registration.send" in over and "match" in over  # overlapped push: before prefill.finished
    crit = set(push.loc[push["path"] == data.CRITICAL, "phase"])
    assert {"write.post", "write.wire", "descriptor.prep"} <= crit  # write.complete's time named by its parts
    assert "registration.send" not in crit
    pull = ph[ph["mode"] == "pull"]
    assert set(pull["path"]) == {data.CRITICAL}
    assert {"read.post", "read.wire", "relay"} <= set(pull["phase"])
    # the critical-path segments add up to the mean handoff
    df = data.window_traces(store_path, None, None)
    for mode in data.MODES:
        mean_h = df.loc[df["mode"] == mode, "handoff_s"].dropna().mean()
        got = ph.loc[(ph["mode"] == mode) & (ph["path"] == data.CRITICAL), "seconds"].sum()
        assert got == pytest.approx(mean_h, rel=0.05)


def test_breakdown_words_from_the_store_and_from_prometheus(store_path):
    """One function words both sources: the store's tilings (with the
    per-request median), or Prometheus' mean durations (no unattributed
    figure: their overlap is unknown)."""
    from kvtrace import store, tracemodel

    ph = data.phase_breakdown(store_path, None, None)
    with store.reading(store_path) as c:
        groups = costs.sample_costs(c, since_ns=None, until_ns=None, limit=data.PHASE_SAMPLE).breakdown
    assert data.breakdown_words(ph) == {m: tracemodel.dominant_words(groups[m]) for m in data.MODES}
    assert "(decode.queue)" in data.breakdown_words(ph)["pull"]  # the fixture's pull is mostly D's queue
    import pandas as pd

    prom_like = pd.DataFrame(
        [
            ("push", "prefill", "write.complete", data.CRITICAL, 0.006, float("nan")),
            ("push", "prefill", "match", data.CRITICAL, 0.002, float("nan")),
        ],
        columns=["mode", "role", "phase", "path", "seconds", "requests"],
    )
    w = data.breakdown_words(prom_like)
    assert w["push"] == (
        "push: 75 % of the handoff is the WRITE posted -> seen done (write.complete), then 25 % "
        "P waiting for the other side (match) (mean phase durations; their overlap unknown)"
    )
    assert w["pull"] == "pull: no completed handoff to break down"


def test_trace_detail_marks_critical_path(store_path):
    push = data.slowest(store_path, 1, mode="push", outcome="ok")
    rec, spans = data.trace_detail(store_path, push["trace_id"][0])
    assert rec["mode"] == "push" and rec["critical_ms"] is not None
    flags = dict(zip(spans["phase"], spans["critical"]))
    assert flags["write.complete"] and flags["kv.ready"] and flags["prefill.finished"]
    assert not flags["registration.send"] and not flags["registration.stage"] and not flags["request"]
    assert spans.loc[spans["phase"] == "kv.ready", "point"].all()
    assert "attr_blocks" in spans.columns
    assert list(spans["role"].drop_duplicates()) == ["router", "prefill", "decode"]
    dec = rec["decomposition"]
    assert dec["queue_prefill_s"] + dec["handoff_s"] + dec["first_decode_s"] == pytest.approx(rec["ttft_s"], rel=1e-6)
    missing, empty = data.trace_detail(store_path, "0" * 32)
    assert missing is None and empty.empty


def test_bench_ratios(store_path):
    df = loaders.with_ratios(benchdata.bench_table(store_path))
    assert len(df) == 12
    r = df[(df["mode"] == "push") & (df["input_len"] == 128) & (df["qps"] == 2.0)].iloc[0]
    assert r["handoff_p50 push÷pull"] == pytest.approx(0.8)
    assert df.loc[df["mode"] == "pull", "handoff_p50 push÷pull"].isna().all()


def test_missing_and_empty_store(tmp_path):
    with pytest.raises(data.StoreMissing):
        data.window_traces(tmp_path / "nope.db", None, None)
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database" * 100)
    with pytest.raises(data.StoreError):
        data.store_info(bad)
    store.connect(tmp_path / "empty.db").close()
    assert data.store_info(tmp_path / "empty.db")["traces"] == 0
    assert benchdata.bench_table(tmp_path / "empty.db").empty


def test_promql_label_escaping():
    assert dashboard_prom.escape_label_value('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    assert dashboard_prom.selector("kvlens_requests_total", mode='pu"sh') == 'kvlens_requests_total{mode="pu\\"sh"}'
    assert dashboard_prom.selector("x") == "x"
    with pytest.raises(ValueError):
        data.since_until("3 weeks")


# ------------------------------------------- fake Prometheus (tests/fakes.py)
@pytest.fixture
def fake_prometheus():
    with FakePrometheus() as prom:
        yield prom


def test_prom_overview(fake_prometheus):
    stats, phases, hist = dashboard_prom.prom_overview(fake_prometheus.url, "15m")
    assert stats["push"].handoff["p50"] == 0.004 and stats["pull"].handoff["p50"] == 0.009
    assert stats["push"].requests == 90 and stats["push"].outcomes["timeout"] == 2
    assert stats["push"].dropped == 5 and stats["push"].req_per_s == 1.5
    push = phases[phases["mode"] == "push"].set_index("phase")["path"].to_dict()
    assert push == {"registration.send": data.OVERLAP, "write.complete": data.CRITICAL}
    assert list(hist[hist["mode"] == "push"]["count"]) == [40, 40, 10]
    assert any('{mode="push"}[15m]' in q for q in fake_prometheus.queries)


def test_prometheus_down_is_an_error_not_a_crash():
    with pytest.raises(dashboard_prom.PrometheusError):
        dashboard_prom.prom_overview("http://127.0.0.1:9", "5m", timeout_s=1.0)


# ------------------------------------------------------------------ pages (AppTest)
def test_overview_page(app, store_path):
    at = app(store_path)
    no_exception(at)
    assert len(metric(at, "handoff p50")) == 2  # push and pull side by side
    assert [s for s in ("Push", "Pull") if any(s in h.value for h in at.subheader)] == ["Push", "Pull"]
    titles = chart_titles(at)
    assert titles.count("critical path by phase (prefill.finished → kv.ready)") == 2
    assert titles.count("overlapped with prefill (off the critical path)") == 1  # push only
    assert titles.count("handoff distribution (click a bar: its traces)") == 2
    assert metric(at, "lost spans") == ["-", "-"]  # no Prometheus given: "-", the help says why
    assert all("--prometheus" in m.help for m in at.metric if m.label == "lost spans")
    # TPOT from the store's bench run (no per-request TPOT), said so in its help
    tpot = [m for m in at.metric if m.label.startswith("TPOT")]
    assert len(tpot) == 2 and all(m.value != "-" and "bench run" in m.help for m in tpot)
    # ("unknown": the health strip's figure kvlens cannot know, in a row of six: tests/unit/test_dashboard_health.py)
    shown = [m for m in at.metric if m.value != "unknown"]
    assert not [m for m in shown if m.value in ("None", "n/a") or "…" in m.value or len(m.value) > 6]
    # links from percentiles to the Traces page carry the filters
    links = [e for e in at.main if getattr(e, "type", "") == "page_link"]
    assert len(links) == 6
    # what dominates each mode's handoff, in words, side by side: the sentence kvlens traces prints
    words = data.breakdown_words(data.phase_breakdown(store_path, *data.since_until("1h")))
    shown = [m.value for m in at.markdown if "Where the handoff goes" in m.value]
    assert len(shown) == 2 and [w in v for w, v in zip((words["push"], words["pull"]), shown)] == [True, True]
    assert shown[0].count("push: ") == 1 and "% of the handoff is" in shown[1]
    # the phase chart uses the one fixed colour scale over every Phase
    spec = next(s for s in charts(at) if str(s.get("title")).startswith("critical path by phase"))
    domain = spec["encoding"]["color"]["scale"]["domain"]
    assert set(p.value for p in sc.Phase) <= set(domain)
    # the time range changes what is shown: 5m holds only a part of the 10-minute fixture
    before = [m for m in at.caption if "requests" in m.value]
    at.select_slider(key="ov_range").set_value("5m").run()
    no_exception(at)
    after = [m for m in at.caption if "requests" in m.value]
    assert before and after and [c.value for c in before] != [c.value for c in after]


def test_overview_with_prometheus(app, store_path, fake_prometheus):
    at = app(store_path, prometheus=fake_prometheus.url)
    no_exception(at)
    assert metric(at, "handoff p50") == ["4.00", "9.00"]
    assert metric(at, "lost spans") == ["5", "5"]
    assert metric(at, "ok") == ["88", "88"]  # counts as integers
    assert any("Prometheus" in c.value for c in at.caption)


def test_overview_prometheus_down_falls_back(app, store_path):
    at = app(store_path, prometheus="http://127.0.0.1:9")
    no_exception(at)
    assert any("Prometheus" in w.value for w in at.warning)
    assert len(metric(at, "handoff p50")) == 2  # from the store


def test_compare_page(app, store_path):
    at = app(store_path, page="compare")
    no_exception(at)
    grid = at.dataframe[0].value
    assert "handoff_p50 push÷pull" in grid.columns and "TTFT p99 (ms)" in grid.columns and len(grid) == 12
    assert any("handoff vs QPS" in str(t) for t in chart_titles(at))
    live = next(d.value for d in at.dataframe if list(d.value.get("mode", ())) == ["push", "pull"])
    # ms to the digits a time carries (3 significant, whole ms at least)
    import re

    for table in (grid, live):
        for c in [c for c in table.columns if c.endswith("(ms)")]:
            for v in table[c]:
                digits = re.sub(r"\D", "", v.lstrip("0.,"))
                assert v == "-" or len(digits) <= 3 or "." not in v, (c, v)
    # no ratio without its interval (issue 43): the grid's ratios are the two with intervals, the live
    # window's are the verdict's, each with its interval or "not enough data"
    assert [c for c in grid.columns if "÷" in c] == ["ttft_p50 push÷pull", "handoff_p50 push÷pull"]
    assert all(
        f"{c.split(' ')[0].replace('_', ' ').replace('ttft', 'TTFT')} 95% CI" in grid.columns
        for c in grid.columns
        if "÷" in c
    )
    everywhere = [d.value for d in at.dataframe]
    assert [c for c in everywhere[1].columns if "÷" in c] == [c for c in grid.columns if "÷" in c]  # all columns
    assert {"ttft_p50_push_over_pull_lo", "handoff_p50_push_over_pull_hi"} <= set(everywhere[1].columns)
    assert not any("÷" in str(x) for t in everywhere[2:] for x in list(t.columns) + list(t.get("mode", ()))), everywhere
    verdict = next(t for t in everywhere if "push/pull" in t.columns)
    assert list(verdict["figure"])[:2] == ["TTFT p50", "TTFT p90"]
    for r in verdict.itertuples():
        assert (r[2] == "-" and "not enough data" in r.verdict) or re.fullmatch(r"\d+\.\d\d-\d+\.\d\d", r[3]), r


def test_compare_without_bench_rows(app, tmp_path):
    p = make_store(tmp_path, n_per_mode=3, bench=False)
    at = app(p, page="compare")
    no_exception(at)
    assert any("No benchmark results" in i.value for i in at.info)


def test_traces_page_filters_and_waterfall(app, store_path):
    at = app(store_path, page="traces")
    no_exception(at)
    rows = at.dataframe[0].value
    assert set(rows["mode"]) == {"push", "pull"}
    at.selectbox(key="tr_mode").set_value("pull").run()
    no_exception(at)
    rows = at.dataframe[0].value
    assert set(rows["mode"]) == {"pull"}
    spans = at.dataframe[1].value
    assert {"read.post", "read.complete", "kv.ready"} <= set(spans["phase"])
    # select another trace: its phases are shown
    tids = list(rows["trace_id"])
    at.selectbox(key="tr_trace").set_value(tids[-1]).run()
    no_exception(at)
    assert at.query_params.get("trace") in (tids[-1], [tids[-1]])
    # outcome filter
    at.selectbox(key="tr_outcome").set_value("failed").run()
    no_exception(at)
    assert set(at.dataframe[0].value["outcome"]) == {"failed"}
    # minimum handoff filter
    at.selectbox(key="tr_outcome").set_value("any").run()
    at.selectbox(key="tr_mode").set_value("push").run()
    p50 = float(ms(at.dataframe[0].value["handoff_ms"]).median()) / 1e3
    at.number_input(key="tr_min").set_value(p50).run()
    no_exception(at)
    got = at.dataframe[0].value
    assert len(got) and (df_by_id(store_path).loc[list(got["trace_id"]), "handoff_s"] >= p50).all()
    wf = [s for s in charts(at) if "layer" in s]
    assert wf, "waterfall chart missing"
    spans = at.dataframe[1].value
    assert {"write.post", "write.complete", "registration.send"} <= set(spans["phase"])
    assert spans.loc[spans["phase"] == "write.complete", "critical"].all()


def test_traces_page_query_params_preset_filters(app, store_path):
    df = data.window_traces(store_path, None, None)
    h = df.loc[df["mode"] == "push", "handoff_s"].dropna().sort_values()
    lo, hi = float(h.iloc[5]), float(h.iloc[15])
    at = app(store_path, page="traces", mode="push", min_handoff=f"{lo:.9g}", max_handoff=f"{hi:.9g}")
    no_exception(at)
    assert at.selectbox(key="tr_mode").value == "push"
    assert at.number_input(key="tr_min").value == pytest.approx(lo)
    rows = at.dataframe[0].value
    assert len(rows) == 10 and set(rows["mode"]) == {"push"}
    got = df_by_id(store_path).loc[list(rows["trace_id"]), "handoff_s"]  # shown to the digits the bound supports
    assert (got >= lo).all() and (got < hi).all()
    # n and trace too, and no "default value set twice" warning from Streamlit
    pick = rows["trace_id"].iloc[3]
    at = app(store_path, page="traces", mode="push", n="5", trace=rows["trace_id"].iloc[0], order="ttft")
    no_exception(at)
    assert not at.warning
    assert len(at.dataframe[0].value) == 5 and at.radio(key="tr_order").value == "ttft"
    at = app(store_path, page="traces", trace=pick, min_handoff=f"{lo:.9g}", max_handoff=f"{hi:.9g}")
    assert at.selectbox(key="tr_trace").value == pick


def df_by_id(path) -> pd.DataFrame:
    return data.slowest(path, 10_000).set_index("trace_id")


def test_overview_link_targets_the_traces_page(app, store_path):
    """A histogram bucket link (its query string) opens Traces with the bucket's filters."""
    at = app(store_path)
    spec = next(s for s in charts(at) if "handoff distribution" in str(s.get("title")))
    assert spec["encoding"]["href"]["field"] == "link"
    link = data.handoff_histogram(data.window_traces(store_path, None, None))["link"].iloc[0]
    qs = {k: v[0] for k, v in parse_qs(urlparse(link).query).items()}
    at2 = app(store_path, **qs)
    no_exception(at2)
    assert at2.selectbox(key="tr_mode").value == qs["mode"]
    rows = at2.dataframe[0].value
    assert len(rows) >= 1 and set(rows["mode"]) == {qs["mode"]}


@pytest.mark.parametrize("page", ["overview", "compare", "traces"])
def test_missing_store_shows_a_message(app, tmp_path, page):
    at = app(tmp_path / "absent" / "traces.db", page=page)
    no_exception(at)
    assert any("No trace store" in w.value for w in at.warning)


@pytest.mark.parametrize("page", ["overview", "compare", "traces"])
def test_empty_store_shows_a_message(app, tmp_path, page):
    p = tmp_path / "traces.db"
    store.connect(p).close()
    at = app(p, page=page)
    no_exception(at)
    assert any("empty" in i.value for i in at.info)


def test_corrupt_store_shows_a_message(app, tmp_path):
    p = tmp_path / "traces.db"
    p.write_bytes(b"garbage" * 1000)
    at = app(p, page="traces")
    no_exception(at)
    assert any("could not be read" in e.value for e in at.error)


@pytest.mark.skipif(not os.environ.get("KVLENS_TEST_STORE"), reason="KVLENS_TEST_STORE not set")
@pytest.mark.parametrize("page", ["overview", "compare", "traces"])
def test_pages_on_a_real_store(app, page):
    p = Path(os.environ["KVLENS_TEST_STORE"])
    assert p.exists(), p
    at = app(p, page=page, run=False)
    at.run()
    if page == "overview":
        at.select_slider(key="ov_range").set_value("all").run()
    no_exception(at)
    if page == "overview":
        assert len(metric(at, "handoff p50")) == 2 or at.info
    if page == "traces" and len(at.dataframe) > 1:
        spans = at.dataframe[1].value
        assert len(spans) and set(spans["phase"]) <= set(sc.PHASE_ORDER)


# ------------------------------------------------------------------ CLI
def test_dashboard_cmd_arguments(tmp_path, monkeypatch):
    import argparse

    from kvlens import dashboard_cmd

    p = argparse.ArgumentParser()
    dashboard_cmd.add_arguments(p)
    args = p.parse_args([])
    assert (args.port, args.host, args.store, args.prometheus) == (8501, "127.0.0.1", None, None)
    args = p.parse_args(["--store", str(tmp_path / "t.db"), "--prometheus", "http://x:9090", "--port", "9999"])
    cmd = dashboard_cmd.command(args, tmp_path / "t.db")
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("dashboard/serve.py")
    i = cmd.index("--")
    assert cmd[i + 1 :] == ["--store", str(tmp_path / "t.db"), "--prometheus", "http://x:9090"]
    for flag, val in (
        ("--server.port", "9999"),
        ("--server.address", "127.0.0.1"),
        ("--server.headless", "true"),
        ("--browser.gatherUsageStats", "false"),
        ("--client.showErrorDetails", "none"),
        ("--client.toolbarMode", "viewer"),
    ):
        assert cmd[cmd.index(flag) + 1] == val
    # a bare `streamlit run dashboard/app.py` from the repository root gets the same viewer toolbar
    import tomllib

    cfg = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert cfg["client"]["toolbarMode"] == "viewer" and cfg["server"]["address"] == "127.0.0.1"
    cmd = dashboard_cmd.command(p.parse_args(["--show-error-details"]), tmp_path / "t.db")
    assert cmd[cmd.index("--client.showErrorDetails") + 1] == "full"
    assert dashboard_cmd.run(p.parse_args(["--port", "0"])) == 2
    assert dashboard_cmd.run(p.parse_args(["--prometheus", "localhost:9090"])) == 2


def test_app_default_store_is_kvlens_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLENS_HOME", str(tmp_path))
    from dashboard.app import parse_config

    assert parse_config([]).store.path == tmp_path.resolve() / "traces.db"
    assert parse_config(["--store", "x.db", "--prometheus", "http://p:9090"]).prometheus == "http://p:9090"


# ------------------------------------------------------------------ figures whole (issue 14)
def test_card_and_table_formats():
    import pandas as pd

    from dashboard import ui

    assert [ui.fmt_short(v, 1e3) for v in (0.006, 0.0131, 0.3546, 1.2345, None)] == [
        "6.00",
        "13.1",
        "355",
        "1,234",
        "-",
    ]
    assert ui.time_unit([0.3, None]) == ("ms", 1e3) and ui.time_unit([12.0]) == ("s", 1.0)
    assert [ui.fmt_rate(v) for v in (1.5, 0.0111, 0.00833, 2345.0, None)] == ["1.5", "0.011", "0.0083", "2,345", "-"]
    assert ui.fmt_n(68.0) == "68" and ui.fmt_n(None) == "-"
    df = pd.DataFrame(
        {"x": [1.23456, None, float("nan")], "n": [68.0, 2.0, None], "s": ["a", None, "b"], "r": [0.8, None, 1.1]}
    )
    out = ui.table_view(df, {"x": ".3f", "r": "{:.2f}×"})
    assert out.to_dict("list") == {
        "x": ["1.235", "-", "-"],
        "n": ["68", "2", "-"],
        "s": ["a", "-", "b"],
        "r": ["0.80×", "-", "1.10×"],
    }


def test_tpot_from_prometheus_goes_to_the_one_mode_that_ran():
    stats = {m: data.ModeStats(mode=m, requests=(10.0 if m == "push" else 0.0)) for m in data.MODES}
    dashboard_prom._tpot(
        lambda q: [({}, 0.012)] if "vllm:request_time_per_output_token_seconds_sum" in q else [], "5m", stats
    )
    assert stats["push"].tpot_mean == 0.012 and "vllm-decode" in stats["push"].tpot_note
    assert stats["pull"].tpot_mean is None and "No pull requests" in stats["pull"].tpot_note
    both = {m: data.ModeStats(mode=m, requests=5.0) for m in data.MODES}
    dashboard_prom._tpot(lambda q: [({}, 0.012)], "5m", both)
    assert all(s.tpot_mean is None and "no mode label" in s.tpot_note for s in both.values())
    none = {m: data.ModeStats(mode=m, requests=5.0) for m in data.MODES}
    dashboard_prom._tpot(lambda q: [], "5m", none)
    assert all(s.tpot_mean is None and "no vLLM TPOT" in s.tpot_note for s in none.values())


def test_bench_tpot_says_why_when_missing():
    import pandas as pd

    got = benchdata.bench_tpot(pd.DataFrame({"mode": ["push", "pull"], "tpot_mean_s": [0.01, None]}), "run-1")
    assert got["push"][0] == 0.01 and "run-1" in got["push"][1]
    assert got["pull"][0] is None and "unknown" in got["pull"][1]
    assert benchdata.bench_tpot(pd.DataFrame(), None)["push"][0] is None


def test_no_none_in_tables(app, store_path):
    """Every table cell is text, "-" where missing: Streamlit would draw "None"."""
    for page in ("traces", "compare"):
        at = app(store_path, page=page)
        no_exception(at)
        for t in at.dataframe:
            v = t.value
            assert not v.isna().any().any(), (page, v.columns[v.isna().any()].tolist())
            assert not v.isin(["None", "nan", "NaN"]).any().any(), page
    live = next(t.value for t in at.dataframe if "requests" in t.value.columns)
    assert live["requests"].str.fullmatch(r"[\d,]+|-|\d+\.\d\d").all()  # counts as integers (ratio row: x.xx)
