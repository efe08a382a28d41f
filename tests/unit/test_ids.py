"""Trace correlation behind any router (docs/phases.md, "Trace correlation"):
P's and D's spans of one request join on the request id they share, or on
the ``remote_request_id`` of the ``kv_transfer_params`` D received; a
request that cannot be joined is a half trace, counted and listed; without
kvlens' relay the hop between the engines is one derived phase; the
engines' own timestamps give a TTFT with its clock bound.

Real recorders, the real OTel pipeline and the real SQLite store; only the
timestamps are made up (vLLM's request-id shapes are the real ones).
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
from opentelemetry.trace import format_trace_id
from prometheus_client import CollectorRegistry

from kvtrace import store, tiling, tracemodel
from exporters.handoff import HandoffResolver
from exporters.families import families_for
from exporters.pipeline import provider_factory
from kvrecord import ids
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder
from kvlens import cli

MS = 1_000_000
P = sc.Phase


def _rec(role: str, home: Path, engine: str, mode: str = "pull") -> Recorder:
    return Recorder(
        role=role,
        mode=mode,
        engine_id=engine,
        pipeline_factory=provider_factory(
            role=role, mode=mode, engine_id=engine, config={"kvlens_home": str(home), "kvlens_metrics": "off"}
        ),
    )


def _vllm_rid(base: str) -> str:
    """vLLM's completion request id for an ``X-Request-Id`` (or its own uuid)."""
    return f"cmpl-{base}-0-{secrets.token_hex(4)}"


