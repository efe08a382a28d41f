"""The store's DDL as templates, one text for both backends (filled by a
:class:`~kvtrace.store.dialect.Dialect`: ``{int}``, ``{real}``,
``{least}``, ``{desc}``, ``{without_rowid}``, ``{bench_seq}``). Indexes
are declared in the order "slowest N" reads them (``{desc}``: NULLs last),
so both backends walk one and stop after N.
"""

from kvrecord import semconv as sc
from kvrecord.derived import DERIVED_PHASES

#: The ``traces`` table (version 2: clock crossings and the settled handoff,
#: docs/phases.md "Clocks across hosts"). ``handoff_raw_s`` is the two-clock
#: difference; ``handoff_s`` is written by the writer's settle pass
#: (:mod:`kvtrace.clockbounds`): corrected for the P/D clock offset, with
#: ``handoff_err_s``, or NULL with ``handoff_note`` saying why it is unknown.
#: ``xlo_ns`` / ``xhi_ns``: this request's own bounds on D's clock minus P's.
#: A template: ``{int}``, ``{real}``, ``{least}`` are the dialect's (``@name@``: the table name).
_TRACES_DDL = """
CREATE TABLE IF NOT EXISTS @name@ (
    trace_id            TEXT PRIMARY KEY,
    request_id          TEXT,
    mode                TEXT,
    dispatch            TEXT,
    outcome             TEXT,
    start_ns            {int},
    end_ns              {int},
    ttft_s              {real},
    prefill_finished_ns {int},
    kv_ready_ns         {int},
    n_spans             {int} NOT NULL DEFAULT 0,
    p_engine            TEXT,
    d_engine            TEXT,
    d2p_sent_ns         {int},
    d2p_recv_ns         {int},
    p2d_sent_ns         {int},
    p2d_recv_ns         {int},
    handoff_s           {real},
    handoff_err_s       {real},
    clock_offset_s      {real},
    clock_lo_s          {real},
    clock_hi_s          {real},
    handoff_note        TEXT,
    handoff_raw_s       {real} GENERATED ALWAYS AS ((kv_ready_ns - prefill_finished_ns) / 1e9) STORED,
    xlo_ns              {int} GENERATED ALWAYS AS (d2p_sent_ns - d2p_recv_ns) STORED,
    xhi_ns              {int} GENERATED ALWAYS AS ({least}(
                            COALESCE(p2d_recv_ns - p2d_sent_ns, kv_ready_ns - prefill_finished_ns),
                            COALESCE(kv_ready_ns - prefill_finished_ns, p2d_recv_ns - p2d_sent_ns))) STORED
)"""

#: Columns version 3 added (``ALTER TABLE ... ADD COLUMN`` on an older
#: store): the TTFT the engines prove where no kvlens router measured one.
#: ``p_arrival_ns``: P's request arrival (its ``prefill`` span's start, P's
#: clock); ``d_first_ns``: D's first token (``decode.first_step`` end, D's
#: clock). The settle pass writes ``ttft_s`` from them (corrected like the
#: handoff, ``ttft_err_s`` its bound) with ``ttft_source = 'engines'`` when
#: no router root span gave the client-seen one (``ttft_source = 'router'``).
V3_TRACE_COLUMNS = (
    ("ttft_source", "TEXT"),
    ("ttft_err_s", "{real}"),
    ("p_arrival_ns", "{int}"),
    ("d_first_ns", "{int}"),
)

#: Column order of a ``spans`` row (writer, ``bulk_insert``, ``spans_for``).
SPAN_COLUMNS = (
    "trace_id",
    "span_id",
    "parent_id",
    "name",
    "role",
    "mode",
    "request_id",
    "start_ns",
    "end_ns",
    "outcome",
    "attributes",
)
#: Column order of a written ``traces`` row (``bulk_insert``: synthetic rows
#: carry their settled handoff as they are; the rest is generated or NULL).
TRACE_COLUMNS = (
    "trace_id",
    "request_id",
    "mode",
    "dispatch",
    "outcome",
    "start_ns",
    "end_ns",
    "ttft_s",
    "prefill_finished_ns",
    "kv_ready_ns",
    "n_spans",
    "handoff_s",
    "handoff_err_s",
)


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

#: Columns version 4 added (the two tiers, issue 24): ``keep`` says whether
#: the request's spans are stored and why (:mod:`kvtrace.store.keep`): NULL
#: while undecided (or written before version 4: all spans kept), ``all``
#: (``--keep all``), a keep reason (``slow``, ``failed``, ``ratio``, ...) or
#: ``no`` (summary only); then one duration per :data:`SUMMARY_PHASES`.
V4_TRACE_COLUMNS = (("keep", "TEXT"), *((c, "{real}") for c in PHASE_COLUMNS.values()))

#: Columns version 7 added: what the live verdict (:mod:`kvtrace.verdict`)
#: reads of a request beyond its timings, folded from its spans so that a
#: request kept as its summary only (``--keep sampled``) still has them:
#: ``prompt_tokens`` (P's count; the router's root span carries the same,
#: from P's answer), ``split`` (the router's weight of the mode it drew;
#: NULL when the mode was not drawn) and ``tpot_s`` (the client-seen time
#: per output token of a stream).
V7_TRACE_COLUMNS = (("prompt_tokens", "{int}"), ("split", "{real}"), ("tpot_s", "{real}"))


def _with_columns(ddl: str, columns) -> str:
    return ddl[: ddl.rindex(")")].rstrip() + "".join(f",\n    {c:<19} {t}" for c, t in columns) + "\n)"


#: Version 2's traces table (what the version 1 -> 2 migration builds).
_TRACES_V2_DDL = _TRACES_DDL
_TRACES_DDL = _with_columns(_TRACES_V2_DDL, (*V3_TRACE_COLUMNS, *V4_TRACE_COLUMNS, *V7_TRACE_COLUMNS))


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

_SPANS_DDL = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id   TEXT NOT NULL,
    span_id    TEXT NOT NULL,
    parent_id  TEXT,
    name       TEXT NOT NULL,
    role       TEXT,
    mode       TEXT,
    request_id TEXT,
    start_ns   {int} NOT NULL,
    end_ns     {int} NOT NULL,
    outcome    TEXT,
    attributes TEXT,
    PRIMARY KEY (trace_id, span_id)
){without_rowid}"""

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

#: Version 6: the partial traces (``handoff.open`` spans, docs/health.md) by
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
