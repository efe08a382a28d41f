"""The collector's write side: a bounded span queue and one writer thread
that puts received spans into the trace store.

:meth:`Ingest.offer` (the HTTP handler, any thread, never blocks on I/O)
queues one request's spans or refuses them when the queue would pass its
bound, so the handler answers 429 and the OTLP exporter retries later. One
daemon thread merges queued requests into batches of up to ``batch_spans``
and writes each through a :class:`kvtrace.store.Keeper` (all SQL stays in
the store). The store is a file or a PostgreSQL URL (``postgresql://``).
A store that is locked or busy, or a PostgreSQL server that is down or went
away, is retried with backoff (up to :attr:`Ingest.MAX_BACKOFF_S`) for
``busy_retry_s`` while the queue fills (so clients are told to back off,
429, and their OTLP exporters retry); after that the batch is dropped and
counted, the next batch tries again, and writing resumes by itself when
the server is back. Nothing is dropped silently:

    kvlens_collector_spans_received_total              spans accepted onto the queue
    kvlens_collector_spans_written_total               spans written to the store
    kvlens_collector_spans_dropped_total{reason}       store_error | shutdown
    kvlens_collector_requests_rejected_total{reason}   too_large | content_type | decode | invalid_span
                                                        | queue_full | shutdown | unauthenticated
    kvlens_collector_queue_spans                       spans queued or being written
    kvlens_collector_spans_unkept_total                spans of requests kept as their summary only
    kvlens_collector_decision_buffer_spans             spans waiting for their request's keep decision
    kvlens_collector_keep_decisions_total{decision}    requests decided, by keep reason or ``no``
    kvlens_collector_decisions_forced_total            requests decided early: the decision buffer was full
    kvlens_collector_late_spans_total{kept}            spans that arrived after their request's decision
    kvlens_collector_held_spans_evicted_total          unkept spans let go before the metrics derived their phases

``received = written + unkept + dropped + queue_spans + decision_buffer_spans``
at any quiet moment (with ``--keep all``: no unkept, no buffer). Under
``--keep sampled`` (:class:`kvtrace.store.Keeper`) every request's summary
is written at once and its spans when it is decided; a late span of an
unkept request counts in ``unkept``.

After each successful write ``on_written(spans)`` runs on the writer thread;
:func:`collector_ingest` passes every span to a
:class:`exporters.metrics.PhaseMetricsProcessor`, so the collector's
``/metrics`` shows the phase histograms and the handoff histogram (with
``trace_id`` exemplars) for every trace it stores. A failure there is logged
once and never stops the writer.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry

from kvtrace import store
from collector.counters import DROP_REASONS, REJECT_REASONS, IngestMetrics
from kvrecord.keeprule import KeepRule
from kvrecord.logutil import log_once

logger = logging.getLogger("kvlens")


class Ingest:
    """Bounded queue + writer thread from received spans to the store at
    ``store_path``. Start-up opens nothing: the writer connects on its first
    batch (:func:`check_store` tells a CLI early that the path is unusable).

    ``max_queue_spans``: spans queued or in flight at most (a request larger
    than that is taken only into an empty queue, so it cannot wait forever).
    ``batch_spans``: spans merged into one store transaction.
    ``busy_retry_s``: how long a locked store (or an unreachable PostgreSQL
    server) is retried before the batch is dropped. ``on_written(spans)`` /
    ``on_close()``: writer-thread / close hooks. ``retention``: keep this long
    (seconds or ``"7d"``; default: keep all): older traces are pruned in
    small batches after a write (:class:`kvtrace.store.Retention`).
    ``registry``: where the ``kvlens_collector_*`` metrics live (default: a new one).
    ``keep``: which requests keep their spans (default: all). ``linger_s``:
    how long a batch short of ``batch_spans`` waits for more spans."""

    #: SQLite's own wait for another writer, per attempt; the retry loop
    #: around it runs up to ``busy_retry_s``, and :meth:`close` waits at
    #: most this much past its timeout for a batch being written.
    ATTEMPT_TIMEOUT_S = 0.5
    #: Longest pause between two attempts on a PostgreSQL server that is
    #: down (asked about once a second, not hammered); a locked SQLite file
    #: is retried every 0.25 s at most.
    MAX_BACKOFF_S = 1.0

    def __init__(
        self,
        store_path: "store.StoreLocation | str | Path",
        *,
        max_queue_spans: int = 100_000,
        on_written: Callable[[Sequence], None] | None = None,
        on_close: Callable[[], None] | None = None,
        registry: CollectorRegistry | None = None,
        batch_spans: int = 2000,
        busy_retry_s: float = 30.0,
        retention: "float | str | None" = None,
        keep: KeepRule | None = None,
        linger_s: float = 0.05,
    ) -> None:
        if int(max_queue_spans) <= 0 or int(batch_spans) <= 0:
            raise ValueError("max_queue_spans and batch_spans must be > 0")
        if busy_retry_s < 0:
            raise ValueError(f"busy_retry_s must be >= 0, got {busy_retry_s!r}")
        self.location = store.StoreLocation.parse(store_path)
        self.retention = store.Retention.of(retention)
        self.max_queue_spans = int(max_queue_spans)
        self.batch_spans = int(batch_spans)
        self.busy_retry_s = float(busy_retry_s)
        self.linger_s = max(0.0, float(linger_s))
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = IngestMetrics(self.registry)
        self.keeper = store.Keeper(keep)
        self._seen: dict[str, int] = {}  # keeper counts already added to the metrics
        self._on_written = on_written
        self._on_close = on_close
        self._q: collections.deque[list] = collections.deque()
        self._queued = 0  # spans in _q plus the batch being written
        self._cv = threading.Condition()
        self._closed = False
        self._stop_at = float("inf")  # close(): monotonic time past which the writer gives up
        self._conn = None  # the store connection (either backend), opened by the writer
        self._thread = threading.Thread(target=self._run, name="kvlens-collector-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ producers
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queued_spans(self) -> int:
        """Spans queued or being written now."""
        return self._queued

    def alive(self) -> bool:
        """The writer thread is running and the queue takes spans."""
        return not self._closed and self._thread.is_alive()

    def offer(self, spans: Sequence) -> bool:
        """Queue one request's spans (the caller gives up ownership). False
        when the queue is full (counted as ``queue_full``) or closed (counted
        as ``shutdown``): answer 429 / 503 with ``Retry-After``. Any thread;
        never blocks on I/O."""
        n = len(spans)
        with self._cv:
            if self._closed:
                reason = "shutdown"
            elif self._queued and self._queued + n > self.max_queue_spans:
                reason = "queue_full"
            else:
                if n:  # (the caller gave the list up: no copy)
                    before = self._queued
                    self._q.append(spans if type(spans) is list else list(spans))
                    self._queued += n
                    self.metrics.queue.set(self._queued)
                    # wake the writer only when it waits for these (first spans; a full batch while it
                    # lingers): a wake-up per small export cost more CPU than decoding it
                    if not before or (before < self.batch_spans <= self._queued):
                        self._cv.notify()
                reason = None
        if reason is not None:
            self.metrics.rejected.labels(reason).inc()
            return False
        if n:
            self.metrics.received.inc(n)
        return True

    def counts(self) -> dict[str, int]:
        """Totals so far: received, written, dropped (all reasons), queued."""
        g = self.registry.get_sample_value
        return {
            "received": int(g("kvlens_collector_spans_received_total") or 0),
            "written": int(g("kvlens_collector_spans_written_total") or 0),
            "dropped": int(sum(g("kvlens_collector_spans_dropped_total", {"reason": r}) or 0 for r in DROP_REASONS)),
            "queued": self._queued,
        }

    def reject(self, reason: str) -> None:
        """Count a request the HTTP or gRPC layer refused (``too_large``,
        ``content_type``, ``decode``, ``invalid_span``, ``unauthenticated``). Any thread."""
        self.metrics.rejected.labels(reason if reason in REJECT_REASONS else "decode").inc()

    # --------------------------------------------------------------- writer
    def _take(self) -> list | None:
        """The next batch (whole requests merged up to ``batch_spans``; one
        larger request is split), or None once closed and drained."""
        with self._cv:
            while not self._q:
                if self._closed:
                    return None
                due = self.keeper.due_in()  # read on this (the writer) thread only
                if due is not None and due <= 0:
                    return []  # nothing queued, held requests due: decide them
                self._cv.wait(due)
            if self._closed and time.monotonic() >= self._stop_at:
                return None  # past close()'s deadline: close() counts what is left
            # A fleet sends many small exports (each process every ~200 ms):
            # wait up to linger_s for a fuller batch, one transaction for many.
            end = time.monotonic() + self.linger_s
            while self._queued < self.batch_spans and not self._closed and (left := end - time.monotonic()) > 0:
                self._cv.wait(left)
            batch: list = []
            while self._q and len(batch) < self.batch_spans:
                head = self._q[0]
                room = self.batch_spans - len(batch)
                if len(head) <= room:
                    batch.extend(self._q.popleft())
                else:
                    batch.extend(head[:room])
                    del head[:room]
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                self._decide_all()
                return
            try:
                self._write(batch)
            except Exception as e:  # never let the writer die
                self._finish(batch, "store_error")
                log_once(
                    "collector-writer:" + type(e).__name__,
                    "collector writer failed (%s); batch dropped",
                    e,
                    exc_info=True,
                )

    def _write(self, batch: list) -> None:
        deadline = time.monotonic() + self.busy_retry_s
        delay = 0.05
        while True:
            if time.monotonic() >= self._stop_at:  # closing, and out of time
                self._failed(batch, TimeoutError("closing: flush timeout reached"))
                return
            try:
                if self._conn is None:
                    self._conn = store.connect(self.location, timeout_s=self.ATTEMPT_TIMEOUT_S)
                stored = self.keeper.write(self._conn, batch)
                break
            except Exception as e:  # StoreError, unwritable path, bad value, server gone
                now = time.monotonic()
                if not store.is_transient(e) or now >= min(deadline, self._stop_at):
                    self._failed(batch, e)
                    return
                sqlite_busy = type(e).__module__ == "sqlite3"
                if not sqlite_busy and not isinstance(e, store.StoreError):
                    self._reset_connection()  # a lost PostgreSQL connection: the next attempt opens another
                log_once(
                    "collector-retry:" + type(e).__name__,
                    "trace store %s not writable now (%s); retrying for up to %.0f s while spans queue",
                    self.location,
                    e,
                    self.busy_retry_s,
                )
                time.sleep(max(0.0, min(delay, deadline - now, self._stop_at - now)))
                delay = min(delay * 2, 0.25 if sqlite_busy else self.MAX_BACKOFF_S)
        self._finish(batch, None, stored)
        if self.retention is not None:
            self.retention.after_write(self._conn)
        if self._on_written is not None:
            try:
                self._on_written(batch)
            except Exception as e:
                log_once(
                    "collector-on-written:" + type(e).__name__,
                    "collector span hook failed (%s); metrics for some spans skipped",
                    e,
                    exc_info=True,
                )

    def _failed(self, batch: list, err: Exception) -> None:
        reason = "shutdown" if self._closed else "store_error"
        self._finish(batch, reason)
        log_once(
            "collector-store:" + type(err).__name__,
            "trace store %s not writable (%s); %d spans dropped "
            "(kvlens_collector_spans_dropped_total counts every drop)",
            self.location,
            err,
            len(batch),
        )
        self._reset_connection()

    def _finish(self, batch: list, drop_reason: str | None, stored: int | None = None) -> None:
        n = len(batch)
        with self._cv:
            self._queued -= n
            self.metrics.queue.set(self._queued)
        if drop_reason is None:
            self.metrics.written.inc(n if stored is None else stored)
        else:
            self.metrics.dropped.labels(drop_reason).inc(n)
        self._sync_keeper()

    def _sync_keeper(self) -> None:
        self.metrics.sync(self.keeper, self._seen)

    def _decide_all(self) -> None:
        """Closing: decide every held request (its spans stored or not), or
        count them dropped (``shutdown``) when the store cannot take them."""
        k = self.keeper
        if not k.buffered:
            return
        try:
            if self._conn is None:
                self._conn = store.connect(self.location, timeout_s=self.ATTEMPT_TIMEOUT_S)
            self.metrics.written.inc(k.flush(self._conn))
        except Exception as e:
            log_once("collector-keep-flush", "held spans not written at shutdown (%s); counted dropped", e)
            self.metrics.dropped.labels("shutdown").inc(k.buffered)
            k.buffered = 0
        self._sync_keeper()

    def _reset_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    # ---------------------------------------------------------------- close
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, write what is queued within ``timeout_s``, count
        the rest as dropped (``shutdown``), close the store connection and
        run ``on_close``. Idempotent; any thread but the writer."""
        with self._cv:
            first = not self._closed
            self._closed = True
            self._stop_at = min(self._stop_at, time.monotonic() + max(0.0, timeout_s))
            self._cv.notify_all()
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():  # a batch in one store attempt: it gives up after that attempt
            self._thread.join(self.ATTEMPT_TIMEOUT_S + 0.5)
        with self._cv:
            left = list(self._q)
            self._q.clear()
        for part in left:  # the writer stopped (or is stuck in one batch): the rest never goes out
            self._finish(part, "shutdown")
        if not first:
            return
        if not self._thread.is_alive():
            self._reset_connection()
        if self._on_close is not None:
            try:
                self._on_close()
            except Exception:
                log_once("collector-on-close", "collector shutdown hook failed", exc_info=True)


