"""The trace store's schema, its version, the SQL dialect, and how a
connection to it is opened.

Tables
------
``spans``   one row per span (any process), keyed (trace_id, span_id).
``traces``  one row per request, folded from its spans by an UPSERT as spans
            arrive from router, P and D in any order, with the timestamps of
            the messages that crossed between P and D; the writer's settle
            pass then writes ``handoff_s`` corrected for the two clocks
            (:mod:`kvtrace.clockbounds`), or leaves it NULL with the reason.
``bench_rows`` results of ``kvlens bench`` (one row per grid cell).
``meta``    ``schema_version`` (and room for more keys).

Indexes serve the two hot reads: "slowest N by handoff (or TTFT), filtered
by outcome / time" (walk one in order, stop after N; ``ddl.DROPPED_V5_INDEXES``
says why mode has none) and "all spans of these traces" (the primary keys).
PostgreSQL: the same columns (``BIGINT`` ns, ``DOUBLE PRECISION`` seconds,
indexes ``DESC NULLS LAST``), ``spans`` and ``traces`` partitioned by UTC
day (:mod:`kvtrace.store.partitions`: keys, routing, retention by day).

Backends and dialect
--------------------
A store is a path (SQLite) or a ``postgresql://`` URL
(a :class:`~kvrecord.location.StoreLocation`); :func:`connect` and
:func:`reading` dispatch on its kind. What the two spell
differently is a :class:`~kvtrace.store.dialect.Dialect`, found from the
connection (``dialect_of(conn)``); PostgreSQL connections are pooled psycopg
connections behind an adapter with the ``sqlite3`` surface
(:mod:`kvtrace.store.pg`).

Versions
--------
``meta.schema_version``. A writer's :func:`connect` creates or upgrades the
schema (``MIGRATIONS``) in one transaction; on PostgreSQL concurrent writers
starting together are serialized by ``pg_advisory_xact_lock`` (SQLite's
``BEGIN IMMEDIATE`` does it there). A reader that finds an older store has
it upgraded once by a writer connection; one that finds a newer store gets
:class:`StoreVersionError`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

from kvtrace.store import partitions, pg, pgerrors
from kvtrace.store.columns import added_in
from kvtrace.store.ddl import TRACES_V2_DDL, DROPPED_V5_INDEXES, PG_SCHEMA_TEMPLATE, SCHEMA_TEMPLATE
from kvrecord.location import StoreLocation
from kvtrace.store.dialect import POSTGRES, SQLITE, Dialect, dialect_of
from kvtrace.store.errors import StoreCorrupt, StoreError, StoreMissing, StoreVersionError

# SQLite's spelling (callers import these names); queries take dialect_of(conn).
#: Parameter placeholder: both backends take ``?`` (the PostgreSQL adapter translates).
PARAM = "?"
LEAST, GREATEST = SQLITE.least, SQLITE.greatest

#: An open store connection: ``sqlite3.Connection`` or :class:`kvtrace.store.pg.PgConnection`.
Connection = Any


def params(n: int) -> str:
    """``n`` comma-separated placeholders, for ``IN (...)``."""
    return ",".join([PARAM] * n)


# ------------------------------------------------------------------ schema
#: The schema this code writes and reads. Bump it with a MIGRATIONS entry.
SCHEMA_VERSION = 7
#: Stores written before the ``meta`` table existed have version 1's tables.
LEGACY_VERSION = 1

_V1_INDEXES = (
    "traces_mode_handoff",
    "traces_mode_outcome_handoff",
    "traces_outcome_handoff",
    "traces_handoff",
    "traces_mode_ttft",
    "traces_ttft",
    "traces_start",
)
_V1_TRACE_COLUMNS = (
    "trace_id, request_id, mode, dispatch, outcome, start_ns, end_ns, ttft_s, prefill_finished_ns, kv_ready_ns, n_spans"
)
#: ``MIGRATIONS[v]``: statements that take a version-``v`` store to ``v + 1``
#: (run by a writer's :func:`connect`, before SCHEMA, in one transaction),
#: templates filled with the store's dialect. PostgreSQL stores start at 2.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 1 -> 2: the traces table is rebuilt (a generated handoff_s becomes a
    # settled one). Rows of version 1 carry no clock crossings: their handoff
    # stays in handoff_raw_s and is marked unknown.
    1: (
        *(f"DROP INDEX IF EXISTS {i}" for i in _V1_INDEXES),
        "ALTER TABLE traces RENAME TO traces_v1",
        TRACES_V2_DDL.replace("@name@", "traces"),
        f"INSERT INTO traces ({_V1_TRACE_COLUMNS}, handoff_note) SELECT {_V1_TRACE_COLUMNS}, "
        "CASE WHEN kv_ready_ns IS NOT NULL AND prefill_finished_ns IS NOT NULL "
        "THEN 'unknown: recorded before clock bounds (schema 1)' END FROM traces_v1",
        "DROP TABLE traces_v1",
    ),
    # 2 -> 3: the engines' TTFT (columns.added_in(3)); older rows keep NULLs.
    2: tuple(f"ALTER TABLE traces ADD COLUMN {c} {t}" for c, t in added_in(3)),
    # 3 -> 4: the keep decision and the per-phase durations (columns.added_in(4));
    # older rows keep NULLs (their spans are all stored).
    3: tuple(f"ALTER TABLE traces ADD COLUMN {c} {t}" for c, t in added_in(4)),
    # 4 -> 5: three traces indexes fewer (ddl.DROPPED_V5_INDEXES). PostgreSQL
    # also partitions spans and traces by day: PG_MIGRATIONS.
    4: tuple(f"DROP INDEX IF EXISTS {i}" for i in DROPPED_V5_INDEXES),
    # 5 -> 6: the partial index on ``handoff.open`` spans (ddl.OPEN_SPAN_NAME);
    # the schema script that follows every migration creates it. Both backends.
    5: (),
    # 6 -> 7: what the verdict reads of a request (columns.added_in(7)), so a
    # summary-only request has it; older rows keep NULLs (read from their spans).
    # Added where missing (ADDED_COLUMNS): PostgreSQL's 4 -> 5 rebuilds traces with today's columns.
    6: (),
}
#: ``ADDED_COLUMNS[v]``: traces columns the step from ``v`` adds where the table lacks them.
ADDED_COLUMNS = {6: added_in(7)}
#: ``PG_MIGRATIONS[v]``: what a PostgreSQL store runs instead of ``MIGRATIONS[v]``
#: (a function of the connection, in the same transaction).
PG_MIGRATIONS = {4: partitions.migrate_v4}


def schema_for(d: Dialect) -> str:
    """The schema script of one backend."""
    return d.sql(PG_SCHEMA_TEMPLATE if d is POSTGRES else SCHEMA_TEMPLATE)


_GET_VERSION = "SELECT value FROM meta WHERE key = 'schema_version'"
_SET_VERSION = (
    f"INSERT INTO meta (key, value) VALUES ('schema_version', {PARAM}) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
#: pg_advisory_xact_lock key serializing schema creation / upgrade ("kvlens" in ASCII).
SCHEMA_LOCK_KEY = 0x6B766C656E73


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def stored_version(conn: Connection) -> int | None:
    """The schema version of the open store; ``None`` when it holds no kvlens
    tables at all (a new or 0-byte file, an empty database). Raises the
    backend's error on a file that is not a database."""
    tables = {r[0] for r in conn.execute(dialect_of(conn).tables)}
    if "meta" in tables:
        row = conn.execute(_GET_VERSION).fetchone()
        if row is not None:
            return int(row[0])
    return LEGACY_VERSION if "traces" in tables else None


