"""The Overview never comes up without its main figures (issue 43, item 6).

A fleet test's Overview had no "handoff p50" card in about 1 run of 6 while
the store held every request. One way a page came up so, found reading the
code: the live window ended at ``now`` rounded down to the loaders' cache
step (5 s up to 1 h, 30 s or 60 s beyond), so a page drawn within a step of
a young store's first requests found no trace in the range and drew no mode
column. (The fleet test draws its page more than 5 s after its first
request, so that run's failure may have had another cause: 9 runs here, 3
under a CPU hog, never failed on the page.) The window now has no end; and
a page that cannot compute a figure draws its card with "-" and the reason,
never nothing, so a failure names its cause. Stores are written through the
real pipeline (tests/store_fixture.py); pages run in Streamlit's AppTest.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

from store_fixture import _recorder, record_requests

from dashboard import data
from dashboard import loaders

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


def _young_store(home: Path, n: int = 3) -> Path:
    """A store whose every trace started after the current cache step began."""
    recs = {(r, m): _recorder(r, m, home) for r in ("router", "prefill", "decode") for m in ("push", "pull")}
    record_requests(recs, random.Random(43), time.time_ns(), n, 0.3)
    return home / "traces.db"


def test_traces_of_the_current_cache_step_are_in_the_window(tmp_path):
    bucket = loaders.now_bucket("1h")  # taken first: every trace below starts after it
    path = _young_store(tmp_path)
    df = data.window_traces(path, *data.since_until("1h", bucket))
    assert sorted(df["mode"].value_counts().to_dict().items()) == [("pull", 3), ("push", 3)]
    assert df["start_ns"].min() > bucket * 10**9  # what the old bounded window (until = bucket) left out


def _overview(monkeypatch, path):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(path)])
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _cards(at) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for m in at.metric:
        out.setdefault(m.label.rsplit(" (", 1)[0], []).append((m.value, m.help or ""))
    return out


def test_overview_of_a_young_store_has_its_figures(monkeypatch, tmp_path):
    at = _overview(monkeypatch, _young_store(tmp_path))
    cards = _cards(at)
    assert len(cards["handoff p50"]) == 2 and all(v not in ("", "-") for v, _ in cards["handoff p50"]), cards
    rate = [c.value for c in at.caption if "rate over the last" in c.value]
    assert len(rate) == 2, [c.value for c in at.caption]  # the window each req/s covers is said


@pytest.mark.parametrize("span_s, why", [(None, "no request has been traced yet"), (7200.0, "no traces started")])
def test_overview_without_figures_says_why_in_their_place(monkeypatch, tmp_path, span_s, why):
    path = tmp_path / "traces.db"
    if span_s is None:
        from kvtrace import store

        store.connect(path).close()  # an empty store
    else:  # traces two hours old: none in the default 1 h range
        recs = {(r, m): _recorder(r, m, tmp_path) for r in ("router", "prefill", "decode") for m in ("push", "pull")}
        record_requests(recs, random.Random(1), time.time_ns() - int(span_s * 1e9), 2, 60.0)
    cards = _cards(_overview(monkeypatch, path))
    for name in ("handoff p50", "handoff p90", "handoff p99", "TTFT p50", "TPOT"):
        assert len(cards[name]) == 2, cards  # push's column and pull's
        assert all(v == "-" and why in h for v, h in cards[name]), cards[name]
