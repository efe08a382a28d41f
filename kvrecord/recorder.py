"""Per-process event recorder: the only kvlens code on vLLM's hot paths.

Contract (docs/architecture.md, "the hot path only enqueues"):

* :meth:`Recorder.record` is called on the engine loop, the push writer
  thread and NIXL callback threads. It takes timestamps the caller already
  has, appends one tuple to a bounded ``deque`` and returns. It never blocks,
  never raises, and counts what it drops when the buffer is full.
* :meth:`Recorder.record_root` is the router's call for the request's root
  span (same cost, same contract).
* A daemon thread drains the buffer, turns events into OpenTelemetry spans
  (trace id read out of the request id, :func:`ids.trace_id_for`; parent:
  the root span, :func:`ids.root_span_id`) and hands them to the SDK's span
  processors, which :mod:`exporters.pipeline` installs through the
  ``pipeline_factory`` it gives the recorder. In vLLM's processes the
  recorder is :class:`exporters.shipping.ShippingRecorder`, whose thread
  ships the raw events to a sidecar process that builds the spans there
  (building a span costs ~43 µs of the engine's GIL per event; shipping
  one costs ~1-2 µs); the hot path is this class's.

Memory stays bounded when an exporter stalls: the event buffer holds at most
``capacity`` events and the span processors' queues are bounded too.

Every event lost is counted, by :class:`DropReason`: the recorder counts
``buffer_full`` (:attr:`Recorder.dropped`, the one hot-path counter),
``shutdown`` (events still buffered when :meth:`Recorder.close` gave up) and
``export_failed`` for events that never became a span (pipeline setup
failed, or building the span raised);
the pipeline's processors count the rest (:mod:`exporters.batching`), and
:func:`exporters.pipeline.dropped_counts` adds them up by (role, reason).
"""

from __future__ import annotations

import atexit
import collections
import enum
import inspect
import threading
import time
from typing import Any, Callable, Mapping

from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from kvrecord import ids
from kvrecord import semconv as sc
from kvrecord.logutil import log_once
from kvrecord.procstats import name_native_thread, write_stats

#: Default event-buffer capacity per process. An event with its small
#: attribute dict is ~0.5-1 KiB, so this keeps the buffer under ~32 MiB.
DEFAULT_CAPACITY = 32768

#: Default bound of :meth:`Recorder.close`, flush and shutdown together: well
#: inside the 15 s ``kvlens up`` gives a child between SIGTERM and SIGKILL.
CLOSE_TIMEOUT_S = 5.0


class DropReason(str, enum.Enum):
    """Why a span was lost (the ``reason`` label of ``kvlens_telemetry_dropped_total``)."""

    BUFFER_FULL = "buffer_full"  # the recorder's event buffer was full (hot path)
    QUEUE_FULL = "queue_full"  # a span processor's export queue was full (exporter too slow)
    EXPORT_FAILED = "export_failed"  # the OTLP exporter returned FAILURE or raised; or no span could be built
    STORE = "store"  # the trace store could not be written in time (locked, unwritable)
    SHUTDOWN = "shutdown"  # still queued when close gave up


#: Builds the process's TracerProvider (or returns None to record nothing).
#: It is given the recorder's id generator and must build the provider with
#: it (``TracerProvider(id_generator=...)``): that is how root spans get their
#: derived ids. Runs once, on the recorder thread.
PipelineFactory = Callable[[ids.PinnedIdGenerator], Any]