@contextlib.contextmanager
def write_tx(conn: Connection) -> Iterator[Connection]:
    """One write transaction on a writer connection (autocommit otherwise):
    committed when the block ends, rolled back when it raises."""
    conn.execute(dialect_of(conn).begin_write)
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(Exception):  # a lost connection: the original error is what matters
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def read_tx(conn: Connection) -> Iterator[Connection]:
    """Several reads from one snapshot (SQLite: a deferred transaction, no
    lock that would block writers in WAL mode; PostgreSQL: REPEATABLE READ,
    READ ONLY)."""
    if conn.in_transaction:  # already inside one: its snapshot serves
        yield conn
        return
    conn.execute(dialect_of(conn).begin_read)
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


def _create_or_upgrade(conn: Connection, loc: StoreLocation) -> None:
    """Bring the store to SCHEMA_VERSION in one transaction (idempotent: every
    writer runs it when it opens the store; a current store costs one read
    and no write lock)."""
    d = dialect_of(conn)
    if stored_version(conn) == SCHEMA_VERSION:
        return
    with write_tx(conn):
        if d is POSTGRES:  # concurrent first writers: one creates, the others then find it current
            conn.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
        found = stored_version(conn)
        if found == SCHEMA_VERSION:
            return
        if found is not None and found > SCHEMA_VERSION:
            raise StoreVersionError(str(loc), found, SCHEMA_VERSION)
        for v in range(SCHEMA_VERSION if found is None else found, SCHEMA_VERSION):
            if d is POSTGRES and v in PG_MIGRATIONS:
                PG_MIGRATIONS[v](conn)
                continue
            for stmt in MIGRATIONS[v]:
                conn.execute(d.sql(stmt))
            if v in ADDED_COLUMNS:
                have = _columns(conn, d, "traces")
                for c, t in ADDED_COLUMNS[v]:
                    if c not in have:
                        conn.execute(d.sql(f"ALTER TABLE traces ADD COLUMN {c} {t}"))
        for stmt in _statements(schema_for(d)):
            conn.execute(stmt)
        if d is POSTGRES:  # the first writes land at once: today's and tomorrow's partitions
            partitions.create(conn, (partitions.today(), partitions.today() + 1))
        conn.execute(_SET_VERSION, (str(SCHEMA_VERSION),))


