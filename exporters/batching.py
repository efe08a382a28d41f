"""Span batching where every lost span is counted and every wait is bounded.

The SDK's ``BatchSpanProcessor`` (1.45) drops spans silently when its queue
is full, ignores the timeout of ``force_flush`` (one flush exports every
queued batch, however long each export takes) and forgets what is still
queued when its shutdown gives up. kvlens needs each of those losses counted
and its close at exit bounded (``kvlens up`` gives a child 15 s before
SIGKILL), so :mod:`exporters.pipeline` batches with these instead:

* :class:`LossCounter`: spans lost, by reason (thread-safe, monotonic).
* :class:`CountingBatchSpanProcessor`: a bounded queue and one export thread
  per exporter. Lost spans are counted by reason: ``queue_full`` (the queue
  was full when the span ended), the exporter's own reason when an export
  returns FAILURE or raises (``store`` for the trace store,
  ``export_failed`` for OTLP; an exporter names it with a ``loss_reason``
  attribute), and ``shutdown`` (still queued, or in an export that had not
  returned, when shutdown gave up).
* :class:`BoundedTracerProvider`: a ``TracerProvider`` whose ``force_flush``
  and ``shutdown`` are bounded in total: its batch processors flush in
  parallel, each against the same deadline.

Accounting: every span handed to a processor is exported, or counted once
under one reason. The one over-count: a batch counted as lost at shutdown
whose export returns SUCCESS afterwards (the process normally exits first).
A span lost in two sinks (store and OTLP) is counted once per sink.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from kvrecord.logutil import log_once
from kvrecord.procstats import name_native_thread
from kvrecord.recorder import DropReason

#: Default bound of :meth:`CountingBatchSpanProcessor.shutdown` when the
#: caller gives none.
SHUTDOWN_TIMEOUT_S = 2.0


class LossCounter:
    """Spans lost, by reason (a :class:`DropReason` value). Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: dict[str, int] = {}

    def add(self, reason: str, n: int = 1) -> None:
        if n > 0:
            with self._lock:
                self._n[reason] = self._n.get(reason, 0) + n

    def counts(self) -> dict[str, int]:
        """A snapshot: reason -> spans lost so far."""
        with self._lock:
            return dict(self._n)


def call_within(fn: Callable[[], Any], timeout_s: float, name: str = "kvlens-bounded") -> None:
    """Run ``fn()`` on a daemon thread and wait for it at most ``timeout_s``
    (it carries on alone past that). Errors are logged once."""

    def run() -> None:
        name_native_thread(name)
        try:
            fn()
        except Exception as e:
            log_once(f"{name}:{type(e).__name__}", "%s failed (%s)", name, e, exc_info=True)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(max(timeout_s, 0.0))


