"""End-to-end: ``kvlens bench`` on the session's shared real stacks (a small
grid, push overlapped + sequential and pull). ``kvlens demo`` has its own
module (tests/e2e/test_e2e_demo.py).

The shared stacks come from ``tests/conftest.py`` (one alive at a time), so
the bench is pointed at their routers (``bench_routers`` / ``--proxy``)
instead of starting its own. Pull runs first: push rows then carry their
push/pull ratios when they are written.
"""

from __future__ import annotations

import json

import pytest

from kvtrace import store
from kvtrace.benchrows import ROW_KEYS
from kvrecord.ids import new_trace_id
from kvlens.bench.grid import BenchOptions
from kvlens.bench.report import describe, print_report
from kvlens.bench.runner import bench_routers, new_run
from conftest import PULL_STACK_KW

pytestmark = pytest.mark.e2e

QPS = [2.0, 6.0]
INPUT_LENS = [64, 512]
OUTPUT_LEN = 4
NUM_PROMPTS = 4


def _store_path(stack) -> store.StoreLocation:
    return stack.store


def _sequential_url(stack) -> str:
    return stack.sequential_router_url


@pytest.fixture(scope="module")
def grid_run(stack_factory, tmp_path_factory):
    """One bench run over pull, then push (overlapped + sequential): pull runs
    first (a push row's ratio and interval need its cell's pull row), on the
    pull pair still up from the tests before (conftest's _STACK_ORDER); the
    push pair it starts is the push_stack fixture's, used by the tests after."""
    out = tmp_path_factory.mktemp("bench")
    pull = stack_factory.get("pull", **PULL_STACK_KW)  # the pull_stack fixture's pair
    opts = BenchOptions(
        qps=QPS,
        input_lens=INPUT_LENS,
        output_len=OUTPUT_LEN,
        num_prompts=NUM_PROMPTS,
        seed=int.from_bytes(new_trace_id()[:8].encode(), "big") % 10_000,  # fresh prompts: shared stacks cache prefixes
        warmup=1,
        trace_wait_s=60.0,
        store=_store_path(pull),
        json_path=out / "rows.jsonl",
        progress=False,
    )
    run = new_run(opts)
    bench_routers([pull.router_url], opts, run=run)
    push = stack_factory.get("push")
    bench_routers([push.router_url, _sequential_url(push)], opts, run=run)
    return run


def test_every_row_present_and_sane(grid_run):
    rows = grid_run.rows
    variants = {("pull", None), ("push", "overlapped"), ("push", "sequential")}
    got = {(r["mode"], r["dispatch"], r["input_len"], r["qps"]) for r in rows}
    assert got == {(m, d, il, q) for m, d in variants for il in INPUT_LENS for q in QPS}
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert r["completed"] + r["failed"] == r["num_prompts"] == NUM_PROMPTS, r
        assert r["completed"] > 0 and r["output_len"] == OUTPUT_LEN
        for k in (
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "handoff_p50_s",
            "handoff_p99_s",
            "req_per_s",
            "e2e_p50_s",
        ):
            assert r[k] is not None and r[k] > 0, (k, r)
        # TPOT: a number only from requests whose tokens arrived apart; the
        # row counts the rest (a starved host can deliver all tokens at once)
        assert 0 <= r["tpot_untimed"] <= r["completed"], r
        if r["tpot_untimed"] < r["completed"]:
            assert r["tpot_mean_s"] is not None and r["tpot_mean_s"] > 0, r
        else:
            assert r["tpot_mean_s"] is None and r["tpot_note"], r
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["handoff_p50_s"] <= r["handoff_p99_s"]
        assert r["ttft_p50_s"] <= r["e2e_p50_s"]
        assert r["handoff_p50_s"] < r["e2e_p99_s"]  # the handoff is part of the request
        assert r["output_tokens_mean"] == OUTPUT_LEN  # ignore_eos: exactly output_len tokens
        # what the machine did: routers given by URL, so the stack's processes are not known
        assert r["cpu_busy"] > 0 and r["cpu_not_bench"] is not None and r["cpu_stack"] is None, r
        # prompts of input_len tokens (decode/encode round trips can miss by one)
        assert abs(r["prompt_tokens_mean"] - r["input_len"]) <= 1
        assert r["handoff_n"] == r["completed"] and r["traces_in_store"] == r["num_prompts"]


