"""kvlens bench, pure parts: grid validation, percentile/ratio math, rows,
table and findings, cross-checks, CLI errors before any load."""

import argparse
import json

import numpy as np

from kvtrace import store
from kvtrace.benchrows import ROW_KEYS, add_ratios, ratio
from kvrecord.ids import new_trace_id
import pytest

from kvlens.bench.cli import add_arguments, options_from_args
from kvlens.bench.grid import MODES, BenchError, BenchOptions, parse_list, parse_names, plan_groups, validate_grid
from kvlens.bench.probe import RouterInfo, decode_tpot, parse_tpot, probe_router
from kvlens.bench.prompts import PromptMaker
from kvlens.bench.crosscheck import TTFT_CROSSCHECK_WARN, cross_check
from kvlens.bench.report import describe, format_table
from kvlens.bench.results import Cell, RequestResult, Target, summarize_cell
from kvlens.bench.runner import bench_routers, bench_stacks, new_run
from kvtrace.stats import mean, percentile, rel_diff
from fakes import FakeRouter


# ------------------------------------------------------------ validation
def _grid(**kw):
    base = dict(
        modes=["push", "pull"],
        dispatches=["overlapped"],
        qps=[1.0, 2.0],
        input_lens=[256, 1024],
        output_len=32,
        num_prompts=8,
        max_model_len=4096,
    )
    base.update(kw)
    return base


def test_valid_grid_passes():
    validate_grid(**_grid())
    validate_grid(**_grid(input_lens=[4064], output_len=32))  # exactly 4096


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(qps=[1.0, 0.0]), "QPS must be > 0"),
        (dict(qps=[-2.0]), "QPS must be > 0"),
        (dict(qps=[float("nan")]), "QPS must be > 0"),
        (dict(qps=[]), "no QPS"),
        (dict(input_lens=[4065], output_len=32), "exceeds the model's max-model-len 4096"),
        (dict(input_lens=[0]), "input length must be a positive integer"),
        (dict(output_len=0), "output length"),
        (dict(num_prompts=0), "num-prompts"),
        (dict(modes=["push", "teleport"]), "unknown mode 'teleport'"),
        (dict(modes=[]), "no mode"),
        (dict(dispatches=["sideways"]), "unknown dispatch 'sideways'"),
    ],
)
def test_invalid_grid_names_the_problem(kw, words):
    with pytest.raises(BenchError, match=words.replace("(", r"\(")):
        validate_grid(**_grid(**kw))


def test_parse_lists():
    assert parse_list("1, 2,4", float, "--qps") == [1.0, 2.0, 4.0]
    assert parse_list("256,1024", int, "--input-len") == [256, 1024]
    with pytest.raises(BenchError, match="'1.5' is not an integer"):
        parse_list("1.5", int, "--input-len")
    with pytest.raises(BenchError, match="empty"):
        parse_list(" , ", float, "--qps")
    with pytest.raises(BenchError, match="not a finite"):
        parse_list("inf", float, "--qps")
    assert parse_names("push,PULL,push", MODES, "mode") == ["push", "pull"]
    with pytest.raises(BenchError, match="unknown mode 'x'"):
        parse_names("x", MODES, "mode")


# ------------------------------------------------------------------ math
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    xs = list(np.random.default_rng(3).exponential(0.05, size=37))
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([None, None], 50) is None
    assert percentile([0.3], 99) == 0.3
    assert percentile([1.0, None, 3.0], 50) == 2.0
    assert mean([1.0, None, 2.0]) == 1.5 and mean([]) is None
    assert ratio(1.0, 2.0) == 0.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None
    assert rel_diff(1.02, 1.0) == pytest.approx(0.02)


