"""``kvlens traces`` (issue 12): bad flag values are one-line usage errors
(exit 2) at parse time, never a traceback; a corrupt or empty store is one
line naming the file (exit 1); the waterfall draws at its narrowest and
widest widths."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvlens import traces
from kvlens.cli import main


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--since", "inf"),
        ("--since", "nan"),
        ("--since", "-5"),
        ("--since", "0"),
        ("--since", "1e400"),
        ("--since", "-infm"),
        ("--since", "40000d"),
        ("--since", "m"),
        ("--since", "ten minutes"),
        ("--slowest", "99999999999999999999"),
        ("--slowest", "0"),
        ("--slowest", "-3"),
        ("--slowest", "2.5"),
        ("--width", "0"),
        ("--width", "3"),
        ("--width", "19"),
        ("--width", "100000"),
        ("--width", "wide"),
    ],
)
def test_bad_values_are_usage_errors(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["traces", "--store", str(tmp_path / "none.db"), f"{flag}={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"kvlens traces: error: argument {flag}:")


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--since", "10m"),
        ("--since", "36500d"),
        ("--since", "0.5"),
        ("--slowest", "10000"),
        ("--width", "20"),
        ("--width", "1000"),
    ],
)
def test_limits_themselves_are_accepted(tmp_path, capsys, flag, value):
    assert main(["traces", "--store", str(tmp_path / "none.db"), f"{flag}={value}"]) == 2  # store missing
    assert "trace store not found" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"\0" * 4096, b"SQLite format 3\0" + b"\xff" * 200])
def test_empty_or_corrupt_store_is_one_line_naming_the_file(tmp_path, capsys, content):
    bad = tmp_path / "odd #name%.db"
    bad.write_bytes(content)
    assert main(["traces", "--store", str(bad)]) == 2  # not a store: bad input (kvlens.exits)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "Traceback" not in err


def test_store_that_is_a_directory_is_one_line(tmp_path, capsys):
    assert main(["traces", "--store", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_run_checks_values_given_without_argparse(tmp_path, capsys):
    """``kvlens demo`` builds the namespace itself."""
    ns = argparse.Namespace(
        store=str(tmp_path / "none.db"),
        slowest=3,
        mode=None,
        outcome=None,
        since="inf",
        trace=None,
        json=False,
        width=60,
    )
    assert traces.run(ns) == 2
    assert "invalid duration" in capsys.readouterr().err


def test_waterfall_at_its_narrowest_and_widest(tmp_path):
    from kvtrace import store, tracemodel
    from store_fixture import make_store

    path = make_store(tmp_path, n_per_mode=2, bench=False)
    with store.reading(path) as conn:
        trs = tracemodel.slowest(conn, 4)
    assert trs
    for tr in trs:
        for asked, drawn in (
            (0, traces.MIN_WIDTH),
            (3, traces.MIN_WIDTH),
            (traces.MIN_WIDTH, traces.MIN_WIDTH),
            (traces.MAX_WIDTH, traces.MAX_WIDTH),
            (10**9, traces.MAX_WIDTH),
        ):
            text = traces.waterfall(tr, asked)
            bars = [line for line in text.splitlines() if "[" in line]
            assert bars and all(line.index("]") - line.index("[") - 1 == drawn for line in bars)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    from store_fixture import make_store

    return make_store(tmp_path_factory.mktemp("kvlens_home"), n_per_mode=4, bench=False)


def test_breakdown_says_what_dominates_per_mode_and_dispatch(small_store, capsys):
    from kvtrace import costs, store, tracemodel

    assert main(["traces", "--store", str(small_store), "--breakdown"]) == 0
    out = capsys.readouterr().out
    with store.reading(small_store) as conn:
        groups = costs.breakdown(conn, by_dispatch=True)
    assert set(groups) == {"push", "push/overlapped", "pull", "pull/sequential"}
    assert out == traces.breakdown_text(groups) + "\n"
    for key in ("push", "pull"):
        b = groups[key]
        assert tracemodel.dominant_words(b) in out  # the one sentence, as the dashboard shows it
        assert f"{b.requests} requests" in out
    assert "push/overlapped:" not in out  # each mode's only dispatch: not repeated
    seq = dataclasses.replace(groups["push/overlapped"], key="push/sequential")
    two = dict(
        groups,
        **{
            "push/sequential": seq,
            "push": tracemodel.summarize([("push", tracemodel.Tiling(10, {}, ()))] * (2 * groups["push"].requests))[
                "push"
            ],
        },
    )
    assert "push/overlapped:" in traces.breakdown_text(two) and "push/sequential:" in traces.breakdown_text(two)
    assert "unattributed at the median" in out and "decode.queue" in out and "write.notify" in out
    assert out.index("push:") < out.index("pull:")
    # filters narrow it
    assert main(["traces", "--store", str(small_store), "--breakdown", "--mode", "pull"]) == 0
    assert "push" not in capsys.readouterr().out.split("\n")[0]


def test_waterfalls_end_with_the_words(small_store, capsys):
    from kvtrace import costs, store, tracemodel

    assert main(["traces", "--store", str(small_store), "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    with store.reading(small_store) as conn:
        groups = costs.breakdown(conn)
    tail = out.split("what the handoff is made of", 1)[1]
    assert tracemodel.dominant_words(groups["push"]) in tail and tracemodel.dominant_words(groups["pull"]) in tail
    assert main(["traces", "--store", str(small_store), "--slowest", "1", "--json"]) == 0
    assert "what the handoff" not in capsys.readouterr().out  # --json stays one object per line


def test_breakdown_text_without_handoffs():
    assert traces.breakdown_text({}) == "no completed handoff to break down"
