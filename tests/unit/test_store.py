"""SQLite trace store: folding spans into traces, queries, read-only access."""

import json
import os
import stat
import time

import pytest

from exporters import pipeline, store
from instrumented_connector import semconv as sc
from instrumented_connector.recorder import Recorder

TID = "0af7651916cd43dd8448eb211c80319c"


def _record_request(home, tid=TID, mode="push", handoff_ns=5_000_000, t0=None):
    t0 = t0 or time.time_ns()
    cfg = {"kvlens_home": str(home), "kvlens_metrics": "off"}
    recs = {
        role: Recorder(role=role, mode=mode, pipeline_factory=pipeline.provider_factory(role=role, mode=mode, engine_id=None, config=cfg))
        for role in ("router", "prefill", "decode")
    }
    rid_p, rid_d = f"cmpl-{tid}-0-11111111", f"cmpl-{tid}-0-22222222"
    pf = t0 + 20_000_000
    recs["decode"].record(sc.Phase.KV_READY, rid_d, pf + handoff_ns, pf + handoff_ns)
    recs["prefill"].record(sc.Phase.PREFILL, rid_p, t0, pf)
    recs["prefill"].record(sc.Phase.PREFILL_FINISHED, rid_p, pf, pf)
    recs["prefill"].record(sc.Phase.WRITE_POST, rid_p, pf + 1000, pf + 2000, "failed" if mode == "pull" else "ok")
    recs["router"].record(sc.Phase.REQUEST, tid, t0 - 1000, pf + handoff_ns + 10_000_000, "ok",
                          {"_trace_id": int(tid, 16), sc.ATTR_TTFT_S: 0.03, sc.ATTR_DISPATCH: "overlapped"})
    for r in recs.values():
        r.close()
    return pf


def test_spans_fold_into_one_trace_with_handoff(tmp_path):
    pf = _record_request(tmp_path)
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    (row,) = store.slowest(conn, 10)
    assert row["trace_id"] == TID and row["mode"] == "push" and row["dispatch"] == "overlapped"
    assert row["request_id"] == TID  # the router's id wins
    assert row["prefill_finished_ns"] == pf and row["handoff_s"] == pytest.approx(0.005)
    assert row["ttft_s"] == pytest.approx(0.03) and row["n_spans"] == 5 and row["outcome"] == "ok"
    spans = store.spans_for(conn, [TID])[TID]
    assert {s["name"] for s in spans} == {"request", "prefill", "prefill.finished", "write.post", "kv.ready"}
    rec = store.trace_record(row, spans)
    json.dumps(rec)
    assert set(rec) >= {"trace_id", "request_id", "mode", "outcome", "ttft_s", "handoff_s", "spans"}


def test_worst_outcome_wins_and_filters(tmp_path):
    _record_request(tmp_path, TID, "push", 5_000_000)
    other = "1" * 32
    _record_request(tmp_path, other, "pull", 9_000_000)
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    rows = store.slowest(conn, 10)
    assert [r["trace_id"] for r in rows] == [other, TID]
    assert rows[0]["outcome"] == "failed"
    assert [r["trace_id"] for r in store.slowest(conn, 10, mode="push")] == [TID]
    assert [r["trace_id"] for r in store.slowest(conn, 10, outcome="failed")] == [other]
    assert [r["trace_id"] for r in store.slowest(conn, 10, min_handoff_s=0.008)] == [other]
    assert store.slowest(conn, 10, since_ns=time.time_ns() + 10**12) == []


def test_sql_filters_are_parameterised(tmp_path):
    _record_request(tmp_path)
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    assert store.slowest(conn, 10, mode="push' OR '1'='1") == []


def test_readonly_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace store not found"):
        store.connect(tmp_path / "nope.db", readonly=True)


@pytest.mark.skipif(os.geteuid() == 0 and False, reason="")
def test_unwritable_store_drops_spans_without_raising(tmp_path, caplog):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "traces.db").mkdir()  # a directory where the file should be: unwritable for anyone, root included
    exp = store.SQLiteSpanExporter(ro / "traces.db")
    r = Recorder(role="prefill", mode="push", pipeline_factory=pipeline.provider_factory(
        role="prefill", mode="push", engine_id=None, config={"kvlens_home": str(ro), "kvlens_metrics": "off"}))
    r.record(sc.Phase.MATCH, "x", 1, 2)
    r.close()  # export fails inside the SDK thread; nothing raises here
    from opentelemetry.sdk.trace.export import SpanExportResult
    assert exp.export([]) == SpanExportResult.FAILURE


def test_parse_since():
    now = time.time_ns()
    assert abs(store.parse_since("10m") - (now - 600e9)) < 5e9
    assert store.parse_since(None) is None
    for bad in ("abc", "-5m", "0"):
        with pytest.raises(ValueError):
            store.parse_since(bad)


def test_bench_rows_roundtrip(tmp_path):
    conn = store.connect(tmp_path / "t.db")
    rows = [{"mode": "push", "dispatch": "overlapped", "qps": 1.0, "input_len": 256, "output_len": 8, "num_prompts": 4, "completed": 4}]
    store.save_bench_rows(conn, "run1", rows)
    store.save_bench_rows(conn, "run2", rows + [dict(rows[0], mode="pull")])
    assert len(store.bench_rows(conn)) == 2 and store.bench_rows(conn, "run1")[0]["completed"] == 4
    assert [r["run_id"] for r in store.bench_runs(conn)] == ["run2", "run1"]


def test_config_validation_is_strict():
    with pytest.raises(ValueError, match="kvlens_bogus"):
        pipeline.validate_config({"kvlens_bogus": 1})
    with pytest.raises(ValueError, match="otlp_endpoint"):
        pipeline.validate_config({"otlp_endpoint": "localhost:4318"})
    with pytest.raises(ValueError, match="kvlens_buffer_events"):
        pipeline.validate_config({"kvlens_buffer_events": "many"})
    assert pipeline.validate_config({"kvlens_home": "/x", "other_vllm_key": 1}) == {"kvlens_home": "/x"}
