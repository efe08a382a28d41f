"""Store operations for kvlens' tests and benchmarks only.

What a test or a benchmark needs from a store and kvlens itself never
does: count rows, read or tamper with the schema version, build a store as
an older kvlens wrote it, hold the write lock, run a statement the backend
refuses, create and drop the databases of a test PostgreSQL server, measure
a store's size. It lives with the tests, out of the product: the one file
outside ``kvtrace/store`` that writes SQL (``tools/check_layout.py``'s
``SQL_ALLOWED``); every other test and benchmark reaches the store through
its API. No kvlens module imports it (``tests/`` is on the tests'
``sys.path``; a benchmark puts it there).

Functions that take a store *name* (a path or a ``postgresql://`` URL) open
a raw connection of their own, autocommit, beneath the store API: no schema
check, no upgrade, because the store they handle is often one the API would
refuse or upgrade. Functions that take ``conn`` use an open store
connection (:func:`kvtrace.store.connect` / :func:`kvtrace.store.reading`),
either backend.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from kvrecord.location import StoreLocation
from kvtrace.store.ddl import TRACES_V2_DDL, SCHEMA_V4_TEMPLATE
from kvtrace.store.dialect import POSTGRES, SQLITE
from kvtrace.store.pg import translate_sql
from kvtrace.store.schema import params

#: A table's column names: SQLite and PostgreSQL ask differently.
_SQLITE_COLUMNS = "SELECT name FROM pragma_table_xinfo(?)"  # xinfo: generated columns too
_PG_COLUMNS = (
    "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = ? "
    "ORDER BY ordinal_position"
)

#: Version 1's traces table, as kvlens wrote it before the ``meta`` table and
#: the clock bounds: a generated two-clock handoff and no crossings.
_V1_SCRIPT = """
CREATE TABLE traces (trace_id TEXT PRIMARY KEY, request_id TEXT, mode TEXT, dispatch TEXT,
    outcome TEXT, start_ns INTEGER, end_ns INTEGER, ttft_s REAL, prefill_finished_ns INTEGER,
    kv_ready_ns INTEGER, n_spans INTEGER NOT NULL DEFAULT 0,
    handoff_s REAL GENERATED ALWAYS AS ((kv_ready_ns - prefill_finished_ns) / 1e9) STORED);
CREATE INDEX traces_handoff ON traces (handoff_s DESC);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
"""
#: Version 2: the settled handoff, without the engines' TTFT columns of version 3.
_V2_SCRIPT = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "INSERT INTO meta VALUES ('schema_version', '2');"
    "CREATE TABLE spans (trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_id TEXT, name TEXT NOT NULL, "
    "role TEXT, mode TEXT, request_id TEXT, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, outcome TEXT, "
    "attributes TEXT, PRIMARY KEY (trace_id, span_id)) WITHOUT ROWID;"
    + SQLITE.sql(TRACES_V2_DDL.replace("@name@", "traces"))
    + ";"
)
_OLD_SCRIPTS = {1: _V1_SCRIPT, 2: _V2_SCRIPT}


# ----------------------------------------------------- raw, by store name
def _raw(name: Any, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
    """Run one statement on the store named ``name`` outside the store API
    (autocommit); its rows as tuples."""
    loc = StoreLocation.parse(name)
    if loc.is_postgres:
        import psycopg

        with psycopg.connect(loc.text, autocommit=True) as c:
            cur = c.execute(translate_sql(sql), tuple(args))
            return cur.fetchall() if cur.description else []
    c = sqlite3.connect(str(loc.path))
    try:
        rows = c.execute(sql, tuple(args)).fetchall()
        c.commit()
        return rows
    finally:
        c.close()


def meta(name: Any) -> dict[str, str]:
    """Every row of the store's ``meta`` table (``{"schema_version": "3"}``)."""
    return {k: v for k, v in _raw(name, "SELECT key, value FROM meta")}