class CountingBatchSpanProcessor(SpanProcessor):
    """Batches ended spans to ``exporter`` on its own thread; counts every
    span it loses into ``losses`` (see the module docstring for the reasons).

    ``on_end`` runs on the thread that ends the span (kvlens: the recorder
    thread): a length check and an append, never blocking. Export runs on the
    processor's daemon thread, every ``schedule_delay_s`` or as soon as a
    full batch is queued. ``max_queue_size`` bounds memory while an exporter
    is slow; the exporter bounds its own calls (the store's ``max_block_s``,
    OTLP's ``timeout``)."""

    def __init__(
        self,
        exporter,
        *,
        losses: LossCounter,
        max_queue_size: int = 4096,
        schedule_delay_s: float = 0.2,
        max_export_batch_size: int = 512,
        loss_reason: str | None = None,
        name: str = "spans",
    ) -> None:
        if max_queue_size <= 0 or max_export_batch_size <= 0 or schedule_delay_s <= 0:
            raise ValueError("max_queue_size, max_export_batch_size and schedule_delay_s must be > 0")
        self.exporter = exporter
        self.losses = losses
        self.loss_reason = loss_reason or getattr(exporter, "loss_reason", DropReason.EXPORT_FAILED.value)
        self.name = name
        self._max = int(max_queue_size)
        self._batch = int(min(max_export_batch_size, max_queue_size))
        self._delay = float(schedule_delay_s)
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()  # guards _inflight, _gave_up, the flush tickets
        self._wake = threading.Event()
        self._inflight = 0  # spans in the exporter's hands right now
        self._stopping = False
        self._gave_up = False
        self._flush_asked = 0
        self._flush_done = 0
        self._thread = threading.Thread(target=self._run, name=f"kvlens-export-{name}", daemon=True)
        self._thread.start()

    # SpanProcessor API ----------------------------------------------------
    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span) -> None:
        ctx = span.context
        if not (ctx and ctx.trace_flags.sampled):
            return
        if self._stopping:
            self.losses.add(DropReason.SHUTDOWN.value)
            return
        q = self._q
        if len(q) >= self._max:
            self.losses.add(DropReason.QUEUE_FULL.value)
            return
        q.append(span)
        if len(q) >= self._batch:
            self._wake.set()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued now; False when that took longer than
        ``timeout_millis`` (the export carries on in the background)."""
        return self.wait_flushed(self.request_flush(), timeout_millis / 1000.0)

    def shutdown(self, timeout_millis: float | None = None) -> None:
        """Export what is queued within ``timeout_millis`` (default
        :data:`SHUTDOWN_TIMEOUT_S`), then count the rest as ``shutdown``."""
        t = SHUTDOWN_TIMEOUT_S if timeout_millis is None else timeout_millis / 1000.0
        self.begin_shutdown()
        self.finish_shutdown(time.monotonic() + t)

    # the two halves of flush and shutdown, for BoundedTracerProvider ------
    def request_flush(self) -> int:
        """Ask the export thread to export everything queued; returns the
        ticket :meth:`wait_flushed` waits for. Never blocks."""
        with self._cv:
            self._flush_asked += 1
            ticket = self._flush_asked
        self._wake.set()
        return ticket

    def wait_flushed(self, ticket: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._cv:
            while self._flush_done < ticket and not self._gave_up:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(min(left, 0.5))
            return self._flush_done >= ticket

    def begin_shutdown(self) -> None:
        """Refuse new spans (counted as ``shutdown``); export the queue. Never blocks."""
        self._stopping = True
        self._wake.set()

    def finish_shutdown(self, deadline: float) -> None:
        """Wait for the export thread until ``deadline`` (monotonic), then
        count what is still queued or in flight as ``shutdown`` and shut the
        exporter down (waiting for that at most 0.5 s)."""
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        with self._cv:
            if self._gave_up:
                return
            self._gave_up = True
            left = len(self._q) + self._inflight
            self._q.clear()
            self._inflight = 0  # counted here: the export thread must not count it again
            self._cv.notify_all()
        self.losses.add(DropReason.SHUTDOWN.value, left)
        call_within(self.exporter.shutdown, 0.5, name=f"kvlens-export-{self.name}-shutdown")

    # the export thread ----------------------------------------------------
    def _run(self) -> None:
        name_native_thread(self._thread.name)
        while True:
            self._wake.wait(self._delay)
            self._wake.clear()
            with self._cv:
                ticket = self._flush_asked
            self._export_queued()
            tick = getattr(self.exporter, "tick", None)  # the store's keep decisions, when idle
            if tick is not None:
                tick()
            with self._cv:
                self._flush_done = max(self._flush_done, ticket)
                self._cv.notify_all()
                if self._gave_up or (self._stopping and not self._q):
                    return

    def _export_queued(self) -> None:
        q = self._q
        while True:
            with self._cv:
                if self._gave_up or not q:
                    return
                batch = [q.popleft() for _ in range(min(len(q), self._batch))]
                self._inflight = len(batch)
            ok = False
            try:
                ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
            except Exception as e:
                log_once(
                    f"export-{self.name}:{type(e).__name__}",
                    "%s exporter raised (%s); batch counted as lost",
                    self.name,
                    e,
                    exc_info=True,
                )
            with self._cv:
                n, self._inflight = self._inflight, 0
            if not ok:
                self.losses.add(self.loss_reason, n)


class BoundedTracerProvider(TracerProvider):
    """A ``TracerProvider`` whose ``force_flush(timeout_millis)`` and
    ``shutdown(timeout_millis)`` are bounded in total, and which installs no
    atexit hook of its own (the :class:`Recorder` closes it, after draining
    its buffer). ``losses``: where its processors count (read by
    :func:`exporters.pipeline.dropped_counts`)."""

    def __init__(self, *args, losses: LossCounter | None = None, **kwargs) -> None:
        kwargs.setdefault("shutdown_on_exit", False)
        super().__init__(*args, **kwargs)
        self.losses = losses if losses is not None else LossCounter()
        self._procs: list = []
        self._closed = False

    def add_span_processor(self, span_processor) -> None:
        super().add_span_processor(span_processor)
        self._procs.append(span_processor)

    def _split(self) -> tuple[list[CountingBatchSpanProcessor], list]:
        batchers = [p for p in self._procs if isinstance(p, CountingBatchSpanProcessor)]
        return batchers, [p for p in self._procs if not isinstance(p, CountingBatchSpanProcessor)]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000.0
        batchers, others = self._split()
        tickets = [(p, p.request_flush()) for p in batchers]
        ok = True
        for p, t in tickets:
            ok = p.wait_flushed(t, deadline - time.monotonic()) and ok
        for p in others:
            ms = max(int((deadline - time.monotonic()) * 1000), 0)
            ok = bool(p.force_flush(ms)) and ok
        return ok

    def shutdown(self, timeout_millis: float | None = None) -> None:
        """Shut every processor down within ``timeout_millis`` (default
        :data:`SHUTDOWN_TIMEOUT_S`): batch processors in parallel, counting
        what they could not export; then the others (span metrics, which
        publish the final drop counts), at least 0.2 s each."""
        if self._closed:
            return
        self._closed = True
        t = SHUTDOWN_TIMEOUT_S if timeout_millis is None else timeout_millis / 1000.0
        deadline = time.monotonic() + t
        batchers, others = self._split()
        for p in batchers:
            p.begin_shutdown()
        for p in batchers:
            p.finish_shutdown(deadline)
        for p in others:
            call_within(p.shutdown, max(deadline - time.monotonic(), 0.2), name="kvlens-processor-shutdown")
