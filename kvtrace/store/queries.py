"""Every read of the store (and the bench rows' write): parameterised queries
as functions of their parameters, returning plain dicts / tuples. Nothing
outside ``kvtrace.store`` writes SQL.

All functions take an open connection (:func:`kvtrace.store.connect` or
:func:`kvtrace.store.reading`, SQLite or PostgreSQL), run on the caller's
thread and may block up to the connection's timeout on a writer's lock.
Times are wall-clock ns (``*_ns``) or seconds (``*_s``). The SQL is written
once: ``{desc}`` and the like are the connection's dialect's
(:mod:`kvtrace.store.dialect`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from kvrecord.durations import parse_duration
from kvtrace.store.columns import SPANS, SUMMARY_COLUMNS, check_names
from kvtrace.store.dialect import POSTGRES, dialect_of
from kvtrace.store.partitions import day_of
from kvtrace.store.spanrows import tuples
from kvtrace.store.schema import PARAM, params, read_tx, write_tx

#: Columns of :func:`handoffs` rows (the resolver's view of a settled trace).
#: ``complete``: the request's own crossings both ways have arrived, so a
#: later span cannot change its settled figure any more.
HANDOFF_COLUMNS = (
    "handoff_s",
    "handoff_err_s",
    "handoff_raw_s",
    "clock_offset_s",
    "clock_lo_s",
    "clock_hi_s",
    "handoff_note",
    "p_engine",
    "d_engine",
    "keep",
    "complete",
)
#: Tuple order of :func:`window` rows.
WINDOW_COLUMNS = ("mode", "outcome", "start_ns", "ttft_s", "handoff_s", "ttft_source")
#: Tuple orders of :func:`handoff_sample` rows.
SAMPLE_TRACE_COLUMNS = ("trace_id", "mode", "prefill_finished_ns", "kv_ready_ns", "handoff_s", "clock_offset_s")
SAMPLE_SPAN_COLUMNS = ("trace_id", "role", "name", "start_ns", "end_ns")
check_names("HANDOFF_COLUMNS", HANDOFF_COLUMNS[:-1])  # the last, "complete", is computed
check_names("WINDOW_COLUMNS", WINDOW_COLUMNS)
check_names("SAMPLE_TRACE_COLUMNS", SAMPLE_TRACE_COLUMNS)
check_names("SAMPLE_SPAN_COLUMNS", SAMPLE_SPAN_COLUMNS, SPANS)
_ORDER = {"handoff": "handoff_s", "ttft": "ttft_s", "start": "start_ns"}


def parse_since(text: str | None) -> int | None:
    """'10m' / '2h' / '30s' / '1d' -> a wall-clock ns lower bound (None: all)."""
    if not text:
        return None
    return time.time_ns() - int(parse_duration(text) * 1e9)


@dataclass(frozen=True)
class TraceFilter:
    """Which traces a query reads; ``None`` (or "") means "no filter".
    Times are wall-clock ns on the trace's start; ``max_handoff_s`` is
    exclusive; ``completed``: only traces whose handoff is known."""

    mode: str | None = None
    outcome: str | None = None
    since_ns: int | None = None
    until_ns: int | None = None
    min_handoff_s: float | None = None
    max_handoff_s: float | None = None
    trace_ids: Sequence[str] | None = None
    completed: bool = False
    p_engine: str | None = None
    d_engine: str | None = None
    #: only traces that lack one side: ``"prefill"`` (no span of D's) or ``"decode"`` (no span of P's)
    half: str | None = None
    #: only traces whose spans are stored (not summary-only under ``--keep sampled``)
    with_spans: bool = False

    def where(self) -> tuple[str, list[Any]]:
        """The one WHERE builder over ``traces``: (clause, params)."""
        clauses, args = ["1=1"], []
        for cond, value in (
            ("mode = ", self.mode),
            ("outcome = ", self.outcome),
            ("start_ns >= ", self.since_ns),
            ("start_ns <= ", self.until_ns),
            ("handoff_s >= ", self.min_handoff_s),
            ("handoff_s < ", self.max_handoff_s),
            ("p_engine = ", self.p_engine),
            ("d_engine = ", self.d_engine),
        ):
            if value is not None and value != "":  # "" (an unset form field) filters nothing either
                clauses.append(cond + PARAM)
                args.append(value)
        if self.trace_ids is not None:
            clauses.append(f"trace_id IN ({params(len(self.trace_ids))})")
            args.extend(self.trace_ids)
        if self.completed:
            clauses.append("handoff_s IS NOT NULL")
        if self.with_spans:
            clauses.append("(keep IS NULL OR keep <> 'no')")
        if self.half is not None:
            if self.half not in HALF_TRACE_SQL:
                raise ValueError(f"half must be one of {sorted(HALF_TRACE_SQL)}, got {self.half!r}")
            clauses.append(HALF_TRACE_SQL[self.half])
        return " AND ".join(clauses), args


#: A half trace: the side present has its engine, the other none (the trace
#: row folds ``p_engine`` from P's spans and ``d_engine`` from D's).
HALF_TRACE_SQL = {
    "prefill": "p_engine IS NOT NULL AND d_engine IS NULL",
    "decode": "d_engine IS NOT NULL AND p_engine IS NULL",
}


def _where(conn: Any = None, **filters: Any) -> tuple[str, list[Any]]:
    """:meth:`TraceFilter.where`; on PostgreSQL a time window also bounds
    ``day`` (each row's is its start's UTC day: :mod:`kvtrace.store.partitions`),
    so only the partitions of those days are read."""
    where, args = TraceFilter(**filters).where()
    if conn is not None and dialect_of(conn) is POSTGRES:
        for op, ns in ((">=", filters.get("since_ns")), ("<=", filters.get("until_ns"))):
            if ns is not None and ns != "":
                where += f" AND day {op} {PARAM}"
                args.append(day_of(int(ns)))
    return where, args


def _slowest_sql(conn: Any, n: int, order: str, **filters: Any) -> tuple[str, list[Any]]:
    col = _ORDER.get(order)
    if col is None:
        raise ValueError(f"unknown order {order!r}")
    where, args = _where(conn, **filters)
    sql = (
        f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM traces WHERE {where} "
        f"ORDER BY {col} {dialect_of(conn).desc} LIMIT {PARAM}"
    )  # NULLs last, as the indexes
    return sql, [*args, int(n)]


def slowest(conn: sqlite3.Connection, n: int = 10, *, order: str = "handoff", **filters: Any) -> list[dict[str, Any]]:
    """Trace summaries (dicts keyed :data:`SUMMARY_COLUMNS`) ordered by
    ``order`` ("handoff", "ttft" or "start") descending, at most ``n``.
    ``filters``: the fields of :class:`TraceFilter` (``mode="push"``, ...)."""
    ids = filters.get("trace_ids")
    if ids is not None:
        filters["trace_ids"] = ids = list(ids)
        if not ids:
            return []
    sql, args = _slowest_sql(conn, n, order, **filters)
    return [dict(r) for r in conn.execute(sql, args)]


def count_summary_only(conn: sqlite3.Connection, **filters: Any) -> int:
    """Completed traces matching ``filters`` kept as their summary only (``keep = 'no'``)."""
    where, args = _where(conn, completed=True, **filters)
    return int(conn.execute(f"SELECT COUNT(*) FROM traces WHERE {where} AND keep = 'no'", args).fetchone()[0])


def slowest_plan(conn: sqlite3.Connection, n: int = 50, *, order: str = "handoff", **filters: Any) -> str:
    """How the backend runs :func:`slowest` with these filters, as one line
    (the benchmark prints it to show which index is walked)."""
    sql, args = _slowest_sql(conn, n, order, **filters)
    return " | ".join(str(r[-1]).strip() for r in conn.execute(dialect_of(conn).explain + sql, args))


def window(conn: sqlite3.Connection, *, since_ns: int | None, until_ns: int | None, limit: int) -> list[tuple]:
    """Traces that started in [since_ns, until_ns], newest first, at most
    ``limit``: tuples in :data:`WINDOW_COLUMNS` order."""
    where, args = _where(conn, since_ns=since_ns, until_ns=until_ns)
    sql = f"SELECT {', '.join(WINDOW_COLUMNS)} FROM traces WHERE {where} ORDER BY start_ns DESC LIMIT {PARAM}"
    return tuples(conn, sql, [*args, int(limit)])


def handoff_sample(
    conn: sqlite3.Connection,
    *,
    since_ns: int | None,
    until_ns: int | None,
    limit: int,
    exclude_phases: Iterable[str] = (),
) -> tuple[list[tuple], list[tuple]]:
    """The newest ``limit`` completed traces (handoff known) that started in
    [since_ns, until_ns] and their spans, read in one snapshot:
    (traces as :data:`SAMPLE_TRACE_COLUMNS` tuples, spans as
    :data:`SAMPLE_SPAN_COLUMNS` tuples), spans named in ``exclude_phases`` left out."""
    where, args = _where(conn, since_ns=since_ns, until_ns=until_ns, completed=True, with_spans=True)
    sample = f"SELECT {', '.join(SAMPLE_TRACE_COLUMNS)} FROM traces WHERE {where} ORDER BY start_ns DESC LIMIT {PARAM}"
    skip = sorted(exclude_phases)
    # The spans by the sample's ids (primary-key lookups), not a join with the
    # sample query: PostgreSQL's planner hash-joins that against a full scan
    # of spans (3.7 s at 10 M spans; this: ~0.1 s on both backends).
    not_skipped = f" AND name NOT IN ({params(len(skip))})" if skip else ""
    with read_tx(conn):
        traces = tuples(conn, sample, [*args, int(limit)])
        spans: list[tuple] = []
        ids = [t[0] for t in traces]
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            spans += tuples(
                conn,
                f"SELECT {', '.join(SAMPLE_SPAN_COLUMNS)} FROM spans "
                f"WHERE trace_id IN ({params(len(chunk))}){not_skipped}",
                [*chunk, *skip],
            )
    return traces, spans


def attributes_of(
    conn: sqlite3.Connection, trace_ids: Sequence[str], names: Iterable[str]
) -> dict[tuple[str, str | None, str, int, int], dict[str, Any]]:
    """The decoded attributes of the spans named ``names`` in the given
    traces, keyed (trace_id, role, name, start_ns, end_ns): the few figures
    a sample's tiling needs beyond :data:`SAMPLE_SPAN_COLUMNS` (NIXL's
    transfer time on write/read.complete), without decoding every span."""
    names = sorted(names)
    out: dict[tuple[str, str | None, str, int, int], dict[str, Any]] = {}
    ids = list(trace_ids)
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        sql = (
            f"SELECT trace_id, role, name, start_ns, end_ns, attributes FROM spans "
            f"WHERE trace_id IN ({params(len(chunk))}) AND name IN ({params(len(names))})"
        )
        for tid, role, name, t0, t1, attrs in tuples(conn, sql, [*chunk, *names]):
            out[(tid, role, name, t0, t1)] = json.loads(attrs or "{}")
    return out


def info(conn: sqlite3.Connection) -> dict[str, Any]:
    """``{"traces": n, "first_ns", "last_ns", "bench_runs": n}`` (first/last: trace start times)."""
    r = conn.execute("SELECT COUNT(*), MIN(start_ns), MAX(start_ns) FROM traces").fetchone()
    b = conn.execute("SELECT COUNT(DISTINCT run_id) FROM bench_rows").fetchone()
    return {"traces": r[0], "first_ns": r[1], "last_ns": r[2], "bench_runs": b[0]}


def handoffs(conn: sqlite3.Connection, trace_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``trace_id -> {HANDOFF_COLUMNS}`` for those of ``trace_ids`` that have
    both ends (settled: ``handoff_s`` known, or NULL with ``handoff_note``)."""
    out: dict[str, dict[str, Any]] = {}
    ids = list(trace_ids)
    cols = ", ".join(HANDOFF_COLUMNS[:-1])
    done = (
        "(d2p_sent_ns IS NOT NULL AND d2p_recv_ns IS NOT NULL AND p2d_sent_ns IS NOT NULL AND p2d_recv_ns IS NOT NULL)"
    )
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        where, args = _where(trace_ids=chunk)
        sql = (
            f"SELECT trace_id, {cols}, {done} AS complete FROM traces WHERE {where} "
            "AND (handoff_s IS NOT NULL OR handoff_note IS NOT NULL)"
        )
        for r in conn.execute(sql, args):
            d = dict(r)
            d["complete"] = bool(d["complete"])
            out[d.pop("trace_id")] = d
    return out


