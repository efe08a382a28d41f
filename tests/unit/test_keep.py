"""The two storage tiers (issue 24): every request's summary, spans only for
kept requests, decisions counted by reason, late spans, a bounded buffer;
on both backends, with a clock the test moves."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys

import pytest
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

from kvrecord import semconv as sc
from kvrecord.ids import root_span_id
from kvrecord.keeprule import KeepRule
from kvtrace import store, tracemodel
from kvtrace.store.keep import Keeper, ratio_pick
from fakes import wait_for

MS = 1_000_000
N = 8  # spans per request (request() below)
T0 = 1_790_000_000_000_000_000


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _span(tid, name, role, start, end, *, parent=True, **attrs) -> ReadableSpan:
    a = {sc.ATTR_ROLE: role, sc.ATTR_MODE: "push", sc.ATTR_REQUEST_ID: f"cmpl-{tid}-0-1234abcd", **attrs}
    if role != "router":
        a[sc.ATTR_ENGINE_ID] = "p0" if role == "prefill" else "d0"
    sid = root_span_id(int(tid, 16)) if name == "request" else int(secrets.token_hex(8), 16) | 1
    ctx = SpanContext(int(tid, 16), sid, False)
    par = SpanContext(int(tid, 16), root_span_id(int(tid, 16)), False) if parent and name != "request" else None
    res = Resource.create({"service.name": f"kvlens-{role}"})
    return ReadableSpan(name=name, context=ctx, parent=par, attributes=a, start_time=start, end_time=end, resource=res)


def request(
    tid: str,
    *,
    handoff_ms: float = 5,
    outcome: str = "ok",
    root: bool = True,
    t0: int = T0,
    mode: str = "push",
    tokens: int | None = None,
    root_attrs: dict | None = None,
) -> list:
    """A request's spans with both clock crossings (its handoff settles);
    ``tokens``: the prompt count P's prefill span carries; ``root_attrs``:
    more of the router's root span (split, TPOT)."""
    pf = t0 + 20 * MS
    kv = pf + int(handoff_ms * MS)
    m = {sc.ATTR_MODE: mode}
    out = [
        _span(tid, "registration.stage", "decode", t0 + MS // 2, t0 + MS // 2, **m),
        _span(tid, "registration.send", "decode", t0 + 1 * MS, t0 + 1 * MS + 100, **m),
        _span(tid, "registration.receive", "prefill", t0 + 2 * MS, t0 + 2 * MS, **m),
        _span(tid, "prefill", "prefill", t0, pf, **m, **({sc.ATTR_TOKENS: tokens} if tokens is not None else {})),
        _span(tid, "prefill.finished", "prefill", pf, pf, **m),
        _span(tid, "write.post", "prefill", pf + 1000, pf + 2000, **m),
        _span(tid, "kv.ready", "decode", kv, kv, **m, **{sc.ATTR_OUTCOME: outcome}),
    ]
    if root:
        ttft = (kv - t0) / 1e9 + 0.01
        a = {sc.ATTR_TTFT_S: ttft, **m, **(root_attrs or {})}
        out.append(_span(tid, "request", "router", t0 - 1000, kv + 20 * MS, **a))
    return out


def _tid(i: int, kept_by_ratio: bool = False) -> str:
    """A trace id outside the 1 % share (or inside it)."""
    tail = "00000001" if kept_by_ratio else "fffffff0"
    return f"{i:024x}{tail}"


def _stored(where, ids):
    with store.reading(getattr(where, "store", where)) as conn:
        return tracemodel.find(conn, ids)


def test_keep_all_stores_every_span_and_says_so(backend):
    k = Keeper(KeepRule())
    with store.connect(backend.store) as conn:
        assert k.write(conn, request(_tid(1))) == N
    tr = _stored(backend, [_tid(1)])[_tid(1)]
    assert tr.keep == "all" and len([s for s in tr.spans if not s.attributes.get(sc.ATTR_DERIVED)]) == N
    assert tr.phases["prefill"] == pytest.approx(0.02)


def test_sampled_keeps_failed_slow_and_ratio_and_summarises_the_rest(backend):
    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0.01, "50ms"), clock=clock)
    fast = [_tid(i) for i in range(6)]
    slow, failed, picked = _tid(10), _tid(11), _tid(12, kept_by_ratio=True)
    spans = [s for t in fast for s in request(t)]
    spans += request(slow, handoff_ms=80) + request(failed, outcome="failed") + request(picked)
    with store.connect(backend.store) as conn:
        assert k.write(conn, spans) == 0  # all held: no decision before the grace
        assert k.buffered == len(spans)
        clock.t += 2.5  # past the grace after each root span
        stored = k.write(conn, [])
    assert stored == 3 * N and k.buffered == 0
    assert (k.counts["slow"], k.counts["failed"], k.counts["ratio"], k.counts["no"]) == (1, 1, 1, 6)
    assert k.counts["unkept"] == 6 * N
    got = _stored(backend, [*fast, slow, failed, picked])
    assert {t: got[t].keep for t in (slow, failed, picked)} == {slow: "slow", failed: "failed", picked: "ratio"}
    for t in fast:  # the summary is whole: handoff settled, TTFT, phases, every span counted
        tr = got[t]
        assert tr.keep == "no" and tr.spans == () and tr.n_spans == N
        assert tr.handoff_s == pytest.approx(0.005, abs=0.002) and tr.ttft_s is not None
        assert tr.phases["prefill"] == pytest.approx(0.02)
        assert tr.to_json()["spans"] == [] and "not kept" in tr.to_json()["spans_note"]
    assert len([s for s in got[slow].spans if not s.attributes.get(sc.ATTR_DERIVED)]) == N


