"""The trace store: the only place in kvlens that writes SQL.

* :mod:`~exporters.store.schema`: tables, indexes, :func:`connect`.
* :mod:`~exporters.store.writer`: spans in (``SQLiteSpanExporter``, the SDK exporter).
* :mod:`~exporters.store.queries`: every read the resolver, ``kvlens traces``,
  the bench and the dashboard need, as functions of their parameters.

Callers use this package's names (``from exporters import store``;
``store.slowest(conn, ...)``), never its SQL.
"""

from exporters.store.queries import (
    bench_rows,
    bench_runs,
    handoffs,
    parse_since,
    save_bench_rows,
    slowest,
    spans_for,
    trace_record,
)
from exporters.store.schema import SCHEMA, connect
from exporters.store.writer import SQLiteSpanExporter, write_spans

__all__ = [
    "SCHEMA",
    "SQLiteSpanExporter",
    "bench_rows",
    "bench_runs",
    "connect",
    "handoffs",
    "parse_since",
    "save_bench_rows",
    "slowest",
    "spans_for",
    "trace_record",
    "write_spans",
]
