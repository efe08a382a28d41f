"""PostgreSQL's day partitions (:mod:`kvtrace.store.partitions`) on the real
server, and what both backends must agree on: a request whose spans
straddle midnight UTC is one summary row, retention drops old days, and a
version-4 store migrates to version 5 with its rows."""

from __future__ import annotations

import random
import threading
import time

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

from kvrecord import semconv as sc
from kvtrace import store
from kvtrace.store import partitions
import store_sql
from kvtrace.store.columns import SUMMARY_PHASES, phase_column
from kvtrace.store.ddl import DROPPED_V5_INDEXES
from kvtrace.store.partitions import DAY_NS, day_of

MS = 1_000_000
S = 1000 * MS


def _span(tid: int, sid: int, name: str, role: str, t0: int, t1: int) -> ReadableSpan:
    attrs = {sc.ATTR_ROLE: role, sc.ATTR_MODE: "push", sc.ATTR_OUTCOME: "ok", sc.ATTR_REQUEST_ID: f"r{tid:x}"}
    return ReadableSpan(
        context=SpanContext(tid, sid, False), parent=None, name=name, attributes=attrs, start_time=t0, end_time=t1
    )


def _straddling(tid: int, midnight: int) -> tuple[list, list]:
    """A request's spans: (those that start before ``midnight``, those after)."""
    before = [_span(tid, 1, "request", "router", midnight - 2 * S, midnight + 3 * S)]
    before.append(_span(tid, 2, "prefill", "prefill", midnight - S, midnight - S // 2))
    after = [_span(tid, 3, "kv.ready", "decode", midnight + S, midnight + S)]
    after.append(_span(tid, 4, "decode.first_step", "decode", midnight + 2 * S, midnight + 2 * S + MS))
    return before, after


def _midnight(days_ago: int = 1) -> int:
    return (day_of(time.time_ns()) - days_ago + 1) * DAY_NS


def test_writers_create_the_partitions_their_spans_need(pg_url):
    conn = store.connect(pg_url)
    try:
        today = partitions.today()
        assert {today, today + 1} <= set(partitions.attached(conn, "spans"))  # made on connect
        old = (today - 10) * DAY_NS + 3600 * S
        store.write_spans(conn, [_span(7, 1, "request", "router", old, old + S)])
        assert today - 10 in partitions.attached(conn, "spans") and today - 10 in partitions.attached(conn, "traces")
        assert store_sql.trace_days(conn, format(7, "032x")) == [today - 10]
    finally:
        conn.close()
    with store.reading(pg_url) as c:
        assert len(store.spans_for(c, [format(7, "032x")])[format(7, "032x")]) == 1


def test_a_request_straddling_midnight_is_one_summary_row(backend):
    """Its spans arrive in two batches across midnight, in either order: one
    row (in the day of its first span on PostgreSQL) with all its spans."""
    midnight = _midnight()
    conn = store.connect(backend.store)
    try:
        for tid, order in ((0xA1, (0, 1)), (0xA2, (1, 0))):
            halves = _straddling(tid, midnight)
            for i in order:
                store.write_spans(conn, halves[i])
            if backend.is_pg:
                assert store_sql.trace_days(conn, format(tid, "032x")) == [day_of(midnight) - 1]
    finally:
        conn.close()
    ids = [format(0xA1, "032x"), format(0xA2, "032x")]
    with store.reading(backend.store) as c:
        rows = store.slowest(c, 10, trace_ids=ids)
        spans = store.spans_for(c, ids)
    assert sorted(r["trace_id"] for r in rows) == ids
    assert all(r["n_spans"] == 4 and r["start_ns"] == midnight - 2 * S for r in rows)
    assert all(len(spans[t]) == 4 for t in ids)


def test_concurrent_writers_fold_a_request_across_midnight_into_one_row(pg_url):
    """Two connections write the two halves of the same requests at once
    (each half one batch, in shuffled orders): the advisory lock makes the
    second find the first's row, whichever day it went to."""
    midnight = _midnight()
    tids = list(range(0xB00, 0xB28))
    store.connect(pg_url).close()
    go = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer(side: int) -> None:
        conn = store.connect(pg_url)
        try:
            order = tids[:]
            random.Random(side).shuffle(order)
            go.wait()
            for t in order:
                store.write_spans(conn, _straddling(t, midnight)[side])
        except BaseException as e:  # noqa: BLE001 - the assert below reports it
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=writer, args=(side,)) for side in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ids = [format(t, "032x") for t in tids]
    with store.reading(pg_url) as c:
        rows = store.slowest(c, 100, trace_ids=ids)
        assert sorted(r["trace_id"] for r in rows) == ids  # one row each
        assert all(r["n_spans"] == 4 and r["start_ns"] == midnight - 2 * S for r in rows)
        assert {d for t in ids for d in store_sql.trace_days(c, t)} == {day_of(midnight) - 1}
        assert sum(len(v) for v in store.spans_for(c, ids).values()) == 4 * len(ids)


def _bulk(conn, starts: list[int], first: int = 1) -> list[str]:
    """Requests with 2 spans each starting at ``starts`` (bulk_insert, summary rows with keep); their ids."""
    cols = (*store.TRACE_COLUMNS, "keep", phase_column(SUMMARY_PHASES[0]))
    spans, traces, ids = [], [], []
    for i, t in enumerate(starts, first):
        tid = format(i, "032x")
        ids.append(tid)
        spans += [
            (tid, format(j, "016x"), None, f"s{j}", "prefill", "push", tid, t + j, t + 9, "ok", "{}") for j in (1, 2)
        ]
        traces.append(
            (tid, tid, "push", "overlapped", "ok", t, t + 10, 0.01, t + 1, t + 2, 2, 0.001, 0.0001, "all", 1e-8)
        )
    store.bulk_insert(conn, spans, traces, cols)
    return ids


def test_retention_drops_old_days_and_keeps_the_rest(backend):
    """PostgreSQL drops the old days' partitions (a Retention of days keeps
    whole days); SQLite deletes the same rows in batches."""
    now = time.time_ns()
    conn = store.connect(backend.store)
    try:
        old = _bulk(conn, [now - 5 * DAY_NS + i for i in range(4)] + [now - 4 * DAY_NS])
        kept = _bulk(conn, [now - 3600 * S, now], first=100)
        keep = store.Retention.of("2d")
        assert keep.after_write(conn) == 5
        if backend.is_pg:
            days = set(partitions.attached(conn, "spans")) | set(partitions.attached(conn, "traces"))
            assert not days & {day_of(now - 5 * DAY_NS), day_of(now - 4 * DAY_NS)}
            assert day_of(now) in days
    finally:
        conn.close()
    with store.reading(backend.store) as c:
        assert store.info(c)["traces"] == 2
        left = store.spans_for(c, old + kept)
    assert [t for t, s in left.items() if s] == kept and all(len(left[t]) == 2 for t in kept)


def test_a_version_4_store_is_migrated_with_its_rows(backend):
    """Version 4's tables as kvlens wrote them: partitioned on PostgreSQL,
    the rows copied, three indexes fewer on both backends, reads unchanged."""
    store_sql.create_v4_store(backend.store)
    now = time.time_ns()
    starts = [now - 3 * DAY_NS, now - DAY_NS, now]
    ids = [format(0xC0 + i, "032x") for i in range(3)]
    cols = (*store.TRACE_COLUMNS, "keep")
    store_sql.insert_rows(
        backend.store,
        "traces",
        cols,
        [
            (t, t, "pull", "sequential", "ok", s, s + S, 0.2, s + 1, s + 2, 1, 0.001 * (i + 1), 1e-4, "all")
            for i, (t, s) in enumerate(zip(ids, starts))
        ],
    )
    store_sql.insert_rows(
        backend.store,
        "spans",
        store.SPAN_COLUMNS,
        [(t, "1", None, "request", "router", "pull", t, s, s + S, "ok", "{}") for t, s in zip(ids, starts)],
    )
    assert store_sql.meta(backend.store)["schema_version"] == "4"
    store.connect(backend.store).close()
    assert (
        store_sql.meta(backend.store)["schema_version"] == str(store.SCHEMA_VERSION) == "7"
    )  # through 5 (issue 37: 6; the verdict columns: 7)
    rels = store_sql.relation_bytes(backend.store)
    assert not set(DROPPED_V5_INDEXES) & set(rels)
    with store.reading(backend.store) as c:
        rows = store.slowest(c, 10)
        spans = store.spans_for(c, ids)
        if backend.is_pg:
            assert {day_of(s) for s in starts} <= set(partitions.attached(c, "traces"))
            assert [store_sql.trace_days(c, t) for t in ids] == [[day_of(s)] for s in starts]
    assert [r["trace_id"] for r in rows] == ids[::-1] and [r["handoff_s"] for r in rows] == [0.003, 0.002, 0.001]
    assert all(len(spans[t]) == 1 for t in ids)


def test_a_day_detach_a_reader_holds_up_is_finished_by_the_next_pass(pg_url):
    """A reader's open snapshot makes the concurrent detach wait past the
    pass's budget: the pass gives up (writers never waited) and the next one
    finishes the detach and drops the day."""
    from kvtrace.store.schema import read_tx

    now = time.time_ns()
    conn = store.connect(pg_url)
    try:
        old = _bulk(conn, [now - 5 * DAY_NS])
        with store.reading(pg_url) as r, read_tx(r):
            assert store.info(r)["traces"] == 1  # the snapshot that sees the old day
            held = store.Retention(2 * 86400, budget_s=0.2)
            assert held.after_write(conn) == 0  # timed out, logged, not raised
            _bulk(conn, [now], first=50)  # writers go on meanwhile
        assert day_of(now - 5 * DAY_NS) in partitions.attached(conn, "traces")  # detach pending
        store.prune(conn, now - 2 * DAY_NS, exact=False)
        assert day_of(now - 5 * DAY_NS) not in partitions.attached(conn, "traces")
    finally:
        conn.close()
    with store.reading(pg_url) as c:
        assert store.info(c)["traces"] == 1 and not store.spans_for(c, old)[old[0]]


def test_a_time_window_reads_only_its_days_partitions(backend):
    """The same rows on both backends; PostgreSQL's plan touches only the
    partitions of the window's days (each row's day is its start's)."""
    now = time.time_ns()
    conn = store.connect(backend.store)
    try:
        _bulk(conn, [now - 3 * DAY_NS, now - 2 * DAY_NS - 1, now - 60 * S, now])
        since = now - 3600 * S
        rows = store.slowest(conn, 10, order="start", since_ns=since)
        plan = store.slowest_plan(conn, 10, mode="push", since_ns=since)
        older = store.window(conn, since_ns=now - 3 * DAY_NS - 1, until_ns=now - 2 * DAY_NS, limit=10)
    finally:
        conn.close()
    assert [r["start_ns"] for r in rows] == [now, now - 60 * S]
    assert [w[2] for w in older] == [now - 2 * DAY_NS - 1, now - 3 * DAY_NS]
    if backend.is_pg:
        assert partitions.partition_name("traces", day_of(now)) in plan
        assert partitions.partition_name("traces", day_of(now - 3 * DAY_NS)) not in plan
