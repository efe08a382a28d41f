"""The dashboard's handoff health (issue 37, item 7) through Streamlit's AppTest:
the Overview's health strip (from the store, and from Prometheus where it has
no health series: "unknown" with the reason, never 0), the list of requests
stuck now linking to their partial traces, and the Traces page naming a
partial trace's waiting side and a stale trace. Stores written through the
real pipeline (tests/store_fixture.py, tests/health_store.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fakes import FakePrometheus
from health_store import add_health_traces
from store_fixture import make_store

from dashboard import data
from dashboard import handoffhealth
from dashboard import prom

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "dashboard" / "app.py")


@pytest.fixture(scope="module")
def health_store(tmp_path_factory):
    home = tmp_path_factory.mktemp("kvlens_health")
    path = make_store(home, n_per_mode=20, bench=False)
    ids = add_health_traces({"kvlens_home": str(home), "kvlens_metrics": "off"}, time.time_ns())
    return path, ids


@pytest.fixture
def app(monkeypatch):
    from streamlit.testing.v1 import AppTest

    def make(path, prometheus: str | None = None, **qp):
        argv = ["app.py", "--store", str(path)] + (["--prometheus", prometheus] if prometheus else [])
        monkeypatch.setattr(sys, "argv", argv)
        at = AppTest.from_file(APP, default_timeout=60)
        for k, v in qp.items():
            at.query_params[k] = v
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return make


def cards(at) -> dict[str, str]:
    labels = {lab: lab for lab in handoffhealth.HEALTH_FIGURES.values()} | {"oldest open": "oldest open (s)"}
    got = {m.label: m for m in at.metric}
    return {k: got[v].value for k, v in labels.items() if v in got}


def helps(at) -> dict[str, str]:
    return {m.label: m.help for m in at.metric}


def stuck_links(at) -> list:
    return [e for e in at.main if getattr(e, "type", "") == "page_link" and "waiting in" in e.proto.label]


def test_health_strip_and_stuck_list_from_the_store(app, health_store):
    path, ids = health_store
    at = app(path)
    c = cards(at)
    assert c["open now"] == "2"
    assert float(c["oldest open"]) >= 30.0  # P held pull_stuck's blocks 30 s before the page ran
    assert c["stale"] == "1" and c["expired"] == "1"
    window = data.window_traces(path, *data.since_until("1h"))
    assert c["failed"] == str(int(window["outcome"].isin(["failed", "timeout"]).sum()))
    # the store cannot say: unknown, with the reason, never 0
    assert c["registration timeouts"] == "unknown"
    assert "--prometheus" in helps(at)["registration timeouts"]
    assert any("unknown:" in x.value and "--prometheus" in x.value for x in at.caption)
    # the requests stuck now, oldest first, each a link to its partial trace
    links = stuck_links(at)
    assert len(links) == 2
    first, second = (e.proto for e in links)
    assert ids["pull_stuck"][:12] in first.label and "P (prefill) waiting in awaiting_read" in first.label
    assert ids["push_stuck"][:12] in second.label and "D (decode) waiting in awaiting_kv" in second.label
    assert "registration timed out" in second.label
    assert "pages/traces.py" in first.page or "traces" in first.page
    assert f"trace={ids['pull_stuck']}" in first.query_string


def test_no_stuck_handoff_says_so(app, tmp_path):
    path = make_store(tmp_path, n_per_mode=3, bench=False)
    at = app(path)
    c = cards(at)
    assert c["open now"] == "0" and c["oldest open"] == "none" and c["stale"] == "0"
    assert not stuck_links(at)
    assert any("No handoff is stuck now" in x.value for x in at.caption)


def test_health_from_prometheus_without_health_series_is_unknown(app, health_store):
    path, _ = health_store
    with FakePrometheus() as fake:  # answers the overview's queries, none of the health metrics
        at = app(path, prometheus=fake.url)
    c = cards(at)
    assert set(c.values()) == {"unknown"}, c
    assert "kvlens_handoffs_open" in helps(at)["open now"]
    # the stuck list still comes from the store (Prometheus holds no request ids)
    assert len(stuck_links(at)) == 2


def test_prom_health_names_each_missing_metric():
    with FakePrometheus() as fake:
        figs = prom.prom_health(fake.url, "15m")
        assert all(f.value is None and f.unknown for f in figs.values())
        assert "kvlens_registration_timeouts_total" in figs["reg_timeouts"].unknown
        assert any("kvlens_kv_stale_total[15m]" in q for q in fake.queries)


def test_traces_page_shows_a_partial_trace(app, health_store):
    path, ids = health_store
    at = app(path, page="traces", trace=ids["push_stuck"])
    assert at.selectbox(key="tr_trace").value == ids["push_stuck"]
    warn = [w.value for w in at.warning if "Partial trace" in w.value]
    assert len(warn) == 1
    assert "D (decode) waiting in `awaiting_kv` since" in warn[0] and "registration timed out" in warn[0]
    assert {m.label: m.value for m in at.metric}["outcome"] == "open"
    assert not [e for e in at.error if "reused memory" in e.value]


def test_traces_page_names_a_stale_trace(app, health_store):
    path, ids = health_store
    at = app(path, page="traces", trace=ids["pull_stale"])
    assert [e.value for e in at.error if "Possibly served from reused memory" in e.value]
    assert not [w for w in at.warning if "Partial trace" in w.value]  # it ended: the complete trace replaced it
