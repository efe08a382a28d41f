"""PostgreSQL's ``spans`` and ``traces`` partitioned by UTC day, so that
retention drops a day as a whole table instead of deleting its rows one by
one (SQLite keeps its batched deletes: :mod:`kvtrace.store.retention`).

Keys
----
PostgreSQL wants a partitioned table's primary key to hold the partition key.

* ``spans``: by RANGE of ``start_ns``, key (trace_id, span_id, start_ns). A
  span's start is its own and never changes (a copy sent twice has the same
  one), so every writer puts a span in the same partition, and the upsert
  ``ON CONFLICT (trace_id, span_id, start_ns)`` finds the first copy. No
  extra column, no extra byte.
* ``traces``: by RANGE of ``day`` (UTC days since the epoch), key (trace_id,
  day). The row's ``start_ns`` cannot be the partition key: it is the LEAST
  of its spans' starts and moves as earlier spans arrive. ``day`` is a
  column the writers keep equal to ``day_of(start_ns)`` of the row.

Which day a summary row is in
-----------------------------
The spans of one request come from several processes (router, P, D; several
collectors) in any order, and each writer sees only some of them: it knows
the earliest start of *its* spans of the request (``m``), not the request's.
Trace ids are random, so nothing else is common to all writers.

Every writer computes ``day_of(m)`` and upserts there. That is the row's day
unless the request's spans straddle a UTC midnight. Let ``STRADDLE_NS`` (1 h)
bound how far apart the starts of one request's spans are (a request longer
than that has a root span that ends later but starts as early). A request
whose spans straddle midnight ``M`` has every start in [M - 1 h, M + 1 h],
so every writer of any of its spans sees ``m`` within an hour of ``M``:
``day_of(m - 1 h) != day_of(m + 1 h)`` ("near midnight"). Writers near
midnight, and only they, take a transaction-scoped advisory lock on the
trace id (all a batch needs, in one sorted statement, before any row lock),
then look for the request's row in the two days around ``m`` (the PK index
of each partition; a committed row is visible: READ COMMITTED reads after the
lock). If the row is in a later day than ``day_of(m)``, it moves to
``day_of(m)`` (an UPDATE of ``day`` moves a row between partitions), so the
row stays in the day of its earliest span; otherwise the upsert goes to the
row's day. Two writers of one straddling request are serialized by the lock
and the second finds the first's row: one row, always. A request not near
midnight has all its spans' starts in one day: every writer computes that
day, no lock, no probe. Cost: about 1 batch in 12 (the two hours around
midnight) pays one extra statement for its near-midnight traces. What is not
covered: a request whose span *starts* are more than an hour apart across
midnight may get two summary rows (its spans are all stored).

Partitions exist before a write lands: a writer creates today's and
tomorrow's when it connects, and those of any day in a batch it has not seen
(late spans, a clock far off), under an advisory lock, as a table of the
parent's shape then ``ATTACH PARTITION``: that takes SHARE UPDATE EXCLUSIVE
on the parent, which no reader or writer conflicts with (``CREATE TABLE ...
PARTITION OF`` would take ACCESS EXCLUSIVE and queue every writer behind a
long reader). There is no DEFAULT partition: ``DETACH ... CONCURRENTLY`` is
refused while one exists.

Dropping a day (:func:`drop_days_before`): ``DETACH PARTITION ...
CONCURRENTLY`` (SHARE UPDATE EXCLUSIVE on the parent: writers and readers
never wait for it; it waits for transactions that may still see the
partition), then ``DROP TABLE`` of the detached table (no lock on the
parent). A detach interrupted half way is finished by the next pass
(``FINALIZE``). Today's and yesterday's partitions are never dropped, so a
writer may trust its cache of the partitions of those days.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from typing import Any, Iterable

from kvtrace.store.ddl import _PG_SPANS_DDL, _PG_TRACES_DDL, _TRACE_INDEXES
from kvtrace.store.dialect import POSTGRES

DAY_NS = 86_400 * 10**9
#: The longest span of start times of one request that still folds into one
#: summary row across a midnight (module docstring).
STRADDLE_NS = 3600 * 10**9
#: First key of the advisory locks on trace ids (two-int form: its own space).
_TRACE_LOCK_SPACE = 0x6B76
#: pg_advisory_xact_lock key serializing partition creation ("kvpart").
PARTITION_LOCK_KEY = 0x6B7670617274
TABLES = ("traces", "spans")

#: Days whose partitions this process has seen, per store URL.
_known: dict[tuple[int, str], set[int]] = {}
_known_lock = threading.Lock()


def day_of(ns: int | None) -> int:
    """UTC days since the epoch of a wall-clock ns (None: day 0)."""
    return int(ns or 0) // DAY_NS


def today() -> int:
    return day_of(time.time_ns())


def partition_name(table: str, day: int) -> str:
    return f"{table}_{(dt.date(1970, 1, 1) + dt.timedelta(days=day)):%Y%m%d}"


def _bounds(table: str, day: int) -> tuple[int, int]:
    return (day * DAY_NS, (day + 1) * DAY_NS) if table == "spans" else (day, day + 1)


_ATTACHED = (
    "SELECT c.relname, i.inhdetachpending FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = ?::regclass"
)


def attached(conn: Any, table: str) -> dict[int, bool]:
    """``day -> detach pending`` of the partitions of ``table``."""
    out = {}
    for name, pending in conn.execute(_ATTACHED, (table,)).fetchall():
        d = dt.datetime.strptime(name.rsplit("_", 1)[1], "%Y%m%d").date()
        out[(d - dt.date(1970, 1, 1)).days] = bool(pending)
    return out


def create(conn: Any, days: Iterable[int]) -> None:
    """Attach a partition of both tables for each of ``days`` that lacks one,
    inside the caller's transaction (serialized by an advisory lock)."""
    conn.execute("SELECT pg_advisory_xact_lock(?)", (PARTITION_LOCK_KEY,))
    for table in TABLES:
        have = attached(conn, table)
        for d in sorted(set(days) - set(have)):
            name, (lo, hi) = partition_name(table, d), _bounds(table, d)
            # a table of that name not attached: a day retention detached and
            # did not get to drop (interrupted): its rows are meant to be gone
            conn.execute(f"DROP TABLE IF EXISTS {name}")
            conn.execute(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING GENERATED)")
            conn.execute(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({lo}) TO ({hi})")


def ensure(conn: Any, days: Iterable[int]) -> None:
    """Partitions of both tables exist for every one of ``days`` (a writer
    connection, outside a transaction). Days this process saw are trusted
    while they are today's or yesterday's (never dropped); older ones are
    looked up each time, as retention may have dropped them since."""
    key = (os.getpid(), conn.url)
    floor = today() - 1
    with _known_lock:
        known = set(_known.get(key, ()))
    want = set(days)
    if not any(d not in known or d < floor for d in want):
        return
    have = attached(conn, "spans").keys() & attached(conn, "traces").keys()
    if want - have:
        conn.execute("BEGIN")
        try:
            create(conn, want - have)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    with _known_lock:
        _known.setdefault(key, set()).update(d for d in want if d >= floor)


def forget(url: str) -> None:
    """Drop this process's cache of ``url``'s partitions (tests that drop them by hand)."""
    with _known_lock:
        _known.pop((os.getpid(), url), None)


def _lock_key(trace_id: str) -> int:
    return int(trace_id[:8], 16) - 2**31 if len(trace_id) >= 8 else hash(trace_id) % 2**31


def route(conn: Any, ups: list[dict]) -> None:
    """Set ``day`` in each of a batch's trace upserts (sorted by trace id),
    inside the write transaction, before any row lock (module docstring):
    ``day_of(start_ns)``, or for a request near midnight the day of the row
    already there, which moves to an earlier day when this batch starts
    earlier."""
    near = []
    for u in ups:
        m = u["start_ns"]
        u["day"] = day_of(m)
        if day_of(m - STRADDLE_NS) != day_of(m + STRADDLE_NS):
            near.append(u)
    if not near:
        return
    keys = sorted({_lock_key(u["trace_id"]) for u in near})
    conn.execute(
        "SELECT pg_advisory_xact_lock(?, k) FROM (SELECT unnest(?::int[]) AS k ORDER BY 1) AS ks",
        (_TRACE_LOCK_SPACE, keys),
    )
    days = sorted({day_of(u["start_ns"] + s) for u in near for s in (-STRADDLE_NS, STRADDLE_NS)})
    rows = conn.execute(
        "SELECT trace_id, MIN(day) FROM traces WHERE trace_id = ANY(?) AND day = ANY(?) GROUP BY trace_id",
        ([u["trace_id"] for u in near], days),
    ).fetchall()
    found = {t: d for t, d in rows}
    moves = []
    for u in near:
        e = found.get(u["trace_id"])
        if e is None:
            continue
        if u["day"] < e:
            moves.append((u["day"], u["trace_id"], e))
        else:
            u["day"] = e
    if moves:
        conn.executemany("UPDATE traces SET day = ? WHERE trace_id = ? AND day = ?", moves)


def _finish_pending(conn: Any) -> None:
    for table in TABLES:
        for d, pending in attached(conn, table).items():
            if pending:
                conn.execute(f"ALTER TABLE {table} DETACH PARTITION {partition_name(table, d)} FINALIZE")
                conn.execute(f"DROP TABLE IF EXISTS {partition_name(table, d)}")


def drop_days_before(conn: Any, older_than_ns: int, *, wait_s: float = 60.0) -> int:
    """Drop the partitions of the days that ended at or before
    ``older_than_ns`` (never today's or yesterday's); returns the number of
    traces they held (counted just before the detach). A writer connection
    outside a transaction; ``wait_s``: how long a detach waits for the
    transactions that still see the day (nobody waits on it meanwhile)."""
    last = min(day_of(older_than_ns) - 1, today() - 2)
    conn.execute(f"SET lock_timeout = {max(int(wait_s * 1000), 1)}")
    try:
        _finish_pending(conn)
        days = sorted(d for d in attached(conn, "traces").keys() | attached(conn, "spans").keys() if d <= last)
        n = 0
        for d in days:
            for table in TABLES:
                name = partition_name(table, d)
                if table == "traces" and d in attached(conn, "traces"):
                    n += int(conn.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0])
                if d in attached(conn, table):
                    conn.execute(f"ALTER TABLE {table} DETACH PARTITION {name} CONCURRENTLY")
                conn.execute(f"DROP TABLE IF EXISTS {name}")
        return n
    finally:
        conn.execute("RESET lock_timeout")


