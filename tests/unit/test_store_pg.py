"""The PostgreSQL backend against SQLite, on a real server (``pg_server``):
same spans in, same answers out (store queries, the handoff resolver,
``kvlens traces``, the dashboard's data layer); retention on both; and the
faults a shared server brings (a wrong URL, a server that is down at start,
one that goes away while the collector runs and comes back)."""

from __future__ import annotations

import math
import time

import pandas as pd
import pytest
from prometheus_client import CollectorRegistry

from kvtrace import store, tiling, tracemodel
from collector.ingest import Ingest
from fakes import wait_for
from store_backends import Backend
from synthetic_store import build

MS = 1_000_000


def _norm(v):
    """Floats to 9 significant digits (the backends may differ in the last
    bit of a generated column computed by the database)."""
    if isinstance(v, float):
        return v if math.isnan(v) else float(f"{v:.9g}")
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_norm(x) for x in v)
    return v


@pytest.fixture(scope="module")
def both(pg_server, tmp_path_factory):
    """The same synthetic traces in a SQLite file and a PostgreSQL database:
    (sqlite Backend, postgresql Backend, trace ids by mode)."""
    from kvtrace.store import pg

    base = time.time_ns() - 700 * 10**9
    d = tmp_path_factory.mktemp("both")
    lite = Backend("sqlite", d / "traces.db", d)
    pgb = Backend("postgresql", pg_server.new_database("both"), d)
    ids = build(lite.store, lite.config(), base)
    assert build(pgb.store, pgb.config(), base) == ids
    yield lite, pgb, ids
    pg.close_pool(pgb.store)


def _spans_without_ids(spans: list[dict]) -> list[dict]:
    """Spans without their (random) span ids, in a stable order."""
    out = [{k: v for k, v in s.items() if k not in ("span_id", "parent_id")} for s in spans]
    return sorted(out, key=lambda s: (s["start_ns"], s["end_ns"], s["name"], s["role"] or ""))


def test_the_same_spans_give_the_same_answers_on_both_backends(both):
    lite, pgb, ids = both
    out = {}
    for b in (lite, pgb):
        with store.reading(b.store) as c:
            tids = ids["push"] + ids["pull"]
            out[b.name] = {
                "info": store.info(c),
                "slowest": sorted(store.slowest(c, 100), key=lambda r: r["trace_id"]),
                "top": [r["trace_id"] for r in store.slowest(c, 5, order="ttft", mode="push")],
                "failed": sorted(r["trace_id"] for r in store.slowest(c, 50, outcome="failed")),
                "handoffs": store.handoffs(c, tids),
                "window": store.window(c, since_ns=None, until_ns=None, limit=1000),
                "sample": store.handoff_sample(
                    c, since_ns=None, until_ns=None, limit=1000, exclude_phases=("request",)
                ),
                "spans": {t: _spans_without_ids(s) for t, s in store.spans_for(c, tids[:6]).items()},
                "bench": [store.bench_rows(c), [r["rows"] for r in store.bench_runs(c)]],
            }
        out[b.name]["sample"] = (out[b.name]["sample"][0], sorted(out[b.name]["sample"][1]))
    assert out["sqlite"]["info"]["traces"] == 24 and len(out["sqlite"]["slowest"]) == 24
    assert out["sqlite"]["failed"]  # the fixture has failed pulls
    for key in out["sqlite"]:
        assert _norm(out["postgresql"][key]) == _norm(out["sqlite"][key]), key


def test_slowest_walks_an_index_on_postgresql(both):
    """Filtered by mode, "slowest" walks the mode's part of the handoff index
    of each day's partition in order and merges them."""
    import store_sql

    _, pgb, _ = both
    with store.reading(pgb.store) as c:
        store_sql.prefer_indexes(c)
        plan = store.slowest_plan(c, 50, mode="push")
        failed = store.slowest_plan(c, 50, outcome="failed")
    assert "Index Scan" in plan and "traces_" in plan and "mode_handoff_s_idx" in plan and "->  Sort " not in plan, plan
    assert "outcome_handoff_s_idx" in failed, failed


