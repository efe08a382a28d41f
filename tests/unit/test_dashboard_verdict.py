"""The live verdict on the dashboard (issue 31): the Overview's first line
and the Compare page's predicted-against-measured table, through
Streamlit's AppTest on stores written by the real pipeline
(tests/store_fixture.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from store_fixture import make_store

from dashboard import verdictview
from kvtrace import store
from kvtrace import verdict as kv_verdict

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("both"), n_per_mode=40, span_s=600.0)


@pytest.fixture
def app(monkeypatch):
    from streamlit.testing.v1 import AppTest

    def make(path, **qp):
        monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(path)])
        at = AppTest.from_file(APP, default_timeout=60)
        for k, v in qp.items():
            at.query_params[k] = v
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return make


def _first_text(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**Verdict"))


def test_the_overview_opens_with_the_verdict(app, both):
    at = app(both, page="overview")
    first = at.main.children[0]
    while not hasattr(first, "value"):  # the headline's fragment holds it
        first = first.children[0]
    assert first.value.startswith("**Verdict, last 1h**"), first.value
    text = _first_text(at)
    assert "TTFT p50 push/pull" in text and "handoff p50 push/pull" in text and "[" in text
    assert "all requests, no split" in text and "40 push and 40 pull requests" in text


def test_one_mode_only_says_it_needs_both(app, tmp_path):
    """Pull requests only, as behind vllm-router: summary rows as a benchmark writes them."""
    path = tmp_path / "traces.db"
    now = time.time_ns()
    rows = []
    for i in range(1, 30):
        t0 = now - i * 10**9
        pf, kv = t0 + 50 * 10**6, t0 + 60 * 10**6
        rows.append((f"{i:032x}", f"r{i}", "pull", "sequential", "ok", t0, kv, 0.1, pf, kv, 0, 0.01, None))
    conn = store.connect(path)
    try:
        store.bulk_insert(conn, [], rows)
    finally:
        conn.close()
    at = app(path, page="overview")
    text = _first_text(at)
    assert kv_verdict.NEEDS_BOTH in text and "only pull requests (29)" in text


def test_the_compare_page_shows_predicted_against_measured(app, both):
    at = app(both, page="compare")
    table = at.dataframe[-1].value
    assert list(table.columns[:4]) == ["predicted", "figure", "predicted (ms)", "95 % interval (ms)"]
    assert set(table["figure"]) == {"handoff p50", "TTFT p50", "handoff p50 without CPU wait"} and len(table) == 6
    measured = table[table["figure"] != "handoff p50 without CPU wait"]
    assert all(v != "-" for v in measured["measured (ms)"]) and set(measured["inside"]) <= {"yes", "no"}
    # the synthetic store's spans carry no CPU figures: the rows without CPU wait say unknown ("-"), never 0
    nowait = table[table["figure"] == "handoff p50 without CPU wait"]
    assert set(nowait["predicted (ms)"]) == {"-"} and set(nowait["measured (ms)"]) == {"-"}
    assert any("Borrowed figures" in e.label for e in at.expander)


def test_headline_text_without_a_store_read():
    v = kv_verdict.compute([])
    assert verdictview.headline_text(v).startswith("**Verdict, last 1h:** needs both modes in the window")
