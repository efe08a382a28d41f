"""The trace store on both backends (SQLite file, real PostgreSQL server:
the ``backend`` fixture): folding spans into traces, queries, schema
versions, read-only access. SQLite-only behaviour (file paths, corrupt
files) is tested on SQLite alone."""

import json
import os
import time
from pathlib import Path

import pytest

from exporters import pipeline
from kvrecord.config import Options
from kvtrace import store, tracemodel
import store_sql
from kvtrace.store import columns
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder
from store_backends import Backend

TID = "0af7651916cd43dd8448eb211c80319c"


def _record_request(home, tid=TID, mode="push", handoff_ns=5_000_000, t0=None):
    """One request's spans through the real pipeline into ``home``'s store
    (``home``: a kvlens home directory, or a :class:`Backend`)."""
    t0 = t0 or time.time_ns()
    cfg = home.config() if isinstance(home, Backend) else {"kvlens_home": str(home), "kvlens_metrics": "off"}
    recs = {
        role: Recorder(
            role=role,
            mode=mode,
            pipeline_factory=pipeline.provider_factory(role=role, mode=mode, engine_id=None, config=cfg),
        )
        for role in ("router", "prefill", "decode")
    }
    rid_p, rid_d = f"cmpl-{tid}-0-11111111", f"cmpl-{tid}-0-22222222"
    pf = t0 + 20_000_000
    recs["decode"].record(sc.Phase.KV_READY, rid_d, pf + handoff_ns, pf + handoff_ns)
    # one D->P message (bounds the clocks from below; kv.ready - prefill.finished from above)
    recs["decode"].record(sc.Phase.REGISTRATION_SEND, rid_d, t0 + 1_000_000, t0 + 1_100_000)
    recs["prefill"].record(sc.Phase.REGISTRATION_RECEIVE, rid_p, t0 + 1_500_000, t0 + 1_500_000)
    recs["prefill"].record(sc.Phase.PREFILL, rid_p, t0, pf)
    recs["prefill"].record(sc.Phase.PREFILL_FINISHED, rid_p, pf, pf)
    recs["prefill"].record(sc.Phase.WRITE_POST, rid_p, pf + 1000, pf + 2000, "failed" if mode == "pull" else "ok")
    recs["router"].record_root(
        tid, None, t0 - 1000, pf + handoff_ns + 10_000_000, "ok", {sc.ATTR_TTFT_S: 0.03, sc.ATTR_DISPATCH: "overlapped"}
    )
    for r in recs.values():
        r.close()
    return pf


def test_spans_fold_into_one_trace_with_handoff(backend):
    pf = _record_request(backend)
    conn = store.connect(backend.store, readonly=True)
    (row,) = store.slowest(conn, 10)
    assert row["trace_id"] == TID and row["mode"] == "push" and row["dispatch"] == "overlapped"
    assert row["request_id"] == TID  # the router's id wins
    assert row["prefill_finished_ns"] == pf and row["handoff_s"] == pytest.approx(0.005)
    assert row["ttft_s"] == pytest.approx(0.03) and row["n_spans"] == 7 and row["outcome"] == "ok"
    # one clock bounded on both sides by the request's own messages: the
    # interval contains 0, so the uncorrected figure stands, with its bound
    assert row["clock_offset_s"] == 0 and row["clock_lo_s"] <= 0 <= row["clock_hi_s"]
    assert row["handoff_err_s"] == pytest.approx(max(-row["clock_lo_s"], row["clock_hi_s"]))
    spans = store.spans_for(conn, [TID])[TID]
    assert {s["name"] for s in spans} == {
        "request",
        "prefill",
        "prefill.finished",
        "write.post",
        "kv.ready",
        "registration.send",
        "registration.receive",
    }
    rec = tracemodel.trace_record(row, spans)
    json.dumps(rec)
    assert set(rec) >= {"trace_id", "request_id", "mode", "outcome", "ttft_s", "handoff_s", "spans"}