def set_schema_version(name: Any, version: int) -> None:
    """Write ``version`` as the store's schema version (a store from a newer
    or an older kvlens, as far as a reader can tell)."""
    _raw(name, "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))


def forget_schema_version(name: Any) -> None:
    """Drop the ``meta`` table: what a store written before it existed looks like."""
    _raw(name, "DROP TABLE meta")


def columns(name: Any, table: str) -> list[str]:
    """The column names of ``table``, in the backend's order."""
    sql = _PG_COLUMNS if StoreLocation.parse(name).is_postgres else _SQLITE_COLUMNS
    return [r[0] for r in _raw(name, sql, (table,))]


def create_old_store(path: "str | os.PathLike", version: int, traces: Iterable[Mapping[str, Any]] = ()) -> None:
    """A new SQLite store at ``path`` with the tables an older kvlens wrote
    (``version`` 1: ``traces`` and ``meta`` only; 2: also ``spans``) and the
    given ``traces`` rows (dicts of column values) in it."""
    c = sqlite3.connect(str(path))
    try:
        c.executescript(_OLD_SCRIPTS[version])
        for row in traces:
            cols = list(row)
            c.execute(f"INSERT INTO traces ({', '.join(cols)}) VALUES ({params(len(cols))})", [row[k] for k in cols])
        c.commit()
    finally:
        c.close()


def added_column_migration(column: str, table: str = "traces") -> tuple[str, ...]:
    """A one-step ``MIGRATIONS`` entry that adds a TEXT column (to test how
    writers run migrations)."""
    return (f"ALTER TABLE {table} ADD COLUMN {column} TEXT",)


@contextlib.contextmanager
def write_lock_held(path: "str | os.PathLike") -> Iterator[None]:
    """Hold a SQLite store's write lock for the block, as a long writer or a
    backup does (the store's schema must exist); nothing is written."""
    holder = sqlite3.connect(str(path), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        yield
        holder.execute("ROLLBACK")
    finally:
        holder.close()


def create_v4_store(name: Any) -> None:
    """Version 4's tables and indexes (unpartitioned, eight ``traces``
    indexes) in the empty store ``name``, as kvlens wrote them before
    version 5: rows go in with :func:`insert_rows`."""
    d = POSTGRES if StoreLocation.parse(name).is_postgres else SQLITE
    for stmt in d.sql(SCHEMA_V4_TEMPLATE).split(";"):
        if stmt.strip():
            _raw(name, stmt)
    _raw(name, "INSERT INTO meta (key, value) VALUES ('schema_version', '4')")


def insert_rows(name: Any, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Plain INSERTs beneath the store API (a store of an older version)."""
    sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({params(len(columns))})"
    for r in rows:
        _raw(name, sql, r)


#: Bytes of each table and index (PostgreSQL: summed over the day
#: partitions, named as the parent's: ``traces_20261204_pkey`` -> ``traces_pkey``).
_PG_RELATIONS = (
    "SELECT c.relname, c.relkind, pg_relation_size(c.oid) + COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0) "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'i')"
)


def relation_bytes(name: Any) -> dict[str, int]:
    """``relation -> bytes`` of the store's tables and indexes (SQLite: from
    ``dbstat``, indexes named as created; ``sqlite_autoindex_*``: a primary key)."""
    import re

    if not StoreLocation.parse(name).is_postgres:
        return {r[0]: int(r[1]) for r in _raw(name, "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name")}
    out: dict[str, int] = {}
    for rel, _, size in _raw(name, _PG_RELATIONS):
        key = re.sub(r"_\d{8}", "", rel)
        out[key] = out.get(key, 0) + int(size)
    return out


def store_bytes(name: Any) -> int:
    """The store's size on disk (SQLite: the file and its write-ahead log;
    PostgreSQL: the database)."""
    loc = StoreLocation.parse(name)
    if loc.is_postgres:
        return int(_raw(loc, "SELECT pg_database_size(current_database())")[0][0])
    p = loc.path
    return sum(f.stat().st_size for f in (p, Path(str(p) + "-wal")) if f.exists())


# ----------------------------------------------- on an open store connection
def span_count(conn: Any) -> int:
    """How many spans the store holds."""
    return int(conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0])


def span_counts_by_role(conn: Any, roles: Sequence[str]) -> dict[str, int]:
    """How many spans each of ``roles`` wrote (roles without spans left out)."""
    sql = f"SELECT role, COUNT(*) FROM spans WHERE role IN ({params(len(roles))}) GROUP BY role"
    return {r[0]: int(r[1]) for r in conn.execute(sql, list(roles)).fetchall()}


def own_intervals(conn: Any, trace_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Each trace's own clock interval (``xlo_ns``, ``xhi_ns``: D's clock minus P's, ns, before the
    pair's window tightens it), for the traces whose two ends are both known."""
    ids = list(trace_ids)
    sql = f"SELECT trace_id, xlo_ns, xhi_ns FROM traces WHERE trace_id IN ({params(len(ids))})"
    rows = conn.execute(sql, ids).fetchall() if ids else []
    return {r[0]: (int(r[1]), int(r[2])) for r in rows if r[1] is not None and r[2] is not None}


def trace_days(conn: Any, trace_id: str) -> list[int]:
    """The ``day`` of each summary row of ``trace_id`` (PostgreSQL: the partition it is in)."""
    return sorted(int(r[0]) for r in conn.execute("SELECT day FROM traces WHERE trace_id = ?", (trace_id,)))


def prefer_indexes(conn: Any) -> None:
    """Plan as on a big store (PostgreSQL: no sequential scan where an index
    serves, and no bitmap scan: with a handful of rows the planner picked a
    bitmap scan plus a sort about 1 run in 4, where a big store's LIMIT walks
    the index in order), so a test's handful of rows shows which index a read walks."""
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")


def run_refused_statement(conn: Any) -> None:
    """Run a statement the backend refuses (an unknown column): raises the
    backend's own error, as a broken query inside ``store.reading`` would."""
    conn.execute("SELECT no_such_column FROM traces")


# ------------------------------------------- a test PostgreSQL server's databases
def create_database(server_url: str, name: str) -> None:
    """Create the empty database ``name`` on the server ``server_url`` (a URL
    of one of its existing databases, e.g. ``postgres``)."""
    _admin(server_url, f"CREATE DATABASE {_ident(name)} TEMPLATE template0")


def drop_database(server_url: str, name: str) -> None:
    """Drop the database ``name``, cutting its open connections (absent: nothing)."""
    _admin(server_url, f"DROP DATABASE IF EXISTS {_ident(name)} WITH (FORCE)")


def create_login_role(server_url: str, role: str, password: str) -> None:
    """Create the role ``role`` that logs in with ``password`` (there already: nothing)."""
    import psycopg

    if any(ch in password for ch in "'\\"):
        raise ValueError("a test role's password must not hold quotes or backslashes")
    with psycopg.connect(server_url, autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
            # a literal: utility statements take no parameters (checked above)
            c.execute(f"CREATE ROLE {_ident(role)} LOGIN PASSWORD '{password}'")


def give_database(server_url: str, name: str, owner: str) -> None:
    """Make ``owner`` the owner of database ``name`` and of its ``public``
    schema (PostgreSQL 15+ lets only the schema's owner create tables there)."""
    _admin(server_url, f"ALTER DATABASE {_ident(name)} OWNER TO {_ident(owner)}")
    _admin(server_url.rsplit("/", 1)[0] + f"/{_ident(name)}", f"ALTER SCHEMA public OWNER TO {_ident(owner)}")


def _ident(name: str) -> str:
    if not name.replace("_", "").isalnum():
        raise ValueError(f"not a plain database name: {name!r}")
    return name


def _admin(server_url: str, statement: str) -> None:
    # autocommit: CREATE / DROP DATABASE cannot run inside a transaction
    import psycopg

    # A loaded test machine (vLLM stacks on every core) can keep a connection
    # waiting past 10 s: the test needs the database, not a fast answer.
    for attempt in range(3):
        try:
            with psycopg.connect(server_url, autocommit=True, connect_timeout=30) as c:
                c.execute(statement)
            return
        except psycopg.errors.ConnectionTimeout:
            if attempt == 2:
                raise


def table_bytes(name: Any) -> dict[str, int]:
    """Bytes on disk: ``store`` (as :func:`store_bytes`) and, on PostgreSQL,
    ``spans`` and ``traces`` (each table with its indexes and TOAST)."""
    loc = StoreLocation.parse(name)
    out = {"store": store_bytes(loc)}
    if loc.is_postgres:
        for table in ("spans", "traces"):
            out[table] = int(_raw(loc, f"SELECT pg_total_relation_size('{table}')")[0][0])
    return out


def drop_index(name: Any, index: str) -> None:
    """Drop one index (a store from before the version that added it, once its version is set back too)."""
    _raw(name, f"DROP INDEX IF EXISTS {_ident(index)}")
