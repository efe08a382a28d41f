"""Reading spans back: whole traces' spans, one written row, the few spans
the metrics' derived phases need, the partial traces (``handoff.open``)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Iterable, Iterator, Sequence

from kvtrace.store.ddl import OPEN_SPAN_NAME
from kvtrace.store.dialect import dialect_of
from kvtrace.store.columns import SPAN_COLUMNS
from kvtrace.store.schema import PARAM, params


def tuples(conn: sqlite3.Connection, sql: str, args: Sequence[Any]) -> list[tuple]:
    """The rows of ``sql`` as plain tuples (no row factory: the queries that read many rows)."""
    cur = conn.cursor()
    cur.row_factory = None  # plain tuples
    return cur.execute(sql, list(args)).fetchall()


def spans_for(conn: sqlite3.Connection, trace_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """All spans of the given traces (dicts keyed :data:`SPAN_COLUMNS`, the
    attributes decoded), by trace id, each list ordered by start time."""
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in trace_ids}
    if not trace_ids:
        return out
    q = (
        f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE trace_id IN ({params(len(trace_ids))}) "
        "ORDER BY start_ns, end_ns"
    )
    for r in conn.execute(q, list(trace_ids)):
        d = dict(r)
        d["attributes"] = json.loads(d["attributes"] or "{}")
        out.setdefault(d["trace_id"], []).append(d)
    return out


def span_dict(row: Sequence[Any]) -> dict[str, Any]:
    """A ``spans`` row as written (a :data:`SPAN_COLUMNS` tuple) in the form :func:`spans_for` reads it."""
    d = dict(zip(SPAN_COLUMNS, row))
    a = d["attributes"]
    d["attributes"] = dict(a) if isinstance(a, dict) else json.loads(a or "{}")  # not yet encoded: held rows
    return d


def named_spans(
    conn: sqlite3.Connection, trace_ids: Sequence[str], names: Iterable[str], decode: Iterable[str] = ()
) -> Iterator[tuple]:
    """The spans named ``names`` of the given traces, one trace after another, each
    ordered as :func:`spans_for`'s: (trace_id, name, role, start_ns, end_ns, outcome,
    attributes) tuples, the attributes decoded for the spans named ``decode`` only
    (others: None). Read 500 traces at a time, as the caller takes them: what it
    makes of one trace can go before the next (fewer live objects, fewer GC passes)."""
    names, decode, ids = sorted(names), sorted(decode), list(trace_ids)
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        # no attributes to decode: NULL (PostgreSQL refuses an empty ``IN ()``)
        attrs = f"CASE WHEN name IN ({params(len(decode))}) THEN attributes END" if decode else "NULL"
        sql = (
            f"SELECT trace_id, name, role, start_ns, end_ns, outcome, {attrs} FROM spans "
            f"WHERE trace_id IN ({params(len(chunk))}) AND name IN ({params(len(names))}) "
            "ORDER BY trace_id, start_ns, end_ns"
        )
        for r in tuples(conn, sql, [*decode, *chunk, *names]):
            yield r if r[6] is None else (*r[:6], json.loads(r[6]))  # most rows: as read, no copy


#: Most partial-trace spans :func:`open_spans` reads (re-emitted every few
#: seconds while a handoff stays open: a minute of 1000 stuck handoffs is ~12k).
OPEN_SPANS_LIMIT = 50_000
_OPEN_SPANS_SQL = (
    f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE name = '{OPEN_SPAN_NAME}' AND end_ns >= {PARAM} "
    f"ORDER BY end_ns DESC LIMIT {PARAM}"
)


def open_spans(
    conn: sqlite3.Connection, *, since_ns: int | None, limit: int = OPEN_SPANS_LIMIT
) -> list[dict[str, Any]]:
    """The partial-trace spans (``handoff.open``, docs/handoff-health.md) whose snapshot
    (their end) is at or after ``since_ns`` (None: all), newest snapshot first,
    at most ``limit``: dicts keyed :data:`SPAN_COLUMNS`, attributes decoded.
    Walks the partial index ``spans_open`` (the span name is a literal so
    both backends use it), whatever the size of the store."""
    out = []
    for r in conn.execute(_OPEN_SPANS_SQL, (int(since_ns or 0), int(limit))):
        d = dict(r)
        d["attributes"] = json.loads(d["attributes"] or "{}")
        out.append(d)
    return out


def open_spans_plan(conn: sqlite3.Connection, *, since_ns: int | None) -> str:
    """How the backend runs :func:`open_spans`, as one line (tests check the index is walked)."""
    args = (int(since_ns or 0), OPEN_SPANS_LIMIT)
    return " | ".join(str(r[-1]).strip() for r in conn.execute(dialect_of(conn).explain + _OPEN_SPANS_SQL, args))
