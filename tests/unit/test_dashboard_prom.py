"""The Overview's PromQL of issue 43, evaluated by Prometheus' own engine
(``promtool test rules``, Debian's ``prometheus``; missing, the test fails):
the data's age that a young fleet's request rate is taken over, and TPOT by
mode from ``kvlens_tpot_seconds``. Then the page's arithmetic on those
figures: the rate over the smaller of the range and the data's age, exact
percentiles from the store where it holds the requests."""

from __future__ import annotations

import subprocess

import pandas as pd
import pytest
import yaml

from dashboard import data
from dashboard import prom as dashboard_prom
from test_alert_rules import promtool


def _promtool_eval(tmp_path, series: list[dict], tests: list[dict]) -> subprocess.CompletedProcess:
    doc = {
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}],
    }
    (tmp_path / "t.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run(
        [promtool(), "test", "rules", "t.yml"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )


def test_data_age_and_tpot_by_mode_in_prometheus(tmp_path):
    # a fleet whose router was first scraped 10 minutes before the evaluation (50 min of nothing first)
    series = [
        {"series": 'kvlens_requests_total{mode="push",outcome="ok"}', "values": "_x200 0+1x40"},
        {"series": 'kvlens_requests_total{mode="pull",outcome="ok"}', "values": "_x220 0+2x20"},
        {"series": 'kvlens_tpot_seconds_sum{mode="push"}', "values": "_x200 0+0.07x40"},
        {"series": 'kvlens_tpot_seconds_count{mode="push"}', "values": "_x200 0+10x40"},
        {"series": 'kvlens_tpot_seconds_sum{mode="pull"}', "values": "_x200 0+0.104x40"},
        {"series": 'kvlens_tpot_seconds_count{mode="pull"}', "values": "_x200 0+10x40"},
    ]
    tests = [
        {"expr": dashboard_prom.age_expr("1h"), "eval_time": "60m", "exp_samples": [{"labels": "{}", "value": 600}]},
        # older than the range: the subquery sees only the range, so the age is the range
        {"expr": dashboard_prom.age_expr("5m"), "eval_time": "60m", "exp_samples": [{"labels": "{}", "value": 300}]},
        {  # in microseconds, rounded: the float sums are not exact
            "expr": f"round(({dashboard_prom.tpot_expr('5m')}) * 1e6)",
            "eval_time": "60m",
            "exp_samples": [{"labels": '{mode="push"}', "value": 7000}, {"labels": '{mode="pull"}', "value": 10400}],
        },
    ]
    out = _promtool_eval(tmp_path, series, tests)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_rate_is_over_the_time_that_has_data():
    now = 10_000 * 10**9
    assert data.rate_window(3600, now - 120 * 10**9, now) == 120  # a 2-minute-old store, 1 h range
    assert data.rate_window(300, now - 3600 * 10**9, now) == 300
    assert data.rate_window(None, now - 50 * 10**9, now) == 50
    assert data.rate_window(3600, None, now) == 3600
    import pandas as pd

    # 20 push and 20 pull requests, one every 3 s each, over the last 2 minutes: 1/3 req/s each, not 20/3600
    starts = [now - (120 - 3 * i) * 10**9 for i in range(40)]
    df = pd.DataFrame(
        {
            "start_ns": starts,
            "mode": ["push", "pull"] * 20,
            "handoff_s": [0.01] * 40,
            "ttft_s": [0.05] * 40,
            "outcome": ["ok"] * 40,
        }
    )
    stats = data.stats_from_traces(df, 3600, now_ns=now)
    for s in stats.values():
        assert s.rate_window_s == pytest.approx(120) and s.req_per_s == pytest.approx(20 / 120)


def test_exact_from_store_where_the_store_holds_the_requests():
    prom = {
        m: data.ModeStats(mode=m, requests=100.0, handoff={"p50": 0.5, "p90": 1.15, "p99": 2.365}) for m in data.MODES
    }
    store = {
        m: data.ModeStats(mode=m, requests=97.0, handoff={"p50": 0.41, "p90": 0.83, "p99": 1.2}) for m in data.MODES
    }
    store["pull"].requests = 40.0  # a store that kept only some of pull's requests
    for m in data.MODES:
        prom[m].req_per_s, prom[m].rate_window_s = 0.86, 90.0  # Prometheus' increase(), extrapolated
    now = 10_000 * 10**9
    # the store's rows: 60 push requests over the last 90 s, 37 older ones (the demo's grid, say); pull's
    rows = [("push", now - int(i * 1.5e9)) for i in range(60)] + [("push", now - 300 * 10**9)] * 37
    rows += [("pull", now - 10**9)] * 40
    df = pd.DataFrame(rows, columns=["mode", "start_ns"])
    data.exact_from_store(prom, store, df=df, now_ns=now)
    assert prom["push"].handoff == {"p50": 0.41, "p90": 0.83, "p99": 1.2} and prom["push"].pct_source == "store"
    # the rate counts the store's requests within Prometheus' window where the store holds them
    assert prom["push"].req_per_s == pytest.approx(60 / 90) and prom["push"].rate_window_s == 90.0
    assert prom["pull"].req_per_s == 0.86 and prom["pull"].rate_window_s == 90.0  # the store holds too few
    assert "exact" in prom["push"].pct_note and "97" in prom["push"].pct_note
    assert prom["pull"].handoff["p90"] == 1.15 and prom["pull"].pct_source == "histogram"
    assert "holds 40 of the 100 pull requests" in prom["pull"].pct_note
    unread = {m: data.ModeStats(mode=m, requests=10.0) for m in data.MODES}
    data.exact_from_store(unread, None, why="the trace store could not be read (locked)")
    assert all("could not be read" in s.pct_note and s.pct_source == "histogram" for s in unread.values())


def test_tpot_per_mode_from_kvlens_histogram():
    stats = {m: data.ModeStats(mode=m, requests=5.0) for m in data.MODES}

    def q(expr: str):
        if expr == dashboard_prom.tpot_expr("5m"):
            return [({"mode": "push"}, 0.007)]  # pull: no request of it had its tokens timed apart
        return [({}, 0.012)] if "vllm:" in expr else []

    dashboard_prom._tpot(q, "5m", stats)
    assert stats["push"].tpot_mean == 0.007 and "kvlens_tpot_seconds" in stats["push"].tpot_note
    # vLLM's figure has no mode label and both modes ran: not given to pull, and the reason says so
    assert stats["pull"].tpot_mean is None and "no mode label" in stats["pull"].tpot_note