def test_worst_outcome_wins_and_filters(backend):
    _record_request(backend, TID, "push", 5_000_000)
    other = "1" * 32
    _record_request(backend, other, "pull", 9_000_000)
    conn = store.connect(backend.store, readonly=True)
    rows = store.slowest(conn, 10)
    assert [r["trace_id"] for r in rows] == [other, TID]
    assert rows[0]["outcome"] == "failed"
    assert [r["trace_id"] for r in store.slowest(conn, 10, mode="push")] == [TID]
    assert [r["trace_id"] for r in store.slowest(conn, 10, outcome="failed")] == [other]
    assert [r["trace_id"] for r in store.slowest(conn, 10, min_handoff_s=0.008)] == [other]
    assert store.slowest(conn, 10, since_ns=time.time_ns() + 10**12) == []


def test_sql_filters_are_parameterised(backend):
    _record_request(backend)
    conn = store.connect(backend.store, readonly=True)
    assert store.slowest(conn, 10, mode="push' OR '1'='1") == []


def test_readonly_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace store not found"):
        store.connect(tmp_path / "nope.db", readonly=True)
    with pytest.raises(store.StoreMissing):
        store.connect(tmp_path / "nope.db", readonly=True)


def test_a_new_store_records_its_schema_version(backend):
    p = backend.store
    store.connect(p).close()
    assert store_sql.meta(p) == {"schema_version": str(store.SCHEMA_VERSION)}
    store.connect(p).close()  # a second writer (another process) changes nothing
    assert store_sql.meta(p) == {"schema_version": str(store.SCHEMA_VERSION)}
    with store.reading(p) as c:
        assert store.info(c)["traces"] == 0


def test_the_tables_are_the_one_column_list(backend, tmp_path):
    """``kvtrace.store.columns`` is what the DDL builds, in its order, on both
    backends (PostgreSQL's partitioned ``traces`` adds its partition key
    ``day``), and what an old store migrates to; the summary and the written
    row are parts of it."""
    store.connect(backend.store).close()
    want = [c.name for c in columns.TRACES]
    assert [c for c in store_sql.columns(backend.store, "traces") if c != "day"] == want
    assert store_sql.columns(backend.store, "spans") == list(store.SPAN_COLUMNS)
    assert set(store.SUMMARY_COLUMNS) | set(store.TRACE_COLUMNS) <= set(want)
    assert [c.since for c in columns.TRACES] == sorted(c.since for c in columns.TRACES)  # ADD COLUMN appends
    old = tmp_path / "v2.db"
    store_sql.create_old_store(old, 2)
    store.connect(old).close()
    assert store_sql.columns(old, "traces") == want


def test_a_newer_store_is_refused_naming_both_versions(backend):
    p = backend.store
    store.connect(p).close()
    newer = store.SCHEMA_VERSION + 1
    store_sql.set_schema_version(p, newer)
    for readonly in (True, False):
        with pytest.raises(
            store.StoreVersionError, match=f"schema version {newer}.*up to version {store.SCHEMA_VERSION}"
        ):
            store.connect(p, readonly=readonly)
    assert issubclass(store.StoreVersionError, store.StoreError)


def test_a_store_from_before_versioning_is_read_and_upgraded(tmp_path):
    _record_request(tmp_path)
    p = tmp_path / "traces.db"
    store_sql.forget_schema_version(p)  # what a store written before the version table looks like
    with store.reading(p) as c:  # a reader accepts it as it is
        assert [r["trace_id"] for r in store.slowest(c, 10)] == [TID]
    store.connect(p).close()  # a writer adds the version
    assert store_sql.meta(p) == {"schema_version": str(store.SCHEMA_VERSION)}
    with store.reading(p) as c:
        assert [r["trace_id"] for r in store.slowest(c, 10)] == [TID]


