"""What differs between the store's two backends, in one place; and how a
store is named.

A store is named by a **path** (an SQLite file, the default for one host) or
a **URL** ``postgresql://user[:password]@host[:port]/dbname`` (also
``postgres://``; libpq query parameters such as ``?sslmode=require`` pass
through): a PostgreSQL database the whole fleet shares. :func:`location`
turns what a user typed into one of the two, and every caller uses it
instead of ``Path(...)`` (which would mangle ``postgresql://u@h/db`` into
``postgresql:/u@h/db``).

The queries (``queries.py``, ``writer.py``, ``retention.py``) are written
once, in SQLite's spelling: ``?`` and ``:name`` placeholders, and
``{least}``-style fields for the few constructs the two spell differently.
A :class:`Dialect` supplies those fields; the PostgreSQL connection adapter
(:mod:`exporters.store.pg`) translates the placeholders once per SQL string.
``dialect_of(conn)`` is how a query finds out which backend it runs on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from exporters.store.errors import StoreUrlError

URL_SCHEMES = ("postgresql", "postgres")


@dataclass(frozen=True)
class Dialect:
    """The SQL a backend spells its own way."""

    name: str
    #: Scalar two-argument minimum / maximum (SQLite's MIN/MAX of two
    #: arguments; PostgreSQL's LEAST/GREATEST). Only used where no argument
    #: can be NULL, where the two agree.
    least: str
    greatest: str
    #: Starts a write transaction. SQLite: take the write lock up front, so
    #: waiting for another process's writer goes through the busy handler
    #: instead of failing on a read-to-write lock upgrade. PostgreSQL: row
    #: locks, taken as rows are written.
    begin_write: str
    #: Starts a read transaction that sees one snapshot for all its reads
    #: (PostgreSQL's default READ COMMITTED takes one per statement).
    begin_read: str
    #: A column that orders a table's rows by insertion (``bench_rows``).
    insert_order: str
    #: Prefix that turns a query into its plan.
    explain: str
    #: The kvlens tables that exist (one column: the name).
    tables: str
    #: Descending order with NULLs last (SQLite sorts NULL lowest, so plain
    #: DESC puts them last; PostgreSQL sorts NULL highest). Indexes are
    #: declared with the same order so "slowest N" walks one and stops.
    desc: str
    # DDL
    int_type: str
    real_type: str
    #: Table option for ``spans`` (clustered on its primary key in SQLite).
    without_rowid: str
    #: The first column of ``bench_rows`` that gives :attr:`insert_order`
    #: (SQLite has the implicit rowid).
    bench_seq: str

    def sql(self, template: str) -> str:
        """``template`` with this dialect's fields (``{least}``, ``{desc}``,
        ``{int}``, ...) filled in; cached, so a hot query pays once."""
        return _fill(self, template)


@functools.lru_cache(maxsize=512)
def _fill(d: Dialect, template: str) -> str:
    return template.format(least=d.least, greatest=d.greatest, desc=d.desc, int=d.int_type, real=d.real_type,
                           without_rowid=d.without_rowid, bench_seq=d.bench_seq, insert_order=d.insert_order)


SQLITE = Dialect(
    name="sqlite",
    least="MIN", greatest="MAX",
    begin_write="BEGIN IMMEDIATE",
    begin_read="BEGIN",
    insert_order="rowid",
    explain="EXPLAIN QUERY PLAN ",
    tables="SELECT name FROM sqlite_master WHERE type = 'table'",
    desc="DESC",
    int_type="INTEGER", real_type="REAL",
    without_rowid=" WITHOUT ROWID",
    bench_seq="",
)

POSTGRES = Dialect(
    name="postgresql",
    least="LEAST", greatest="GREATEST",
    begin_write="BEGIN",
    begin_read="BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
    insert_order="seq",
    explain="EXPLAIN ",
    tables="SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()",
    desc="DESC NULLS LAST",
    # PostgreSQL's REAL is a 4-byte float: seconds need DOUBLE PRECISION.
    int_type="BIGINT", real_type="DOUBLE PRECISION",
    without_rowid="",
    bench_seq="seq BIGINT GENERATED ALWAYS AS IDENTITY,\n    ",
)


def dialect_of(conn: Any) -> Dialect:
    """The dialect of an open store connection (an ``sqlite3.Connection``
    has none of its own: SQLite)."""
    return getattr(conn, "dialect", SQLITE)


# ------------------------------------------------------------------ naming
def is_url(name: Any) -> bool:
    """Whether ``name`` names a PostgreSQL store (``postgresql://`` / ``postgres://``)."""
    if not isinstance(name, str):
        return False
    head = name.strip().split("://", 1)[0].lower() if "://" in name else ""
    return head in URL_SCHEMES


def check_url(url: str) -> str:
    """``url`` when it is a usable PostgreSQL URL; :class:`StoreUrlError`
    (a ``ValueError``) naming the problem otherwise (a typo'd scheme, no
    host, no database, a bad port)."""
    text = url.strip()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme not in URL_SCHEMES:
        raise StoreUrlError(f"not a PostgreSQL URL: {redact(text)!r} (use postgresql://user@host:port/dbname)")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise StoreUrlError(f"bad port in {redact(text)!r} (use postgresql://user@host:port/dbname)") from None
    del port
    host = parts.hostname or ""
    if not host and "host=" not in parts.query:
        raise StoreUrlError(f"no host in {redact(text)!r} (use postgresql://user@host:port/dbname)")
    if not unquote(parts.path.lstrip("/")) and "dbname=" not in parts.query:
        raise StoreUrlError(f"no database name in {redact(text)!r} (use postgresql://user@host:port/dbname)")
    try:
        from psycopg.conninfo import conninfo_to_dict

        conninfo_to_dict(text)
    except ImportError:  # the driver is checked when a connection is opened
        pass
    except Exception as e:  # psycopg.ProgrammingError: libpq could not parse it
        raise StoreUrlError(f"bad PostgreSQL URL {redact(text)!r}: {e}") from None
    return text


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{netloc[1]}").geturl()


def endpoint(url: str) -> tuple[str, int, str, str]:
    """(host, port, database, user) of a URL, with libpq's defaults filled in."""
    parts = urlsplit(url)
    from urllib.parse import parse_qs

    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    host = parts.hostname or q.get("host") or "localhost"
    port = parts.port or int(q.get("port") or 5432)
    db = unquote(parts.path.lstrip("/")) or q.get("dbname") or ""
    user = unquote(parts.username or "") or q.get("user") or os.environ.get("PGUSER") or ""
    return host, port, db, user


def location(name: str | os.PathLike) -> str | Path:
    """What a user typed for ``--store`` (or a config value) as a store name:
    a checked PostgreSQL URL (str), else an absolute :class:`Path` (``~``
    expanded). :class:`StoreUrlError` (a ``ValueError``) for a malformed URL."""
    if isinstance(name, str) and is_url(name):
        return check_url(name)
    if isinstance(name, str) and "://" in name:
        scheme = name.split("://", 1)[0]
        raise StoreUrlError(f"unknown store URL scheme {scheme!r} in {redact(name)!r}: a store is a file path "
                         "or postgresql://user@host:port/dbname")
    return Path(name).expanduser().resolve()


def display(name: str | os.PathLike) -> str:
    """A store's name for messages (a URL's password redacted)."""
    return redact(name) if is_url(name) else str(name)
