"""The live verdict (issue 31): the stratified bootstrap of a push/pull ratio
on figures with a known answer (coverage of a true ratio of 1, a ratio of 2
resolved, a shift of the prompt-length mix that must not pass for a
difference), the verdict over requests, and ``kvlens verdict`` on both
store backends with its exit codes."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvlens.cli import main
from kvtrace import stats
from kvtrace import verdict as v


def _lognormal(gen, median: float, n: int):
    return list(gen.lognormal(np.log(median), 0.5, n))


# ------------------------------------------------------------------ the bootstrap
def test_a_true_ratio_of_1_is_no_resolvable_difference_in_about_95_percent_of_seeds():
    """200 fixed seeds (never flaky): two strata with different medians and a
    different mix on each side, the same distribution per stratum on both."""
    hits = 0
    for seed in range(200):
        gen = np.random.default_rng(1000 + seed)
        num = {"short": _lognormal(gen, 0.1, 100), "long": _lognormal(gen, 0.4, 150)}
        den = {"short": _lognormal(gen, 0.1, 150), "long": _lognormal(gen, 0.4, 100)}
        r = stats.stratified_ratio(num, den, q=50, seed=seed, resamples=1000)
        hits += r.status == stats.NO_DIFFERENCE
    assert 0.90 <= hits / 200 <= 0.99, hits  # measured: 0.98 (the median's percentile bootstrap is conservative)


def test_a_ratio_of_2_is_resolved_and_its_interval_holds_2():
    gen = np.random.default_rng(5)
    num = {"a": _lognormal(gen, 0.2, 80), "b": _lognormal(gen, 0.8, 80)}
    den = {"a": _lognormal(gen, 0.1, 80), "b": _lognormal(gen, 0.4, 80)}
    for q in (50, 90):
        r = stats.stratified_ratio(num, den, q=q)
        assert r.status == stats.RESOLVED and r.lo > 1
        assert r.lo <= 2 <= r.hi and 1.6 < r.ratio < 2.5


def test_a_shift_of_the_mix_does_not_pass_for_a_difference():
    """Simpson: push is 1.5x slower in each bucket but sees mostly short
    prompts, pull mostly long ones. Pooled naively push looks faster; like
    with like it is slower, by 1.5."""
    gen = np.random.default_rng(9)
    push = {"short": _lognormal(gen, 0.15, 270), "long": _lognormal(gen, 1.5, 30)}
    pull = {"short": _lognormal(gen, 0.10, 30), "long": _lognormal(gen, 1.0, 270)}
    naive = stats.percentile([*push["short"], *push["long"]], 50) / stats.percentile(
        [*pull["short"], *pull["long"]], 50
    )
    assert naive < 0.3  # the mix speaks, not the modes
    r = stats.stratified_ratio(push, pull, q=50)
    assert r.status == stats.RESOLVED and r.lo > 1 and r.lo <= 1.5 <= r.hi
    assert [s.weight for s in r.strata] == [0.5, 0.5]  # each stratum's share of both sides together


def test_below_the_minimum_a_stratum_does_not_count_and_none_is_not_enough_data():
    gen = np.random.default_rng(1)
    few = stats.MIN_PER_STRATUM - 1
    r = stats.stratified_ratio({"a": _lognormal(gen, 1, few)}, {"a": _lognormal(gen, 1, 50)})
    assert r.status == stats.NOT_ENOUGH and r.lo is None and str(stats.MIN_PER_STRATUM) in r.note
    r = stats.stratified_ratio(
        {"a": _lognormal(gen, 1, 50), "b": _lognormal(gen, 1, few)}, {"a": _lognormal(gen, 1, 50), "b": [1.0] * 50}
    )
    assert [(s.name, s.weight) for s in r.strata] == [("a", 1.0), ("b", 0.0)]
    assert r.to_json()["strata"][1] == {"name": "b", "n_num": few, "n_den": 50, "weight": 0.0, "ratio": None}


def test_the_same_figures_give_the_same_interval():
    gen = np.random.default_rng(2)
    num, den = {"a": _lognormal(gen, 1, 40)}, {"a": _lognormal(gen, 1, 40)}
    assert stats.stratified_ratio(num, den) == stats.stratified_ratio(num, den)


# ------------------------------------------------------------------ the verdict
def test_buckets_are_named_by_their_prompt_lengths():
    assert [v.bucket_of(t) for t in (1, 512, 513, 2048, 2049, 8192, 8193, None)] == [
        "<=512 tokens",
        "<=512 tokens",
        "513-2048",
        "513-2048",
        "2049-8192",
        "2049-8192",
        ">8192",
        v.UNKNOWN_LENGTH,
    ]
    assert v.bucket_names() == ["<=512 tokens", "513-2048", "2049-8192", ">8192", v.UNKNOWN_LENGTH]


def _req(i: int, mode: str, ttft: float, tokens: int | None = 300, split: float | None = None) -> v.Request:
    return v.Request(f"{mode}{i}", mode, None, "ok", i, tokens, split, ttft, ttft / 10, None)


def test_one_mode_only_needs_both_modes():
    out = v.compute([_req(i, "pull", 0.1) for i in range(30)])
    assert out.status == v.NEEDS_BOTH and "only pull requests (30)" in out.message and not out.ratios
    assert "vllm-router is pull only" in v.text(out, "1h")


def test_split_assigned_requests_are_used_alone_where_there_are_some():
    gen = np.random.default_rng(3)
    canary = [_req(i, m, t, split=0.5) for m in ("push", "pull") for i, t in enumerate(_lognormal(gen, 0.2, 20))]
    bench = [_req(100 + i, "push", 5.0) for i in range(40)]  # a benchmark's slow push run, same window
    out = v.compute(canary + bench)
    assert out.selection == "split" and out.used == 40 and out.left_out == 40
    assert out.ratios["ttft_p50"].status != stats.NOT_ENOUGH and out.ratios["ttft_p50"].hi < 3
    assert out.counts["push"]["<=512 tokens"] == 20
    tpot = out.ratios["tpot_p50"]
    assert tpot.status == stats.NOT_ENOUGH and "kvlens.tpot_s" in tpot.note
    assert v.compute(bench + [_req(i, "pull", 0.2) for i in range(20)]).selection == "all"


# ------------------------------------------------------------------ the command
@pytest.fixture
def synthetic(backend):
    from synthetic_store import build

    build(backend.store, backend.config(), time.time_ns() - 300 * 10**9, n_per_mode=48, span_s=240.0)
    return backend


def test_verdict_json_has_ratios_intervals_and_counts_on_both_backends(synthetic, capsys):
    assert main(["verdict", "--store", str(synthetic.store), "--window", "1h", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["selection"] == "all" and out["window"] == "1h"
    assert set(out["ratios"]) == {"ttft_p50", "ttft_p90", "handoff_p50", "tpot_p50", "handoff_nowait_p50"}
    # the synthetic spans carry no CPU figures: unknown with the reason, never a ratio of made-up figures
    nowait = out["ratios"]["handoff_nowait_p50"]
    assert nowait["status"] == stats.NOT_ENOUGH and "CPU figures" in nowait["note"]
    assert out["handoff_cpu_wait_share_p50"] == {"push": None, "pull": None} and out["cpu_words"] is None
    handoff = out["ratios"]["handoff_p50"]
    assert handoff["status"] in (stats.RESOLVED, stats.NO_DIFFERENCE)
    assert handoff["interval"][0] <= handoff["ratio"] <= handoff["interval"][1]
    assert sum(out["counts"]["push"].values()) == 48 and sum(out["counts"]["pull"].values()) == 48
    assert out["counts"]["push"][">8192"] == 0 and out["buckets"][0] == "<=512 tokens"


def test_verdict_text_names_the_buckets(synthetic, capsys):
    assert main(["verdict", "--store", str(synthetic.store)]) == 0
    text = capsys.readouterr().out
    assert "TTFT p50" in text and "<=512 tokens" in text and "weight" in text


def test_an_empty_window_needs_both_modes(synthetic, capsys):
    # the synthetic requests started 5 to 1 minutes ago: none in the last second
    assert main(["verdict", "--store", str(synthetic.store), "--window", "1s"]) == 0
    assert "needs both modes in the window" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", [["verdict"], ["whatif", "--from", "pull"]])
@pytest.mark.parametrize("window", ["0", "-1h", "ten", "inf", "400d"])
def test_a_bad_window_is_a_usage_error(tmp_path, capsys, cmd, window):
    with pytest.raises(SystemExit) as exit_:
        main([*cmd, "--store", str(tmp_path / "x.db"), f"--window={window}"])
    assert exit_.value.code == 2
    assert f"kvlens {cmd[0]}: error: argument --window" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["verdict"], ["whatif", "--from", "push"]])
def test_a_bad_store_is_one_line_and_exit_2(tmp_path, capsys, cmd):
    bad = tmp_path / "garbage.db"
    bad.write_bytes(b"\0" * 4096)
    for store, says in (
        (tmp_path / "none.db", "trace store not found"),
        (bad, "not a kvlens trace store"),
        (tmp_path, "is a directory"),
        ("postgresql://", "postgresql"),
    ):
        assert main([*cmd, "--store", str(store)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err


def test_the_verdict_says_when_the_host_decides():
    """Per mode the median CPU-wait share of the handoff; from 25 % the words
    say the host's contention decides, and the handoff without CPU wait gets
    its own stratified ratio."""
    from kvtrace.verdict import Request, compute, cpu_words

    reqs = []
    for i in range(40):
        for mode, h, w in (("push", 0.100, 0.060), ("pull", 0.100, 0.010)):
            reqs.append(Request(f"{mode}{i}", mode, None, "ok", i, 300, None, 0.2, h + i * 1e-4, None, w))
    v = compute(reqs)
    assert v.cpu_share["push"] == pytest.approx(0.6, abs=0.03) and v.cpu_share["pull"] == pytest.approx(0.1, abs=0.01)
    words = cpu_words(v)
    assert "59 % of push's and 10 % of pull's" in words and "contention decides" in words
    r = v.ratios["handoff_nowait_p50"]
    assert r.ratio == pytest.approx(0.045 / 0.095, rel=0.05) and r.hi < 1  # push faster without the wait
    assert v.ratios["handoff_p50"].status == stats.NO_DIFFERENCE  # the same handoffs as measured