def _columns(conn: Connection, d: Dialect, table: str) -> set[str]:
    if d is POSTGRES:
        sql = "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = ?"
        return {r[0] for r in conn.execute(sql, (table,)).fetchall()}
    return {r[1] for r in conn.execute(f"PRAGMA table_xinfo({table})").fetchall()}


def read_uri(path: Path) -> str:
    """SQLite URI opening ``path`` read-only; ``#``, ``%``, ``?`` and spaces
    are percent-escaped so they stay part of the file name."""
    return f"file:{quote(str(path.absolute()))}?mode=ro"


def translate(e: BaseException, loc: StoreLocation) -> StoreError:
    """The backend's exception as a :class:`StoreError` a person can act on."""
    if isinstance(e, StoreError):
        return e
    if loc.is_postgres or pgerrors.is_backend_error(e):
        return pgerrors.translate(e, loc.text)
    msg = str(e)
    if isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg):
        return StoreError(f"trace store {loc} is busy ({msg}); try again")
    return StoreCorrupt(f"{loc} is not a kvlens trace store or is damaged ({msg})")


def _check_readable(conn: Connection, loc: StoreLocation) -> int | None:
    """The version a reader found, after refusing an empty or newer store
    (the connection is closed then). Older: the caller upgrades."""
    try:
        found = stored_version(conn)
    except Exception as e:
        conn.close()
        if isinstance(e, (sqlite3.Error,)) or pgerrors.is_backend_error(e):
            raise translate(e, loc) from e
        raise
    if found is None or found > SCHEMA_VERSION:
        conn.close()
        if found is None:
            if loc.is_postgres:
                raise StoreMissing(
                    f"trace store {loc} has no kvlens tables yet: a writer "
                    "(kvlens collect --store URL, or a connector with this kvlens_store) creates them"
                )
            raise StoreCorrupt(f"{loc} is empty or not a kvlens trace store (no kvlens tables)")
        raise StoreVersionError(str(loc), found, SCHEMA_VERSION)
    return found


def _upgrade_for_reader(loc: StoreLocation, found: int, timeout_s: float) -> None:
    # An older store: upgrade it once (a writer's connect migrates), then
    # read it as usual. A store on read-only media (or a read-only database
    # user) cannot be read by this version; say so rather than fail on a
    # missing column later.
    try:
        connect(loc, timeout_s=timeout_s).close()
    except (sqlite3.Error, OSError, StoreError) as e:
        raise StoreError(
            f"{loc} has schema version {found}, older than this kvlens' "
            f"{SCHEMA_VERSION}, and could not be upgraded ({e})"
        ) from e