def halves(conn: sqlite3.Connection, trace_ids: Sequence[str]) -> dict[str, str]:
    """``trace_id -> "prefill" | "decode"`` for those of ``trace_ids`` whose
    row holds only that side's spans (:data:`HALF_TRACE_SQL`)."""
    out: dict[str, str] = {}
    ids = list(trace_ids)
    for side, cond in HALF_TRACE_SQL.items():
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            where, args = _where(trace_ids=chunk)
            for (tid,) in conn.execute(f"SELECT trace_id FROM traces WHERE {where} AND {cond}", args):
                out[tid] = side
    return out


def save_bench_rows(conn: sqlite3.Connection, run_id: str, rows: Sequence[dict[str, Any]]) -> None:
    """Persist ``kvlens bench`` rows (dicts with the --json keys), in one
    write transaction on a writer connection."""
    now = time.time_ns()
    with write_tx(conn):
        conn.executemany(
            "INSERT INTO bench_rows (run_id, created_ns, mode, dispatch, qps, input_len, output_len, "
            f'num_prompts, "row") VALUES ({params(9)})',
            [
                (
                    run_id,
                    now,
                    r["mode"],
                    r.get("dispatch"),
                    float(r["qps"]),
                    int(r["input_len"]),
                    r.get("output_len"),
                    r.get("num_prompts"),
                    json.dumps(r),
                )
                for r in rows
            ],
        )