def _row(mode, dispatch, il, q, ttft, handoff, **kw):
    r = dict(
        mode=mode,
        dispatch=dispatch,
        input_len=il,
        output_len=16,
        qps=q,
        num_prompts=8,
        completed=8,
        failed=0,
        ttft_mean_s=ttft,
        ttft_p50_s=ttft,
        ttft_p99_s=ttft * 2,
        tpot_mean_s=0.01,
        handoff_p50_s=handoff,
        handoff_p99_s=handoff and handoff * 2,
        req_per_s=q,
    )
    r.update(kw)
    return r


def test_ratios_each_push_dispatch_vs_pull():
    rows = [
        _row("pull", None, 256, 1.0, 0.100, 0.020),
        _row("push", "overlapped", 256, 1.0, 0.080, 0.005),
        _row("push", "sequential", 256, 1.0, 0.120, 0.010),
        _row("push", "overlapped", 1024, 1.0, 0.2, 0.01),  # no pull for this cell
    ]
    add_ratios(rows)
    assert rows[0]["ttft_p50_push_over_pull"] is None  # pull rows carry none
    assert rows[1]["ttft_p50_push_over_pull"] == pytest.approx(0.8)
    assert rows[1]["handoff_p50_push_over_pull"] == pytest.approx(0.25)
    assert rows[2]["ttft_p50_push_over_pull"] == pytest.approx(1.2)
    assert rows[3]["ttft_p50_push_over_pull"] is None


def _ci(lo_t, hi_t, lo_h=None, hi_h=None):
    return dict(
        rounds=1,
        ttft_p50_push_over_pull_lo=lo_t,
        ttft_p50_push_over_pull_hi=hi_t,
        handoff_p50_push_over_pull_lo=lo_h,
        handoff_p50_push_over_pull_hi=hi_h,
    )


def test_table_and_findings():
    rows = add_ratios(
        [
            _row("pull", None, 256, 1.0, 0.100, 0.020, **_ci(None, None)),
            _row("push", "overlapped", 256, 1.0, 0.080, 0.005, **_ci(0.7, 0.9, 0.2, 0.3)),
            _row("push", "sequential", 256, 1.0, 0.101, None, **_ci(0.9, 1.1)),
        ]
    )
    t = format_table(rows, wide=True).splitlines()
    assert t[0].split()[:4] == ["mode", "dispatch", "input", "QPS"]
    assert "TTFT p50 push/pull [95% CI]" in t[0] and "handoff p50 push/pull [95% CI]" in t[0]
    assert "rounds" not in t[0]  # one round: no per-round columns
    body = t[2:]
    assert [b.split()[:2] for b in body] == [["push", "overlapped"], ["push", "sequential"], ["pull", "-"]]
    assert "80.0" in body[0] and "0.80 [0.70-0.90]" in body[0] and "0.25 [0.20-0.30]" in body[0]
    assert body[1].rstrip().endswith("-")  # handoff ratio missing -> "-"
    words = describe(rows)
    assert any(
        "push (overlapped) vs pull" in w
        and "push 20% lower (push/pull 0.80, 95% CI 0.70-0.90)" in w
        and "push 75% lower" in w
        for w in words
    )
    assert any(
        "push (sequential)" in w and "no resolvable difference (push/pull 1.01, 95% CI 0.90-1.10)" in w for w in words
    )
    assert any(
        w.startswith("Overall, push (overlapped) vs pull on TTFT p50 over 1 cells: push lower in 1 ") for w in words
    )
    assert any(
        w.startswith("Overall, push (sequential) vs pull on TTFT p50 over 1 cells: no resolvable difference in 1 ")
        for w in words
    )
    assert not any("lower in" in w for w in words if "(sequential)" in w)  # never a winner inside the interval
    assert format_table([]) == "(no rows)"
    assert "nothing to compare" in describe([_row("pull", None, 256, 1.0, 0.1, 0.01)])[0]


def test_pull_wins_wording():
    rows = add_ratios(
        [
            _row("pull", None, 256, 2.0, 0.100, 0.010, **_ci(None, None)),
            _row("push", "overlapped", 256, 2.0, 0.125, 0.02, **_ci(1.1, 1.4, 1.5, 2.5)),
        ]
    )
    (cell, *_rest) = describe(rows)
    assert "pull 20% lower" in cell and "pull 50% lower" in cell


