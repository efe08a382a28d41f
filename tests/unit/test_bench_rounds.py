"""kvlens bench --repeat: the two-level bootstrap on synthetic figures whose
answer is known, the "no resolvable difference" and "not enough data"
rules, the ABBA order of rounds and stack starts, pooled rows on a fake
router, and the dashboard's reading of the intervals."""

import json

import numpy as np
import pytest
from fakes import FakeRouter
from test_bench import _opts, _res, tiny_tokenizer_dir  # noqa: F401 (a fixture)

from kvtrace import benchrows
from kvtrace import store
from kvtrace.benchrows import add_ratios
from kvlens.bench.cli import run_guarded
from kvlens.bench.grid import BenchOptions
from kvlens.bench.report import describe, format_table
from kvlens.bench.results import Cell, Target, summarize_cell
from kvlens.bench.rounds import abba, add_intervals, pooled_rows, stack_plan
from kvlens.bench.runner import bench_routers, bench_stacks, new_run
from kvtrace.stats import bootstrap_diff, bootstrap_ratio


def _rounds(rng, k, n, scale, level=None):
    """k rounds of n lognormal latencies around ``scale`` seconds; ``level``:
    one multiplier per round (what a stack start does to a whole round)."""
    level = level or [1.0] * k
    return [list(scale * lv * rng.lognormal(0.0, 0.3, n)) for lv in level]


# ------------------------------------------------------------- bootstrap
def test_twice_as_slow_is_resolved_and_near_two():
    rng = np.random.default_rng(7)
    push, pull = _rounds(rng, 3, 32, 0.200), _rounds(rng, 3, 32, 0.100)
    lo, hi = bootstrap_ratio(push, pull)
    assert 1.0 < lo < 2.0 < hi < 3.0
    assert benchrows.verdict(lo, hi) == benchrows.PULL_LOWER
    lo2, hi2 = bootstrap_ratio(pull, push)  # the other way round: push lower
    assert hi2 < 1.0 and benchrows.verdict(lo2, hi2) == benchrows.PUSH_LOWER


def test_same_distribution_is_no_resolvable_difference():
    rng = np.random.default_rng(11)
    push, pull = _rounds(rng, 3, 32, 0.100), _rounds(rng, 3, 32, 0.100)
    lo, hi = bootstrap_ratio(push, pull)
    assert lo < 1.0 < hi
    assert benchrows.verdict(lo, hi) == benchrows.NO_DIFFERENCE


def test_too_few_requests_is_not_enough_data():
    assert bootstrap_ratio([[0.2]], [[0.1, 0.1, 0.1]]) is None  # one push request
    assert bootstrap_ratio([[0.2, None], []], [[0.1, 0.1]]) is None  # None and empty rounds do not count
    assert bootstrap_ratio([[0.2, 0.3]], []) is None
    assert bootstrap_ratio([[0.2, 0.3]], [[0.0, 0.0, 0.0]]) is None  # pull p50 of 0: no ratio
    assert benchrows.verdict(None, None) == benchrows.NOT_ENOUGH_DATA
    assert benchrows.verdict(float("nan"), 1.2) == benchrows.NOT_ENOUGH_DATA


def test_rounds_that_differ_widen_the_interval():
    """The spread between rounds (stack starts) counts: the same requests as
    one round give a narrower interval than as rounds that differ."""
    rng = np.random.default_rng(3)
    push = _rounds(rng, 4, 16, 0.100, level=[0.6, 1.6, 0.7, 1.5])
    pull = _rounds(rng, 4, 16, 0.100)
    lo, hi = bootstrap_ratio(push, pull)
    flo, fhi = bootstrap_ratio([sum(push, [])], [sum(pull, [])])
    assert hi - lo > 1.5 * (fhi - flo)


def test_bootstrap_is_reproducible():
    rng = np.random.default_rng(5)
    push, pull = _rounds(rng, 2, 8, 0.15), _rounds(rng, 2, 8, 0.10)
    assert bootstrap_ratio(push, pull) == bootstrap_ratio(push, pull)
    assert bootstrap_ratio(push, pull, seed=1) != bootstrap_ratio(push, pull)