def bench_rows(conn: sqlite3.Connection, run_id: str | None = None) -> list[dict[str, Any]]:
    """Bench rows of one run (default: the latest run), in the order saved,
    each the saved dict plus ``run_id``."""
    if run_id is None:
        r = conn.execute("SELECT run_id FROM bench_rows ORDER BY created_ns DESC LIMIT 1").fetchone()
        if r is None:
            return []
        run_id = r[0]
    sql = f'SELECT run_id, "row" FROM bench_rows WHERE run_id = {PARAM} ORDER BY {dialect_of(conn).insert_order}'
    return [dict(json.loads(r["row"]), run_id=r["run_id"]) for r in conn.execute(sql, (run_id,))]


def bench_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Bench runs, newest first: run_id, created_ns, rows."""
    return [
        dict(r)
        for r in conn.execute(
            "SELECT run_id, MAX(created_ns) AS created_ns, COUNT(*) AS rows FROM bench_rows "
            "GROUP BY run_id ORDER BY created_ns DESC"
        )
    ]


# ------------------------------------------------------------- per (P, D) pair
#: Tuple order of :func:`pair_rows` rows.
PAIR_COLUMNS = (
    "mode",
    "p_engine",
    "d_engine",
    "start_ns",
    "handoff_s",
    "handoff_err_s",
    "ttft_s",
    "clock_lo_s",
    "clock_hi_s",
    "clock_offset_s",
)


def pair_rows(conn: sqlite3.Connection, *, since_ns: int | None, until_ns: int | None, limit: int) -> list[tuple]:
    """Traces that started in [since_ns, until_ns] with the engines that
    served them and their settled clock window, newest first, at most
    ``limit``: tuples in :data:`PAIR_COLUMNS` order (the per-pair figures are
    percentiles, which SQLite cannot compute, so the caller aggregates)."""
    where, args = _where(conn, since_ns=since_ns, until_ns=until_ns)
    sql = f"SELECT {', '.join(PAIR_COLUMNS)} FROM traces WHERE {where} ORDER BY start_ns DESC LIMIT {PARAM}"
    return tuples(conn, sql, [*args, int(limit)])


def engines(conn: sqlite3.Connection) -> list[tuple[str | None, str | None]]:
    """The distinct (P engine, D engine) pairs in the store (the pair index
    answers it), sorted; ``None`` where a side was never recorded."""
    rows = conn.execute("SELECT DISTINCT p_engine, d_engine FROM traces").fetchall()
    return sorted(((r[0], r[1]) for r in rows), key=lambda t: (t[0] or "", t[1] or ""))


def pair_clocks(conn: sqlite3.Connection) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (P engine, D engine): ``n`` requests with both ends, ``settled``
    (a clock interval stored), and the tightest interval over them
    (``lo_s`` max of the lows, ``hi_s`` min of the highs: an offset inside it
    is inside every request's own stored interval)."""
    sql = (
        "SELECT p_engine, d_engine, COUNT(*), COUNT(clock_lo_s), MAX(clock_lo_s), MIN(clock_hi_s) FROM traces "
        "WHERE p_engine IS NOT NULL AND d_engine IS NOT NULL AND kv_ready_ns IS NOT NULL GROUP BY p_engine, d_engine"
    )
    return {(p, d): {"n": n, "settled": k, "lo_s": lo, "hi_s": hi} for p, d, n, k, lo, hi in tuples(conn, sql, ())}