def test_rows_without_intervals_get_no_verdict():
    """Rows saved before intervals existed: the ratio, but no winner."""
    rows = add_ratios([_row("pull", None, 256, 2.0, 0.100, 0.010), _row("push", "overlapped", 256, 2.0, 0.05, 0.02)])
    (cell, *_rest) = describe(rows)
    assert "push/pull 0.50, no interval recorded, so no verdict" in cell and "lower" not in cell
    body = format_table(rows, wide=True).splitlines()[2]
    assert "0.50" in body and "[" not in body


# ------------------------------------------------------ rows, cross-checks
def _res(rid, ok=True, ttft=0.05, lat=0.2, last=0.15, n=16, error=None):
    return RequestResult(
        request_id=rid,
        ok=ok,
        status=200 if ok else 502,
        error=error,
        send_s=0.0,
        ttft_s=ttft if ok else None,
        latency_s=lat,
        last_token_s=last if ok else None,
        output_tokens=n if ok else None,
        prompt_tokens=256,
    )


def test_summarize_cell_and_cross_check():
    results = [_res("a" * 32, ttft=0.050), _res("b" * 32, ttft=0.070), _res("c" * 32, ok=False, error="HTTP 502: boom")]
    traces = {
        "a" * 32: dict(trace_id="a" * 32, outcome="ok", ttft_s=0.049, handoff_s=0.004),
        "b" * 32: dict(trace_id="b" * 32, outcome="ok", ttft_s=0.070, handoff_s=0.006),
        "c" * 32: dict(trace_id="c" * 32, outcome="failed", ttft_s=None, handoff_s=None),
    }
    cell = Cell(Target("push", "overlapped", "http://x"), 2.0, 256, results, traces, duration_s=1.0)
    row = summarize_cell(cell, BenchOptions(output_len=16), "run1", "off")
    assert set(ROW_KEYS) <= set(row)
    assert (row["completed"], row["failed"], row["num_prompts"]) == (2, 1, 3)
    assert row["ttft_p50_s"] == pytest.approx(0.06) and row["ttft_mean_s"] == pytest.approx(0.06)
    assert row["handoff_p50_s"] == pytest.approx(0.005) and row["handoff_n"] == 2
    assert row["tpot_mean_s"] == pytest.approx(((0.15 - 0.05) + (0.15 - 0.07)) / 2 / 15)
    assert row["req_per_s"] == pytest.approx(2.0)
    assert row["failed_outcomes"] == {"failed": 1}
    json.dumps(row)
    cc = cross_check([cell])
    assert cc.n_compared == 2 and cc.completed == 2 and cc.ok_traces_in_store == 2 and cc.traces_in_store == 3
    assert cc.ttft_rel_diff_p50 == pytest.approx((0.001 / 0.049) / 2)
    assert cc.failed == [("push/overlapped", "c" * 32, "HTTP 502: boom", "failed")]
    text = "\n".join(cc.lines())
    assert "match" in text and "failed requests (1)" in text and "WARNING" not in text.split("failed requests")[0]
    assert TTFT_CROSSCHECK_WARN == 0.02


def test_cross_check_warns_and_counts_missing():
    cell = Cell(
        Target("pull", None, "http://x"),
        1.0,
        256,
        [_res("d" * 32, ttft=0.060)],
        {"d" * 32: dict(trace_id="d" * 32, outcome="ok", ttft_s=0.050, handoff_s=None)},
        1.0,
    )
    cc = cross_check([cell])
    assert cc.ttft_warn and cc.handoff_missing == 1
    assert any(line.startswith("WARNING: client and router TTFT") for line in cc.lines())


def test_request_ids_are_trace_ids():
    ids = {new_trace_id() for _ in range(100)}  # what the load generator sends as X-Request-Id
    assert len(ids) == 100 and all(len(i) == 32 and int(i, 16) and i == i.lower() for i in ids)