def _open_readonly(loc: StoreLocation, timeout_s: float) -> sqlite3.Connection:
    if not loc.path.exists():
        raise StoreMissing(f"trace store not found: {loc}")
    conn = sqlite3.connect(read_uri(loc.path), uri=True, timeout=timeout_s, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    found = _check_readable(conn, loc)
    if found < SCHEMA_VERSION:
        conn.close()
        _upgrade_for_reader(loc, found, timeout_s)
        return _open_readonly(loc, timeout_s)
    return conn


def _connect_pg(loc: StoreLocation, *, readonly: bool, timeout_s: float) -> pg.PgConnection:
    url = loc.text
    conn = pg.connect(url, readonly=readonly, timeout_s=timeout_s)
    if readonly:
        found = _check_readable(conn, loc)
        if found < SCHEMA_VERSION:
            conn.close()
            _upgrade_for_reader(loc, found, timeout_s)
            return _connect_pg(loc, readonly=True, timeout_s=timeout_s)
        return conn
    try:
        _create_or_upgrade(conn, loc)
        partitions.ensure(conn, (partitions.today(), partitions.today() + 1))
    except StoreError:
        conn.close()
        raise
    except Exception as e:
        conn.close()
        if pgerrors.is_backend_error(e):
            raise pgerrors.translate(e, url) from e
        raise
    return conn


def connect(
    path: "StoreLocation | str | os.PathLike", *, readonly: bool = False, timeout_s: float = 5.0, durable: bool = True
) -> Connection:
    """Open the store at ``path`` (a :class:`StoreLocation`; a file path or
    a ``postgresql://`` URL is parsed into one); the caller closes the
    connection.

    Writers create the store (SQLite: the file, WAL) and create or upgrade
    its schema to :data:`SCHEMA_VERSION`; transactions are explicit
    (:func:`write_tx`). ``durable=False`` skips fsyncs (SQLite, synthetic
    loads only: a crash can lose the last transactions). Readers open it
    read-only.

    Raises :class:`StoreMissing` (reader, no file; PostgreSQL: no such
    database, or no kvlens tables yet), :class:`StoreCorrupt` (reader: not a
    kvlens store, 0 bytes, damaged), :class:`StoreVersionError` (written by
    a newer kvlens), :class:`~kvtrace.store.errors.StoreUnavailable` /
    :class:`~kvtrace.store.errors.StoreAccessDenied` (PostgreSQL server
    down, refusing the user); a SQLite writer also lets ``sqlite3.Error``
    through (locked past ``timeout_s``: the span exporter retries on it).
    May block up to ``timeout_s`` on another writer's lock or the server.
    """
    loc = StoreLocation.parse(path)
    if loc.is_postgres:
        return _connect_pg(loc, readonly=readonly, timeout_s=timeout_s)
    if readonly:
        return _open_readonly(loc, timeout_s)
    path = loc.path
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: autocommit; write_tx() opens the transactions.
    conn = sqlite3.connect(str(path), timeout=timeout_s, check_same_thread=False, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'NORMAL' if durable else 'OFF'}")
        _create_or_upgrade(conn, loc)
    except BaseException:
        # sqlite3 errors stay as they are here: the span exporter retries on "locked".
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def reading(path: "StoreLocation | str | os.PathLike", timeout_s: float = 5.0) -> Iterator[Connection]:
    """A short-lived read-only connection: ``with store.reading(p) as c:``.
    Backend errors inside the block come out as :class:`StoreError`; the
    connection is closed (PostgreSQL: given back to its pool) on leaving."""
    p = StoreLocation.parse(path)
    conn = connect(p, readonly=True, timeout_s=timeout_s)
    try:
        yield conn
    except sqlite3.Error as e:
        raise translate(e, p) from e
    except Exception as e:
        if pgerrors.is_backend_error(e):
            raise translate(e, p) from e
        raise
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def set_wait(conn: Connection, seconds: float) -> None:
    """Bound how long the next statements wait (SQLite: for another
    writer's lock; PostgreSQL: for any one statement, row locks included)."""
    ms = max(int(seconds * 1000), 1)
    if dialect_of(conn) is POSTGRES:
        conn.execute(f"SET statement_timeout = {ms}")
    else:
        conn.execute(f"PRAGMA busy_timeout = {ms}")


def checkpoint(conn: Connection) -> None:
    """Fold the write-ahead log into the main file (SQLite, after a bulk
    load); PostgreSQL: refresh the planner's statistics instead."""
    if dialect_of(conn) is POSTGRES:
        conn.execute("ANALYZE")
    else:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
