"""kvlens bench's report fits a 120-column terminal: the default table keeps
the columns that decide, ``--wide`` has every figure, and every other line
wraps at spaces (issue 43, item 5). Rows are pooled by the real code from
cells shaped like the demo's (3 variants x 4 cells x 2 rounds, slow cells,
failed and untimed requests, a busy machine)."""

from __future__ import annotations

import numpy as np

from kvlens.bench.cli import add_arguments, options_from_args
from kvlens.bench.grid import BenchOptions
from kvlens.bench.report import WIDTH, format_table, report_text, wrap
from kvlens.bench.results import Cell, RequestResult, Target, summarize_cell
from kvlens.bench.runner import BenchRun

VARIANTS = (("pull", None), ("push", "overlapped"), ("push", "sequential"))


def _results(rng, cell: int, n: int, scale: float) -> tuple[list[RequestResult], dict[str, dict]]:
    results, traces = [], {}
    for i in range(n):
        tid = f"{cell:08x}{i:024x}"
        ttft = float(rng.lognormal(np.log(scale), 0.6))
        ok = i != 3 or cell % 5  # a failed request in some cells
        one_read = i == 2 and cell % 3 == 0  # a request whose tokens all came in one read
        last = ttft if one_read else ttft + 15 * float(rng.uniform(0.005, 0.02))
        results.append(
            RequestResult(
                request_id=tid,
                trace_id=tid,
                kvlens_router=True,
                ok=bool(ok),
                status=200 if ok else 502,
                error=None if ok else "HTTP 502: upstream decode failed: the KV never arrived",
                ttft_s=ttft if ok else None,
                latency_s=last + 0.002,
                last_token_s=last if ok else None,
                output_tokens=16 if ok else None,
                prompt_tokens=256,
            )
        )
        traces[tid] = dict(
            trace_id=tid,
            outcome="ok" if ok else "failed",
            ttft_s=ttft * 0.98 if ok else None,
            handoff_s=ttft * float(rng.uniform(0.1, 0.6)) if ok else None,
        )
    return results, traces


def _run(tmp_path, wide: bool = False) -> BenchRun:
    rng = np.random.default_rng(43)
    opts = BenchOptions(qps=(1.0, 4.0), input_lens=(256, 2048), output_len=16, num_prompts=4, repeat=2, wide=wide)
    run = BenchRun("20261206-231500-abcdef", tmp_path / "traces.db", None, repeat=2, opts=opts)
    k = 0
    for rnd in (1, 2):
        for mode, dispatch in VARIANTS:
            for il in opts.input_lens:
                for q in opts.qps:
                    k += 1
                    scale = (0.065 if il == 256 else 0.3) * (20 if q == 4.0 and il == 2048 else 1)
                    res, tr = _results(rng, k, opts.num_prompts, scale)
                    label = "push/" + dispatch if dispatch else "pull"
                    c = Cell(Target(mode, dispatch, "http://127.0.0.1:8000"), q, il, res, tr, 4.0, round=rnd)
                    c.decode_tpot = (0.4, 45.0) if k % 7 else None
                    c.decode_tpot_note = None if k % 7 else f"D's /metrics unreachable for {label}"
                    busy = k == 5
                    c.machine = dict(
                        cpu_busy=1.9 if busy else 1.1,
                        cpu_stack={"prefill": 0.6, "decode": 0.4, "router": 0.1},
                        cpu_bench=0.05,
                        cpu_outside=0.83 if busy else 0.04,
                        machine_busy=busy,
                        placement="not as asked: decode: worker 7 thread 9 on CPUs [0], asked [1]"
                        if busy
                        else "as asked",
                    )
                    c.row = summarize_cell(c, opts, run.run_id, "off")
                    run.cells.append(c)
    return run


def test_default_report_fits_120_columns(tmp_path):
    run = _run(tmp_path)
    text = report_text(run)
    long = [x for x in text.splitlines() if len(x) > WIDTH]
    assert not long, "\n".join(long)
    table = format_table(run.rows).splitlines()
    # the columns that decide, a two-line header, a row per variant and cell
    assert table[0].split() == [
        "TTFT", "handoff", "TTFT", "p50", "push/pull", "handoff", "p50", "push/pull", "CPU", "wait", "n",
    ]  # fmt: skip
    assert table[1].split()[:6] == ["mode", "dispatch", "input", "QPS", "p50", "ms"]
    assert len(table) == 3 + 12 and set(table[2]) == {"-", " "}
    assert sum("[" in x and "]" in x for x in table[3:]) == 8  # every push row carries its two intervals
    assert max(map(len, table)) <= WIDTH  # with the CPU-wait share (issue 41)
    assert "CPU outside" not in text and "by round" not in text  # behind --wide
    # the lines that used to run long are wrapped, not cut: every word is still there
    flat = " ".join(text.split())
    assert "What this measured:" in flat and "The machine was busy during 1 of 12 rows" in flat
    assert "client: HTTP 502: upstream decode failed: the KV never arrived" in flat
    assert sum(" !" in x for x in table[3:]) == 1  # the busy cell is flagged in the narrow table too
    assert "--wide" in text


def test_wide_report_keeps_every_figure(tmp_path):
    run = _run(tmp_path, wide=True)
    text = report_text(run)
    head = format_table(run.rows, wide=True).splitlines()[0]
    for col in ("TTFT mean ms", "TTFT p99 ms", "TPOT mean ms", "handoff p99 ms", "req/s", "CPU outside"):
        assert col in head, head
    assert "TTFT p50 by round ms" in head and "0.83 !" in text  # the busy cell, flagged
    assert max(map(len, text.splitlines())) > WIDTH  # wide is wide: its table is not wrapped


def test_wrap_keeps_figures_whole_and_indents():
    line = "input 2048 tokens, 1 QPS, push (sequential) vs pull: " + "handoff p50 35.9 ms vs 21.9 ms: " * 5
    line += "pull 39% lower (push/pull 1.63, 95% CI 1.22-2.05)"
    out = wrap(line, width=60).splitlines()
    assert len(out) > 2 and all(len(x) <= 60 for x in out)
    assert out[0].startswith("  input") and all(x.startswith("      ") for x in out[1:])
    assert "1.22-2.05)" in out[-1]
    sub = wrap("  push/overlapped in=256 qps=1: client 12.3 ms, D 11.9 ms (+3.4%)", width=120)
    assert sub.startswith("    push/overlapped")  # a sub-item keeps its own indent


def test_wide_flag_reaches_the_options():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert options_from_args(p.parse_args(["--wide"])).wide
    assert not options_from_args(p.parse_args([])).wide


def test_the_demos_closing_words_fit_too():
    from kvlens.demolive import fit

    text = "== the live verdict ==\n     from the 43 pull requests, had they run push: " + "handoff p50 7.7 ms, " * 12
    out = fit(text).splitlines()
    assert out[0] == "== the live verdict ==" and all(len(x) <= WIDTH for x in out)
    assert out[1].startswith("     from the 43 pull requests, had they run push:") and out[2].startswith("         ")
