"""Writing spans into the store: one transaction per batch, spans folded
into their request's ``traces`` row as they arrive. The same SQL on both
backends (``{least}`` / ``{greatest}``: the connection's dialect).

Concurrent writers (several collectors on one PostgreSQL database, every
process of a host on one SQLite file) never deadlock on each other: a batch
writes its span rows and trace upserts in trace-id order, so two batches
that share traces lock their rows in the same order."""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Iterable, Sequence

from orjson import dumps as _orjson_dumps

from opentelemetry.sdk.trace import ReadableSpan

from kvtrace import clockbounds
from kvtrace.clockbounds import WINDOW_NS
from kvtrace.store.columns import PHASE_COLUMNS, SPAN_COLUMNS, TRACE_COLUMNS
from kvtrace.store import partitions
from kvtrace.store.dialect import POSTGRES, SQLITE, dialect_of
from kvtrace.store.partitions import day_of
from kvtrace.store.schema import PARAM, params, write_tx
from kvrecord import semconv as sc
from kvrecord.ids import base_request_id

logger = logging.getLogger("kvlens")

# Worst outcome wins when folding spans into a trace (docs/phases.md):
# unknown < ok < expired < timeout < failed < stale (served from released KV: docs/handoff-health.md).
_OUTCOME_RANK = ("ok", "expired", "timeout", "failed", "stale")


def _rank(col: str) -> str:
    whens = " ".join(f"WHEN '{o}' THEN {i}" for i, o in enumerate(_OUTCOME_RANK, 1))
    return f"(CASE {col} {whens} ELSE 0 END)"


# How the spans of a request fold into its row. With tensor parallelism a
# worker-side phase arrives once per rank: the handoff ends when the last
# rank's KV is ready (kv.ready: the latest), and each clock crossing keeps
# its earliest send and earliest receipt (the first receipt follows the
# first send, so the pair still bounds the offset; docs/phases.md). The
# scheduler's points (one per request) keep the first value.
_FOLD_FIRST = ("prefill_finished_ns", "p_engine", "d_engine", "p_arrival_ns", "d_first_ns")
_FOLD_MIN = ("d2p_sent_ns", "d2p_recv_ns", "p2d_sent_ns", "p2d_recv_ns")
_FOLD_MAX = ("kv_ready_ns",)
#: What the verdict reads (columns.added_in(7)): the first value seen wins (P's count and the router's agree).
_FOLD_VERDICT = ("prompt_tokens", "split", "tpot_s")
_FOLDED = (*_FOLD_FIRST, *_FOLD_MIN, *_FOLD_MAX, *_FOLD_VERDICT)
#: Each recorded phase's duration column (the longest copy wins: ranks, retries).
_PHASE_COL = PHASE_COLUMNS
_PHASES = tuple(_PHASE_COL.values())

_UPSERT_TRACE = f"""
INSERT INTO traces ({{trace_key}}, request_id, mode, dispatch, outcome, start_ns, end_ns,
                    ttft_s, ttft_source, {", ".join(_FOLDED)}, n_spans, keep, {", ".join(_PHASES)})
VALUES ({{trace_key_values}}, :request_id, :mode, :dispatch, :outcome, :start_ns, :end_ns,
        :ttft_s, :ttft_source, {", ".join(":" + c for c in _FOLDED)}, :n_spans, :keep,
        {", ".join(":" + c for c in _PHASES)})
ON CONFLICT ({{trace_key}}) DO UPDATE SET
    request_id = CASE WHEN :is_router OR traces.request_id IS NULL
                      THEN excluded.request_id ELSE traces.request_id END,
    mode = COALESCE(traces.mode, excluded.mode),
    dispatch = COALESCE(excluded.dispatch, traces.dispatch),
    outcome = CASE WHEN {_rank("excluded.outcome")} > {_rank("traces.outcome")}
                   THEN excluded.outcome ELSE traces.outcome END,
    start_ns = {{least}}(traces.start_ns, excluded.start_ns),
    end_ns = {{greatest}}(traces.end_ns, excluded.end_ns),
    ttft_s = COALESCE(excluded.ttft_s, traces.ttft_s),
    ttft_err_s = CASE WHEN excluded.ttft_s IS NOT NULL THEN NULL ELSE traces.ttft_err_s END,
    ttft_source = COALESCE(excluded.ttft_source, traces.ttft_source),
    {", ".join(f"{c} = COALESCE(traces.{c}, excluded.{c})" for c in (*_FOLD_FIRST, *_FOLD_VERDICT))},
    {", ".join(f"{c} = COALESCE({{least}}(traces.{c}, excluded.{c}), traces.{c}, excluded.{c})" for c in _FOLD_MIN)},
    {", ".join(f"{c} = COALESCE({{greatest}}(traces.{c}, excluded.{c}), traces.{c}, excluded.{c})" for c in _FOLD_MAX)},
    {", ".join(f"{c} = COALESCE({{greatest}}(traces.{c}, excluded.{c}), traces.{c}, excluded.{c})" for c in _PHASES)},
    keep = COALESCE(traces.keep, excluded.keep),
    n_spans = traces.n_spans + excluded.n_spans
"""


