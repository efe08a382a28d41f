"""Embedded trace store: one SQLite file (WAL) per host that every kvlens
process writes to and the CLI / dashboard read read-only.

Tables
------
``spans``   one row per span (any process), keyed (trace_id, span_id).
``traces``  one row per request, folded from its spans by an UPSERT as spans
            arrive from router, P and D in any order; ``handoff_s`` is a
            generated column ``(kv_ready_ns - prefill_finished_ns) / 1e9``.
``bench_rows`` results of ``kvlens bench`` (one row per grid cell).

Indexes are chosen for the two hot reads: "slowest N by handoff (or TTFT),
filtered by mode / outcome / time" (``traces_*_handoff``, ``traces_*_ttft``,
``traces_start``: SQLite walks the matching index in order and stops after N)
and "all spans of these traces" (the spans primary key).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from instrumented_connector import semconv as sc

logger = logging.getLogger("kvlens")

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id   TEXT NOT NULL,
    span_id    TEXT NOT NULL,
    parent_id  TEXT,
    name       TEXT NOT NULL,
    role       TEXT,
    mode       TEXT,
    request_id TEXT,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER NOT NULL,
    outcome    TEXT,
    attributes TEXT,
    PRIMARY KEY (trace_id, span_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS traces (
    trace_id            TEXT PRIMARY KEY,
    request_id          TEXT,
    mode                TEXT,
    dispatch            TEXT,
    outcome             TEXT,
    start_ns            INTEGER,
    end_ns              INTEGER,
    ttft_s              REAL,
    prefill_finished_ns INTEGER,
    kv_ready_ns         INTEGER,
    n_spans             INTEGER NOT NULL DEFAULT 0,
    handoff_s           REAL GENERATED ALWAYS AS ((kv_ready_ns - prefill_finished_ns) / 1e9) STORED
);
CREATE INDEX IF NOT EXISTS traces_mode_handoff ON traces (mode, handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_mode_outcome_handoff ON traces (mode, outcome, handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_outcome_handoff ON traces (outcome, handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_handoff ON traces (handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_mode_ttft ON traces (mode, ttft_s DESC);
CREATE INDEX IF NOT EXISTS traces_ttft ON traces (ttft_s DESC);
CREATE INDEX IF NOT EXISTS traces_start ON traces (start_ns);
CREATE TABLE IF NOT EXISTS bench_rows (
    run_id      TEXT NOT NULL,
    created_ns  INTEGER NOT NULL,
    mode        TEXT NOT NULL,
    dispatch    TEXT,
    qps         REAL NOT NULL,
    input_len   INTEGER NOT NULL,
    output_len  INTEGER,
    num_prompts INTEGER,
    row         TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS bench_rows_run ON bench_rows (run_id);
"""

# Worst outcome wins when folding spans into a trace. instr() positions in
# this string rank them: ok(1) < expired(4) < timeout(12) < failed(20).
_OUTCOME_RANK = "'ok expired timeout failed'"

_UPSERT_TRACE = f"""
INSERT INTO traces (trace_id, request_id, mode, dispatch, outcome, start_ns, end_ns,
                    ttft_s, prefill_finished_ns, kv_ready_ns, n_spans)
VALUES (:trace_id, :request_id, :mode, :dispatch, :outcome, :start_ns, :end_ns,
        :ttft_s, :prefill_finished_ns, :kv_ready_ns, 1)
ON CONFLICT (trace_id) DO UPDATE SET
    request_id = CASE WHEN :is_router OR traces.request_id IS NULL
                      THEN excluded.request_id ELSE traces.request_id END,
    mode = COALESCE(traces.mode, excluded.mode),
    dispatch = COALESCE(excluded.dispatch, traces.dispatch),
    outcome = CASE WHEN instr({_OUTCOME_RANK}, excluded.outcome) > instr({_OUTCOME_RANK}, traces.outcome)
                   THEN excluded.outcome ELSE traces.outcome END,
    start_ns = MIN(traces.start_ns, excluded.start_ns),
    end_ns = MAX(traces.end_ns, excluded.end_ns),
    ttft_s = COALESCE(excluded.ttft_s, traces.ttft_s),
    prefill_finished_ns = COALESCE(traces.prefill_finished_ns, excluded.prefill_finished_ns),
    kv_ready_ns = COALESCE(traces.kv_ready_ns, excluded.kv_ready_ns),
    n_spans = traces.n_spans + 1
"""