# ------------------------------------------------------------- ABBA order
def test_abba_alternates_rounds():
    assert abba(["pull", "push"], 1) == [(1, ["pull", "push"])]
    assert abba(["pull", "push"], 4) == [
        (1, ["pull", "push"]),
        (2, ["push", "pull"]),
        (3, ["pull", "push"]),
        (4, ["push", "pull"]),
    ]
    order = [m for _, ms in abba(["pull", "push"], 4) for m in ms]
    # every mode sits as often early as late in a round: drift lands on both alike
    assert sum(i % 2 for i, m in enumerate(order) if m == "push") == 2


def test_stack_plan_starts():
    # one round: each mode once on its own stack (today's run)
    assert stack_plan(2, 1, fresh=False) == [(1, 0, True), (1, 1, True)]
    # ABBA keeps the stack that ends one round and starts the next
    assert stack_plan(2, 3, fresh=False) == [
        (1, 0, True),
        (1, 1, True),
        (2, 1, False),
        (2, 0, True),
        (3, 0, False),
        (3, 1, True),
    ]
    assert all(start for _, _, start in stack_plan(2, 3, fresh=True))
    assert stack_plan(1, 2, fresh=False) == [(1, 0, True), (2, 0, False)]


# ------------------------------------------------- intervals on cell rows
def _cells(mode, dispatch, rounds_ttft, handoff=0.004):
    out = []
    for r, ttfts in enumerate(rounds_ttft, start=1):
        res = [_res(f"{mode[:2]}{r:02d}{i:028x}", ttft=t) for i, t in enumerate(ttfts)]
        traces = {
            x.request_id: dict(trace_id=x.request_id, outcome="ok", ttft_s=x.ttft_s, handoff_s=handoff) for x in res
        }
        out.append(Cell(Target(mode, dispatch, "http://x"), 1.0, 256, res, traces, 1.0, round=r))
    return out


def test_pooled_rows_carry_intervals_and_verdicts():
    rng = np.random.default_rng(2)
    pull = _cells("pull", None, _rounds(rng, 2, 12, 0.100))
    slow = _cells("push", "overlapped", _rounds(rng, 2, 12, 0.200), handoff=0.004)
    same = _cells("push", "sequential", [[0.1], [0.1]])  # 1 request a round: 2 in all, enough
    few = _cells("push", "sequential", [[0.1]])
    for c in pull + slow + same:
        c.row = {"prefix_caching": "off"}
    opts = BenchOptions(output_len=16)
    rows = pooled_rows(pull + slow + same, opts, "run1")
    by = {(r["mode"], r["dispatch"]): r for r in rows}
    assert len(rows) == 3 and all(r["rounds"] == 2 and set(benchrows.ROW_KEYS) <= set(r) for r in rows)
    assert by[("pull", None)]["ttft_p50_push_over_pull_lo"] is None and by[("pull", None)]["ttft_p50_verdict"] is None
    s = by[("push", "overlapped")]
    assert s["completed"] == 24 and len(s["round_ttft_p50_s"]) == 2
    assert s["ttft_p50_push_over_pull_lo"] > 1.0 and s["ttft_p50_verdict"] == benchrows.PULL_LOWER
    assert s["handoff_p50_verdict"] == benchrows.NO_DIFFERENCE  # identical handoffs: the interval is [1, 1]
    assert s["ttft_p50_push_over_pull_lo"] <= s["ttft_p50_push_over_pull"] <= s["ttft_p50_push_over_pull_hi"]
    json.dumps(rows)
    # one request on the push side: a ratio, but no interval and no winner
    row = summarize_cell(few[0], opts, "run1", "off")
    add_intervals([row], pull + few)
    assert row["ttft_p50_push_over_pull_lo"] is None and row["ttft_p50_verdict"] == benchrows.NOT_ENOUGH_DATA
    row["ttft_p50_push_over_pull"] = 1.0
    words = describe(add_ratios([by[("pull", None)], row]))
    assert "TTFT p50 100.0 ms" in words[0] and "not enough data for an interval" in words[0]
    assert "lower" not in words[0].split(";")[0]


