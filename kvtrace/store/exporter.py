"""The store as an OpenTelemetry ``SpanExporter``: what a process's batch
span processor (and the collector) hands its spans to. Bounded: a batch it
cannot write in time is dropped and counted, never waited for."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvrecord.location import StoreLocation
from kvtrace.store.errors import is_transient
from kvtrace.store.schema import connect, set_wait
from kvrecord.keeprule import KeepRule
from kvtrace.store.keep import Keeper

logger = logging.getLogger("kvlens")


class StoreSpanExporter(SpanExporter):
    """OTel ``SpanExporter`` writing to the store (a file path or a
    ``postgresql://`` URL). Called by one batch processor's export thread.
    A batch that cannot be written within ``max_block_s`` (the write lock
    held by another writer all that time, an unwritable file, a PostgreSQL
    server that is down) is dropped: ``export`` returns FAILURE, adds the
    batch to :attr:`lost` and logs once; kvlens' batch processor counts it
    as lost with reason :attr:`loss_reason` (``store``). Serving never notices.

    ``max_block_s``: the most one ``export`` call waits, every lock retry,
    reconnect and back-off included (default :attr:`MAX_BLOCK_S`).
    ``retention``: keep this long (seconds, or a duration such as ``"7d"``);
    older traces are pruned in small batches after a write, at most once
    per :attr:`kvtrace.store.retention.Retention.every_s` (default: keep all)."""

    #: Every kvlens process of a host writes this one file; on a loaded host
    #: a writer can hold the lock for seconds. Waiting only delays the export
    #: thread (its queue is bounded and counts what it refuses), but it must
    #: stay bounded: at most this long per batch, then the batch is dropped.
    MAX_BLOCK_S = 10.0
    #: ``kvlens_telemetry_dropped_total`` reason for a batch this exporter drops.
    loss_reason = "store"

    def __init__(
        self,
        path: "StoreLocation | str | Path",
        *,
        max_block_s: float | None = None,
        retention: "float | str | None" = None,
        keep: "KeepRule | None" = None,
    ):
        from kvtrace.store.retention import Retention

        self.location = StoreLocation.parse(path)
        self.max_block_s = float(self.MAX_BLOCK_S if max_block_s is None else max_block_s)
        if not self.max_block_s > 0:
            raise ValueError(f"max_block_s must be > 0, got {max_block_s!r}")
        self.retention = Retention.of(retention)
        #: writes every request's summary, spans as ``keep`` decides (default: all)
        self.keeper = Keeper(keep)
        self.lost = 0  # spans of the batches this exporter dropped
        self._conn = None
        self._lock = threading.Lock()
        self._warned = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        deadline = time.monotonic() + self.max_block_s
        if not self._lock.acquire(timeout=self.max_block_s):
            return self._dropped(spans, "exporter busy")
        try:
            self._write(spans, deadline)
            if self.retention is not None:
                self.retention.after_write(self._conn)
            return SpanExportResult.SUCCESS
        except Exception as e:
            self._close_conn()
            return self._dropped(spans, e)
        finally:
            self._lock.release()

    def _write(self, spans, deadline: float) -> None:
        """Write one batch, retrying what may pass (SQLite "locked"/"busy",
        a PostgreSQL server that is unreachable or went away) until
        ``deadline`` (monotonic); every wait is capped by the time left."""
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            try:
                if self._conn is None:
                    self._conn = connect(self.location, timeout_s=max(left, 0.001))
                set_wait(self._conn, left)
                self.keeper.write(self._conn, spans)  # no spans: the held requests that are due
                return
            except Exception as e:
                left = deadline - time.monotonic()
                if not is_transient(e) or left <= 0.001:
                    raise
                if not isinstance(e, sqlite3.Error):  # a lost server connection: open a new one
                    self._close_conn()
                time.sleep(min(0.05 * 2**attempt, 1.0, left))
                attempt += 1

    def _dropped(self, spans, why) -> SpanExportResult:
        self.lost += len(spans)
        if not self._warned:
            self._warned = True
            logger.warning(
                "kvlens: trace store %s not writable within %.3g s (%s); spans dropped and counted "
                '(kvlens_telemetry_dropped_total{reason="store"})',
                self.location,
                self.max_block_s,
                why,
            )
        return SpanExportResult.FAILURE

    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def tick(self) -> None:
        """Decide the held requests that are due (the export thread, when it
        has no spans to send: under ``--keep sampled`` a quiet process still
        stores its requests' spans). Never raises."""
        due = self.keeper.due_in()
        if due is None or due > 0 or not self._lock.acquire(blocking=False):
            return
        try:
            self._write((), time.monotonic() + self.max_block_s)
        except Exception as e:
            self._close_conn()
            self._dropped((), e)
        finally:
            self._lock.release()

    def shutdown(self) -> None:
        """Decide every held request, close the connection; if an export
        still holds it (a shutdown that gave up waiting), leave it to the
        process's exit."""
        if self._lock.acquire(timeout=0.1):
            try:
                if self.keeper.buffered:
                    try:
                        self._write((), time.monotonic() + 1.0)
                        self.keeper.flush(self._conn)
                    except Exception as e:
                        self.lost += self.keeper.buffered
                        self._dropped((), e)
                self._close_conn()
            finally:
                self._lock.release()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
