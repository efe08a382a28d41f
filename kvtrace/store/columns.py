"""The store's columns, written once: every column of the ``traces`` table
(its declaration, the schema version that added it, whether a trace summary
reads it and whether ``bulk_insert`` writes it) and of the ``spans`` table.

Everything else derives its list from here: the DDL
(:mod:`kvtrace.store.ddl`: the ``CREATE TABLE`` texts of every version), the
migrations (:mod:`kvtrace.store.schema`: the columns each version adds), the
queries (:data:`SUMMARY_COLUMNS`: what ``slowest`` selects, and the
dashboard's table of the slowest requests), the writer (:data:`TRACE_COLUMNS`,
:data:`SPAN_COLUMNS`, :data:`PHASE_COLUMNS`). A new column is one entry here
(with the next schema version and its migration in ``schema.py``).

Declarations are dialect templates (:meth:`kvtrace.store.dialect.Dialect.sql`:
``{int}``, ``{real}``, ``{least}``), the same text for both backends.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrecord import semconv as sc
from kvrecord.derived import DERIVED_PHASES

#: The first version this list describes: the ``traces`` table as version 2
#: built it (version 1's is rebuilt by ``schema.MIGRATIONS[1]``, which names
#: its own columns). Columns of later versions come by ``ALTER TABLE ... ADD COLUMN``.
BASE_VERSION = 2


@dataclass(frozen=True)
class Column:
    """One column: ``decl`` follows its name in ``CREATE TABLE`` (and in
    ``ALTER TABLE ... ADD COLUMN`` for a column of a later version)."""

    name: str
    decl: str
    #: the schema version whose table first has it
    since: int = BASE_VERSION
    #: in a trace summary (:data:`SUMMARY_COLUMNS`: ``slowest`` rows, the dashboard's table)
    summary: bool = True
    #: written as it is by ``bulk_insert`` (:data:`TRACE_COLUMNS`)
    written: bool = False


#: Recorded phases with a duration (no points, none of the derived ones:
#: those need spans of two processes), one summary column each:
#: ``d_<phase>`` (dots as underscores), seconds, the longest copy of the
#: phase in the trace (with tensor parallelism one per rank).
SUMMARY_PHASES: tuple[str, ...] = tuple(
    p.value for p in sc.Phase if p not in sc.POINT_PHASES and p not in DERIVED_PHASES
)


def phase_column(phase: str) -> str:
    """The summary column of a recorded phase's duration (``write.complete`` -> ``d_write_complete``)."""
    return "d_" + phase.replace(".", "_")


#: Each of :data:`SUMMARY_PHASES` -> its summary column (writer, queries).
PHASE_COLUMNS: dict[str, str] = {p: phase_column(p) for p in SUMMARY_PHASES}

_W = {"written": True}
_HIDDEN = {"summary": False}  # read by the writer's settle pass, not by a summary