# ------------------------------------------- repeats on a fake router / stack
def test_repeat_runs_abba_and_writes_pooled_rows(tmp_path, tiny_tokenizer_dir):  # noqa: F811
    opts = _opts(tmp_path, tiny_tokenizer_dir, input_lens=[16], num_prompts=3, repeat=3)
    opts.store.parent.mkdir()
    with FakeRouter(opts.store, "pull") as pull, FakeRouter(opts.store, "push", "sequential") as push:
        run = bench_routers([push.url, pull.url], opts)
    assert [(c.round, c.target.mode) for c in run.cells] == [
        (1, "pull"),
        (1, "push"),
        (2, "push"),
        (2, "pull"),
        (3, "pull"),
        (3, "push"),
    ]
    rows = run.rows
    assert [(r["mode"], r["rounds"], r["completed"]) for r in rows] == [("pull", 3, 9), ("push", 3, 9)]
    p = rows[1]
    assert p["ttft_p50_push_over_pull_lo"] is not None and p["ttft_p50_verdict"] in (
        benchrows.PUSH_LOWER,
        benchrows.PULL_LOWER,
        benchrows.NO_DIFFERENCE,
    )
    assert p["handoff_p50_verdict"] == benchrows.NO_DIFFERENCE  # the fake's handoff is one constant
    conn = store.connect(opts.store, readonly=True)
    saved = store.bench_rows(conn, run.run_id)
    conn.close()
    assert len(saved) == 2 and saved[1]["ttft_p50_push_over_pull_hi"] == p["ttft_p50_push_over_pull_hi"]
    assert [json.loads(x)["rounds"] for x in opts.json_path.read_text().splitlines()] == [3, 3]
    table = format_table(add_ratios(rows), wide=True)
    assert "TTFT p50 by round ms" in table.splitlines()[0]


@pytest.mark.parametrize("fresh, starts", [(False, ["pull", "push", "pull"]), (True, ["pull", "push", "push", "pull"])])
def test_repeat_on_started_stacks(tmp_path, tiny_tokenizer_dir, fresh, starts):  # noqa: F811
    opts = _opts(tmp_path, tiny_tokenizer_dir, input_lens=[16], num_prompts=2, warmup=0, repeat=2, fresh_stacks=fresh)
    opts.store.parent.mkdir()
    events = []
    with FakeRouter(opts.store, "pull") as pull, FakeRouter(opts.store, "push") as push:
        urls = {"pull": pull.url, "push": push.url}

        class FakeStack:
            def __init__(self, **kw):
                self.mode, self.router_url = kw["mode"], urls[kw["mode"]]

            def start(self):
                events.append(("start", self.mode))

            def add_router(self, d):
                raise AssertionError("one dispatch")

            def stop(self):
                events.append(("stop", self.mode))

        run = bench_stacks(["push", "pull"], ["overlapped"], opts, stack_factory=FakeStack)
    assert [m for e, m in events if e == "start"] == starts
    assert [e for e, _ in events] == ["start", "stop"] * len(starts)  # one stack at a time, every one stopped
    assert [(c.round, c.target.mode) for c in run.cells] == [(1, "pull"), (1, "push"), (2, "push"), (2, "pull")]
    assert [r["rounds"] for r in run.rows] == [2, 2]


def test_cli_repeat_errors(capsys):
    from kvlens.cli import main

    assert main(["bench", "--repeat", "0"]) == 2
    assert "--repeat must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--fresh-stacks", "--proxy", "http://127.0.0.1:9"]) == 2
    assert "--fresh-stacks goes with stacks kvlens bench starts" in capsys.readouterr().err


