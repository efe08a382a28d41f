"""The trace store's schema, its version, the SQL dialect, and how a
connection to it is opened.

Tables
------
``spans``   one row per span (any process), keyed (trace_id, span_id).
``traces``  one row per request, folded from its spans by an UPSERT as spans
            arrive from router, P and D in any order, with the timestamps of
            the messages that crossed between P and D; the writer's settle
            pass then writes ``handoff_s`` corrected for the two clocks
            (:mod:`exporters.clockbounds`), or leaves it NULL with the reason.
``bench_rows`` results of ``kvlens bench`` (one row per grid cell).
``meta``    ``schema_version`` (and room for more keys).

Indexes are chosen for the two hot reads: "slowest N by handoff (or TTFT),
filtered by mode / outcome / time" (``traces_*_handoff``, ``traces_*_ttft``,
``traces_start``: SQLite walks the matching index in order and stops after N)
and "all spans of these traces" (the spans primary key).

Dialect
-------
Everything SQLite-specific that the queries and the writer need is named in
the "dialect" section below (placeholders, two-argument MIN/MAX, the write
transaction, insertion order, query plans, the catalogue). A second backend
(PostgreSQL) supplies its own values for these and its own :func:`connect`;
the queries in ``queries.py`` / ``writer.py`` are otherwise plain SQL.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from exporters.store.errors import StoreCorrupt, StoreError, StoreMissing, StoreVersionError

# ------------------------------------------------------------------ dialect
#: Parameter placeholder (PostgreSQL drivers: ``%s``).
PARAM = "?"
#: Scalar two-argument minimum / maximum (PostgreSQL: LEAST / GREATEST).
LEAST, GREATEST = "MIN", "MAX"
#: Starts a transaction that takes the write lock up front, so waiting for
#: another process's writer goes through the busy handler (the connection
#: timeout) instead of failing on a read-to-write lock upgrade.
BEGIN_WRITE = "BEGIN IMMEDIATE"
#: An implicit column that orders rows of a table by insertion.
INSERT_ORDER = "rowid"
#: Prefix that turns a query into its plan.
EXPLAIN = "EXPLAIN QUERY PLAN "
_TABLES = "SELECT name FROM sqlite_master WHERE type = 'table'"


def params(n: int) -> str:
    """``n`` comma-separated placeholders, for ``IN (...)``."""
    return ",".join([PARAM] * n)


# ------------------------------------------------------------------ schema
#: The schema this code writes and reads. Bump it with a MIGRATIONS entry.
SCHEMA_VERSION = 2
#: Stores written before the ``meta`` table existed have version 1's tables.
LEGACY_VERSION = 1

#: The ``traces`` table (version 2: clock crossings and the settled handoff,
#: docs/phases.md "Clocks across hosts"). ``handoff_raw_s`` is the two-clock
#: difference; ``handoff_s`` is written by the writer's settle pass
#: (:mod:`exporters.clockbounds`): corrected for the P/D clock offset, with
#: ``handoff_err_s``, or NULL with ``handoff_note`` saying why it is unknown.
#: ``xlo_ns`` / ``xhi_ns``: this request's own bounds on D's clock minus P's.
_TRACES_DDL = """
CREATE TABLE IF NOT EXISTS {name} (
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
    p_engine            TEXT,
    d_engine            TEXT,
    d2p_sent_ns         INTEGER,
    d2p_recv_ns         INTEGER,
    p2d_sent_ns         INTEGER,
    p2d_recv_ns         INTEGER,
    handoff_s           REAL,
    handoff_err_s       REAL,
    clock_offset_s      REAL,
    clock_lo_s          REAL,
    clock_hi_s          REAL,
    handoff_note        TEXT,
    handoff_raw_s       REAL GENERATED ALWAYS AS ((kv_ready_ns - prefill_finished_ns) / 1e9) STORED,
    xlo_ns              INTEGER GENERATED ALWAYS AS (d2p_sent_ns - d2p_recv_ns) STORED,
    xhi_ns              INTEGER GENERATED ALWAYS AS ({least}(
                            COALESCE(p2d_recv_ns - p2d_sent_ns, kv_ready_ns - prefill_finished_ns),
                            COALESCE(kv_ready_ns - prefill_finished_ns, p2d_recv_ns - p2d_sent_ns))) STORED
)"""
_V1_INDEXES = ("traces_mode_handoff", "traces_mode_outcome_handoff", "traces_outcome_handoff", "traces_handoff",
               "traces_mode_ttft", "traces_ttft", "traces_start")
_V1_TRACE_COLUMNS = ("trace_id, request_id, mode, dispatch, outcome, start_ns, end_ns, ttft_s, "
                     "prefill_finished_ns, kv_ready_ns, n_spans")
#: ``MIGRATIONS[v]``: statements that take a version-``v`` store to ``v + 1``
#: (run by a writer's :func:`connect`, before SCHEMA, in one transaction).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 1 -> 2: the traces table is rebuilt (a generated handoff_s becomes a
    # settled one). Rows of version 1 carry no clock crossings: their handoff
    # stays in handoff_raw_s and is marked unknown.
    1: (
        *(f"DROP INDEX IF EXISTS {i}" for i in _V1_INDEXES),
        "ALTER TABLE traces RENAME TO traces_v1",
        _TRACES_DDL.format(name="traces", least=LEAST),
        f"INSERT INTO traces ({_V1_TRACE_COLUMNS}, handoff_note) SELECT {_V1_TRACE_COLUMNS}, "
        "CASE WHEN kv_ready_ns IS NOT NULL AND prefill_finished_ns IS NOT NULL "
        "THEN 'unknown: recorded before clock bounds (schema 1)' END FROM traces_v1",
        "DROP TABLE traces_v1",
    ),
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
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
{traces};
CREATE INDEX IF NOT EXISTS traces_mode_handoff ON traces (mode, handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_mode_outcome_handoff ON traces (mode, outcome, handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_outcome_handoff ON traces (outcome, handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_handoff ON traces (handoff_s DESC);
CREATE INDEX IF NOT EXISTS traces_mode_ttft ON traces (mode, ttft_s DESC);
CREATE INDEX IF NOT EXISTS traces_ttft ON traces (ttft_s DESC);
CREATE INDEX IF NOT EXISTS traces_start ON traces (start_ns);
CREATE INDEX IF NOT EXISTS traces_pair_start ON traces (p_engine, d_engine, start_ns);
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
""".replace("{traces}", _TRACES_DDL.format(name="traces", least=LEAST))