def _resolved(b: Backend, ids: dict[str, list[str]]) -> dict:
    from exporters.metrics import PhaseMetricsProcessor

    reg = CollectorRegistry()
    proc = PhaseMetricsProcessor(registry=reg, store_path=b.store, handoff_from="router", exemplars=False)
    try:
        for mode, tids in ids.items():
            for t in tids:
                proc.handoff.submit(t, mode)
        proc.handoff.resolve_once(expire=False)
    finally:
        proc.shutdown()
    g = reg.get_sample_value
    out = {
        m: (g("kvlens_handoff_seconds_count", {"mode": m}), g("kvlens_handoff_seconds_sum", {"mode": m})) for m in ids
    }
    for fam in reg.collect():  # the derived phases the resolver observed, by (mode, role, phase)
        for smp in fam.samples:
            if smp.name == "kvlens_phase_duration_seconds_count":
                out[(smp.labels["mode"], smp.labels["role"], smp.labels["phase"])] = smp.value
    return out


def test_the_handoff_resolver_reads_the_same_on_both_backends(both):
    lite, pgb, ids = both
    a, b = _resolved(lite, ids), _resolved(pgb, ids)
    assert a["push"][0] and a["pull"][0]  # something was resolved
    assert _norm(b) == _norm(a)
    # derived phases (no process sees them whole) come from the resolver: one
    # observation per derived interval of each resolved trace, as the trace model derives them
    with store.reading(lite.store) as c:
        traces = tracemodel.find(c, [t for v in ids.values() for t in v])
    want: dict = {}
    for tr in traces.values():
        if tr.handoff_s is None and tr.handoff_note is None:
            continue
        for name, role, _, _ in tiling.derive(tr.spans):
            want[(tr.mode, role, name)] = want.get((tr.mode, role, name), 0) + 1
    got = {k: v for k, v in a.items() if isinstance(k, tuple)}
    assert got == want
    assert any(k[0] == "pull" and k[2] == "prefill.respond" for k in got)
    assert any(k[0] == "push" and k[2] == "write.notify" for k in got)


def test_kvlens_traces_prints_the_same_on_both_backends(both, capsys):
    from kvlens.cli import main

    lite, pgb, ids = both
    text = {}
    for b in (lite, pgb):
        assert main(["traces", "--store", str(b.store), "--slowest", "4", "--mode", "push"]) == 0
        text[b.name] = capsys.readouterr().out
        assert main(["traces", "--store", str(b.store), "--trace", ids["pull"][3]]) == 0
        text[b.name + "-one"] = capsys.readouterr().out
        assert main(["traces", "--store", str(b.store), "--breakdown"]) == 0
        text[b.name + "-breakdown"] = capsys.readouterr().out
    assert text["sqlite"].count("\n") > 4 and ids["pull"][3] in text["sqlite-one"]
    assert text["postgresql"] == text["sqlite"]
    assert text["postgresql-one"] == text["sqlite-one"]
    assert "handoff" in text["sqlite-breakdown"] and text["postgresql-breakdown"] == text["sqlite-breakdown"]


def test_the_dashboard_data_layer_is_the_same_on_both_backends(both):
    from dashboard import data as D

    lite, pgb, ids = both
    got = {}
    for b in (lite, pgb):
        name = str(b.store)
        head, spans = D.trace_detail(name, ids["push"][2])
        got[b.name] = (
            D.store_info(name),
            D.slowest(name, 10),
            D.phase_breakdown(name, None, None),
            head,
            spans.drop(columns=[c for c in ("span_id", "parent_id") if c in spans]),
        )
    (i1, s1, p1, h1, sp1), (i2, s2, p2, h2, sp2) = got["sqlite"], got["postgresql"]
    assert i1["traces"] == 24 and len(s1) == 10 and len(p1) and h1 is not None and len(sp1)
    assert i2 == i1 and _norm(h2) == _norm(h1)
    pd.testing.assert_frame_equal(s2.reset_index(drop=True), s1.reset_index(drop=True), check_exact=False)
    pd.testing.assert_frame_equal(p2.reset_index(drop=True), p1.reset_index(drop=True), check_exact=False)
    key = [c for c in ("start_ns", "name", "role") if c in sp1]
    pd.testing.assert_frame_equal(
        sp2.sort_values(key).reset_index(drop=True)[sorted(sp2.columns)],
        sp1.sort_values(key).reset_index(drop=True)[sorted(sp1.columns)],
        check_exact=False,
        check_dtype=False,
    )


