"""The store's DDL as templates, one text for both backends (filled by a
:class:`~kvtrace.store.dialect.Dialect`: ``{int}``, ``{real}``,
``{least}``, ``{desc}``, ``{without_rowid}``, ``{bench_seq}``). Indexes
are declared in the order "slowest N" reads them (``{desc}``: NULLs last),
so both backends walk one and stop after N.
"""

from kvrecord import semconv as sc
from kvtrace.store.columns import SPANS, TRACES, Column, traces_up_to


def _table(head: str, columns: tuple[Column, ...], width: int, tail: str = "") -> str:
    """``CREATE TABLE`` text: one line per column (the name padded to ``width``), then ``tail``."""
    lines = [f"    {c.name:<{width}} {c.decl}" for c in columns] + ([f"    {tail}"] if tail else [])
    return f"\n{head} (\n" + ",\n".join(lines) + "\n)"


#: The ``traces`` table as a template (:data:`kvtrace.store.columns.TRACES`
#: says what each column holds): ``{int}``, ``{real}``, ``{least}`` are the
#: dialect's (``@name@``: the table name). Version 2's (what the version
#: 1 -> 2 migration builds), and today's.
TRACES_V2_DDL = _table("CREATE TABLE IF NOT EXISTS @name@", traces_up_to(2), 19)
_TRACES_DDL = _table("CREATE TABLE IF NOT EXISTS @name@", TRACES, 19)


#: Indexes of ``traces`` up to version 4 that version 5 drops: each cost
#: 30-45 bytes per request (issue 24: every request keeps its summary row).
#: "slowest N with mode = m and outcome = o" walks ``traces_mode_handoff``
#: and skips the rows of other outcomes (a few: most are ``ok``), or, for a
#: rare outcome (failed, timeout: no handoff, sorted last), walks that
#: outcome's part of ``traces_outcome_handoff``; both stop after about N.
#: The mode indexes stay: modes differ in their handoffs (pull's are
#: longer), so walking ``traces_handoff`` for the push rows reads every
#: slower pull first (measured: 30-45 ms at 200k requests, growing with the
#: store, against 0.3 ms). ``store.slowest_plan`` (benchmarks/bench_store.py)
#: shows which index each read walks.
DROPPED_V5_INDEXES = ("traces_mode_outcome_handoff",)

_SPANS_DDL = (
    _table("CREATE TABLE IF NOT EXISTS spans", SPANS, 10, tail="PRIMARY KEY (trace_id, span_id)") + "{without_rowid}"
)

_TRACE_INDEXES = """
CREATE INDEX IF NOT EXISTS traces_mode_handoff ON traces (mode, handoff_s {desc});
CREATE INDEX IF NOT EXISTS traces_mode_outcome_handoff ON traces (mode, outcome, handoff_s {desc});
CREATE INDEX IF NOT EXISTS traces_outcome_handoff ON traces (outcome, handoff_s {desc});
CREATE INDEX IF NOT EXISTS traces_handoff ON traces (handoff_s {desc});
CREATE INDEX IF NOT EXISTS traces_mode_ttft ON traces (mode, ttft_s {desc});
CREATE INDEX IF NOT EXISTS traces_ttft ON traces (ttft_s {desc});
CREATE INDEX IF NOT EXISTS traces_start ON traces (start_ns);
CREATE INDEX IF NOT EXISTS traces_pair_start ON traces (p_engine, d_engine, start_ns);
"""

_REST_DDL = """
CREATE TABLE IF NOT EXISTS bench_rows (
    {bench_seq}run_id      TEXT NOT NULL,
    created_ns  {int} NOT NULL,
    mode        TEXT NOT NULL,
    dispatch    TEXT,
    qps         {real} NOT NULL,
    input_len   {int} NOT NULL,
    output_len  {int},
    num_prompts {int},
    "row"       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS bench_rows_run ON bench_rows (run_id);
"""

_META_DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);"""


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:  # the DDL above changed under this edit: say so at import
        raise AssertionError(f"DDL edit expected {old!r} once")
    return text.replace(old, new)


def _kept(indexes: str) -> str:
    return "".join(
        ln + "\n" for ln in indexes.splitlines() if ln and not any(f" {i} " in ln for i in DROPPED_V5_INDEXES)
    )


#: Version 4's schema (all eight ``traces`` indexes, nothing partitioned): what
#: ``tests/store_sql.py`` builds to test the migration to version 5.
SCHEMA_V4_TEMPLATE = (
    _META_DDL + _SPANS_DDL + ";\n" + _TRACES_DDL.replace("@name@", "traces") + ";" + _TRACE_INDEXES + _REST_DDL
)

# PostgreSQL, version 5: ``spans`` and ``traces`` partitioned by day
# (kvtrace/store/partitions.py says why the keys are what they are). A
# partitioned table's primary key must hold the partition key: ``spans``
# (trace_id, span_id, start_ns), partitioned on its own start (a span's
# start never changes: a copy sent again has the same one); ``traces``
# (trace_id, day), ``day`` = UTC days since the epoch of the row's start.
_PG_SPANS_DDL = _replace_once(
    _SPANS_DDL,
    "PRIMARY KEY (trace_id, span_id)\n)",
    "PRIMARY KEY (trace_id, span_id, start_ns)\n) PARTITION BY RANGE (start_ns)",
)
_PG_TRACES_DDL = (
    _replace_once(
        _TRACES_DDL.replace("@name@", "traces"),
        "trace_id            TEXT PRIMARY KEY,",
        "trace_id            TEXT NOT NULL,\n    day                 INTEGER NOT NULL,",
    )[:-2]
    + ",\n    PRIMARY KEY (trace_id, day)\n) PARTITION BY RANGE (day)"
)
if not _TRACES_DDL.endswith("\n)"):
    raise AssertionError("the traces DDL must end with its closing parenthesis")

#: Version 6: the partial traces (``handoff.open`` spans, docs/handoff-health.md) by
#: their snapshot time, so "stuck now" (``store.open_spans``) reads a few index
#: entries instead of every span. Partial: the other spans cost nothing. The
#: span name is a literal (a partial index serves only a query that names it so).
OPEN_SPAN_NAME = sc.SPAN_HANDOFF_OPEN
_SPAN_INDEXES = f"""
CREATE INDEX IF NOT EXISTS spans_open ON spans (end_ns) WHERE name = '{OPEN_SPAN_NAME}';
"""

#: The schema as a template (``{int}``, ``{real}``, ``{desc}``, ...:
#: :meth:`Dialect.sql`): SQLite's, and PostgreSQL's (partitioned).
SCHEMA_TEMPLATE = (
    _META_DDL
    + _SPANS_DDL
    + ";\n"
    + _TRACES_DDL.replace("@name@", "traces")
    + ";"
    + _kept(_TRACE_INDEXES)
    + _SPAN_INDEXES
    + _REST_DDL
)
PG_SCHEMA_TEMPLATE = (
    _META_DDL + _PG_SPANS_DDL + ";\n" + _PG_TRACES_DDL + ";" + _kept(_TRACE_INDEXES) + _SPAN_INDEXES + _REST_DDL
)