def test_a_version_1_store_is_migrated_and_its_handoffs_marked_unknown(tmp_path):
    """Schema 1 had a two-clock handoff_s and no clock crossings: after the
    upgrade the figure is kept as handoff_raw_s and the handoff is unknown."""
    p = tmp_path / "traces.db"
    row = dict(trace_id=TID, mode="push", start_ns=1, prefill_finished_ns=1000, kv_ready_ns=5001000, n_spans=3)
    store_sql.create_old_store(p, 1, [row])
    with store.reading(p) as c:  # a reader upgrades it once, then reads
        (row,) = store.slowest(c, 10)
    assert row["handoff_raw_s"] == pytest.approx(0.005) and row["handoff_s"] is None
    assert "schema 1" in row["handoff_note"] and row["n_spans"] == 3
    assert store_sql.meta(p) == {"schema_version": str(store.SCHEMA_VERSION)}


def test_a_writer_runs_the_migrations_up_to_its_version(backend, monkeypatch):
    from kvtrace.store import schema

    p = backend.store
    store.connect(p).close()
    monkeypatch.setattr(schema, "SCHEMA_VERSION", store.SCHEMA_VERSION + 1)
    monkeypatch.setattr(schema, "MIGRATIONS", {store.SCHEMA_VERSION: store_sql.added_column_migration("note")})
    store.connect(p).close()
    store.connect(p).close()  # already current: the migration does not run twice (it would fail)
    assert store_sql.meta(p) == {"schema_version": str(store.SCHEMA_VERSION + 1)}
    assert "note" in store_sql.columns(p, "traces")
    with store.reading(p) as c:  # a reader of the new version reads it
        assert store.info(c)["traces"] == 0


@pytest.mark.parametrize("content", [b"", b"not a database" * 100], ids=["0-byte", "garbage"])
def test_a_corrupt_or_empty_file_is_a_clear_error(tmp_path, content):
    p = tmp_path / "traces.db"
    p.write_bytes(content)
    with pytest.raises(store.StoreCorrupt, match="not a kvlens trace store"):
        store.connect(p, readonly=True)
    with pytest.raises(store.StoreError):
        with store.reading(p) as c:
            store.info(c)