#: The ``traces`` table, in its ``CREATE TABLE`` order (docs/phases.md
#: "Clocks across hosts"). Version 2: the clock crossings and the settled
#: handoff. ``handoff_raw_s`` is the two-clock difference; ``handoff_s`` is
#: written by the writer's settle pass (:mod:`kvtrace.clockbounds`):
#: corrected for the P/D clock offset, with ``handoff_err_s``, or NULL with
#: ``handoff_note`` saying why it is unknown. ``xlo_ns`` / ``xhi_ns``: this
#: request's own bounds on D's clock minus P's.
#:
#: Version 3: the TTFT the engines prove where no kvlens router measured one.
#: ``p_arrival_ns``: P's request arrival (its ``prefill`` span's start, P's
#: clock); ``d_first_ns``: D's first token (``decode.first_step`` end, D's
#: clock). The settle pass writes ``ttft_s`` from them (corrected like the
#: handoff, ``ttft_err_s`` its bound) with ``ttft_source = 'engines'`` when
#: no router root span gave the client-seen one (``ttft_source = 'router'``).
#:
#: Version 4 (the two tiers, issue 24): ``keep`` says whether the request's
#: spans are stored and why (:mod:`kvtrace.store.keep`): NULL while undecided
#: (or written before version 4: all spans kept), ``all`` (``--keep all``), a
#: keep reason (``slow``, ``failed``, ``ratio``, ...) or ``no`` (summary
#: only); then one duration per :data:`SUMMARY_PHASES`.
#:
#: Version 7: what the live verdict (:mod:`kvtrace.verdict`) reads of a
#: request beyond its timings, folded from its spans so that a request kept
#: as its summary only (``--keep sampled``) still has them: ``prompt_tokens``
#: (P's count; the router's root span carries the same, from P's answer),
#: ``split`` (the router's weight of the mode it drew; NULL when the mode was
#: not drawn) and ``tpot_s`` (the client-seen time per output token of a stream).
TRACES: tuple[Column, ...] = (
    Column("trace_id", "TEXT PRIMARY KEY", **_W),
    Column("request_id", "TEXT", **_W),
    Column("mode", "TEXT", **_W),
    Column("dispatch", "TEXT", **_W),
    Column("outcome", "TEXT", **_W),
    Column("start_ns", "{int}", **_W),
    Column("end_ns", "{int}", **_W),
    Column("ttft_s", "{real}", **_W),
    Column("prefill_finished_ns", "{int}", **_W),
    Column("kv_ready_ns", "{int}", **_W),
    Column("n_spans", "{int} NOT NULL DEFAULT 0", **_W),
    Column("p_engine", "TEXT"),
    Column("d_engine", "TEXT"),
    Column("d2p_sent_ns", "{int}", **_HIDDEN),
    Column("d2p_recv_ns", "{int}", **_HIDDEN),
    Column("p2d_sent_ns", "{int}", **_HIDDEN),
    Column("p2d_recv_ns", "{int}", **_HIDDEN),
    Column("handoff_s", "{real}", **_W),
    Column("handoff_err_s", "{real}", **_W),
    Column("clock_offset_s", "{real}"),
    Column("clock_lo_s", "{real}"),
    Column("clock_hi_s", "{real}"),
    Column("handoff_note", "TEXT"),
    Column("handoff_raw_s", "{real} GENERATED ALWAYS AS ((kv_ready_ns - prefill_finished_ns) / 1e9) STORED"),
    Column("xlo_ns", "{int} GENERATED ALWAYS AS (d2p_sent_ns - d2p_recv_ns) STORED", **_HIDDEN),
    Column(
        "xhi_ns",
        "{int} GENERATED ALWAYS AS ({least}(\n"
        "                            COALESCE(p2d_recv_ns - p2d_sent_ns, kv_ready_ns - prefill_finished_ns),\n"
        "                            COALESCE(kv_ready_ns - prefill_finished_ns, p2d_recv_ns - p2d_sent_ns))) STORED",
        **_HIDDEN,
    ),
    Column("ttft_source", "TEXT", since=3),
    Column("ttft_err_s", "{real}", since=3),
    Column("p_arrival_ns", "{int}", since=3, **_HIDDEN),
    Column("d_first_ns", "{int}", since=3, **_HIDDEN),
    Column("keep", "TEXT", since=4),
    *(Column(c, "{real}", since=4) for c in PHASE_COLUMNS.values()),
    Column("prompt_tokens", "{int}", since=7),
    Column("split", "{real}", since=7),
    Column("tpot_s", "{real}", since=7),
)

#: The ``spans`` table, one row per span, in its ``CREATE TABLE`` order,
#: which is also a written row's tuple order (writer, ``bulk_insert``, ``spans_for``).
SPANS: tuple[Column, ...] = (
    Column("trace_id", "TEXT NOT NULL"),
    Column("span_id", "TEXT NOT NULL"),
    Column("parent_id", "TEXT"),
    Column("name", "TEXT NOT NULL"),
    Column("role", "TEXT"),
    Column("mode", "TEXT"),
    Column("request_id", "TEXT"),
    Column("start_ns", "{int} NOT NULL"),
    Column("end_ns", "{int} NOT NULL"),
    Column("outcome", "TEXT"),
    Column("attributes", "TEXT"),
)

#: Column order of a ``spans`` row (writer, ``bulk_insert``, ``spans_for``).
SPAN_COLUMNS: tuple[str, ...] = tuple(c.name for c in SPANS)
#: Column order of a written ``traces`` row (``bulk_insert``: synthetic rows
#: carry their settled handoff as they are; the rest is generated or NULL).
TRACE_COLUMNS: tuple[str, ...] = tuple(c.name for c in TRACES if c.written)
#: Columns of a trace summary (``slowest`` rows, :mod:`kvtrace.tracemodel`,
#: the dashboard's table of the slowest requests), in the table's order.
SUMMARY_COLUMNS: tuple[str, ...] = tuple(c.name for c in TRACES if c.summary)


def traces_up_to(version: int) -> tuple[Column, ...]:
    """The ``traces`` columns a version-``version`` table has, in order."""
    return tuple(c for c in TRACES if c.since <= version)


def added_in(version: int) -> tuple[tuple[str, str], ...]:
    """``(name, decl)`` of the ``traces`` columns that version ``version`` added
    (``ALTER TABLE traces ADD COLUMN name decl``)."""
    if version <= BASE_VERSION:
        raise ValueError(f"version {version}'s columns are the table itself (BASE_VERSION = {BASE_VERSION})")
    return tuple((c.name, c.decl) for c in TRACES if c.since == version)


def check_names(what: str, names, table: tuple[Column, ...] = TRACES) -> None:
    """Raise at import when a query's projection names a column the table lacks."""
    known = {c.name for c in table}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise AssertionError(f"{what} names columns the store lacks: {unknown}")
