"""Dashboard with several P and D instances (xPyD): the per-(P, D) pair
loader (dashboard/pairs.py) and the engine filters (dashboard/data.py) on a
store with three pairs written through the real pipeline
(tests/pair_store.py), the pages through Streamlit's AppTest; and the
figure formats the cards and tables share (one unit per row, digits from
the clock bound).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from pair_store import Pair, make_pair_store

from dashboard import data
from dashboard import pairs
from dashboard import ui

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "dashboard" / "app.py")

FAST, SLOW, SKEWED = Pair("p0", "d0"), Pair("p1", "d0", slow_ms=40.0), Pair("p0", "d1", skew_ms=5.0)


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory):
    return make_pair_store(tmp_path_factory.mktemp("kvlens_pairs"), [FAST, SLOW, SKEWED], n_per_mode=10)


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


def test_pair_table_one_row_per_mode_and_pair(pair_store):
    path, ids = pair_store
    assert pairs.engine_pairs(path) == [("p0", "d0"), ("p0", "d1"), ("p1", "d0")]
    t = pairs.pair_table(path, None, None)
    assert list(t.columns) == pairs.PAIR_TABLE_COLUMNS
    assert sorted(zip(t["mode"], t["pair"])) == sorted(
        (m, f"{p.p} → {p.d}") for m in data.MODES for p in (FAST, SLOW, SKEWED)
    )
    assert (t["requests"] == 10).all()
    # every failed request is counted, but only known handoffs make the percentiles
    known = data.window_traces(path, None, None)["handoff_s"].notna().sum()
    assert t["handoffs"].sum() == known
    for mode, g in t.groupby("mode"):
        # the slow instance stands out: first in its mode, well above the fastest pair
        assert g.iloc[0]["pair"] == "p1 → d0", g
        assert g.iloc[0]["vs_best"] > 1.5 and g["vs_best"].min() == 1.0
        assert (g["handoff_p90_s"] >= g["handoff_p50_s"]).all()
        assert g["ttft_p50_s"].notna().all() and (g["err_p50_s"] > 0).all()


def test_each_pair_keeps_its_own_clock_window(pair_store):
    path, _ = pair_store
    t = pairs.pair_table(path, None, None).set_index(["mode", "pair"])
    for mode in data.MODES:
        same_host = t.loc[(mode, "p0 → d0")]
        assert same_host["clock_lo_s"] <= 0 <= same_host["clock_hi_s"] and same_host["clock_offset_s"] == 0
        # D's clock 5 ms ahead: the window excludes 0 and holds the skew, and the store corrected for it
        skewed = t.loc[(mode, "p0 → d1")]
        assert 0 < skewed["clock_lo_s"] <= 0.005 <= skewed["clock_hi_s"]
        assert skewed["clock_offset_s"] > 0
        assert pairs.clock_window_text(skewed["clock_lo_s"], skewed["clock_hi_s"]).startswith("[+")
    assert pairs.clock_window_text(None, 0.001) is None


def test_pair_table_of_an_empty_range(pair_store):
    path, _ = pair_store
    future = 2**62
    assert list(pairs.pair_table(path, future, None).columns) == pairs.PAIR_TABLE_COLUMNS
    assert pairs.pair_stats(pd.DataFrame()).empty


def test_pair_without_engines_is_labelled():
    rows = pd.DataFrame(
        [("push", None, "d0", 1, 0.01, 0.001, 0.05, -0.001, 0.002, 0.0)], columns=list(pairs.queries.PAIR_COLUMNS)
    )
    t = pairs.pair_stats(rows)
    assert list(t["pair"]) == ["? → d0"] and t["p_engine"].isna().all()
    assert "p_engine" not in t["link"][0] and "d_engine=d0" in t["link"][0]


def test_slowest_by_engine(pair_store):
    path, ids = pair_store
    by_p = data.slowest(path, 100, p_engine="p1")
    assert len(by_p) == 20 and set(by_p["p_engine"]) == {"p1"}
    assert set(by_p["trace_id"]) == set(ids[SLOW]["push"] + ids[SLOW]["pull"])
    by_d = data.slowest(path, 100, d_engine="d1", mode="pull")
    assert len(by_d) == 10 and set(by_d["d_engine"]) == {"d1"} and set(by_d["mode"]) == {"pull"}
    both = data.slowest(path, 100, p_engine="p0", d_engine="d0", trace_ids=ids[FAST]["push"][:3])
    assert set(both["trace_id"]) == set(ids[FAST]["push"][:3])
    assert data.slowest(path, 5, p_engine="p9").empty
    assert data.slowest(path, 5, p_engine="p0", trace_ids=[]).empty


def test_overview_shows_the_pairs(app, pair_store):
    path, _ = pair_store
    at = app(path)
    assert any("per (P, D) pair" in h.value for h in at.subheader)
    grid = at.dataframe[-1].value
    assert len(grid) == 6 and set(grid["pair"]) == {"p0 → d0", "p1 → d0", "p0 → d1"}
    assert grid["traces"].str.contains("p_engine=").all()
    assert grid["D − P clock (ms)"].str.match(r"\[[+-]\d").all()
    assert not grid.isin(["None", "nan"]).any().any()
    # the slow instance is named above the table, in both modes; the others are not
    named = [m.value for m in at.markdown if "the fastest" in m.value]
    assert len(named) == 2 and all("p1 → d0" in v for v in named), named


def test_traces_page_filters_by_engine(app, pair_store):
    path, ids = pair_store
    at = app(path, page="traces", p_engine="p1")
    assert at.selectbox(key="tr_p").value == "p1" and at.selectbox(key="tr_d").value == "any"
    assert at.selectbox(key="tr_p").options == ["any", "p0", "p1"]
    rows = at.dataframe[0].value
    assert len(rows) == 20 and set(rows["pair"]) == {"p1 → d0"}
    at.selectbox(key="tr_p").set_value("p0").run()
    at.selectbox(key="tr_d").set_value("d1").run()
    assert not at.exception
    assert set(at.dataframe[0].value["pair"]) == {"p0 → d1"}
    assert at.query_params.get("d_engine") in ("d1", ["d1"])
    assert any("P → D `p0 → d1`" in c.value for c in at.caption)


# ------------------------------------------------------------------ formats
def test_digits_follow_the_clock_bound():
    assert [ui.bound_decimals(e) for e in (0.4, 0.15, 3.0, 40.0, 0.042, None, 0.0)] == [1, 2, 0, -1, 2, None, None]
    assert ui.fmt_ms(9.246954, 0.0004) == "9,247.0" and ui.fmt_err_ms(0.0004) == "0.4"
    assert ui.fmt_ms(9.246954, 0.00015) == "9,246.95" and ui.fmt_err_ms(0.00015) == "0.15"
    assert ui.fmt_ms(9.246954, 0.04) == "9,250" and ui.fmt_err_ms(0.04) == "40"
    # no bound: 3 significant digits, whole ms at least
    assert [ui.fmt_ms(v) for v in (12.301303, 0.0123456, 0.00012, 0.0, None)] == ["12,301", "12.3", "0.120", "0", "-"]
    assert ui.fmt_handoff(9.246954, 0.0004) == "9,247.0 ± 0.4 ms"
    assert ui.fmt_handoff(None, None, "unknown: ...") == "unknown"


def test_one_unit_per_row_across_push_and_pull():
    from dashboard.pages.overview import row_units

    push = data.ModeStats(
        "push",
        requests=5.0,
        handoff={"p50": 0.02, "p90": 0.03, "p99": 0.04},
        ttft={"p50": 0.55, "p99": 12.6},
        tpot_mean=0.012,
    )
    pull = data.ModeStats(
        "pull",
        requests=5.0,
        handoff={"p50": 0.01, "p90": 0.02, "p99": 0.03},
        ttft={"p50": 0.362, "p99": 1.745},
        tpot_mean=0.011,
    )
    units = row_units({"push": push, "pull": pull})
    assert units == {"handoff": ("ms", 1e3), "ttft": ("s", 1.0)}
    # what the cards then show: both columns in seconds, three significant digits
    assert [ui.fmt_short(v, 1.0) for v in (0.55, 12.6, 0.362, 1.745, 0.012)] == [
        "0.550",
        "12.6",
        "0.362",
        "1.75",
        "0.012",
    ]
    # a mode without requests does not choose the unit
    idle = data.ModeStats("pull", requests=0.0, ttft={"p50": 20.0})
    assert row_units({"push": push, "pull": idle})["ttft"] == ("s", 1.0)
    assert row_units({"push": pull, "pull": idle})["ttft"] == ("ms", 1e3)
