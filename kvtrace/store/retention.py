"""Retention: deleting traces older than a horizon, in batches that do not
block writers, on both backends.

:func:`prune` deletes the oldest traces that started before ``older_than_ns``
(and their spans) ``batch`` traces at a time, each batch its own short write
transaction, so a writer waits at most one batch (SQLite: the file's write
lock; PostgreSQL: only the rows being deleted). The oldest go first (the
``traces_start`` index), so an interrupted pass leaves a store that is still
a contiguous window of time.

On PostgreSQL the days that ended before the horizon go first, as whole
partitions (:func:`kvtrace.store.partitions.drop_days_before`: detached
concurrently, no writer waits on it); the batched deletes then take what is
left before the horizon in the days still kept (``exact``). A
:class:`Retention` of a day or more is not exact there: it keeps whole days
(up to a day more than asked) and never deletes row by row, which at fleet
scale would cost as much as the writes themselves.

Bench rows are kept: they are a handful per ``kvlens bench`` run, and a
result someone asked for, not telemetry.

:class:`Retention` is what writers hold (the collector's ingest, the span
exporter in vLLM processes): after a successful write it prunes at most
once per :attr:`Retention.every_s`, for at most :attr:`Retention.budget_s`
(the rest waits for the next pass), so a store that ran for months without
retention is trimmed over a few minutes without stalling span writes. Every
process of a host may prune the same store: deletes are idempotent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvrecord.durations import parse_duration
from kvtrace.store import partitions
from kvtrace.store.dialect import POSTGRES, dialect_of
from kvtrace.store.schema import PARAM, params, write_tx

logger = logging.getLogger("kvlens")

#: Traces per delete transaction (with ~10 spans each: ~10k rows).
DEFAULT_BATCH = 1000

_OLDEST = f"SELECT trace_id FROM traces WHERE start_ns < {PARAM} ORDER BY start_ns LIMIT {PARAM}"


def prune(
    conn: Any,
    older_than_ns: int,
    *,
    batch: int = DEFAULT_BATCH,
    max_s: float | None = None,
    pause_s: float = 0.0,
    exact: bool = True,
) -> int:
    """Delete traces that started before ``older_than_ns`` and their spans,
    ``batch`` traces per transaction, oldest first; stop when none is left or
    after ``max_s`` seconds (None: no limit). ``pause_s``: sleep between
    batches (lets other writers in on a busy SQLite file). PostgreSQL: whole
    days first; ``exact=False``: only those (the module docstring). Returns
    the number of traces deleted. ``conn``: a writer connection."""
    if int(batch) <= 0:
        raise ValueError(f"batch must be > 0, got {batch!r}")
    t_end = None if max_s is None else time.monotonic() + max_s
    deleted = 0
    if dialect_of(conn) is POSTGRES:
        # a detach waits (for transactions that still see the day) at most the
        # pass's budget: a writer's thread runs it; an unfinished one is finished next pass
        deleted = partitions.drop_days_before(conn, int(older_than_ns), wait_s=60.0 if max_s is None else max_s)
        if not exact:
            return deleted
    while True:
        with write_tx(conn):
            ids = [r[0] for r in conn.execute(_OLDEST, (int(older_than_ns), int(batch))).fetchall()]
            if ids:
                marks = params(len(ids))
                conn.execute(f"DELETE FROM spans WHERE trace_id IN ({marks})", ids)
                conn.execute(f"DELETE FROM traces WHERE trace_id IN ({marks})", ids)
        deleted += len(ids)
        if len(ids) < batch or (t_end is not None and time.monotonic() >= t_end):
            return deleted
        if pause_s > 0:
            time.sleep(pause_s)


class Retention:
    """Keep ``keep_s`` seconds of traces: :meth:`after_write` prunes older
    ones at most every ``every_s`` seconds, for at most ``budget_s`` each."""

    every_s = 60.0
    budget_s = 1.0

    def __init__(
        self, keep_s: float, *, every_s: float | None = None, budget_s: float | None = None, batch: int = DEFAULT_BATCH
    ) -> None:
        if not keep_s > 0:
            raise ValueError(f"retention must be > 0 s, got {keep_s!r}")
        self.keep_s = float(keep_s)
        if every_s is not None:
            self.every_s = float(every_s)
        if budget_s is not None:
            self.budget_s = float(budget_s)
        self.batch = int(batch)
        self.pruned = 0  # traces deleted by this process
        self._next = 0.0  # monotonic time of the next pass (0: at the first write)
        self._warned = False

    @classmethod
    def of(cls, value: "Retention | float | int | str | None") -> "Retention | None":
        """A Retention from a duration (``"7d"``, seconds), or None for "keep all"."""
        if value is None or value == "" or isinstance(value, Retention):
            return value or None
        if isinstance(value, str):
            if value.strip().lower() in ("off", "none", "0"):
                return None
            return cls(parse_duration(value))
        return cls(float(value))

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def after_write(self, conn: Any) -> int:
        """Prune once if a pass is due (the caller just wrote on ``conn``).
        Never raises: a failed pass is logged once and retried next time."""
        if conn is None or not self.due():
            return 0
        self._next = time.monotonic() + self.every_s
        try:
            n = prune(
                conn,
                time.time_ns() - int(self.keep_s * 1e9),
                batch=self.batch,
                max_s=self.budget_s,
                exact=self.keep_s < partitions.DAY_NS / 1e9,
            )
        except Exception as e:
            if not self._warned:
                self._warned = True
                logger.warning("kvlens: trace retention pass failed (%s); retrying in %.0f s", e, self.every_s)
            return 0
        if n:
            self.pruned += n
            if n >= self.batch:  # more may be left: come back sooner than every_s
                self._next = time.monotonic() + min(self.every_s, 5.0)
        return n
