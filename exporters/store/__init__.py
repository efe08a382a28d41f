"""The trace store: the only place in kvlens that writes SQL.

* :mod:`~exporters.store.schema`: tables, schema version, the SQL dialect,
  :func:`connect` / :func:`reading`.
* :mod:`~exporters.store.writer`: spans in (``SQLiteSpanExporter``, the SDK exporter).
* :mod:`~exporters.store.queries`: every read the resolver, ``kvlens traces``,
  the bench and the dashboard need, as functions of their parameters.
* :mod:`~exporters.store.errors`: :class:`StoreError` and its kinds, printable as one line.

Callers use this package's names (``from exporters import store``;
``with store.reading(path) as c: store.slowest(c, ...)``), never its SQL.
What a trace *means* (its spans' critical-path marking, its JSON form) is
:mod:`exporters.tracemodel`, one layer up.
"""

from exporters.store.errors import StoreCorrupt, StoreError, StoreMissing, StoreVersionError
from exporters.store.queries import (
    HANDOFF_COLUMNS,
    SAMPLE_SPAN_COLUMNS,
    SAMPLE_TRACE_COLUMNS,
    SUMMARY_COLUMNS,
    WINDOW_COLUMNS,
    TraceFilter,
    bench_rows,
    bench_runs,
    handoff_sample,
    handoffs,
    info,
    parse_since,
    save_bench_rows,
    slowest,
    slowest_plan,
    spans_for,
    window,
)
from exporters.store.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    SPAN_COLUMNS,
    TRACE_COLUMNS,
    checkpoint,
    connect,
    reading,
)
from exporters.store.writer import SQLiteSpanExporter, bulk_insert, settle, write_spans

__all__ = [
    "HANDOFF_COLUMNS",
    "SCHEMA",
    "SAMPLE_SPAN_COLUMNS",
    "SAMPLE_TRACE_COLUMNS",
    "SCHEMA_VERSION",
    "SPAN_COLUMNS",
    "SQLiteSpanExporter",
    "SUMMARY_COLUMNS",
    "StoreCorrupt",
    "StoreError",
    "StoreMissing",
    "StoreVersionError",
    "TRACE_COLUMNS",
    "TraceFilter",
    "WINDOW_COLUMNS",
    "bench_rows",
    "bench_runs",
    "bulk_insert",
    "checkpoint",
    "connect",
    "handoff_sample",
    "handoffs",
    "info",
    "parse_since",
    "reading",
    "save_bench_rows",
    "slowest",
    "slowest_plan",
    "spans_for",
    "window",
    "settle",
    "write_spans",
]