# A span written twice (an SDK retry) replaces the first copy (a template:
# {span_key}, the dialect's conflict key).
_SPAN_CONFLICT = "ON CONFLICT ({span_key}) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in SPAN_COLUMNS[2:])
_INSERT_SPAN = SQLITE.sql(
    f"INSERT INTO spans ({', '.join(SPAN_COLUMNS)}) VALUES ({params(len(SPAN_COLUMNS))}) {_SPAN_CONFLICT}"
)  # SQLite's (PostgreSQL: COPY)


# Plain-string constants: enum ``.value`` lookups cost ~0.4 us each per span.
_ROUTER, _PREFILL, _DECODE = sc.Role.ROUTER.value, sc.Role.PREFILL.value, sc.Role.DECODE.value
_REQUEST, _PF, _KV = sc.Phase.REQUEST.value, sc.Phase.PREFILL_FINISHED.value, sc.Phase.KV_READY.value
_PREFILL_PHASE, _FIRST = sc.Phase.PREFILL.value, sc.Phase.DECODE_FIRST_STEP.value
_TTFT_ROUTER, _TTFT_ENGINES = sc.TtftSource.ROUTER.value, sc.TtftSource.ENGINES.value
_PULL, _SEQUENTIAL = sc.Mode.PULL.value, sc.Dispatch.SEQUENTIAL.value
_JSON = json.JSONEncoder(default=str, separators=(",", ":")).encode


def _attrs_json(a: dict) -> str:
    """A span's attributes as the JSON text the store keeps: orjson (a tenth
    of the json module's CPU; what spans hold, str keys and str / int / float
    / bool values or tuples of them, reads back the same), the json module
    for what orjson refuses (an int past 64 bits). Two differences in the
    text: floats in orjson's shortest form (``1e-5`` for ``1e-05``) and a NaN
    as ``null`` (valid JSON) rather than ``NaN``."""
    try:
        return _orjson_dumps(a, default=str).decode()
    except TypeError:  # orjson.JSONEncodeError is one
        return _JSON(a)


def _plain(attributes) -> dict:
    """A span's attributes (a read-only proxy) as a new dict: the proxy's ``copy()``
    copies the dict (or BoundedAttributes) under it, ~8x faster than ``dict(proxy)``."""
    if not attributes:
        return {}
    a = attributes.copy()
    return a if type(a) is dict else dict(a)


#: A trace's upsert before any span folded into it (:func:`span_rows`).
_BLANK = {
    "request_id": None,
    "mode": None,
    "dispatch": None,
    "outcome": None,
    "ttft_s": None,
    "ttft_source": None,
    "is_router": False,
    "n_spans": 0,
    **dict.fromkeys(_FOLDED),
    **dict.fromkeys(_PHASES),
}
_CROSS = sc.CROSSINGS
#: Spans that carry the prompt's token count besides the root, P's first (kvtrace.verdict reads them in order).
TOKEN_SPANS = (sc.Phase.PREFILL.value, sc.Phase.DECODE_QUEUE.value, sc.Phase.ALLOC.value)


