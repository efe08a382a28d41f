"""The PostgreSQL backend: a pooled psycopg 3 connection that looks like the
``sqlite3.Connection`` the queries were written for.

Why an adapter rather than a second copy of the queries: the queries are
plain SQL that both backends run; what differs is small and mechanical
(placeholders, a few spellings, DDL types). :class:`PgConnection` offers the
part of the ``sqlite3`` surface the store uses (``execute``,
``executemany``, ``cursor()`` with a settable ``row_factory``,
``in_transaction``, ``close``) and translates SQLite's ``?`` / ``:name``
placeholders into psycopg's ``%s`` / ``%(name)s`` once per SQL string
(cached). Rows are :class:`Row`: tuples that also answer ``row["column"]``
and ``dict(row)``, as ``sqlite3.Row`` does. The few spellings that differ
are the :data:`~kvtrace.store.dialect.POSTGRES` dialect's fields.

Connections come from one ``psycopg_pool.ConnectionPool`` per URL per
process (readers and writers share it; connections are in autocommit mode
and the store's ``write_tx`` / ``read_tx`` open transactions explicitly).
``close()`` returns the connection to the pool; a broken one is discarded
there, and the pool checks a connection before handing it out, so a
process survives a server restart. While the pool has no connection at all
(first use, or after the server went away), :func:`connect` first opens
one directly: libpq's own error (refused, unknown database, bad password)
comes back at once as a :class:`~kvtrace.store.errors.StoreError` kind
naming host:port, instead of a pool timeout later.

psycopg errors become ``StoreError`` kinds in :func:`translate` (a
connection failure is :class:`~kvtrace.store.errors.StoreUnavailable`,
which writers retry).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
from typing import Any, Iterable, Sequence

from kvrecord.location import redact
from kvtrace.store.dialect import POSTGRES
from kvtrace.store.errors import StoreError
from kvtrace.store.pgerrors import POOL_MAX, translate

logger = logging.getLogger("kvlens")

#: TCP keepalives, so a writer blocked on a server that vanished without a
#: reset (host down, cable pulled) gets an error in ~10 s, not hours.
_CONNECT_KW = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "application_name": "kvlens",
}

# ------------------------------------------------------------ placeholders
_TOKENS = re.compile(r"('(?:[^']|'')*')|(\?)|(?<![:\w]):([A-Za-z_]\w*)|(%)")


@functools.lru_cache(maxsize=1024)
def translate_sql(sql: str) -> str:
    """SQLite placeholders (``?``, ``:name``) as psycopg's (``%s``,
    ``%(name)s``); ``%`` escaped; string literals and ``::`` casts untouched."""

    def sub(m: re.Match) -> str:
        if m.group(1):
            return m.group(1).replace("%", "%%")
        if m.group(2):
            return "%s"
        if m.group(3):
            return f"%({m.group(3)})s"
        return "%%"

    return _TOKENS.sub(sub, sql)


# -------------------------------------------------------------------- rows
class Row(tuple):
    """A result row: a tuple that also answers ``row["col"]``, ``keys()`` and
    ``dict(row)``, like ``sqlite3.Row``."""

    __slots__ = ()
    _names: tuple[str, ...] = ()
    _index: dict[str, int] = {}

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._names)


@functools.lru_cache(maxsize=256)
def _row_class(names: tuple[str, ...]) -> type[Row]:
    return type("Row", (Row,), {"__slots__": (), "_names": names, "_index": {n: i for i, n in enumerate(names)}})


def row_factory(cursor):
    desc = cursor.description
    if desc is None:
        return tuple
    cls = _row_class(tuple(d.name for d in desc))
    return cls


def _tuple_rows(cursor):
    return tuple


# ------------------------------------------------------------------- pools
_pools: dict[tuple[int, str], Any] = {}
_pools_lock = threading.Lock()


def _reset(conn) -> None:
    """Back in the pool: drop session settings a user of the connection made
    (a writer's ``statement_timeout``), so the next user starts clean."""
    conn.execute("RESET ALL")


def _pool(url: str):
    # Keyed by pid too: a forked child (vLLM forks its workers) must not use
    # the parent's pool, whose threads did not survive the fork and whose
    # sockets the parent still uses; it opens its own.
    key = (os.getpid(), url)
    with _pools_lock:
        p = _pools.get(key)
        if p is None:
            from psycopg_pool import ConnectionPool

            # The pool's own reconnect warnings would repeat every attempt while
            # a server is down; the store's callers log that once themselves.
            logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
            p = ConnectionPool(
                url,
                min_size=0,
                max_size=POOL_MAX,
                open=True,
                name="kvlens-store",
                kwargs={"autocommit": True, "row_factory": row_factory, **_CONNECT_KW},
                check=ConnectionPool.check_connection,
                reset=_reset,
                max_idle=300.0,
                reconnect_timeout=30.0,
                num_workers=1,
            )
            _pools[key] = p
        return p


@atexit.register
def close_pools() -> None:
    """Close every pool of this process (at exit; tests that stop the server)."""
    with _pools_lock:
        pools = [p for (pid, _), p in _pools.items() if pid == os.getpid()]
        _pools.clear()
    for p in pools:
        try:
            p.close(timeout=1.0)
        except Exception:
            pass


def close_pool(url: str) -> None:
    """Close ``url``'s pool in this process, if any (tests dropping a database)."""
    with _pools_lock:
        p = _pools.pop((os.getpid(), url), None)
    if p is not None:
        try:
            p.close(timeout=1.0)
        except Exception:
            pass


def _probe(url: str, timeout_s: float) -> None:
    """Open and close one connection outside the pool: raises libpq's error
    at once (translated) when the server cannot be used."""
    import psycopg

    try:
        psycopg.connect(url, **{**_CONNECT_KW, "connect_timeout": max(1, int(round(timeout_s)))}).close()
    except psycopg.Error as e:
        raise translate(e, url) from e


# -------------------------------------------------------------- connection
class PgCursor:
    """The ``sqlite3.Cursor`` surface over a psycopg cursor."""

    def __init__(self, cur) -> None:
        self._cur = cur

    @property
    def row_factory(self):
        return self._cur.row_factory

    @row_factory.setter
    def row_factory(self, f) -> None:
        self._cur.row_factory = row_factory if f is not None else _tuple_rows

    def execute(self, sql: str, params: Sequence | dict = ()) -> "PgCursor":
        if params:
            self._cur.execute(translate_sql(sql), params)
        else:  # psycopg substitutes nothing without parameters: the SQL goes as written
            self._cur.execute(sql)
        return self

    def executemany(self, sql: str, seq: Iterable) -> "PgCursor":
        self._cur.executemany(translate_sql(sql), list(seq))
        return self

    def fetchone(self):
        return self._cur.fetchone()

    def fetchall(self) -> list:
        return self._cur.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount

    def __iter__(self):
        return iter(self._cur)


class PgConnection:
    """A pooled psycopg connection with the ``sqlite3.Connection`` surface
    the store uses. ``close()`` gives it back to the pool."""

    dialect = POSTGRES

    def __init__(self, url: str, pool, conn, *, readonly: bool) -> None:
        self.url = url
        self.readonly = readonly
        self._pool = pool
        self._conn = conn

    @property
    def raw(self):
        """The psycopg connection (benchmarks, tests)."""
        return self._conn

    def cursor(self) -> PgCursor:
        return PgCursor(self._conn.cursor())

    def execute(self, sql: str, params: Sequence | dict = ()) -> PgCursor:
        return self.cursor().execute(sql, params)

    def executemany(self, sql: str, seq: Iterable) -> PgCursor:
        return self.cursor().executemany(sql, seq)

    def copy_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence]) -> None:
        """Rows into ``table`` with ``COPY ... FROM STDIN`` (bulk loads: no
        conflict handling, a duplicate key fails the transaction)."""
        with self._conn.cursor() as cur, cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as cp:
            for r in rows:
                cp.write_row(r)

    def copy_upsert(
        self, table: str, columns: Sequence[str], order: str, conflict: str, rows: Iterable[Sequence]
    ) -> None:
        """``INSERT ... ON CONFLICT`` of many rows in three round trips instead
        of one statement per row: ``COPY`` into a session temp table (emptied
        at commit), then one ``INSERT ... SELECT ... ORDER BY order conflict``
        (the order is the lock order). Inside the caller's transaction; rows
        must be unique on the conflict key."""
        stage = f"kvlens_stage_{table}"
        cols = ", ".join(columns)
        with self._conn.cursor() as cur:
            cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS {stage} (LIKE {table}) ON COMMIT DELETE ROWS")
            with cur.copy(f"COPY {stage} ({cols}) FROM STDIN") as cp:
                for r in rows:
                    cp.write_row(r)
            cur.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {stage} ORDER BY {order} {conflict}")

    @property
    def in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus

        return self._conn.info.transaction_status != TransactionStatus.IDLE

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._pool.putconn(conn)  # the pool discards a broken or mid-transaction one
        except Exception:
            try:
                conn.close()
            except Exception:
                pass

    def __enter__(self) -> "PgConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a connection a caller forgot goes back to its pool
        if getattr(self, "_conn", None) is not None:
            try:
                self.close()
            except Exception:
                pass


def connect(url: str, *, readonly: bool, timeout_s: float) -> PgConnection:
    """A pooled connection to ``url``; :class:`StoreError` kinds when the
    server cannot be used (see the module docstring)."""
    try:
        import psycopg  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency since 0.x
        raise StoreError(
            f"trace store {redact(url)} needs the psycopg driver: pip install 'psycopg[binary,pool]'"
        ) from e
    pool = _pool(url)
    if pool.get_stats().get("pool_size", 0) == 0:
        _probe(url, timeout_s)
    try:
        conn = pool.getconn(timeout=max(timeout_s, 0.1))
    except Exception as e:
        if _is_pool_timeout(e):
            _probe(url, timeout_s)  # the real reason, if the server is the problem
        raise translate(e, url) from e
    return PgConnection(url, pool, conn, readonly=readonly)


def _is_pool_timeout(e: BaseException) -> bool:
    from psycopg_pool import PoolTimeout

    return isinstance(e, PoolTimeout)
