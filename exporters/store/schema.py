"""The trace store's schema and how a connection to it is opened.

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

import sqlite3
from pathlib import Path

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