# --------------------------------------------------------------- retention
def _synthetic(conn, starts: list[int]) -> list[str]:
    """Traces (3 spans each) starting at ``starts`` via bulk_insert; their ids."""
    spans, traces, ids = [], [], []
    for i, t in enumerate(starts):
        tid = format(i + 1, "032x")
        ids.append(tid)
        for j in range(3):
            spans.append(
                (tid, format(j + 1, "016x"), None, f"s{j}", "prefill", "push", tid, t + j, t + j + 5, "ok", "{}")
            )
        traces.append((tid, tid, "push", "overlapped", "ok", t, t + 10, 0.01, t + 1, t + 2, 3, 0.001, 0.0001))
    store.bulk_insert(conn, spans, traces)
    return ids


def test_prune_deletes_old_traces_with_their_spans_in_batches(backend):
    conn = store.connect(backend.store)
    try:
        now = time.time_ns()
        day = 86400 * 10**9
        old = _synthetic(conn, [now - 3 * day + i for i in range(7)] + [now - 60 * 10**9 + i for i in range(3)])
        store.save_bench_rows(conn, "r1", [{"mode": "push", "qps": 1.0, "input_len": 8}])
        assert store.prune(conn, now - day, batch=2) == 7  # 4 transactions: 2 + 2 + 2 + 1
        assert store.prune(conn, now - day, batch=2) == 0
        with store.reading(backend.store) as c:
            assert store.info(c)["traces"] == 3 and store.info(c)["bench_runs"] == 1
            left = store.spans_for(c, old)
        assert [t for t, s in left.items() if s] == old[7:]  # the spans went with their traces
        assert all(len(left[t]) == 3 for t in old[7:])
    finally:
        conn.close()


def test_retention_prunes_after_a_write_at_most_once_per_period(backend):
    conn = store.connect(backend.store)
    try:
        now = time.time_ns()
        _synthetic(conn, [now - 10 * 3600 * 10**9, now - 9 * 3600 * 10**9, now])
        keep = store.Retention.of("1h")
        assert keep.keep_s == 3600 and store.Retention.of("off") is None and store.Retention.of(None) is None
        assert keep.after_write(conn) == 2
        _synthetic(conn, [now - 5 * 3600 * 10**9])  # id 1 again: an old trace arrives late
        assert keep.after_write(conn) == 0  # not due again within every_s
        with store.reading(backend.store) as c:
            assert store.info(c)["traces"] == 2
    finally:
        conn.close()
    with pytest.raises(ValueError, match="invalid duration"):
        store.Retention.of("7 days")


def test_collector_and_connector_retention_options():
    from kvrecord.config import Options
    from kvlens.cli import main

    def retention_s(cfg):
        return Options.from_config(cfg).retention_s

    assert retention_s({"kvlens_retention": "7d"}) == 7 * 86400 and retention_s({}) is None
    assert retention_s({"kvlens_retention": "off"}) is None and retention_s({"kvlens_retention": 60}) == 60
    with pytest.raises(ValueError, match="kvlens_retention"):
        Options.from_config({"kvlens_retention": "forever"})
    assert main(["collect", "--retention", "soon", "--port", "0"]) == 2