def _number(v) -> float | None:
    """A finite number attribute as a float; None for anything else (a bool, text, NaN)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
        return float(v)
    return None


def _count(v) -> int | None:
    return int(v) if _number(v) is not None and v >= 0 else None


def _span_key(row: tuple) -> tuple[str, str]:
    return row[0], row[1]


def span_rows(spans: Iterable[ReadableSpan]) -> tuple[list[tuple], dict[str, dict]]:
    """(``spans`` rows, one folded ``traces`` upsert per trace id) of OTel
    ``ReadableSpan`` s (this process's SDK's, or decoded from OTLP): what
    :func:`write_rows` takes. Each span folds straight into its trace's
    upsert by the UPSERT's own rules (:data:`_UPSERT_TRACE`, the batch's
    later span playing ``excluded``), so a batch costs one upsert per trace."""
    rows, ups = [], {}
    rank = _RANK
    hexes: dict[int, str] = {}  # a batch's spans share few trace ids
    for span in spans:
        a = span.attributes
        tid = getattr(span, "trace_hex", None)  # a decoded span (WireSpan) carries its ids in hex
        if tid is not None:
            sid, parent = span.span_hex, span.parent_hex
        else:  # an SDK span: its attributes a read-only view, its ids ints
            a = _plain(a)
            ctx, parent = span.context, span.parent
            tid = hexes.get(ctx.trace_id)
            if tid is None:
                tid = hexes[ctx.trace_id] = "%032x" % ctx.trace_id  # format_trace_id's text, a third of its cost
            sid, parent = "%016x" % ctx.span_id, "%016x" % parent.span_id if parent else None
        name = span.name
        g = a.get
        role, mode, outcome, rid = g(sc.ATTR_ROLE), g(sc.ATTR_MODE), g(sc.ATTR_OUTCOME, "ok"), g(sc.ATTR_REQUEST_ID)
        start, end = span.start_time, span.end_time  # properties: read each once
        start, end = int(start or 0), int(end or start or 0)
        # the attributes stay a dict until the row is inserted (insert_span_rows):
        # under --keep sampled most rows never are, and JSON is a third of a row's cost
        rows.append((tid, sid, parent, name, role, mode, rid, start, end, outcome, a))
        u = ups.get(tid)
        if u is None:
            u = ups[tid] = {**_BLANK, "trace_id": tid, "outcome": outcome, "start_ns": start, "end_ns": end}
        else:
            if rank.get(outcome, 0) > rank.get(u["outcome"], 0):
                u["outcome"] = outcome
            if start < u["start_ns"]:
                u["start_ns"] = start
            if end > u["end_ns"]:
                u["end_ns"] = end
        _fold_span(u, g, name, role, mode, rid, start, end)
    return rows, ups


def _fold_span(u: dict, g, name: str, role, mode, rid, start: int, end: int) -> None:
    """What one span adds to its trace's upsert ``u`` (outcome and times: the caller)."""
    is_router = role == _ROUTER
    if is_router:
        u["is_router"] = True
    if is_router or u["request_id"] is None:
        u["request_id"] = rid if is_router or rid is None else base_request_id(rid)
    if u["mode"] is None:
        u["mode"] = mode
    # pull is sequential by construction (D needs P's answer), whoever routed it
    disp = g(sc.ATTR_DISPATCH) or (_SEQUENTIAL if mode == _PULL else None)
    if disp is not None:
        u["dispatch"] = disp
    u["n_spans"] += 1
    if role == _PREFILL:
        if u["p_engine"] is None:
            u["p_engine"] = g(sc.ATTR_ENGINE_ID)
        if name == _PREFILL_PHASE and u["p_arrival_ns"] is None:
            u["p_arrival_ns"] = start
    elif role == _DECODE:
        if u["d_engine"] is None:
            u["d_engine"] = g(sc.ATTR_ENGINE_ID)
        if name == _FIRST and u["d_first_ns"] is None:
            u["d_first_ns"] = end
    if name == _REQUEST:
        ttft = g(sc.ATTR_TTFT_S)
        if ttft is not None:
            u["ttft_s"], u["ttft_source"] = ttft, _TTFT_ROUTER
        if u["split"] is None:
            u["split"] = _number(g(sc.ATTR_SPLIT))
        if u["tpot_s"] is None:
            u["tpot_s"] = _number(g(sc.ATTR_TPOT_S))
        if u["prompt_tokens"] is None:
            u["prompt_tokens"] = _count(g(sc.ATTR_TOKENS))
    elif name in TOKEN_SPANS:
        if u["prompt_tokens"] is None:
            u["prompt_tokens"] = _count(g(sc.ATTR_TOKENS))
    if name == _PF:
        if u["prefill_finished_ns"] is None:
            u["prefill_finished_ns"] = end
    elif name == _KV:
        if u["kv_ready_ns"] is None or end > u["kv_ready_ns"]:
            u["kv_ready_ns"] = end
    col = _PHASE_COL.get(name)
    if col is not None:
        d = (end - start) / 1e9
        if u[col] is None or d > u[col]:
            u[col] = d
    cross = _CROSS.get((role, name, None)) or _CROSS.get((role, name, mode))
    if cross is not None:
        t = start if cross[1] == "start" else end
        if u[cross[0]] is None or t < u[cross[0]]:
            u[cross[0]] = t