def test_a_summary_only_request_keeps_what_the_verdict_reads(backend):
    """Under --keep sampled most requests are their summary alone: the prompt
    length, the split weight and the TPOT live on the summary (schema 7), so
    the live verdict buckets them by length and counts them as the canary's."""
    from kvtrace import verdict

    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0.0, "50ms"), clock=clock)
    t0 = __import__("time").time_ns() - 60 * 10**9
    ids = {m: [_tid(i + (50 if m == "pull" else 0)) for i in range(12)] for m in ("push", "pull")}
    spans = []
    for m, tids in ids.items():
        for i, t in enumerate(tids):
            root = {sc.ATTR_SPLIT: 0.5, sc.ATTR_TPOT_S: 0.02 + i / 1000, sc.ATTR_TOKENS: 300 + i}
            spans += request(t, mode=m, tokens=300 + i, root_attrs=root, t0=t0 + i * MS, handoff_ms=5 + i)
    with store.connect(backend.store) as conn:
        k.write(conn, spans)
        clock.t += 2.5
        k.write(conn, [])
    got = _stored(backend, [t for tids in ids.values() for t in tids])
    assert {tr.keep for tr in got.values()} == {"no"}  # summaries only: no span to read them from
    tr = got[ids["pull"][3]]
    assert (tr.prompt_tokens, tr.split, tr.tpot_s) == (303, 0.5, pytest.approx(0.023))
    with store.reading(backend.store) as conn:
        reqs = verdict.load(conn, since_ns=t0 - 10**9)
    assert len(reqs) == 24 and all(r.tokens is not None and r.split == 0.5 for r in reqs), reqs
    out = verdict.compute(reqs)
    assert out.selection == "split"
    assert out.counts["push"]["<=512 tokens"] == 12 and out.counts["pull"]["<=512 tokens"] == 12
    assert out.counts["push"][verdict.UNKNOWN_LENGTH] == 0