# ------------------------------------------------------------------ faults
def test_a_malformed_store_url_is_refused_with_a_clear_message(tmp_path, capsys):
    from kvrecord.config import Options
    from kvlens.cli import main

    parse = store.StoreLocation.parse
    assert parse("postgresql://u@h/db").is_postgres and parse("postgres://u@h/db").is_postgres
    assert not parse("/tmp/x.db").is_postgres and not parse(tmp_path).is_postgres
    assert parse("postgresql://u:pw@h:5433/db").url == "postgresql://u:pw@h:5433/db"
    assert str(parse("postgresql://u:secret@h:5433/db")) == "postgresql://u:***@h:5433/db"
    for bad, why in [
        ("postgresql://u@h:99999/db", "bad port"),
        ("postgresql://u@h:5432/", "no database"),
        ("postgresql:///db", "no host"),
        ("mysql://u@h/db", "unknown store URL scheme"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse(bad)
    assert Options.from_config({"kvlens_store": "postgresql://u@h/db"}).store.url == "postgresql://u@h/db"
    with pytest.raises(ValueError, match="kvlens_store: no database"):
        Options.from_config({"kvlens_store": "postgresql://u@h:5432/"})
    with pytest.raises(ValueError, match="kvlens_store must be 'on', 'off' or a postgresql://"):
        Options.from_config({"kvlens_store": "postgresq://u@h/db"})
    assert main(["collect", "--store", "postgresql://u@h:70000/db", "--port", "0"]) == 2
    assert "bad port" in capsys.readouterr().err
    assert main(["dashboard", "--store", "postgresql://u@h/", "--port", "8599"]) == 2
    assert "no database" in capsys.readouterr().err
    assert main(["traces", "--store", "postgresql://u@h/"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no database" in err[0]
    with pytest.raises(store.StoreError, match="no host"):
        store.connect("postgresql:///db")


def _down_url() -> str:
    from kvrecord.ports import free_port

    return f"postgresql://kvlens:secret@127.0.0.1:{free_port()}/traces"  # nothing listens there


def test_a_server_that_is_down_at_start_is_one_line_and_a_non_zero_exit(capsys):
    from kvlens.cli import main

    url = _down_url()
    port = url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(store.StoreUnavailable, match=f"127.0.0.1:{port} is not reachable"):
        store.connect(url)
    with pytest.raises(store.StoreUnavailable):
        with store.reading(url) as c:
            store.info(c)
    for argv, rc in (  # a server that cannot be reached now: the command failed, its input was fine (kvlens.exits)
        (["collect", "--store", url, "--port", "0"], 1),
        (["traces", "--store", url], 1),
        (["verdict", "--store", url], 1),
        (["whatif", "--from", "push", "--store", url], 1),
        (["dashboard", "--store", url, "--port", "8599"], 1),
    ):
        assert main(argv) == rc, argv
        err = capsys.readouterr().err.strip().splitlines()
        # one warning (the password is on the command line), then the one line that says why
        assert len(err) == 2 and "warning" in err[0] and "PGPASSWORD" in err[0], err
        assert f"127.0.0.1:{port} is not reachable" in err[1], err
        assert not [e for e in err if "secret" in e]  # the password is never printed


def test_a_missing_database_or_user_is_named(pg_server, capsys):
    from kvlens.cli import main

    url = pg_server.url("no_such_db")
    with pytest.raises(store.StoreMissing, match="database 'no_such_db' does not exist"):
        store.connect(url)
    assert main(["traces", "--store", url]) == 2
    assert "does not exist" in capsys.readouterr().err
    nobody = f"postgresql://nobody@{pg_server.host}:{pg_server.port}/postgres"
    with pytest.raises(store.StoreAccessDenied, match="refused user 'nobody'"):
        store.connect(nobody)
    empty = pg_server.new_database("empty")
    with pytest.raises(store.StoreMissing, match="no kvlens tables yet"):
        store.connect(empty, readonly=True)


def test_the_span_exporter_stays_bounded_and_counts_a_down_server():
    from opentelemetry.sdk.trace.export import SpanExportResult

    from test_collector import record_spans

    spans = record_spans(1)
    exp = store.StoreSpanExporter(_down_url(), max_block_s=0.3)
    assert exp.export(spans) == SpanExportResult.FAILURE
    assert exp.lost == len(spans)
    exp.shutdown()


def test_the_collector_rides_out_a_server_restart(pg_server, pg_url):
    """Server stopped mid-run: spans wait in the bounded queue (what does not
    fit is refused, 429, and counted), a short-patience collector drops and
    counts; the server comes back and the waiting spans are written."""
    from test_collector import record_spans, trace_ids

    first, second, third = record_spans(1), record_spans(1), record_spans(1)
    patient = Ingest(pg_url, max_queue_spans=len(second) + 5, busy_retry_s=120.0)
    impatient = Ingest(pg_url, busy_retry_s=0.2)
    try:
        assert patient.offer(first) and wait_for(lambda: patient.counts()["written"] == len(first), 30.0)
        pg_server.stop()
        assert patient.offer(second)
        assert not patient.offer(third)  # over the bound: refused (the HTTP layer answers 429)
        assert (
            patient.registry.get_sample_value("kvlens_collector_requests_rejected_total", {"reason": "queue_full"}) == 1
        )
        assert impatient.offer(third)
        assert wait_for(lambda: impatient.counts()["dropped"] == len(third), 30.0)
        assert patient.counts()["written"] == len(first) and patient.counts()["dropped"] == 0
        assert patient.alive()
        pg_server.start()
        assert wait_for(lambda: patient.counts()["written"] == len(first) + len(second), 30.0)
        c = patient.counts()
        assert c["received"] == c["written"] + c["dropped"] + c["queued"] and c["dropped"] == 0
        assert impatient.registry.get_sample_value(
            "kvlens_collector_spans_dropped_total", {"reason": "store_error"}
        ) == len(third)
        with store.reading(pg_url) as conn:
            got = store.spans_for(conn, trace_ids(first + second + third))
        assert sum(len(v) for v in got.values()) == len(first) + len(second)
    finally:
        if not pg_server.running():
            pg_server.start()
        patient.close(5.0)
        impatient.close(5.0)


def test_concurrent_first_writers_create_the_schema_once(pg_url):
    assert _concurrently(lambda _: store.connect(pg_url).close(), 4) == []
    with store.reading(pg_url) as c:
        assert store.info(c)["traces"] == 0


def _concurrently(fn, n: int) -> list[BaseException]:
    """Run ``fn(i)`` for i in range(n) on n threads at once; what they raised."""
    import threading

    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - collected for the caller's assert
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_span_sent_twice_in_one_batch_is_stored_once(backend):
    from test_collector import record_spans, trace_ids

    spans = record_spans(1)
    conn = store.connect(backend.store)
    try:
        store.write_spans(conn, spans + spans[:3])  # an SDK retry inside one batch
    finally:
        conn.close()
    with store.reading(backend.store) as c:
        got = store.spans_for(c, trace_ids(spans))
    assert sum(len(v) for v in got.values()) == len(spans)


def test_concurrent_writers_of_the_same_traces_do_not_deadlock(pg_url):
    """Four connections writing overlapping batches in different orders at
    once: rows are locked in trace-id order, so none waits on another in a
    cycle (PostgreSQL would abort one with "deadlock detected")."""
    import random

    from test_collector import record_spans, trace_ids

    spans = record_spans(3)
    store.connect(pg_url).close()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        conn = store.connect(pg_url)
        try:
            for _ in range(5):
                batch = spans[:]
                rng.shuffle(batch)
                store.write_spans(conn, batch)
        finally:
            conn.close()

    assert _concurrently(writer, 4) == []
    with store.reading(pg_url) as c:
        rows = store.slowest(c, 100)
        assert sum(len(v) for v in store.spans_for(c, trace_ids(spans)).values()) == len(spans)
    assert len(rows) == len(trace_ids(spans)) and all(r["n_spans"] > 0 for r in rows)