@pytest.mark.parametrize("name", ["a#b", "a%20b", "a?mode=rw", "with space", "é"])
def test_paths_with_uri_characters_open_read_only(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    _record_request(d)
    with store.reading(d / "traces.db") as c:
        assert [r["trace_id"] for r in store.slowest(c, 10)] == [TID]
    with pytest.raises(store.StoreMissing, match="a#b|a%20b|a\\?mode|with space|é"):
        store.connect(d / "other.db", readonly=True)


def test_reading_turns_backend_errors_into_store_errors(backend):
    p = backend.store
    store.connect(p).close()
    with pytest.raises(store.StoreError):
        with store.reading(p) as c:
            store_sql.run_refused_statement(c)  # any backend error inside the block


def test_traces_cli_prints_one_line_on_a_bad_store(tmp_path, capsys):
    from kvlens.cli import main

    bad = tmp_path / "traces.db"
    bad.write_bytes(b"garbage" * 1000)
    assert main(["traces", "--store", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvlens traces:") and "Traceback" not in err
    store_p = tmp_path / "new" / "traces.db"
    store.connect(store_p).close()
    store_sql.set_schema_version(store_p, store.SCHEMA_VERSION + 1)
    assert main(["traces", "--store", str(store_p)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "schema version" in err
    assert main(["traces", "--store", str(tmp_path / "absent.db")]) == 2
    assert "trace store not found" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0 and False, reason="")
def test_unwritable_store_drops_spans_without_raising(tmp_path, caplog):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "traces.db").mkdir()  # a directory where the file should be: unwritable for anyone, root included
    exp = store.StoreSpanExporter(ro / "traces.db")
    r = Recorder(
        role="prefill",
        mode="push",
        pipeline_factory=pipeline.provider_factory(
            role="prefill", mode="push", engine_id=None, config={"kvlens_home": str(ro), "kvlens_metrics": "off"}
        ),
    )
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


def test_bench_rows_roundtrip(backend):
    conn = store.connect(backend.store)
    rows = [
        {
            "mode": "push",
            "dispatch": "overlapped",
            "qps": 1.0,
            "input_len": 256,
            "output_len": 8,
            "num_prompts": 4,
            "completed": 4,
        }
    ]
    store.save_bench_rows(conn, "run1", rows)
    store.save_bench_rows(conn, "run2", rows + [dict(rows[0], mode="pull")])
    assert len(store.bench_rows(conn)) == 2 and store.bench_rows(conn, "run1")[0]["completed"] == 4
    assert [r["run_id"] for r in store.bench_runs(conn)] == ["run2", "run1"]


def test_config_validation_is_strict():
    with pytest.raises(ValueError, match="kvlens_bogus"):
        Options.from_config({"kvlens_bogus": 1})
    with pytest.raises(ValueError, match="otlp_endpoint"):
        Options.from_config({"otlp_endpoint": "localhost:4318"})
    with pytest.raises(ValueError, match="kvlens_buffer_events"):
        Options.from_config({"kvlens_buffer_events": "many"})
    assert Options.from_config({"kvlens_home": "/x", "other_vllm_key": 1}) == Options.from_config({"kvlens_home": "/x"})
    with pytest.raises(ValueError, match="kvlens_span_builder must be 'sidecar' or 'inline'"):
        Options.from_config({"kvlens_span_builder": "thread"})
    assert Options.from_config({"kvlens_span_builder": "inline"}).span_builder == "inline"


def test_collector_store_needs_a_separate_collector_process(tmp_path):
    """``kvlens up --collector-store`` names the collector's store: refused
    where no collector process runs; the stack's joined store is that URL."""
    from kvlens.stack.errors import StackError
    from kvlens.stack.launch import Stack

    url = "postgresql://kvlens@db.internal:5432/kvlens"
    for kw in ({}, {"separate_homes": True, "collector": "router"}):
        with pytest.raises(StackError, match="--collector-store needs --separate-homes with --collector process"):
            Stack(mode="push", kvlens_home=tmp_path, collector_store=url, **kw)
    s = Stack(mode="push", kvlens_home=tmp_path, separate_homes=True, collector_store=url)
    assert s.store.url == url and s.topology.home_for("prefill") == tmp_path.resolve() / "hosts" / "prefill"


# vLLM's own keys that share kv_connector_extra_config with kvlens' (the stack's,
# NIXL push/pull's, and other connectors' of the supported vLLM): never mistaken for typos.
_VLLM_KEYS = (
    "kv_lease_duration",
    "push_registration_timeout",
    "backends",
    "bidirectional_kv_xfer",
    "decoder_kv_blocks_ttl",
    "enforce_handshake_compat",
    "engine_ttl",
    "kv_recompute_threshold",
    "num_threads",
    "backend",
    "num_workers",
    "handshake_port",
    "notify_port",
    "transfer_timeout",
    "enable_telemetry",
    "read_mode",
    "use_layerwise",
    "store_threshold",
    "memory_limit",
    "max_tracker_size",
    "http_port",
)


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("otlp_endpiont", "otlp_endpoint"),
        ("otel_endpoint", "otlp_endpoint"),
        ("OTLP_ENDPOINT", "otlp_endpoint"),
        ("kvlens_buffer_event", "kvlens_buffer_events"),
        ("kvlen_home", "kvlens_home"),
        ("kv_lens_home", "kvlens_home"),
        ("kvlens_metric", "kvlens_metrics"),
        ("kvlens_bogus", None),
        ("otlp_headers", None),
    ],
)
def test_misspelled_option_names_the_key_and_the_closest_known_one(typo, meant):
    with pytest.raises(ValueError) as e:
        Options.from_config({typo: "http://x:4318", "kv_lease_duration": 7})
    msg = str(e.value)
    assert repr(typo) in msg and "did you mean" in msg
    if meant:
        assert f"did you mean {meant!r}" in msg


def test_vllm_keys_pass_validation():
    cfg = {k: 1 for k in _VLLM_KEYS}
    cfg["kvlens_home"] = "/x"
    assert Options.from_config(cfg) == Options.from_config({"kvlens_home": "/x"})


def test_stack_kv_transfer_config_validates():
    from kvlens.stack.commands import kv_transfer_config

    for mode in ("push", "pull"):
        cfg = kv_transfer_config(mode, "prefill", "p0", False, Path("/tmp/h"), otlp_endpoint="http://c:4318")
        extra = cfg["kv_connector_extra_config"]
        assert {k for k in extra if k.startswith(("kvlens", "otlp"))} == {"kvlens_home", "otlp_endpoint"}
        opts = Options.from_config(extra)
        assert (opts.home, opts.otlp_endpoint) == (Path("/tmp/h").resolve(), "http://c:4318")


@pytest.mark.parametrize("bad", [True, False, 0, -3, 1.5, "many", "true", None, [8]])
def test_buffer_events_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="kvlens_buffer_events"):
        Options.from_config({"kvlens_buffer_events": bad})


