"""Per-process event recorder: the only kvlens code on vLLM's hot paths.

Contract (docs/architecture.md, "the hot path only enqueues"):

* :meth:`Recorder.record` is called on the engine loop, the push writer
  thread and NIXL callback threads. It takes timestamps the caller already
  has, appends one event (its :data:`kvrecord.events.EventFields`) to a
  bounded ``deque`` and returns. It never blocks, never raises, and counts what it drops
  when the buffer is full.
* :meth:`Recorder.record_root` is the router's call for the request's root
  span (same cost, same contract).
* A daemon thread drains the buffer, turns events into OpenTelemetry spans
  (:class:`kvrecord.spanbuilder.SpanBuilder`) and hands them to the SDK's span
  processors, which :mod:`exporters.pipeline` installs through the
  ``pipeline_factory`` it gives the recorder. In vLLM's processes the
  recorder is :class:`exporters.shipping.ShippingRecorder`: it ships the
  events to a sidecar that builds the spans (a span costs ~43 µs of the
  engine's GIL, shipping an event ~1-2 µs); the hot path is this class's.

Memory stays bounded when an exporter stalls: the event buffer holds at most ``capacity`` events and the
span processors' queues are bounded too. The thread also runs ``add_periodic`` work (:mod:`kvrecord.periodic`).

Every event lost is counted, by :class:`DropReason`: the recorder counts ``buffer_full``
(:attr:`Recorder.dropped`, the one hot-path counter), ``shutdown`` (events still buffered when
:meth:`Recorder.close` gave up) and ``export_failed`` for events that never became a span (pipeline
setup failed, or building the span raised); the pipeline's processors count the rest
(:mod:`exporters.batching`), and :func:`exporters.pipeline.dropped_counts` adds them up by (role, reason).
"""

from __future__ import annotations

import atexit
import collections
import enum
import inspect
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from kvrecord import ids
from kvrecord import semconv as sc
from kvrecord.events import Event, EventFields, Kind, as_event
from kvrecord.logutil import log_once
from kvrecord.periodic import Periodic
from kvrecord.procstats import name_native_thread, write_stats
from kvrecord.spanbuilder import SpanBuilder

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

_SPAN, _ROOT, _REQUEST = Kind.SPAN, Kind.ROOT, sc.Phase.REQUEST  # module globals: the hot path reads them


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
        self._q: collections.deque[EventFields] = collections.deque()
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
        self._idle = False  # a subclass's thread sleeps until the next event wakes it (exporters.shipping)
        self._start_lock = threading.Lock()
        self._provider = None
        self._builder: SpanBuilder | None = None  # once the pipeline is built
        self._ready = threading.Event()  # set once the pipeline is built (or failed)
        self._pipeline_failed = False
        self.thread_name = "kvlens-recorder"
        self.losses = None  # the provider's processors' loss counter (exporters.batching.LossCounter), once built
        self.periodic = Periodic()  # calls its background thread runs when due (add_periodic)

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
        q.append((_SPAN, phase, request_id, start_ns, end_ns, outcome, attrs, None))  # an Event's fields
        if self._idle:  # a flag read per event, an Event.set per batch
            self._idle = False
            self._wake.set()
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
        q.append((_ROOT, _REQUEST, trace_id, start_ns, end_ns, outcome, attrs, parent_span_id))
        if self._idle:
            self._idle = False
            self._wake.set()
        if self._thread is None:
            self._ensure_started()

    def point(self, phase: sc.Phase, request_id: str, outcome: str = "ok", attrs: dict | None = None) -> None:
        """Enqueue a zero-length phase stamped now."""
        t = time.time_ns()
        self.record(phase, request_id, t, t, outcome, attrs)

    # ------------------------------------------------ the buffer, from outside
    def enqueue(self, events: Iterable[Event]) -> int:
        """Buffer events recorded elsewhere (the sidecar's: its engine's, :mod:`exporters.sidecar`),
        each as :meth:`record` would: one that does not fit is refused and
        counted (``buffer_full``). Returns the number refused. Never blocks."""
        q, cap, refused = self._q, self.capacity, 0
        for ev in events:
            if len(q) >= cap:
                refused += 1
            else:
                q.append(ev)
        self.dropped += refused
        if self._idle:
            self._idle = False
            self._wake.set()
        if self._thread is None:
            self._ensure_started()
        return refused

    @property
    def buffered(self) -> int:
        return len(self._q)  # events waiting

    def take(self, n: int) -> list[EventFields]:
        """The oldest ``n`` buffered events (fewer when fewer wait), off the buffer."""
        q = self._q
        return [q.popleft() for _ in range(min(n, len(q)))]

    def drop_buffered(self) -> int:
        """Empty the buffer, counting its events lost (``shutdown``). Returns how many."""
        left = len(self._q)
        if left:
            self._q.clear()
            self.shutdown_dropped += left
        return left

    def wake(self) -> None:
        self._wake.set()  # the background thread drains now, not at its next interval

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until the pipeline is built or failed (:attr:`pipeline_failed`); False on timeout."""
        return self._ready.wait(timeout_s)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()  # the pipeline is built, or failed

    @property
    def pipeline_failed(self) -> bool:
        return self._pipeline_failed  # events are counted export_failed, not exported

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()  # close has begun

    # --------------------------------------------------------------- background
    def add_periodic(self, fn: Callable[[], None], every_s: float = 1.0) -> None:
        """Run ``fn()`` on the background thread about every ``every_s``
        (:class:`kvrecord.periodic.Periodic`); starts the thread."""
        self.periodic.add(fn, every_s)
        self.start()

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
                self._builder = SpanBuilder(self._provider.get_tracer("kvlens"), self.ids, self._base_attrs)
        except Exception:
            log_once("pipeline", "telemetry pipeline setup failed; spans are dropped and counted", exc_info=True)
            self._provider = None
            self._pipeline_failed = True

    def _run(self) -> None:
        name_native_thread(self.thread_name)
        self._setup()
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            self.drain()
            self.periodic.run_due()
            write_stats(self)
        self.drain()

    def _wait_for_events(self, timeout_s: float) -> None:
        """A subclass's thread, idle: with nothing buffered, sleep until an event
        arrives, :meth:`wake` or ``timeout_s`` (a timed wait costs ~40 µs of CPU)."""
        self._idle = True  # set before looking: an event appended after the look wakes us
        if not self._q:
            self._wake.wait(timeout_s)
            self._wake.clear()
        self._idle = False

    def _signal_stop(self) -> threading.Thread | None:
        """Tell the background thread to stop (close); returns it, if started."""
        self._stop.set()
        self._wake.set()
        return self._thread

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
        n, q = 0, self._q
        if not self._ready.is_set():
            return 0  # pipeline still being built: keep the events
        builder = self._builder
        while True:
            try:
                ev = q.popleft()
            except IndexError:
                break
            n += 1
            if builder is None:
                continue  # no pipeline (none configured, or it failed: counted below)
            try:
                builder.build(as_event(ev))
                self.exported += 1
            except Exception as e:
                self.failed_dropped += 1
                log_once("emit:" + type(e).__name__, "failed to build a span (%s); skipped", e, exc_info=True)
        if self._pipeline_failed:
            self.failed_dropped += n
        self.recorded += n
        return n

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
            t = self._signal_stop()
            if t is not None and t is not threading.current_thread():
                t.join(timeout_s * 0.3)
            self.drain()
            self.drop_buffered()  # left only when the pipeline never became ready: never spans
            p, self._provider, self._builder = self._provider, None, None
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