def test_a_late_span_folds_into_the_summary_and_follows_the_decision(backend):
    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0, "1s"), clock=clock)
    unkept, kept = _tid(1), _tid(2)
    with store.connect(backend.store) as conn:
        k.write(conn, request(unkept) + request(kept, outcome="timeout"))
        clock.t += 3
        k.write(conn, [])
        late = [_span(t, "decode.first_step", "decode", T0 + 40 * MS, T0 + 47 * MS) for t in (unkept, kept)]
        assert k.write(conn, late) == 1
    assert (k.counts["late_kept"], k.counts["late_dropped"]) == (1, 1)
    got = _stored(backend, [unkept, kept])
    assert got[unkept].n_spans == N + 1 and got[unkept].phases["decode.first_step"] == pytest.approx(0.007)
    assert got[unkept].spans == ()
    assert "decode.first_step" in {s.name for s in got[kept].spans}
    # another process (a new keeper) follows the recorded decision
    k2 = Keeper(KeepRule.parse("sampled", 0, "1s"), clock=clock)
    with store.connect(backend.store) as conn:
        assert k2.write(conn, [_span(kept, "decode.queue", "decode", T0, T0 + MS)]) == 1


def test_requests_without_a_root_wait_for_the_decision_wait(backend):
    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0, "1s", wait_s=10.0), clock=clock)
    with store.connect(backend.store) as conn:
        k.write(conn, request(_tid(1), root=False))
        clock.t += 5
        k.write(conn, [])
        assert k.buffered == N - 1 and 4.9 < k.due_in() <= 5.0
        clock.t += 5
        k.write(conn, [])
    assert k.buffered == 0 and k.counts["no"] == 1


def test_a_full_buffer_decides_the_oldest_early_and_counts_them(backend):
    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0, "1s", max_spans=10), clock=clock)
    with store.connect(backend.store) as conn:
        for i in range(3):
            k.write(conn, request(_tid(i), root=False))
        assert k.buffered <= 10
        assert k.counts["forced"] == 2 and k.counts["no"] == 2
        k.flush(conn)
    assert k.buffered == 0 and k.counts["no"] == 3


def test_a_live_percentile_keeps_the_slow_tail_after_its_warmup(backend):
    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0, "p90"), clock=clock)
    spans = []
    for i in range(60):
        spans += request(_tid(i), handoff_ms=5 + (i % 10) * 0.5, t0=T0 + i * 100 * MS)
    spans += request(_tid(99), handoff_ms=200, t0=T0 + 70 * 100 * MS)
    with store.connect(backend.store) as conn:
        k.write(conn, spans)
        k.flush(conn)
    assert k.counts["warmup"] == 20  # the window's first requests: too few to say
    assert 1 <= k.counts["slow"] <= 10 and k.counts["slow"] + k.counts["no"] + 20 == 61
    assert _stored(backend, [_tid(99)])[_tid(99)].keep == "slow"


