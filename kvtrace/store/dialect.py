"""What differs between the store's two backends, in one place. (How a
store is *named*, a path or a PostgreSQL URL, is :mod:`kvrecord.location`.)

The queries (``queries.py``, ``writer.py``, ``retention.py``) are written
once, in SQLite's spelling: ``?`` and ``:name`` placeholders, and
``{least}``-style fields for the few constructs the two spell differently.
A :class:`Dialect` supplies those fields; the PostgreSQL connection adapter
(:mod:`kvtrace.store.pg`) translates the placeholders once per SQL string.
``dialect_of(conn)`` is how a query finds out which backend it runs on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


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
    #: The conflict key of ``traces`` and of ``spans`` (PostgreSQL: partitioned,
    #: so the partition key is part of it: :mod:`kvtrace.store.partitions`),
    #: and the upsert's placeholders of the traces key.
    trace_key: str = "trace_id"
    trace_key_values: str = ":trace_id"
    span_key: str = "trace_id, span_id"

    def sql(self, template: str) -> str:
        """``template`` with this dialect's fields (``{least}``, ``{desc}``,
        ``{int}``, ...) filled in; cached, so a hot query pays once."""
        return _fill(self, template)


@functools.lru_cache(maxsize=512)
def _fill(d: Dialect, template: str) -> str:
    return template.format(
        least=d.least,
        greatest=d.greatest,
        desc=d.desc,
        int=d.int_type,
        real=d.real_type,
        without_rowid=d.without_rowid,
        bench_seq=d.bench_seq,
        insert_order=d.insert_order,
        trace_key=d.trace_key,
        trace_key_values=d.trace_key_values,
        span_key=d.span_key,
    )


SQLITE = Dialect(
    name="sqlite",
    least="MIN",
    greatest="MAX",
    begin_write="BEGIN IMMEDIATE",
    begin_read="BEGIN",
    insert_order="rowid",
    explain="EXPLAIN QUERY PLAN ",
    tables="SELECT name FROM sqlite_master WHERE type = 'table'",
    desc="DESC",
    int_type="INTEGER",
    real_type="REAL",
    without_rowid=" WITHOUT ROWID",
    bench_seq="",
)

POSTGRES = Dialect(
    name="postgresql",
    least="LEAST",
    greatest="GREATEST",
    begin_write="BEGIN",
    begin_read="BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
    insert_order="seq",
    explain="EXPLAIN ",
    tables="SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()",
    desc="DESC NULLS LAST",
    # PostgreSQL's REAL is a 4-byte float: seconds need DOUBLE PRECISION.
    int_type="BIGINT",
    real_type="DOUBLE PRECISION",
    without_rowid="",
    bench_seq="seq BIGINT GENERATED ALWAYS AS IDENTITY,\n    ",
    trace_key="trace_id, day",
    trace_key_values=":trace_id, :day",
    span_key="trace_id, span_id, start_ns",
)


def dialect_of(conn: Any) -> Dialect:
    """The dialect of an open store connection (an ``sqlite3.Connection``
    has none of its own: SQLite)."""
    return getattr(conn, "dialect", SQLITE)