def test_ratios_computed_from_rows(grid_run):
    rows = grid_run.rows
    pull = {(r["input_len"], r["qps"]): r for r in rows if r["mode"] == "pull"}
    for r in rows:
        if r["mode"] == "pull":
            assert r["ttft_p50_push_over_pull"] is None
            continue
        p = pull[(r["input_len"], r["qps"])]
        assert r["ttft_p50_push_over_pull"] == pytest.approx(r["ttft_p50_s"] / p["ttft_p50_s"])
        assert r["handoff_p50_push_over_pull"] == pytest.approx(r["handoff_p50_s"] / p["handoff_p50_s"])
    words = describe(rows)
    assert any(w.startswith("Overall, push (overlapped)") for w in words)
    assert any(w.startswith("Overall, push (sequential)") for w in words)


def test_rows_readable_from_store_and_json(grid_run):
    conn = store.connect(grid_run.store, readonly=True)
    try:
        saved = store.bench_rows(conn, grid_run.run_id)
    finally:
        conn.close()
    assert len(saved) == len(grid_run.rows) == 12
    key = lambda r: (r["mode"], r["dispatch"] or "", r["input_len"], r["qps"])  # noqa: E731
    for s, r in zip(sorted(saved, key=key), sorted(grid_run.rows, key=key)):
        for k in ROW_KEYS:
            assert s[k] == pytest.approx(r[k]) if isinstance(r[k], float) else s[k] == r[k]
        assert s["ttft_p50_push_over_pull"] == r["ttft_p50_push_over_pull"]  # written with the ratio
    lines = grid_run.json_path.read_text().splitlines()
    assert len(lines) == 12
    for line in lines:
        obj = json.loads(line)
        assert set(ROW_KEYS) <= set(obj)


def test_cross_checks_hold(grid_run, capsys):
    cc = print_report(grid_run)
    out = capsys.readouterr().out
    assert "client TTFT vs router span TTFT" in out and "push/pull" in out
    assert cc.completed == cc.ok_traces_in_store  # completed requests = ok traces of the run
    assert cc.traces_in_store == cc.sent == 12 * NUM_PROMPTS
    assert cc.handoff_missing == 0
    assert cc.n_compared == cc.completed
    # the router is one local hop from the client: its TTFT is close to ours
    assert cc.ttft_rel_diff_p50 < 0.25
    assert cc.ttft_diff_p50_s > -0.005  # the client cannot see the first token before the router sends it


def test_cli_bench_on_running_router(push_stack, tmp_path, capsys):
    from kvlens.cli import main

    push = push_stack
    jp = tmp_path / "one.jsonl"
    rc = main(
        [
            "bench",
            "--proxy",
            push.router_url,
            "--qps",
            "4",
            "--input-len",
            "128",
            "--output-len",
            "3",
            "--num-prompts",
            "3",
            "--warmup",
            "0",
            "--store",
            _store_path(push).text,
            "--json",
            str(jp),
            "--seed",
            "4242",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    (row,) = [json.loads(x) for x in jp.read_text().splitlines()]
    assert (row["mode"], row["dispatch"], row["completed"] + row["failed"]) == ("push", "overlapped", 3)
    assert "mode" in out and "completed requests" in out
    # --modes contradicting the router: refused before any load
    assert main(["bench", "--proxy", push.router_url, "--modes", "pull"]) == 2
    assert "serves push" in capsys.readouterr().err