def test_the_ratio_share_is_by_trace_id_and_about_right():
    ids = [secrets.token_hex(16) for _ in range(20000)]
    share = sum(ratio_pick(t, 0.1) for t in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert all(ratio_pick(t, 1.0) for t in ids[:10]) and not any(ratio_pick(t, 0.0) for t in ids[:100])
    assert [ratio_pick(t, 0.1) for t in ids[:50]] == [ratio_pick(t, 0.1) for t in ids[:50]]


@pytest.mark.parametrize(
    "args, flag",
    [
        (("sometimes", None, None), "--keep must be one of all, sampled"),
        (("sampled", "1.5", None), "--keep-ratio must be from 0 to 1"),
        (("sampled", "x", None), "--keep-ratio must be a number"),
        (("sampled", None, "p100"), "--keep-slow percentile"),
        (("sampled", None, "slowish"), "--keep-slow must be a percentile"),
        (("sampled", None, "-2s"), "--keep-slow"),
    ],
)
def test_a_bad_keep_rule_names_its_flag(args, flag):
    with pytest.raises(ValueError, match=flag):
        KeepRule.parse(*args)


def test_keep_rule_forms():
    r = KeepRule.parse("sampled", "0.05", "250ms")
    assert (r.ratio, r.slow_s, r.slow_pct) == (0.05, 0.25, None)
    assert KeepRule.parse("SAMPLED", None, "p99.9").slow_pct == 99.9
    assert KeepRule.parse(**dict(zip(("keep", "ratio", "slow"), r.to_config().values()))) == r
    with pytest.raises(ValueError, match="kvlens_keep_ratio"):
        KeepRule.parse("sampled", 2, None, prefix="kvlens_keep")


def test_collector_metrics_count_every_request_and_exemplars_name_only_kept_ones(backend):
    """A known mix through the collector's ingest under --keep sampled: the
    counts are those of every request, the stored spans those of the kept."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest

    from collector.ingest import collector_ingest

    reg = CollectorRegistry()
    rule = KeepRule.parse("sampled", 0, "50ms", wait_s=1.0, grace_s=0.2)
    ing = collector_ingest(backend.store, reg, keep=rule, handoff_deadline_s=5.0)
    fast = [_tid(i) for i in range(10)]
    slow, failed = [_tid(20), _tid(21)], _tid(22)
    spans = [s for t in fast for s in request(t)] + request(failed, outcome="failed")
    spans += [s for t in slow for s in request(t, handoff_ms=80)]
    try:
        assert ing.offer(spans)
        val = reg.get_sample_value

        def settled() -> bool:
            done = val("kvlens_collector_decision_buffer_spans") == 0 and ing.queued_spans == 0
            return done and (val("kvlens_handoff_seconds_count", {"mode": "push"}) or 0) == 13

        assert wait_for(settled, 60.0)
        assert val("kvlens_requests_total", {"mode": "push", "outcome": "ok"}) == 13
        derived = {"mode": "push", "role": "decode", "phase": "registration.dispatch", "outcome": "ok"}
        assert wait_for(lambda: val("kvlens_phase_duration_seconds_count", derived) == 13, 60.0)
        for d, n in (("slow", 2), ("failed", 1), ("no", 10), ("ratio", 0)):
            assert val("kvlens_collector_keep_decisions_total", {"decision": d}) == n, d
        assert val("kvlens_collector_spans_written_total") == 3 * N
        assert val("kvlens_collector_spans_unkept_total") == 10 * N
        assert val("kvlens_collector_spans_received_total") == 13 * N
        text = generate_latest(reg).decode()
        named = set(re.findall(r'# \{trace_id="([0-9a-f]{32})"\}', text))
        assert named and named <= {*slow, failed}
    finally:
        ing.close()
    got = _stored(backend, [*fast, *slow, failed])
    assert len(got) == 13 and all(got[t].spans == () for t in fast)


def test_kvlens_collect_sampled_end_to_end(tmp_path, backend, capsys):
    """The real command under --keep sampled, fed by the SDK's OTLP exporter,
    on both backends; SIGTERM decides what is still held; ``kvlens traces``
    lists the summary-only requests with no spans and says why."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from kvlens.cli import main

    db = backend.store if backend.is_pg else tmp_path / "c.db"
    argv = ["collect", "--port", "0", "--no-grpc", "--store", str(db), "--keep", "sampled", "--keep-ratio", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", *argv, "--keep-slow", "50ms"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVLENS_HOME": str(tmp_path)},
    )
    fast, slow, failed = [_tid(i) for i in range(6)], _tid(7), _tid(8)
    spans = [s for t in fast for s in request(t)] + request(slow, handoff_ms=90) + request(failed, outcome="expired")
    try:
        m = re.search(r"on (http://127\.0\.0\.1:\d+/v1/traces)", proc.stdout.readline())
        assert m, proc.stderr.read() if proc.poll() is not None else ""
        assert "keep sampled" in proc.stdout.readline()
        exporter = OTLPSpanExporter(endpoint=m.group(1), timeout=10)
        assert exporter.export(spans).name == "SUCCESS"
        exporter.shutdown()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert f"{2 * N} spans written, 0 dropped, {6 * N} not kept (summaries only)" in out
    capsys.readouterr()
    assert main(["traces", "--store", str(db), "--json", "--slowest", "20"]) == 0
    rows = {r["trace_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {*fast, slow, failed}
    assert (rows[slow]["keep"], rows[failed]["keep"]) == ("slow", "expired") and rows[slow]["spans"]
    for t in fast:
        assert rows[t]["keep"] == "no" and rows[t]["spans"] == [] and "not kept" in rows[t]["spans_note"]
        assert rows[t]["handoff_s"] is not None and rows[t]["phases_s"]["prefill"] > 0
    assert main(["traces", "--store", str(db), "--breakdown"]) == 0
    assert "6 completed requests kept as summaries only" in capsys.readouterr().out


def test_the_dashboard_shows_a_summary_only_request(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    db = tmp_path / "d.db"
    clock = Clock()
    k = Keeper(KeepRule.parse("sampled", 0, "1s"), clock=clock)
    with store.connect(db) as conn:
        k.write(conn, request(_tid(1)) + request(_tid(2), outcome="failed"))
        k.flush(conn)
    app = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(db)])
    at = AppTest.from_file(str(app), default_timeout=60)
    at.query_params["page"] = "traces"
    at.query_params["trace"] = _tid(1)
    at.run()
    assert not at.exception
    assert any("summary only" in i.value for i in at.info)
    assert "prefill" in set(at.dataframe[-1].value["phase"])


def test_the_connectors_store_exporter_decides_when_idle_and_at_shutdown(backend):
    """The exporter vLLM's processes write through (``kvlens_keep*`` keys):
    its export thread's idle ``tick`` decides what is due, ``shutdown`` the rest."""
    from kvrecord.config import Options

    opts = Options.from_config({**backend.config(), "kvlens_keep": "sampled", "kvlens_keep_ratio": "0"})
    ex = store.StoreSpanExporter(opts.store, keep=KeepRule.parse("sampled", 0, "1s", wait_s=0.3, grace_s=0.1))
    assert opts.keep.sampled and ex.keeper.rule.sampled
    early, late = _tid(1), _tid(2)
    assert ex.export(request(early) + request(late, outcome="failed", root=False)).name == "SUCCESS"
    assert wait_for(lambda: ex.tick() or ex.keeper.counts["no"] == 1, 60.0)  # the root's grace, then a tick
    ex.shutdown()
    assert ex.keeper.buffered == 0 and ex.keeper.counts["failed"] == 1
    got = _stored(backend, [early, late])
    assert got[early].keep == "no" and got[early].spans == () and got[late].keep == "failed"


def test_the_router_takes_the_keep_flags_for_its_own_spans_and_what_it_collects(tmp_path, monkeypatch):
    import argparse

    from proxy import cli
    from proxy.app import _receiver_ingest

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    argv = ["--mode", "push", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--collect"]
    args = p.parse_args([*argv, "--keep", "sampled", "--keep-ratio", "0.2", "--keep-slow", "p95"])
    monkeypatch.setenv("KVLENS_HOME", str(tmp_path))
    cfg = cli.config(args)
    assert cfg.options.store.path.parent == tmp_path
    assert cfg.options.keep == KeepRule.parse("sampled", 0.2, "p95")
    ing = _receiver_ingest(cfg)
    try:
        assert ing.keeper.rule == cfg.options.keep
    finally:
        ing.close()
    with pytest.raises(ValueError, match="--keep-slow applies only with --keep sampled"):
        cli.config(p.parse_args([*argv, "--keep-slow", "p95"]))


def test_the_slow_window_percentile_is_the_last_window_values_one():
    """keep._Window against the plain definition: the pNN of the last WINDOW
    values (sorted, index int(n * pNN / 100)), None below MIN_WINDOW."""
    import random

    from kvtrace.store import keep

    rnd, w, seen = random.Random(7), keep._Window(), []
    for k in range(3 * keep.WINDOW):
        v = rnd.choice([rnd.expovariate(20.0), 0.05, 0.05])  # ties included
        last = sorted(seen[-keep.WINDOW :])
        want = None if len(last) < keep.MIN_WINDOW else v > last[min(len(last) - 1, int(len(last) * 99.0 / 100.0))]
        assert w.above(0, v, 99.0) == want, k
        seen.append(v)
    assert w.above(1, None, 99.0) is False and len(w.ranked[0]) == keep.WINDOW
