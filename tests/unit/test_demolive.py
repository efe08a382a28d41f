"""The demo's closing words (:func:`kvlens.demolive.closing_words`) on a
synthetic store with a known mix: the live verdict's ratios with their
intervals and counts, the what-if both ways, the grid's verdict beside;
an empty window and an unreadable store said in words, never as 0."""

from __future__ import annotations

import re
import time

import pytest

from kvlens.demolive import closing_words
from kvtrace import stats
from kvtrace.store import StoreLocation

GRID = ["Overall, push (overlapped) vs pull on TTFT p50 over 4 cells: no resolvable difference in 4 (...)."]


@pytest.fixture
def synthetic(tmp_path):
    from store_backends import Backend
    from synthetic_store import build

    b = Backend("sqlite", tmp_path / "traces.db", tmp_path)
    base = time.time_ns() - 300 * 10**9
    build(b.store, b.config(), base, n_per_mode=48, span_s=240.0)
    return StoreLocation.parse(str(b.store)), base


def test_the_closing_words_give_the_live_verdict_the_whatif_and_the_grid(synthetic):
    loc, base = synthetic
    text, enough = closing_words(loc, base - 10**9, 125.0, GRID)
    assert enough
    assert "the 2 min 5 s since it started" in text
    assert "requests compared: 48 push, 48 pull" in text and f"needs {stats.MIN_PER_STRATUM} of each" in text
    for name in ("TTFT p50", "TTFT p90", "handoff p50", "TPOT p50"):
        (line,) = [x for x in text.splitlines() if x.strip().startswith(name)]
        assert re.search(r"\d\.\d\d \[\d+\.\d\d-\d+\.\d\d\]", line) or stats.NOT_ENOUGH in line, line
    assert re.search(r"from the \d+ pull requests, had they run push: handoff p50 \d", text), text
    assert re.search(r"from the \d+ push requests, had they run pull: handoff p50 \d", text), text
    assert "measured here: handoff p50" in text and "interval" in text
    assert "the grid's verdict, for comparison" in text and GRID[0] in text
    (short,) = [x for x in text.splitlines() if x.strip().startswith("in short: ")]
    assert "TTFT p50" in short and "handoff p50" in short and "TPOT p50" in short, short


def test_an_empty_window_needs_both_modes_and_shows_no_zero(synthetic):
    loc, _ = synthetic
    text, enough = closing_words(loc, time.time_ns() + 60 * 10**9, 3.0, [])
    assert not enough
    assert "needs both modes in the window" in text and "no push or pull requests" in text
    assert "requests compared" not in text and "what-if" not in text and "grid's verdict" not in text


def test_an_unreadable_store_is_said(tmp_path):
    text, enough = closing_words(StoreLocation.parse(str(tmp_path / "none.db")), 0, 1.0, GRID)
    assert not enough and "cannot be read" in text and "none.db" in text


class _Fleet:
    stopped = 0

    def stop(self) -> None:
        self.stopped += 1


def _demo_args(tmp_path, monkeypatch, *extra: str):
    import argparse

    from kvlens import demo

    monkeypatch.setenv("KVLENS_HOME", str(tmp_path))
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args(["--model", str(tmp_path), "--qps", "4", "--input-len", "16", "--no-progress", *extra])
    monkeypatch.setattr(demo, "_check", lambda a: demo.options_from_args(a))
    monkeypatch.setattr(demo, "run_guarded", lambda *a: None)  # the grid: finished (its own tests cover it)
    monkeypatch.setattr(demo, "print_report", lambda run_: None)
    monkeypatch.setattr(demo, "_traces", lambda *a: None)
    monkeypatch.setattr(demo, "_grid_verdict", lambda run_: ["Overall, ..."])
    return demo, args


@pytest.mark.parametrize("how", ["returns", "interrupted"])
def test_the_live_part_runs_on_the_fleet_and_the_fleet_is_stopped(tmp_path, monkeypatch, how):
    """After the grid the demo starts the mixed fleet and hands it to the live
    part; the fleet is stopped however the live part ends (its own stop, or an
    interrupt landing before it took the signals)."""
    demo, args = _demo_args(tmp_path, monkeypatch)
    fleet, seen = _Fleet(), {}
    monkeypatch.setattr(demo, "start_fleet", lambda opts, home: fleet)

    def live(stack, loc, a, grid):
        seen.update(stack=stack, grid=grid)
        if how == "interrupted":
            raise KeyboardInterrupt
        return 0

    monkeypatch.setattr(demo, "live", live)
    assert demo.run(args) == (0 if how == "returns" else 130)
    assert seen == {"stack": fleet, "grid": ["Overall, ..."]} and fleet.stopped >= 1


def test_a_fleet_that_does_not_start_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    from kvlens.stack.errors import StackError

    demo, args = _demo_args(tmp_path, monkeypatch)

    def fails(opts, home):
        raise StackError("port 8000 in use")

    monkeypatch.setattr(demo, "start_fleet", fails)
    monkeypatch.setattr(demo, "live", lambda *a: pytest.fail("no live part without a fleet"))
    assert demo.run(args) == 1
    assert "the live part's fleet did not start: port 8000 in use" in capsys.readouterr().err


def test_no_dashboard_starts_no_fleet(tmp_path, monkeypatch, capsys):
    demo, args = _demo_args(tmp_path, monkeypatch, "--no-dashboard")
    monkeypatch.setattr(demo, "start_fleet", lambda *a: pytest.fail("--no-dashboard starts no fleet"))
    assert demo.run(args) == 0 and "kvlens demo: done." in capsys.readouterr().out