def migrate_v4(conn: Any) -> None:
    """Version 4 -> 5 on PostgreSQL, inside the upgrade's transaction: the
    old tables are renamed, the partitioned ones created, a partition for every day the rows cover, the rows
    copied (``day`` from each trace's start), the old tables dropped.
    Copying is safe: one transaction, so a failure leaves the version-4
    store as it was; it takes as long as the store is big, while other
    writers wait on the schema lock (upgrade a big store at a quiet time)."""
    for ln in _TRACE_INDEXES.splitlines():  # their names are the new table's
        if ln.startswith("CREATE INDEX"):
            conn.execute(f"DROP INDEX IF EXISTS {ln.split()[5]}")
    for table in TABLES:
        conn.execute(f"ALTER TABLE {table} RENAME TO {table}_v4")
        conn.execute(f"ALTER TABLE {table}_v4 RENAME CONSTRAINT {table}_pkey TO {table}_v4_pkey")
    conn.execute(POSTGRES.sql(_PG_SPANS_DDL))
    conn.execute(POSTGRES.sql(_PG_TRACES_DDL))
    days = conn.execute(
        f"SELECT DISTINCT COALESCE(start_ns, 0) / {DAY_NS} FROM traces_v4 "
        f"UNION SELECT DISTINCT start_ns / {DAY_NS} FROM spans_v4"
    ).fetchall()
    create(conn, [int(r[0]) for r in days])
    cols = [
        r[0]
        for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = 'traces_v4' AND is_generated = 'NEVER' ORDER BY ordinal_position"
        ).fetchall()
    ]
    conn.execute("INSERT INTO spans SELECT * FROM spans_v4")
    c = ", ".join(cols)
    conn.execute(f"INSERT INTO traces (day, {c}) SELECT COALESCE(start_ns, 0) / {DAY_NS}, {c} FROM traces_v4")
    conn.execute("DROP TABLE spans_v4")
    conn.execute("DROP TABLE traces_v4")