# ------------------------------------------------------------ dashboard
def test_compare_page_reads_intervals():
    pytest.importorskip("streamlit")
    import pandas as pd

    from dashboard.loaders import with_ratios
    from dashboard.pages.compare import bench_display

    def row(mode, dispatch, ttft, **kw):
        base = {k: None for k in benchrows.ROW_KEYS}
        base.update(
            mode=mode,
            dispatch=dispatch,
            input_len=256,
            output_len=16,
            qps=1.0,
            ttft_p50_s=ttft,
            handoff_p50_s=0.01,
            rounds=2,
        )
        base.update(kw)
        return base

    df = with_ratios(
        pd.DataFrame(
            [
                row("pull", None, 0.1),
                row("push", "overlapped", 0.2, ttft_p50_push_over_pull_lo=1.5, ttft_p50_push_over_pull_hi=2.5),
                row("push", "sequential", 0.1, ttft_p50_push_over_pull_lo=0.8, ttft_p50_push_over_pull_hi=1.3),
                row("push", "overlapped", 0.1, qps=2.0, rounds=float("nan")),  # saved before intervals; no pull either
            ],
            columns=list(benchrows.ROW_KEYS),
        ).astype({"rounds": float})
    )

    def col(name, frame=None):  # "-" on the page
        return [None if pd.isna(v) else v for v in (bench_display(df) if frame is None else frame)[name]]

    assert col("TTFT p50 95% CI") == [None, "1.50–2.50", "0.80–1.30", None]
    assert col("TTFT p50 verdict") == [None, benchrows.PULL_LOWER, benchrows.NO_DIFFERENCE, None]
    assert col("handoff p50 verdict") == [None, benchrows.NOT_ENOUGH_DATA, benchrows.NOT_ENOUGH_DATA, None]
    old = df[list(benchrows.ROW_KEYS)].copy()
    old.loc[3, "qps"] = 1.0  # now its cell has a pull row, but it was saved before intervals
    assert col("TTFT p50 verdict", bench_display(with_ratios(old)))[3] == "no interval recorded"


def test_ctrl_c_in_round_two_saves_pooled_rows(tmp_path, tiny_tokenizer_dir, capsys):  # noqa: F811
    import os
    import signal

    opts = _opts(tmp_path, tiny_tokenizer_dir, input_lens=[16], num_prompts=2, warmup=0, repeat=3)
    opts.store.parent.mkdir()

    def interrupt(n):  # the pull router's 3rd request: round 2's pull cell (after push's)
        if n == 3:
            os.kill(os.getpid(), signal.SIGINT)
            return True
        return False

    with FakeRouter(opts.store, "pull", on_request=interrupt) as pull, FakeRouter(opts.store, "push") as push:
        run = new_run(opts)
        old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            code = run_guarded("bench", run, lambda: bench_routers([pull.url, push.url], opts, run=run))
        finally:
            signal.signal(signal.SIGINT, old_handler)
    assert code == 130
    assert [(c.round, c.target.mode) for c in run.cells] == [(1, "pull"), (1, "push"), (2, "push")]
    conn = store.connect(opts.store, readonly=True)
    saved = store.bench_rows(conn, run.run_id)
    conn.close()
    assert sorted((r["mode"], r["rounds"]) for r in saved) == [("pull", 1), ("push", 2)]
    out = capsys.readouterr().out
    assert "interrupted in round 2 of 3" in out and "95% CI" in out


def test_bootstrap_diff_brackets_a_known_shift_and_is_seeded():
    """The difference of medians' interval (a CPU wait's rise near 0, where a ratio says nothing): a shift of
    5 over a spread of 1 is bracketed; the same figures give the same interval; one figure a side is none."""
    base = [0.0, 0.5, 1.0, 0.2, 0.8, 0.4, 0.6, 0.3]
    lo, hi = bootstrap_diff([[x + 5.0 for x in base]], [base])
    assert lo <= 5.0 <= hi and lo > 3.0
    assert bootstrap_diff([[x + 5.0 for x in base]], [base]) == (lo, hi)
    assert bootstrap_diff([[1.0]], [base]) is None