def _pull(
    pre: Recorder, dec: Recorder, p_rid: str, d_rid: str, t0: int, *, join: str | None, first_token: bool = True
) -> int:
    """One pull request as the hooks record it (no kvlens router); returns kv.ready ns."""
    pf = t0 + 40 * MS
    pre.record(P.PREFILL, p_rid, t0, pf, "ok", {sc.ATTR_TOKENS: 256})
    pre.record(P.PREFILL_FINISHED, p_rid, pf, pf, "ok", {sc.ATTR_BLOCKS: 8})
    q0 = pf + 6 * MS  # P's response, the router, D's intake: router.hop
    j = {sc.ATTR_JOIN_REQUEST_ID: join}
    dec.record(P.DECODE_QUEUE, d_rid, q0, q0 + 3 * MS, "ok", dict(j))
    dec.record(P.ALLOC, d_rid, q0 + 3 * MS, q0 + 3 * MS, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "p0", **j})
    t = q0 + 4 * MS
    dec.record(P.DESCRIPTOR_PREP, d_rid, t, t + MS, "ok", dict(j))
    dec.record(P.READ_POST, d_rid, t + MS, t + 2 * MS, "ok", dict(j))
    dec.record(P.READ_COMPLETE, d_rid, t + 2 * MS, t + 5 * MS, "ok")  # knows only D's id
    kv = t + 6 * MS
    pre.record(P.KV_RELEASED, p_rid, t + 5 * MS + MS // 2, t + 5 * MS + MS // 2, "ok")
    dec.record(P.KV_READY, d_rid, kv, kv, "ok")
    if first_token:
        dec.record(P.DECODE_FIRST_STEP, d_rid, kv + 2 * MS, kv + 9 * MS, "ok")
    return kv


def _close(*recs: Recorder) -> None:
    for r in recs:
        r.flush()
        r.close()


def _traces(home: Path) -> list[tracemodel.Trace]:
    with store.reading(home / "traces.db") as conn:
        return tracemodel.slowest(conn, 100, order="start")


def test_joins_a_decode_request_id_to_the_prefill_one_by_kv_transfer_params(tmp_path):
    """A router that sends no X-Request-Id: vLLM gives P and D unrelated
    uuids; D's kv_transfer_params name P's request id, and that joins them."""
    pre, dec = _rec("prefill", tmp_path, "p0"), _rec("decode", tmp_path, "d0")
    p_rid, d_rid = _vllm_rid(secrets.token_hex(16)), _vllm_rid(secrets.token_hex(16))
    assert ids.trace_id_for(p_rid) != ids.trace_id_for(d_rid)
    _pull(pre, dec, p_rid, d_rid, time.time_ns(), join=p_rid)
    _close(pre, dec)
    (tr,) = _traces(tmp_path)
    assert tr.trace_id == format_trace_id(ids.trace_id_for(p_rid))
    assert (tr.p_engine, tr.d_engine, tr.half) == ("p0", "d0", None)
    assert tr.handoff_s is not None and tr.handoff_s > 0
    d_spans = [s for s in tr.spans if s.role == "decode" and not s.attributes.get(sc.ATTR_DERIVED)]
    assert {s.name for s in d_spans} >= {"decode.queue", "alloc", "read.complete", "kv.ready"}
    # spans recorded with D's id alone (kv.ready) learned the join from the earlier ones
    assert all(s.attributes.get(sc.ATTR_JOIN_REQUEST_ID) == p_rid for s in d_spans)
    assert all(s.attributes.get(sc.ATTR_REQUEST_ID) == d_rid for s in d_spans)


def test_vllm_router_ids_join_by_the_shared_request_id(tmp_path):
    """vllm-router sends P and D one X-Request-Id ``___prefill_addr_..._<uuid>``."""
    rid = f"___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_{secrets.token_hex(16)}"
    pre, dec = _rec("prefill", tmp_path, "p0"), _rec("decode", tmp_path, "d0")
    p_rid = _vllm_rid(rid)
    _pull(pre, dec, p_rid, _vllm_rid(rid), time.time_ns(), join=p_rid)
    _close(pre, dec)
    (tr,) = _traces(tmp_path)
    assert tr.trace_id == rid[-32:]
    assert tr.half is None


def test_unjoinable_request_is_two_half_traces_listed_and_counted(tmp_path):
    """No shared id and no kv_transfer_params link: two half traces, each
    listed by ``kvlens traces --half``; the D side's lookup counts it."""
    pre, dec = _rec("prefill", tmp_path, "p0"), _rec("decode", tmp_path, "d0")
    p_rid, d_rid = _vllm_rid(secrets.token_hex(16)), _vllm_rid(secrets.token_hex(16))
    _pull(pre, dec, p_rid, d_rid, time.time_ns(), join=None)
    _close(pre, dec)
    trs = _traces(tmp_path)
    assert sorted(t.half for t in trs) == ["decode", "prefill"]
    assert all(t.handoff_s is None for t in trs)
    reg = CollectorRegistry()
    fam = families_for(reg)
    res = HandoffResolver(fam, tmp_path / "traces.db", deadline_s=0.01, max_pending=10, poll_s=0.01, exemplars=False)
    d_trace = next(t for t in trs if t.half == "decode").trace_id
    res.submit(d_trace, "pull")
    res.submit(d_trace, "pull")  # a second trigger span of the same request: counted once
    time.sleep(0.02)
    res.resolve_once()
    res.close()
    assert reg.get_sample_value("kvlens_traces_unjoined_total", {"mode": "pull", "reason": "no_prefill_side"}) == 1
    assert reg.get_sample_value("kvlens_handoff_unresolved_total", {"mode": "pull", "reason": "missing"}) == 1


def test_traces_cli_shows_half_traces_engines_and_ttft_source(tmp_path, capsys):
    pre, dec = _rec("prefill", tmp_path, "p1"), _rec("decode", tmp_path, "d0")
    p_rid = _vllm_rid(secrets.token_hex(16))
    _pull(pre, dec, p_rid, _vllm_rid(secrets.token_hex(16)), time.time_ns(), join=p_rid)
    _pull(
        pre,
        dec,
        _vllm_rid(secrets.token_hex(16)),
        _vllm_rid(secrets.token_hex(16)),
        time.time_ns() + 100 * MS,
        join=None,
    )
    _close(pre, dec)
    db = str(tmp_path / "traces.db")
    assert cli.main(["traces", "--store", db, "--half", "decode"]) == 0
    out = capsys.readouterr().out
    assert "half a trace: no span of P's joined it" in out and out.count("trace ") == 1
    assert cli.main(["traces", "--store", db, "--p-engine", "p1", "--d-engine", "d0"]) == 0
    out = capsys.readouterr().out
    assert "P=p1  D=d0" in out and "(engines)" in out and "half a trace" not in out
    assert cli.main(["traces", "--store", db, "--p-engine", "p9"]) == 0
    assert "no traces match" in capsys.readouterr().out


def test_router_hop_is_derived_only_without_relay(tmp_path):
    """Without kvlens' relay the hop P -> router -> D is one derived phase,
    and the handoff is (nearly) all named; with the relay it is not derived."""
    pre, dec = _rec("prefill", tmp_path, "p0"), _rec("decode", tmp_path, "d0")
    p_rid = _vllm_rid(secrets.token_hex(16))
    _pull(pre, dec, p_rid, _vllm_rid(secrets.token_hex(16)), time.time_ns(), join=p_rid)
    _close(pre, dec)
    (tr,) = _traces(tmp_path)
    hop = [s for s in tr.spans if s.name == "router.hop"]
    assert len(hop) == 1 and hop[0].critical and hop[0].attributes[sc.ATTR_DERIVED]
    assert hop[0].end_ns - hop[0].start_ns == 6 * MS
    til = tr.tiling()
    assert til.unattributed_share < 0.10
    relay = tracemodel.Span(name="relay", role="router", start_ns=hop[0].start_ns + MS, end_ns=hop[0].start_ns + 2 * MS)
    names = {d[0] for d in tiling.derive([*tr.spans, relay])}
    assert "router.hop" not in names and {"prefill.respond", "decode.intake"} <= names


def test_engines_ttft_is_p_arrival_to_d_first_token_and_a_router_ttft_wins(tmp_path):
    pre, dec = _rec("prefill", tmp_path, "p0"), _rec("decode", tmp_path, "d0")
    router = _rec("router", tmp_path, None)
    t0 = time.time_ns()
    p_rid = _vllm_rid(secrets.token_hex(16))
    kv = _pull(pre, dec, p_rid, _vllm_rid(secrets.token_hex(16)), t0, join=p_rid)
    tid = secrets.token_hex(16)  # through kvlens' router: the client-seen TTFT stays
    _pull(pre, dec, _vllm_rid(tid), _vllm_rid(tid), t0 + 200 * MS, join=None)
    _close(pre, dec)
    router.record_root(tid, None, t0 + 199 * MS, t0 + 300 * MS, "ok", {sc.ATTR_TTFT_S: 0.0777})
    _close(router)
    by_id = {t.trace_id: t for t in _traces(tmp_path)}
    eng = by_id[format_trace_id(ids.trace_id_for(p_rid))]
    assert eng.ttft_source == "engines"
    assert eng.ttft_s == pytest.approx((kv + 9 * MS - t0) / 1e9, abs=eng.ttft_err_s + 1e-9)
    assert eng.ttft_err_s is not None and eng.ttft_err_s == eng.handoff_err_s
    rt = by_id[tid]
    assert (rt.ttft_source, rt.ttft_s, rt.ttft_err_s) == ("router", pytest.approx(0.0777), None)


def test_schema_2_store_is_upgraded_with_the_ttft_columns(tmp_path):
    import store_sql
    from kvtrace.store.columns import added_in

    db = tmp_path / "traces.db"
    store_sql.create_old_store(db, 2, [{"trace_id": "ab", "mode": "pull", "ttft_s": 0.5}])
    conn = store.connect(db)
    conn.close()
    assert {c for c, _ in added_in(3)} <= set(store_sql.columns(db, "traces"))
    assert store_sql.meta(db)["schema_version"] == str(store.SCHEMA_VERSION)
    with store.reading(db) as c:
        ((ttft_s, ttft_source),) = [(r["ttft_s"], r["ttft_source"]) for r in store.slowest(c, 10)]
    assert (ttft_s, ttft_source) == (0.5, None)


def test_bench_finds_a_request_by_the_id_the_router_gave_it():
    """``kvlens bench --proxy`` in front of any router: the trace is the sent
    X-Request-Id where the router kept it, else the one in the response's id."""
    sent = secrets.token_hex(16)
    assert ids.trace_of_response(f"cmpl-{sent}", sent) == sent  # kvlens' router
    assert ids.trace_of_response(None, sent) == sent
    uuid = secrets.token_hex(16)
    vr = f"cmpl-___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_{uuid}"
    assert ids.trace_of_response(vr, sent) == uuid  # vllm-router's id on P and D


def test_bench_cross_check_keeps_engine_ttfts_apart():
    from kvlens.bench.crosscheck import cross_check
    from kvlens.bench.results import Cell, RequestResult, Target

    tgt = Target(mode="pull", url="http://127.0.0.1:1", dispatch=None)
    res = [RequestResult(request_id=f"{i:032x}", ok=True, ttft_s=0.100) for i in (1, 2)]
    traces = {
        f"{1:032x}": {"ttft_s": 0.090, "ttft_source": "engines", "handoff_s": 0.01, "outcome": "ok"},
        f"{2:032x}": {"ttft_s": 0.099, "ttft_source": "router", "handoff_s": 0.01, "outcome": "ok"},
    }
    cc = cross_check([Cell(tgt, 1.0, 128, res, traces, 2.0)])
    assert cc.n_compared == 1 and cc.n_engines == 1
    assert cc.engines_diff_p50_s == pytest.approx(0.010)
    assert any("engines' TTFT" in line for line in cc.lines())