# Event tuples (kept positional: building one is the whole hot-path cost):
#   phase event: (phase, request_id, start_ns, end_ns, outcome, attrs)
#   root event:  (_ROOT, trace_id_hex, start_ns, end_ns, outcome, attrs, parent_span_id | None)
Event = tuple
#: The root marker: a string no phase has (a plain str survives pickling, so
#: the sidecar path ships it as is; exporters.shipping).
ROOT_TAG = _ROOT = "\x00kvlens.root"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class Recorder:
    """Bounded event buffer + background span builder for one process/role.

    ``pipeline_factory`` (see :data:`PipelineFactory`) runs on the background
    thread, so a slow or failing exporter setup never touches the caller.
    Processes get their recorder from :func:`exporters.pipeline.get_recorder`;
    tests build one directly with their own factory.
    """

    def __init__(
        self,
        *,
        role: str,
        mode: str,
        engine_id: str | None = None,
        capacity: int = DEFAULT_CAPACITY,
        pipeline_factory: PipelineFactory | None = None,
        flush_interval_s: float = 0.1,
        base_attrs: Mapping[str, Any] | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"kvlens recorder capacity must be > 0, got {capacity}")
        self.role = sc.closed(role, sc.Role)
        self.mode = sc.closed(mode, sc.Mode)
        self.engine_id = engine_id
        self.capacity = capacity
        self.dropped = 0  # events refused, buffer full (DropReason.BUFFER_FULL)
        self.shutdown_dropped = 0  # events still buffered when close gave up (DropReason.SHUTDOWN)
        self.failed_dropped = 0  # no span built: pipeline setup failed, or building raised (EXPORT_FAILED)
        self.recorded = 0
        self.exported = 0
        self.ids = ids.PinnedIdGenerator()
        self._q: collections.deque[Event] = collections.deque()
        self._factory = pipeline_factory
        self._interval = flush_interval_s
        self._base_attrs = {sc.ATTR_MODE: self.mode, sc.ATTR_ROLE: self.role}
        if engine_id:
            self._base_attrs[sc.ATTR_ENGINE_ID] = engine_id
        if base_attrs:
            self._base_attrs.update(base_attrs)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._provider = None
        self._tracer = None
        self._ready = threading.Event()  # set once the pipeline is built (or failed)
        self._pipeline_failed = False
        self.thread_name = "kvlens-recorder"
        self.losses = None  # the provider's processors' loss counter (exporters.batching.LossCounter), once built
        self._joins = ids.Joins()  # D's request id -> P's; span-builder thread only

    # ------------------------------------------------------------------ hot path
    def record(
        self,
        phase: sc.Phase,
        request_id: str,
        start_ns: int,
        end_ns: int,
        outcome: str = "ok",
        attrs: dict | None = None,
    ) -> None:
        """Enqueue one phase of ``request_id`` (a vLLM request id, or the
        router's 32-hex trace id). Times are wall-clock ns. Any thread; never
        blocks; never raises."""
        q = self._q
        if len(q) >= self.capacity:
            self.dropped += 1
            return
        q.append((phase, request_id, start_ns, end_ns, outcome, attrs))
        if self._thread is None:
            self._ensure_started()

    def record_root(
        self,
        trace_id: str,
        parent_span_id: int | None,
        start_ns: int,
        end_ns: int,
        outcome: str = "ok",
        attrs: dict | None = None,
    ) -> None:
        """Enqueue the request's root ``request`` span (the router's).

        ``trace_id``: the 32-hex W3C trace id the router chose; the span gets
        it and the span id :func:`ids.root_span_id` derives from it, so P's
        and D's spans are its children. ``parent_span_id``: the client's
        ``traceparent`` span, or None for a root. Same contract as
        :meth:`record`: any thread, never blocks, never raises."""
        q = self._q
        if len(q) >= self.capacity:
            self.dropped += 1
            return
        q.append((_ROOT, trace_id, start_ns, end_ns, outcome, attrs, parent_span_id))
        if self._thread is None:
            self._ensure_started()

    def point(self, phase: sc.Phase, request_id: str, outcome: str = "ok", attrs: dict | None = None) -> None:
        """Enqueue a zero-length phase stamped now."""
        t = time.time_ns()
        self.record(phase, request_id, t, t, outcome, attrs)

    # --------------------------------------------------------------- background
    def start(self) -> "Recorder":
        """Start the background thread now (at engine start-up), so building
        the OTel pipeline - SQLite schema, exporters - never competes with
        the first request. Idempotent; ``record`` also starts it lazily."""
        if self._thread is None:
            self._ensure_started()
        return self

    def _ensure_started(self) -> None:
        try:
            with self._start_lock:
                if self._thread is not None:
                    return
                t = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                self._thread = t
                t.start()
                atexit.register(self.close)
        except Exception:
            log_once("recorder-start", "could not start the recorder thread", exc_info=True)

    def _setup(self) -> None:
        try:
            self._build()
        finally:
            self._ready.set()

    def _build(self) -> None:
        if self._factory is None:
            return
        try:
            self._provider = self._factory(self.ids)
            self.losses = getattr(self._provider, "losses", None)  # its processors' LossCounter, if it has one
            if self._provider is not None:
                if getattr(self._provider, "id_generator", None) is not self.ids:
                    log_once(
                        "id-generator", "provider not built with the recorder's id generator; root spans get random ids"
                    )
                self._tracer = self._provider.get_tracer("kvlens")
        except Exception:
            log_once("pipeline", "telemetry pipeline setup failed; spans are dropped and counted", exc_info=True)
            self._provider = None
            self._tracer = None
            self._pipeline_failed = True

    def _run(self) -> None:
        name_native_thread(self.thread_name)
        self._setup()
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            self.drain()
            write_stats(self)
        self.drain()

    def unreported_drops(self) -> dict[str, int]:
        """Losses this recorder counted, by :class:`DropReason` value, that
        this process reports itself (:func:`exporters.pipeline.dropped_counts`)."""
        d = {
            DropReason.BUFFER_FULL.value: self.dropped,
            DropReason.SHUTDOWN.value: self.shutdown_dropped,
            DropReason.EXPORT_FAILED.value: self.failed_dropped,
        }
        return {k: v for k, v in d.items() if v}

    def drain(self) -> int:
        """Turn every buffered event into a span. Background thread (or tests)."""
        n = 0
        q = self._q
        if not self._ready.is_set():
            return 0  # pipeline still being built: keep the events
        while True:
            try:
                ev = q.popleft()
            except IndexError:
                break
            n += 1
            try:
                if ev[0] == _ROOT:
                    self._emit_root(ev)
                else:
                    self._emit(ev)
            except Exception as e:
                self.failed_dropped += 1
                log_once("emit:" + type(e).__name__, "failed to build a span (%s); skipped", e, exc_info=True)
        if self._pipeline_failed:
            self.failed_dropped += n
        self.recorded += n
        return n

    def _attributes(self, request_id: str, outcome: str, attrs: dict | None) -> dict:
        a = dict(self._base_attrs)
        a[sc.ATTR_REQUEST_ID] = request_id
        a[sc.ATTR_OUTCOME] = sc.closed(outcome, sc.Outcome)
        if attrs:
            for k, v in attrs.items():
                if v is not None:
                    a[k] = v
        return a

    def _emit(self, ev: Event) -> None:
        """A phase span: child of the request's root span (derived ids)."""
        tracer = self._tracer
        if tracer is None:
            return
        phase, rid, t0, t1, outcome, attrs = ev
        name = phase.value if isinstance(phase, sc.Phase) else str(phase)
        a = self._attributes(rid, outcome, attrs)
        tid = ids.trace_id_for(self._joins.key(rid, a))
        ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(tid, ids.root_span_id(tid), True, _SAMPLED)))
        self._end(tracer.start_span(name, context=ctx, attributes=a, start_time=t0), a, t0, t1)

    def _emit_root(self, ev: Event) -> None:
        """The root span takes the derived root id, so P and D spans that
        never talked to the router are its children. Its parent is the
        caller's traceparent span when there was one (the SDK then takes the
        trace id from it); otherwise it is a root, and the pinned generator
        supplies the trace id too."""
        tracer = self._tracer
        if tracer is None:
            return
        _, trace_hex, t0, t1, outcome, attrs, parent_sid = ev
        tid = ids.trace_id_for(trace_hex)
        if parent_sid:
            ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(tid, parent_sid, True, _SAMPLED)))
        else:
            ctx = Context()
        a = self._attributes(trace_hex, outcome, attrs)
        with self.ids.pin(span_id=ids.root_span_id(tid), trace_id=tid):
            span = tracer.start_span(sc.Phase.REQUEST.value, context=ctx, attributes=a, start_time=t0)
        self._end(span, a, t0, t1)

    def _end(self, span, a: dict, t0: int, t1: int) -> None:
        if a[sc.ATTR_OUTCOME] != sc.Outcome.OK.value:
            span.set_status(Status(StatusCode.ERROR, a[sc.ATTR_OUTCOME]))
        span.end(end_time=max(t1, t0))
        self.exported += 1

    def flush(self, timeout_s: float = 5.0) -> None:
        """Drain now and flush exporters (tests, shutdown). Not for hot paths."""
        if self._thread is None:
            self._setup_if_needed()
        else:
            self._ready.wait(timeout_s)
        self.drain()
        if self._provider is not None:
            try:
                self._provider.force_flush(int(timeout_s * 1000))
            except Exception:
                log_once("flush", "exporter flush failed", exc_info=True)

    def _setup_if_needed(self) -> None:
        with self._start_lock:
            if not self._ready.is_set():
                self._setup()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the thread, export what is buffered, shut the exporters down,
        all within about ``timeout_s``: a stalled exporter (a store locked by
        another writer, an OTLP endpoint that never answers) cannot hold the
        process's exit. What is not exported by then is counted as lost,
        reason ``shutdown`` (here for events still buffered, by the
        processors for spans still queued). Idempotent; any thread."""
        deadline = time.monotonic() + timeout_s
        try:
            self._stop.set()
            self._wake.set()
            t = self._thread
            if t is not None and t is not threading.current_thread():
                t.join(timeout_s * 0.3)
            self.drain()
            left = len(self._q)  # pipeline never became ready: these never become spans
            if left:
                self._q.clear()
                self.shutdown_dropped += left
            p, self._provider, self._tracer = self._provider, None, None
            if p is not None:
                _close_provider(p, deadline)
            write_stats(self, force=True)
        except Exception:
            log_once("close", "recorder shutdown failed", exc_info=True)


def _close_provider(provider, deadline: float) -> None:
    """Flush for 60 % of the time left, then shut down within the rest
    (``shutdown(timeout_millis=)`` when the provider takes it, as
    :class:`exporters.batching.BoundedTracerProvider` does)."""
    try:
        provider.force_flush(max(int((deadline - time.monotonic()) * 600), 0))
    except Exception:
        log_once("flush", "exporter flush failed", exc_info=True)
    left_ms = max(deadline - time.monotonic(), 0.0) * 1000
    try:
        params = inspect.signature(provider.shutdown).parameters
    except (TypeError, ValueError):
        params = {}
    if "timeout_millis" in params:
        provider.shutdown(timeout_millis=left_ms)
    else:
        provider.shutdown()