def test_plan_groups_runs_pull_first():
    assert plan_groups(["push", "pull"], ["overlapped", "sequential"]) == [
        ("pull", [None]),
        ("push", ["overlapped", "sequential"]),
    ]
    assert plan_groups(["push"], ["sequential"]) == [("push", ["sequential"])]


def test_prompts_have_exact_token_counts(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog 12345"] * 50, tr)
    tok.save(str(tmp_path / "tokenizer.json"))
    maker = PromptMaker(tmp_path)
    rng = np.random.default_rng(0)
    for n in (1, 17, 256, 1000):
        p = maker.make(n, rng)
        assert len(tok.encode(p, add_special_tokens=False).ids) == n


# ------------------------------------------------------------------- CLI
def _cli(*argv):
    from kvlens.cli import main

    return main(["bench", *argv])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--qps", "0"], "QPS must be > 0"),
        (["--qps", "1,fast"], "'fast' is not a number"),
        (["--input-len", "4090", "--output-len", "32"], "exceeds the model's max-model-len 4096"),
        (["--modes", "push,teleport"], "unknown mode 'teleport'"),
        (["--dispatch", "sideways"], "unknown dispatch"),
        (["--proxy", "http://127.0.0.1:9"], "router at http://127.0.0.1:9 is unreachable"),
        (["--proxy", "localhost:8000"], "must be an http(s) URL"),
        (["--num-prompts", "0"], "num-prompts"),
    ],
)
def test_cli_bad_input_exits_2_before_load(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_HOME", str(tmp_path))
    assert _cli(*argv) == 2
    err = capsys.readouterr().err
    assert "kvlens bench: error:" in err and words in err
    assert not (tmp_path / "model").exists()  # nothing generated, nothing started


def test_cli_proxy_mode_conflict(monkeypatch, capsys):
    monkeypatch.setattr(
        "kvlens.bench.cli.probe_router", lambda url, api_key=None: RouterInfo(url, "pull", None, "m", None, 4096)
    )
    assert _cli("--proxy", "http://127.0.0.1:1", "--modes", "push") == 2
    assert "serves pull, but --modes says push" in capsys.readouterr().err


def test_demo_has_no_dashboard_flag():
    from kvlens import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    a = p.parse_args(["--no-dashboard"])
    assert a.no_dashboard and options_from_args(a).num_prompts == demo.DEMO_NUM_PROMPTS


# ---------------------------- load generator on a fake router (tests/fakes.py)
@pytest.fixture
def tiny_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["push pull prefill decode handoff 0123456789"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    d = tmp_path / "model"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return d


def _opts(tmp_path, model, **kw):
    base = dict(
        qps=[50.0],
        input_lens=[16, 32],
        output_len=3,
        num_prompts=6,
        seed=1,
        warmup=1,
        trace_wait_s=3.0,
        store=tmp_path / "h" / "traces.db",
        json_path=tmp_path / "rows.jsonl",
        progress=False,
        model=model,
    )
    base.update(kw)
    return BenchOptions(**base)


def test_generator_joins_router_traces(tmp_path, tiny_tokenizer_dir):
    opts = _opts(tmp_path, tiny_tokenizer_dir)
    opts.store.parent.mkdir()
    with FakeRouter(opts.store, "pull", fail_every=5) as pull, FakeRouter(opts.store, "push", "sequential") as push:
        run = bench_routers([push.url, pull.url], opts)
    # cells in turn, pull before push inside each cell (so push rows get their ratio)
    assert [(r["mode"], r["input_len"]) for r in run.rows] == [("pull", 16), ("push", 16), ("pull", 32), ("push", 32)]
    for r in run.rows:
        assert r["completed"] + r["failed"] == 6 and r["output_tokens_mean"] == 3
        assert r["handoff_p50_s"] == pytest.approx(FakeRouter.HANDOFF_NS / 1e9)
        assert r["traces_in_store"] == 6 and r["handoff_n"] == r["completed"]
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["e2e_p99_s"]
    pulls = [r for r in run.rows if r["mode"] == "pull"]
    assert sum(r["failed"] for r in pulls) >= 2 and all(set(r["failed_outcomes"]) <= {"timeout"} for r in pulls)
    assert all(
        r["dispatch"] == "sequential" and r["ttft_p50_push_over_pull"] is not None
        for r in run.rows
        if r["mode"] == "push"
    )
    cc = cross_check(run.cells)
    assert cc.completed == cc.ok_traces_in_store and cc.n_compared == cc.completed
    assert {f[3] for f in cc.failed} == {"timeout"} and all("HTTP 504" in f[2] for f in cc.failed)
    # written as each cell finished: store and JSON agree, push rows with their ratio
    conn = store.connect(opts.store, readonly=True)
    saved = store.bench_rows(conn, run.run_id)
    conn.close()
    assert [s["ttft_p50_push_over_pull"] for s in saved] == [r["ttft_p50_push_over_pull"] for r in run.rows]
    assert len(opts.json_path.read_text().splitlines()) == 4


def test_grid_over_router_max_len_refused_before_load(tmp_path, tiny_tokenizer_dir):
    opts = _opts(tmp_path, tiny_tokenizer_dir, input_lens=[1020], output_len=8)
    opts.store.parent.mkdir()
    with FakeRouter(opts.store) as r:
        with pytest.raises(BenchError, match="max-model-len 1024"):
            bench_routers([r.url], opts)
        assert r.n == 0


def test_ctrl_c_stops_the_stack_and_keeps_finished_rows(tmp_path, tiny_tokenizer_dir):
    import os
    import signal

    opts = _opts(tmp_path, tiny_tokenizer_dir, warmup=0)
    stopped = []

    def interrupt(n):  # during the second cell
        if n == 8:
            os.kill(os.getpid(), signal.SIGINT)
            return True
        return False

    with FakeRouter(opts.store, "pull", on_request=interrupt) as fake:

        class FakeStack:
            def __init__(self, **kw):
                self.kw, self.router_url = kw, fake.url

            def start(self):
                assert "--no-enable-prefix-caching" in self.kw["vllm_args"]

            def add_router(self, d):
                raise AssertionError("pull has one router")

            def stop(self):
                stopped.append(True)

        run = new_run(opts)
        # a shell starts background jobs with SIGINT ignored, and Python then
        # installs no handler: put Ctrl-C's usual handler in place for this test
        old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.raises(KeyboardInterrupt):
                bench_stacks(["pull"], ["overlapped"], opts, run=run, stack_factory=FakeStack)
        finally:
            signal.signal(signal.SIGINT, old_handler)
    assert stopped == [True]
    assert len(run.rows) == 1 and run.rows[0]["input_len"] == 16
    conn = store.connect(opts.store, readonly=True)
    assert len(store.bench_rows(conn, run.run_id)) == 1
    conn.close()


# ------------------------------- issue 12: the bench says when it cannot measure
def test_tokens_in_one_read_have_no_tpot():
    apart = _res("a" * 32, ttft=0.05, last=0.15, n=16)
    apart.text_reads = 16
    together = _res("b" * 32, ttft=0.05, last=0.05, n=16)  # first and last token: one timestamp
    one_read = _res("c" * 32, ttft=0.05, last=0.0501, n=16)
    one_read.text_reads = 1  # a hair apart, but only because parsing one read took time
    single = _res("d" * 32, n=1, last=0.05)
    assert apart.tpot_s == pytest.approx(0.1 / 15) and not apart.tpot_untimed
    for r in (together, one_read):
        assert r.tpot_s is None and r.tpot_untimed
    assert single.tpot_s is None and not single.tpot_untimed  # 1 token: no TPOT to time
    assert _res("e" * 32, ok=False).tpot_s is None and not _res("e" * 32, ok=False).tpot_untimed


def _cell(results, decode=None, note=None):
    c = Cell(Target("push", "overlapped", "http://x"), 2.0, 256, results, {}, duration_s=1.0)
    c.decode_tpot, c.decode_tpot_note = decode, note
    return c


def test_row_counts_untimed_and_reports_unknown_with_the_reason():
    opts = BenchOptions(output_len=16)
    untimed = [_res(f"{i:032x}", ttft=0.05, last=0.05) for i in range(3)]
    row = summarize_cell(_cell(untimed, decode=(0.03, 3.0)), opts, "run1", "off")
    assert "tpot_untimed" in ROW_KEYS
    assert row["tpot_mean_s"] is None and row["tpot_untimed"] == 3  # never 0.0
    assert "all 3 completed requests' tokens reached the client in one read" in row["tpot_note"]
    assert row["tpot_decode_mean_s"] == pytest.approx(0.01) and row["tpot_decode_n"] == 3  # D still measured it
    assert row["tpot_client_vs_decode_rel_diff"] is None
    assert "untimed" in format_table([row], wide=True).splitlines()[2]  # not "-", not 0.0
    mixed = untimed[:1] + [_res("f" * 32, ttft=0.05, last=0.20)]
    row = summarize_cell(_cell(mixed, decode=(0.02, 2.0)), opts, "run1", "off")
    assert row["tpot_mean_s"] == pytest.approx(0.01) and row["tpot_untimed"] == 1
    assert "from 1 requests; 1 not timed" in row["tpot_note"]
    assert row["tpot_client_vs_decode_rel_diff"] == pytest.approx(0.0)
    row = summarize_cell(_cell(mixed[1:], note="D's URL is not known"), opts, "run1", "off")
    assert row["tpot_untimed"] == 0 and row["tpot_note"] is None and row["tpot_decode_mean_s"] is None
    assert row["tpot_decode_note"] == "D's URL is not known"
    cc = cross_check([_cell(untimed, decode=(0.03, 3.0)), _cell(mixed, decode=(0.022, 2.0))])
    text = "\n".join(cc.lines())
    assert cc.tpot_untimed == 4 and "WARNING: 4 completed requests could not be timed for TPOT" in text
    assert "vllm:request_time_per_output_token_seconds" in text and "median relative difference 9.09%" in text
    assert "client unknown, D 10.0 ms; client TPOT unknown: all 3" in text
    assert "client 10.0 ms, D 11.0 ms (-9.1%)" in text


def test_decode_tpot_histogram_parsing():
    text = (
        "# TYPE vllm:request_time_per_output_token_seconds histogram\n"
        'vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf"} 3.0\n'
        'vllm:request_time_per_output_token_seconds_count{engine="0"} 3.0\n'
        'vllm:request_time_per_output_token_seconds_sum{engine="0"} 0.03\n'
        'vllm:request_time_per_output_token_seconds_count{engine="1"} 1.0\n'
        'vllm:request_time_per_output_token_seconds_sum{engine="1"} 0.02\n'
        "# TYPE vllm:time_per_output_token_seconds histogram\n"
        "vllm:time_per_output_token_seconds_count 99.0\nvllm:time_per_output_token_seconds_sum 9.0\n"
    )
    assert parse_tpot(text) == pytest.approx((0.05, 4.0))  # summed over engines, newest name first
    assert parse_tpot(
        "vllm:time_per_output_token_seconds_count 2\nvllm:time_per_output_token_seconds_sum 1\n"
    ) == pytest.approx((1.0, 2.0))  # the older name
    assert parse_tpot("other_metric 1\n") is None
    assert decode_tpot(None) == (None, "D's URL is not known (kvlens bench --decode-url URL): not cross-checked")
    got, why = decode_tpot("http://127.0.0.1:9")
    assert got is None and "unreachable" in why


@pytest.mark.parametrize("one_chunk", [True, False], ids=["all-tokens-in-one-read", "tokens-apart"])
def test_bench_detects_tokens_that_arrive_together(tmp_path, tiny_tokenizer_dir, one_chunk):
    """A router that delivers a whole answer in one write: TPOT None (never
    0), every request counted untimed, D's own figure still reported."""
    opts = _opts(tmp_path, tiny_tokenizer_dir, input_lens=[16], output_len=4, num_prompts=4, warmup=1)
    opts.store.parent.mkdir()
    # tokens 0.1 s apart: a busy machine may still join two in one read (at least two reads each)
    with FakeRouter(opts.store, "pull", one_chunk=one_chunk, token_gap_s=0.1) as fake:
        run = bench_routers([Target("pull", None, fake.url, decode_url=fake.url)], opts)
    (row,) = run.rows
    assert row["completed"] == 4 and row["tpot_decode_mean_s"] == pytest.approx(FakeRouter.D_TPOT_S)
    assert row["tpot_decode_n"] == 4  # the cell's requests only, not the warm-up
    if one_chunk:
        assert row["tpot_mean_s"] is None and row["tpot_untimed"] == 4 and "one read" in row["tpot_note"]
        assert all(r.text_reads == 1 for r in run.cells[0].results)
        assert row["tpot_client_vs_decode_rel_diff"] is None
    else:
        assert row["tpot_untimed"] == 0 and row["tpot_note"] is None
        assert row["tpot_mean_s"] > 0.02 and row["tpot_client_vs_decode_rel_diff"] is not None
        assert all(2 <= r.text_reads <= 4 for r in run.cells[0].results)
    saved = json.loads(opts.json_path.read_text())
    assert saved["tpot_untimed"] == row["tpot_untimed"] and saved["tpot_mean_s"] == row["tpot_mean_s"]


def test_bench_sends_the_api_key(tmp_path, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.delenv("KVLENS_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-bench")
    opts = _opts(tmp_path, tiny_tokenizer_dir, input_lens=[16], output_len=2, num_prompts=2, warmup=1)
    opts.store.parent.mkdir()
    with FakeRouter(opts.store, "pull", api_key="sk-bench") as fake:
        p = argparse.ArgumentParser()
        add_arguments(p)
        opts.api_key = options_from_args(p.parse_args([])).api_key  # from the environment
        run = bench_routers([fake.url], opts)
        assert probe_router(fake.url).model is None  # /v1/models without the key: refused
    assert run.rows[0]["completed"] == 2
    assert set(fake.auth_seen[:-1]) == {"Bearer sk-bench"}
    args = p.parse_args(["--api-key", "sk-flag", "--proxy", "http://x:1", "--decode-url", "http://d:2/"])
    o = options_from_args(args)
    assert (o.api_key, o.decode_url) == ("sk-flag", "http://d:2") and "sk-flag" not in repr(o)


def test_demo_live_load_is_gentle_bounded_and_stops():
    """The live part's load: one request at a time through the router (its
    key as a bearer token, a fresh request id each), counted, and stopped
    at once (it waits on an event, not a sleep)."""
    from fakes import FakeVllm, p_fails, p_ok, wait_for

    from kvlens.demo import GentleLoad

    for answer, field in ((p_ok, "ok"), (p_fails, "failed")):
        fake = FakeVllm(answer)
        try:
            load = GentleLoad(fake.url, "sk-demo", interval_s=0.05)
            load.start()
            wait_for(lambda: getattr(load, field) >= 3)
            load.stop(timeout_s=10)
            assert not load.is_alive()
            n = len(fake.requests)
            assert n >= 3 and {r["path"] for r in fake.requests} == {"/v1/completions"}
            assert {r["headers"]["Authorization"] for r in fake.requests} == {"Bearer sk-demo"}
            assert len({r["headers"]["X-Request-Id"] for r in fake.requests}) == n
            assert load.ok + load.failed == n and getattr(load, field) == n
        finally:
            fake.close()