#: Column order of a ``spans`` row (writer, ``bulk_insert``, ``spans_for``).
SPAN_COLUMNS = ("trace_id", "span_id", "parent_id", "name", "role", "mode", "request_id",
                "start_ns", "end_ns", "outcome", "attributes")
#: Column order of a written ``traces`` row (``bulk_insert``: synthetic rows
#: carry their settled handoff as they are; the rest is generated or NULL).
TRACE_COLUMNS = ("trace_id", "request_id", "mode", "dispatch", "outcome", "start_ns", "end_ns",
                 "ttft_s", "prefill_finished_ns", "kv_ready_ns", "n_spans", "handoff_s", "handoff_err_s")

_GET_VERSION = "SELECT value FROM meta WHERE key = 'schema_version'"
_SET_VERSION = (
    f"INSERT INTO meta (key, value) VALUES ('schema_version', {PARAM}) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def stored_version(conn: sqlite3.Connection) -> int | None:
    """The schema version of the open store; ``None`` when it holds no kvlens
    tables at all (a new or 0-byte file). Raises the backend's error on a file
    that is not a database."""
    tables = {r[0] for r in conn.execute(_TABLES)}
    if "meta" in tables:
        row = conn.execute(_GET_VERSION).fetchone()
        if row is not None:
            return int(row[0])
    return LEGACY_VERSION if "traces" in tables else None


@contextlib.contextmanager
def write_tx(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction on a writer connection (autocommit otherwise):
    committed when the block ends, rolled back when it raises."""
    conn.execute(BEGIN_WRITE)
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def read_tx(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Several reads from one snapshot (a deferred transaction: no lock is
    taken that would block writers in WAL mode)."""
    if conn.in_transaction:  # already inside one: its snapshot serves
        yield conn
        return
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


def _is_current(conn: sqlite3.Connection) -> bool:
    try:
        row = conn.execute(_GET_VERSION).fetchone()
    except sqlite3.OperationalError:  # no meta table: new or pre-versioning store
        return False
    return row is not None and int(row[0]) == SCHEMA_VERSION


def _create_or_upgrade(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the store to SCHEMA_VERSION in one transaction (idempotent: every
    process of a host runs it when it opens the store; a current store costs
    one read and no write lock)."""
    if _is_current(conn):
        return
    with write_tx(conn):
        found = stored_version(conn)
        if found is not None and found > SCHEMA_VERSION:
            raise StoreVersionError(path, found, SCHEMA_VERSION)
        for v in range(SCHEMA_VERSION if found is None else found, SCHEMA_VERSION):
            for stmt in MIGRATIONS[v]:
                conn.execute(stmt)
        for stmt in _statements(SCHEMA):
            conn.execute(stmt)
        conn.execute(_SET_VERSION, (str(SCHEMA_VERSION),))


def read_uri(path: Path) -> str:
    """SQLite URI opening ``path`` read-only; ``#``, ``%``, ``?`` and spaces
    are percent-escaped so they stay part of the file name."""
    return f"file:{quote(str(path.absolute()))}?mode=ro"


def translate(e: sqlite3.Error, path: Path) -> StoreError:
    """The backend's exception as a :class:`StoreError` a person can act on."""
    msg = str(e)
    if isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg):
        return StoreError(f"trace store {path} is busy ({msg}); try again")
    return StoreCorrupt(f"{path} is not a kvlens trace store or is damaged ({msg})")


def _open_readonly(path: Path, timeout_s: float) -> sqlite3.Connection:
    if not path.exists():
        raise StoreMissing(f"trace store not found: {path}")
    conn = sqlite3.connect(read_uri(path), uri=True, timeout=timeout_s, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    try:
        found = stored_version(conn)
    except sqlite3.Error as e:
        conn.close()
        raise translate(e, path) from e
    if found is None or found > SCHEMA_VERSION:
        conn.close()
        if found is None:
            raise StoreCorrupt(f"{path} is empty or not a kvlens trace store (no kvlens tables)")
        raise StoreVersionError(path, found, SCHEMA_VERSION)
    if found < SCHEMA_VERSION:
        # An older store: upgrade it once (a writer's connect migrates), then
        # read it as usual. A store on read-only media cannot be read by this
        # version; say so rather than fail on a missing column later.
        conn.close()
        try:
            connect(path, timeout_s=timeout_s).close()
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"{path} has schema version {found}, older than this kvlens' "
                             f"{SCHEMA_VERSION}, and could not be upgraded ({e})") from e
        return _open_readonly(path, timeout_s)
    return conn


def connect(
    path: str | Path, *, readonly: bool = False, timeout_s: float = 5.0, durable: bool = True
) -> sqlite3.Connection:
    """Open the store; the caller closes the connection.

    Writers create the file (WAL) and create or upgrade its schema to
    :data:`SCHEMA_VERSION`; transactions are explicit (:func:`write_tx`).
    ``durable=False`` skips fsyncs (synthetic loads only: a crash can lose
    the last transactions). Readers open it read-only.

    Raises :class:`StoreMissing` (reader, no file), :class:`StoreCorrupt`
    (reader: not a kvlens store, 0 bytes, damaged), :class:`StoreVersionError`
    (written by a newer kvlens); a writer also lets ``sqlite3.Error`` through
    (locked past ``timeout_s``: the span exporter retries on it). May block up
    to ``timeout_s`` on another writer's lock.
    """
    path = Path(path)
    if readonly:
        return _open_readonly(path, timeout_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: autocommit; write_tx() opens the transactions.
    conn = sqlite3.connect(str(path), timeout=timeout_s, check_same_thread=False, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'NORMAL' if durable else 'OFF'}")
        _create_or_upgrade(conn, path)
    except BaseException:
        # sqlite3 errors stay as they are here: the span exporter retries on "locked".
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def reading(path: str | Path, timeout_s: float = 5.0) -> Iterator[sqlite3.Connection]:
    """A short-lived read-only connection: ``with store.reading(p) as c:``.
    Backend errors inside the block come out as :class:`StoreError`; the
    connection is closed on leaving."""
    p = Path(path)
    conn = connect(p, readonly=True, timeout_s=timeout_s)
    try:
        yield conn
    except sqlite3.Error as e:
        raise translate(e, p) from e
    finally:
        conn.close()


def checkpoint(conn: sqlite3.Connection) -> None:
    """Fold the write-ahead log into the main file (after a bulk load)."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