_INSERT_SPAN = """
INSERT OR REPLACE INTO spans (trace_id, span_id, parent_id, name, role, mode, request_id,
                              start_ns, end_ns, outcome, attributes)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""


def connect(path: str | Path, *, readonly: bool = False, timeout_s: float = 5.0) -> sqlite3.Connection:
    """Open the store. Writers create it (WAL, schema); readers open it
    read-only and fail with a clear error when it does not exist."""
    path = Path(path)
    if readonly:
        if not path.exists():
            raise FileNotFoundError(f"trace store not found: {path}")
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        return conn
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: transactions are explicit (see write_spans).
    conn = sqlite3.connect(str(path), timeout=timeout_s, check_same_thread=False, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(SCHEMA)
    return conn


def _span_rows(span) -> tuple[tuple, dict]:
    """(spans row, traces upsert params) for one OTel ReadableSpan."""
    ctx = span.context
    a = dict(span.attributes or {})
    tid = format(ctx.trace_id, "032x")
    name = span.name
    role = a.get(sc.ATTR_ROLE)
    mode = a.get(sc.ATTR_MODE)
    outcome = a.get(sc.ATTR_OUTCOME, "ok")
    rid = a.get(sc.ATTR_REQUEST_ID)
    parent = format(span.parent.span_id, "016x") if span.parent else None
    start, end = int(span.start_time or 0), int(span.end_time or span.start_time or 0)
    row = (tid, format(ctx.span_id, "016x"), parent, name, role, mode, rid, start, end, outcome,
           json.dumps(a, default=str, separators=(",", ":")))
    is_router = role == sc.Role.ROUTER.value
    up = {
        "trace_id": tid,
        "request_id": rid if is_router or rid is None else _base_id(rid),
        "mode": mode,
        "dispatch": a.get(sc.ATTR_DISPATCH),
        "outcome": outcome,
        "start_ns": start,
        "end_ns": end,
        "ttft_s": a.get(sc.ATTR_TTFT_S) if name == sc.Phase.REQUEST.value else None,
        "prefill_finished_ns": end if name == sc.Phase.PREFILL_FINISHED.value else None,
        "kv_ready_ns": end if name == sc.Phase.KV_READY.value else None,
        "is_router": is_router,
    }
    return row, up


def _base_id(rid: str) -> str:
    from instrumented_connector.recorder import base_request_id

    return base_request_id(rid)


def write_spans(conn: sqlite3.Connection, spans: Sequence) -> None:
    """Insert spans and fold them into ``traces`` in one transaction.

    ``BEGIN IMMEDIATE`` takes the write lock up front, so waiting for another
    process's writer goes through SQLite's busy handler (the connection
    timeout) instead of failing on a read-to-write lock upgrade."""
    rows, ups = [], []
    for s in spans:
        r, u = _span_rows(s)
        rows.append(r)
        ups.append(u)
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(_INSERT_SPAN, rows)
        conn.executemany(_UPSERT_TRACE, ups)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class SQLiteSpanExporter:
    """OTel ``SpanExporter`` writing to the store. Called by the SDK's
    BatchSpanProcessor thread only; a failure (unwritable file, lock held too
    long) is logged once and the batch is dropped - serving never notices."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._warned = False

    #: Every kvlens process of a host writes this one file; on a loaded host a
    #: writer can hold the lock for seconds. Waiting here only delays the SDK's
    #: export thread (its queue is bounded), so wait generously before dropping.
    BUSY_TIMEOUT_S = 30.0
    LOCKED_RETRIES = 4

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = connect(self.path, timeout_s=self.BUSY_TIMEOUT_S)
        return self._conn

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            with self._lock:
                for attempt in range(self.LOCKED_RETRIES + 1):
                    try:
                        write_spans(self._connection(), spans)
                        break
                    except sqlite3.OperationalError as e:
                        msg = str(e).lower()
                        if attempt == self.LOCKED_RETRIES or ("locked" not in msg and "busy" not in msg):
                            raise
                        time.sleep(0.5 * 2**attempt)
            return SpanExportResult.SUCCESS
        except Exception as e:
            if not self._warned:
                self._warned = True
                logger.warning("kvlens: trace store %s not writable (%s); spans dropped", self.path, e)
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    pass
                self._conn = None
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# ------------------------------------------------------------------ readers
def parse_since(text: str | None) -> int | None:
    """'10m' / '2h' / '30s' / '1d' -> a wall-clock ns lower bound (None: all)."""
    if not text:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        if t[-1] in units:
            secs = float(t[:-1]) * units[t[-1]]
        else:
            secs = float(t)
    except (ValueError, IndexError):
        raise ValueError(f"invalid duration {text!r}: use e.g. 30s, 10m, 2h, 1d") from None
    if secs <= 0:
        raise ValueError(f"invalid duration {text!r}: must be > 0")
    return time.time_ns() - int(secs * 1e9)