@pytest.mark.parametrize("good, n", [(1, 1), (4096, 4096), ("4096", 4096), (" 64 ", 64), (512.0, 512)])
def test_buffer_events_accepts_integers(good, n):
    assert Options.from_config({"kvlens_buffer_events": good}).buffer_events == n
    r = pipeline.get_recorder(
        "router",
        "push",
        f"buf-{n}-{good!r}",
        {"kvlens_buffer_events": good, "kvlens_store": "off", "kvlens_metrics": "off"},
    )
    try:
        assert r.capacity == n
    finally:
        pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)


def test_string_options_must_be_strings():
    for key in ("kvlens_home", "otlp_endpoint", "kvlens_service_name"):
        with pytest.raises(ValueError, match=key):
            Options.from_config({key: 5})


def test_connector_start_fails_on_a_misspelled_option():
    """At engine start the connector validates before anything else, so a typo
    stops vLLM's start-up with the message (not telemetry silently off)."""
    from types import SimpleNamespace

    from instrumented_connector import connector

    vcfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_producer", kv_connector_extra_config={"otlp_endpiont": "http://c:4318"}
        )
    )
    with pytest.raises(ValueError, match="did you mean 'otlp_endpoint'"):
        connector._make_recorder(vcfg, "push", "typo-engine")


def test_span_attributes_are_stored_as_json_whatever_their_values(backend):
    """Attributes go in as JSON text (orjson, or the json module for what it
    refuses, such as an int past 64 bits) and come back as they were recorded."""
    from collector.wire import WireSpan

    attrs = {
        "kvlens.role": "prefill",
        "kvlens.mode": "push",
        "kvlens.blocks": 16,
        "kvlens.nixl_xfer_s": 1e-05,
        "kvlens.remote_ranks": (0, 1),
        "kvlens.ok": True,
        "huge": 2**70,
    }
    tid = int(TID, 16)
    small = {k: v for k, v in attrs.items() if k != "huge"}
    spans = [
        WireSpan("prefill", tid, 1, None, 10, 20, dict(attrs), TID, "%016x" % 1, None),
        WireSpan("prefill.finished", tid, 2, None, 20, 20, small, TID, "%016x" % 2, None),
    ]
    conn = store.connect(backend.store)
    store.write_spans(conn, spans)
    got = {s["name"]: s["attributes"] for s in store.spans_for(conn, [TID])[TID]}
    assert got["prefill"] == {**attrs, "kvlens.remote_ranks": [0, 1]}
    assert got["prefill.finished"] == {k: v for k, v in got["prefill"].items() if k != "huge"}