def write_spans(conn: sqlite3.Connection, spans: Sequence[ReadableSpan]) -> None:
    """Insert OTel ``ReadableSpan`` s (local or decoded from OTLP) and fold them into ``traces``, in one
    write transaction (blocks up to the connection timeout on another
    process's writer). Every span is stored (``keep = 'all'``)."""
    write_rows(conn, *span_rows(spans))


def write_rows(conn: sqlite3.Connection, rows: Sequence[tuple], ups: dict[str, dict], keep: str | None = "all") -> None:
    """One write transaction: the ``spans`` rows (those of kept requests:
    all of them, or fewer under sampling), every trace's summary upsert
    (``keep``: the value a new row gets; NULL while undecided), the settle
    pass."""
    d = dialect_of(conn)
    batch = [{**ups[t], "keep": keep} for t in sorted(ups)]
    if d is POSTGRES:  # the days' partitions first (their own transaction, rarely)
        partitions.ensure(conn, {day_of(r[7]) for r in rows} | {day_of(u["start_ns"]) for u in batch})
    with write_tx(conn):
        if d is POSTGRES:  # each summary row's day (locks near midnight): before any row lock
            partitions.route(conn, batch)
        insert_span_rows(conn, rows)
        conn.executemany(d.sql(_UPSERT_TRACE), batch)
        settle(conn, sorted(ups))


def insert_span_rows(conn: sqlite3.Connection, rows: Sequence[tuple]) -> None:
    """Insert ``spans`` rows inside the caller's write transaction: one row
    per span (a copy sent twice in one batch: the later wins, as two upserts
    in a row would), in lock order (see the module docstring)."""
    if not rows:
        return
    enc = _attrs_json
    rows = [
        r if type(r[-1]) is not dict else (*r[:-1], enc(r[-1]))
        for r in sorted({_span_key(r): r for r in rows}.values(), key=_span_key)
    ]
    if hasattr(conn, "copy_upsert"):  # PostgreSQL: COPY + one INSERT ... SELECT, ~3x executemany
        conn.copy_upsert("spans", SPAN_COLUMNS, "trace_id, span_id", dialect_of(conn).sql(_SPAN_CONFLICT), rows)
    else:
        conn.executemany(_INSERT_SPAN, rows)


def prepare_span_rows(conn: sqlite3.Connection, rows: Sequence[tuple]) -> None:
    """Before the write transaction that inserts ``rows`` (:func:`insert_span_rows`):
    PostgreSQL's day partitions for them (their own transaction, rarely)."""
    if rows and dialect_of(conn) is POSTGRES:
        partitions.ensure(conn, {day_of(r[7]) for r in rows})


_RANK = {o: i for i, o in enumerate(_OUTCOME_RANK, 1)}