def slowest(
    conn: sqlite3.Connection,
    n: int = 10,
    *,
    mode: str | None = None,
    outcome: str | None = None,
    since_ns: int | None = None,
    until_ns: int | None = None,
    min_handoff_s: float | None = None,
    max_handoff_s: float | None = None,
    trace_ids: Iterable[str] | None = None,
    order: str = "handoff",
) -> list[dict[str, Any]]:
    """Traces ordered by handoff (or ttft) descending, with parameterised filters."""
    where, params = ["1=1"], []
    if mode:
        where.append("mode = ?")
        params.append(mode)
    if outcome:
        where.append("outcome = ?")
        params.append(outcome)
    if since_ns is not None:
        where.append("start_ns >= ?")
        params.append(since_ns)
    if until_ns is not None:
        where.append("start_ns <= ?")
        params.append(until_ns)
    if min_handoff_s is not None:
        where.append("handoff_s >= ?")
        params.append(min_handoff_s)
    if max_handoff_s is not None:
        where.append("handoff_s < ?")
        params.append(max_handoff_s)
    if trace_ids is not None:
        ids = list(trace_ids)
        if not ids:
            return []
        where.append(f"trace_id IN ({','.join('?' * len(ids))})")
        params.extend(ids)
    col = {"handoff": "handoff_s", "ttft": "ttft_s", "start": "start_ns"}.get(order)
    if col is None:
        raise ValueError(f"unknown order {order!r}")
    sql = (
        "SELECT trace_id, request_id, mode, dispatch, outcome, start_ns, end_ns, ttft_s, "
        "prefill_finished_ns, kv_ready_ns, handoff_s, n_spans FROM traces "
        f"WHERE {' AND '.join(where)} ORDER BY {col} DESC LIMIT ?"  # NULLs sort last in DESC
    )
    params.append(int(n))
    return [dict(r) for r in conn.execute(sql, params)]


def spans_for(conn: sqlite3.Connection, trace_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """All spans of the given traces, ordered by start time."""
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in trace_ids}
    if not trace_ids:
        return out
    q = (
        "SELECT trace_id, span_id, parent_id, name, role, mode, request_id, start_ns, end_ns, "
        f"outcome, attributes FROM spans WHERE trace_id IN ({','.join('?' * len(trace_ids))}) "
        "ORDER BY start_ns, end_ns"
    )
    for r in conn.execute(q, list(trace_ids)):
        d = dict(r)
        d["attributes"] = json.loads(d["attributes"] or "{}")
        out.setdefault(d["trace_id"], []).append(d)
    return out


def trace_record(summary: dict[str, Any], spans: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``kvlens traces --json`` object for one trace."""
    return {
        "trace_id": summary["trace_id"],
        "request_id": summary["request_id"],
        "mode": summary["mode"],
        "dispatch": summary.get("dispatch"),
        "outcome": summary["outcome"],
        "ttft_s": summary["ttft_s"],
        "handoff_s": summary["handoff_s"],
        "start_ns": summary["start_ns"],
        "spans": [
            {
                "name": s["name"],
                "role": s["role"],
                "start_ns": s["start_ns"],
                "end_ns": s["end_ns"],
                "span_id": s["span_id"],
                "parent_id": s["parent_id"],
                "outcome": s["outcome"],
                "attributes": s["attributes"],
            }
            for s in spans
        ],
    }


def save_bench_rows(conn: sqlite3.Connection, run_id: str, rows: Sequence[dict[str, Any]]) -> None:
    """Persist ``kvlens bench`` rows (dicts with the --json keys)."""
    now = time.time_ns()
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(
            "INSERT INTO bench_rows (run_id, created_ns, mode, dispatch, qps, input_len, output_len, "
            "num_prompts, row) VALUES (?,?,?,?,?,?,?,?,?)",
            [
                (run_id, now, r["mode"], r.get("dispatch"), float(r["qps"]), int(r["input_len"]),
                 r.get("output_len"), r.get("num_prompts"), json.dumps(r))
                for r in rows
            ],
        )
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def bench_rows(conn: sqlite3.Connection, run_id: str | None = None) -> list[dict[str, Any]]:
    """Bench rows of one run (default: the latest run)."""
    if run_id is None:
        r = conn.execute("SELECT run_id FROM bench_rows ORDER BY created_ns DESC LIMIT 1").fetchone()
        if r is None:
            return []
        run_id = r[0]
    return [
        dict(json.loads(r["row"]), run_id=r["run_id"])
        for r in conn.execute("SELECT run_id, row FROM bench_rows WHERE run_id = ? ORDER BY rowid", (run_id,))
    ]


def bench_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Bench runs, newest first: run_id, created_ns, rows."""
    return [
        dict(r)
        for r in conn.execute(
            "SELECT run_id, MAX(created_ns) AS created_ns, COUNT(*) AS rows FROM bench_rows "
            "GROUP BY run_id ORDER BY created_ns DESC"
        )
    ]
