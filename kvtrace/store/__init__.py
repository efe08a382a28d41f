"""The trace store: the only place in kvlens that writes SQL.

A store is named by a path (an SQLite file: one host) or a URL
``postgresql://user@host:port/dbname`` (a PostgreSQL database the fleet
shares); :meth:`StoreLocation.parse` turns what a user typed into one of
the two, once, and everything else takes the :class:`StoreLocation` (the
functions here parse a path or URL given instead). Same schema, same
queries, same results.

* :mod:`~kvtrace.store.dialect`: what the two backends spell differently
  (how a store is named: :mod:`kvrecord.location`).
* :mod:`~kvtrace.store.schema`: tables, schema version and migrations,
  :func:`connect` / :func:`reading` (dispatching on the name).
* :mod:`~kvtrace.store.pg`: the PostgreSQL backend (pooled psycopg 3
  connections behind the ``sqlite3`` surface the queries use).
* :mod:`~kvtrace.store.retention`: :func:`prune`, :class:`Retention`.
* :mod:`~kvtrace.store.writer`: spans in (rows, the trace fold, the settled handoff).
* :mod:`~kvtrace.store.keep`: the two tiers: :class:`Keeper` writes every
  request's summary and the spans of the requests its keep rule keeps.
* :mod:`~kvtrace.store.exporter`: ``StoreSpanExporter``, the SDK exporter
  onto the writer, either backend, bounded.
* :mod:`~kvtrace.store.queries`: every read the resolver, ``kvlens traces``,
  the bench and the dashboard need, as functions of their parameters.
* :mod:`~kvtrace.store.errors`: :class:`StoreError` and its kinds, printable as one line.

Callers use this package's names (``from exporters import store``;
``with store.reading(path) as c: store.slowest(c, ...)``), never its SQL.
What a trace *means* (its spans' critical-path marking, its JSON form) is
:mod:`kvtrace.tracemodel`, one layer up.
"""

from kvrecord.location import StoreLocation
from kvtrace.store.errors import (
    StoreAccessDenied,
    StoreCorrupt,
    StoreError,
    StoreMissing,
    StoreUnavailable,
    StoreUrlError,
    StoreVersionError,
    is_transient,
)
from kvtrace.store.columns import PHASE_COLUMNS, SPAN_COLUMNS, SUMMARY_COLUMNS, TRACE_COLUMNS
from kvtrace.store.queries import (
    HANDOFF_COLUMNS,
    SAMPLE_SPAN_COLUMNS,
    SAMPLE_TRACE_COLUMNS,
    WINDOW_COLUMNS,
    TraceFilter,
    attributes_of,
    bench_rows,
    bench_runs,
    count_summary_only,
    handoff_sample,
    handoffs,
    halves,
    info,
    parse_since,
    save_bench_rows,
    slowest,
    slowest_plan,
    window,
)
from kvtrace.store.spanrows import named_spans, open_spans, open_spans_plan, span_dict, spans_for
from kvtrace.store.schema import SCHEMA_VERSION, checkpoint, connect, reading
from kvtrace.store.retention import Retention, prune
from kvtrace.store.exporter import StoreSpanExporter
from kvtrace.store.writer import bulk_insert, settle, write_spans
from kvtrace.store.keep import Keeper

__all__ = [
    "HANDOFF_COLUMNS",
    "Keeper",
    "PHASE_COLUMNS",
    "SAMPLE_SPAN_COLUMNS",
    "SAMPLE_TRACE_COLUMNS",
    "SCHEMA_VERSION",
    "SPAN_COLUMNS",
    "Retention",
    "StoreAccessDenied",
    "StoreLocation",
    "StoreSpanExporter",
    "StoreUnavailable",
    "StoreUrlError",
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
    "count_summary_only",
    "checkpoint",
    "connect",
    "is_transient",
    "prune",
    "attributes_of",
    "handoff_sample",
    "handoffs",
    "halves",
    "info",
    "named_spans",
    "open_spans",
    "open_spans_plan",
    "parse_since",
    "reading",
    "save_bench_rows",
    "slowest",
    "slowest_plan",
    "span_dict",
    "spans_for",
    "window",
    "settle",
    "write_spans",
]