def check_store(store_path: "store.StoreLocation | str | Path") -> None:
    """Open the store for writing once and close it: raises
    :class:`kvtrace.store.StoreError` / ``sqlite3.Error`` / ``OSError``
    when the path cannot be a kvlens store, or (PostgreSQL) a
    :class:`~kvtrace.store.StoreError` kind when the server is down,
    refuses the user or lacks the database (for a start-up message)."""
    store.connect(store_path).close()


def collector_ingest(
    store_path: "store.StoreLocation | str | Path",
    registry: CollectorRegistry,
    *,
    max_queue_spans: int = 100_000,
    exemplars: bool = True,
    handoff_deadline_s: float = 10.0,
    **kw,
) -> Ingest:
    """An :class:`Ingest` whose written spans feed a
    :class:`~exporters.metrics.PhaseMetricsProcessor` on ``registry`` (phase
    histograms; the handoff histogram, resolved from the store when a
    router's ``request`` span arrives, with ``trace_id`` exemplars); the
    processor is shut down with the ingest. ``handoff_deadline_s``: how long
    a request's handoff is looked for in the store before it is counted
    unresolved. ``kw``: further :class:`Ingest` options."""
    from exporters.metrics import PhaseMetricsProcessor

    store_path = store.StoreLocation.parse(store_path)
    ingest = Ingest(store_path, max_queue_spans=max_queue_spans, registry=registry, **kw)
    proc = PhaseMetricsProcessor(
        registry=registry,
        store_path=store_path,
        handoff_from="any",
        exemplars=exemplars,
        handoff_deadline_s=handoff_deadline_s,
        keeper=ingest.keeper,
    )

    def on_written(spans: Sequence) -> None:
        for s in spans:
            proc.on_end(s)

    # set before the first span can arrive: nobody holds the ingest yet
    ingest._on_written, ingest._on_close = on_written, proc.shutdown
    return ingest