_SETTLE_COLUMNS = (
    "trace_id",
    "p_engine",
    "d_engine",
    "start_ns",
    "ttft_source",
    "p_arrival_ns",
    "d_first_ns",
    "prefill_finished_ns",
    "kv_ready_ns",
    "d2p_sent_ns",
    "d2p_recv_ns",
    "p2d_sent_ns",
    "p2d_recv_ns",
)
_PAIR_WINDOW = (
    f"SELECT MAX(xlo_ns), MIN(xhi_ns) FROM traces WHERE p_engine = {PARAM} AND d_engine = {PARAM} "
    f"AND start_ns >= {PARAM} AND start_ns <= {PARAM}"
)
_SET_SETTLED = (
    f"UPDATE traces SET handoff_s = {PARAM}, handoff_err_s = {PARAM}, clock_offset_s = {PARAM}, "
    f"clock_lo_s = {PARAM}, clock_hi_s = {PARAM}, handoff_note = {PARAM} WHERE trace_id = {PARAM}"
)
#: The engines' TTFT, never over a router's (client-seen) one.
_SET_ENGINE_TTFT = (
    f"UPDATE traces SET ttft_s = {PARAM}, ttft_err_s = {PARAM}, ttft_source = {PARAM} "
    f"WHERE trace_id = {PARAM} AND (ttft_source IS NULL OR ttft_source = '{_TTFT_ENGINES}')"
)


def settle(conn: sqlite3.Connection, trace_ids: Iterable[str]) -> int:
    """Write the clock-corrected handoff of those ``trace_ids`` that have
    both ends (:func:`kvtrace.clockbounds.settle`, the pair's window read
    from the store). Inside the caller's write transaction; returns the
    number of rows settled. Idempotent: a later span of the trace re-settles it."""
    ids = list(trace_ids)
    rows = []
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        rows += conn.execute(
            f"SELECT {', '.join(_SETTLE_COLUMNS)} FROM traces WHERE trace_id IN ({params(len(chunk))}) "
            "AND prefill_finished_ns IS NOT NULL AND kv_ready_ns IS NOT NULL",
            chunk,
        ).fetchall()
    if not rows:
        return 0
    spans: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r[1] is not None and r[2] is not None:
            spans.setdefault((r[1], r[2]), []).append(int(r[3] or 0))
    windows = {
        pair: tuple(conn.execute(_PAIR_WINDOW, (*pair, min(st) - WINDOW_NS, max(st) + WINDOW_NS)).fetchone())
        for pair, st in spans.items()
    }
    updates, ttfts = [], []
    for tid, pe, de, _, ttft_src, p_arr, d_first, pf, kv, *cross in rows:
        raw = kv - pf
        s = clockbounds.settle(raw, clockbounds.own_bounds(raw, *cross), windows.get((pe, de)))
        updates.append((s.handoff_s, s.err_s, s.offset_s, s.lo_s, s.hi_s, s.note, tid))
        if ttft_src != _TTFT_ROUTER and p_arr is not None and d_first is not None:
            # P's arrival -> D's first token, two clocks like the handoff: the
            # same offset corrects it, with the same bound (unknown with it)
            ttft = None if s.handoff_s is None else s.handoff_s + ((d_first - p_arr) - raw) / 1e9
            ttfts.append((ttft, None if ttft is None else s.err_s, _TTFT_ENGINES, tid))
    updates.sort(key=lambda u: u[-1])  # trace-id lock order
    conn.executemany(_SET_SETTLED, updates)
    if ttfts:
        conn.executemany(_SET_ENGINE_TTFT, ttfts)
    return len(updates)


def bulk_insert(
    conn: sqlite3.Connection,
    spans: Sequence[tuple],
    traces: Sequence[tuple],
    trace_columns: Sequence[str] = TRACE_COLUMNS,
) -> None:
    """Insert rows as they are (tuples in :data:`SPAN_COLUMNS` /
    ``trace_columns`` order, by default :data:`TRACE_COLUMNS`; ``keep`` and
    the phase columns for summary-only requests), without folding: for
    synthetic stores (benchmarks), where each trace row is already complete.
    One transaction (PostgreSQL: ``COPY``, so a row already there fails it)."""
    cols = tuple(trace_columns)
    if dialect_of(conn) is POSTGRES:  # COPY, ~10x executemany; each row's day (no request straddles here)
        at = cols.index("start_ns")
        traces = [(day_of(r[at]), *r) for r in traces]
        partitions.ensure(conn, {day_of(r[7]) for r in spans} | {r[0] for r in traces})
        with write_tx(conn):
            conn.copy_rows("spans", SPAN_COLUMNS, spans)
            conn.copy_rows("traces", ("day", *cols), traces)
        return
    with write_tx(conn):
        conn.executemany(_INSERT_SPAN, spans)
        conn.executemany(f"INSERT INTO traces ({', '.join(cols)}) VALUES ({params(len(cols))})", traces)
