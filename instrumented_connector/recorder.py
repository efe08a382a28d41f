"""Per-process event recorder: the only kvlens code on vLLM's hot paths.

Contract (STYLE.md, "the hot path only enqueues"):

* :meth:`Recorder.record` is called on the engine loop, the push writer
  thread and NIXL callback threads. It takes timestamps the caller already
  has, appends one tuple to a bounded ``deque`` and returns. It never blocks,
  never raises, and counts what it drops when the buffer is full.
* A daemon thread drains the buffer, turns events into OpenTelemetry spans
  (deterministic trace id per request, see :func:`trace_id_for`) and hands
  them to the SDK's span processors (SQLite store, OTLP, metrics) built by
  :mod:`exporters.pipeline`.

Memory stays bounded when an exporter stalls: the event buffer holds at most
``capacity`` events and the SDK's BatchSpanProcessor queues are bounded too.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Mapping

from instrumented_connector import semconv as sc

logger = logging.getLogger("kvlens")

#: Default event-buffer capacity per process. An event with its small
#: attribute dict is ~0.5-1 KiB, so this keeps the buffer under ~32 MiB.
DEFAULT_CAPACITY = 32768

_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)  # as vLLM's get_base_request_id
_HEX32_RE = re.compile(r"[0-9a-f]{32}")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
    """Log ``msg`` at WARNING the first time ``key`` is seen in this process."""
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    try:
        logger.warning("kvlens: " + msg, *args, exc_info=exc_info)
    except Exception:  # logging itself must not break the host
        pass


def base_request_id(request_id: str) -> str:
    """Strip vLLM's per-request ``-<8 hex>`` suffix (``get_base_request_id``)."""
    return _SUFFIX_RE.sub("", request_id)


def trace_id_for(request_id: str) -> int:
    """The 128-bit trace id shared by router, P and D for one request.

    The router sends a 32-hex W3C trace id as ``X-Request-Id``; vLLM turns it
    into ``cmpl-<id>-0-<8 hex>`` on each side, so the id is read straight out
    of the request id. Any other id (a third-party router's uuid) is hashed
    after stripping the random suffix, which P and D do not share.
    """
    base = base_request_id(request_id)
    m = _HEX32_RE.search(base.lower())
    if m:
        tid = int(m.group(0), 16)
        if tid:
            return tid
    return int.from_bytes(hashlib.blake2b(base.encode(), digest_size=16).digest(), "big") or 1


def root_span_id(trace_id: int) -> int:
    """Span id of the request's root span (the router's ``request`` span).

    Derived from the trace id so P and D can parent their spans to it without
    talking to the router."""
    d = hashlib.blake2b(trace_id.to_bytes(16, "big"), digest_size=8, person=b"kvlens-root").digest()
    return int.from_bytes(d, "big") or 1


# Event tuple layout (kept positional: building it is the whole hot-path cost).
# (phase, request_id, start_ns, end_ns, outcome, attrs)
Event = tuple


class Recorder:
    """Bounded event buffer + background span builder for one process/role.

    ``pipeline_factory`` returns an OTel ``TracerProvider`` (or None to record
    nothing); it runs on the background thread, so a slow or failing exporter
    setup never touches the caller.
    """

    def __init__(
        self,
        *,
        role: str,
        mode: str,
        engine_id: str | None = None,
        capacity: int = DEFAULT_CAPACITY,
        pipeline_factory: Callable[[], Any] | None = None,
        flush_interval_s: float = 0.1,
        base_attrs: Mapping[str, Any] | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"kvlens recorder capacity must be > 0, got {capacity}")
        self.role = sc.closed(role, sc.Role)
        self.mode = sc.closed(mode, sc.Mode)
        self.engine_id = engine_id
        self.capacity = capacity
        self.dropped = 0
        self.recorded = 0
        self.exported = 0
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
        self._pid = os.getpid()
        self._provider = None
        self._tracer = None
        self._ready = threading.Event()  # set once the pipeline is built (or failed)

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
        """Enqueue one phase. Any thread; never blocks; never raises."""
        q = self._q
        if len(q) >= self.capacity:
            self.dropped += 1
            return
        q.append((phase, request_id, start_ns, end_ns, outcome, attrs))
        if self._thread is None:
            self._ensure_started()

    def point(self, phase: sc.Phase, request_id: str, outcome: str = "ok", attrs: dict | None = None) -> None:
        """Enqueue a zero-length phase stamped now."""
        t = time.time_ns()
        self.record(phase, request_id, t, t, outcome, attrs)

    # --------------------------------------------------------------- background
    def start(self) -> "Recorder":
        """Start the background thread now (at engine start-up), so building
        the OTel pipeline - imports, SQLite schema, exporters - never competes
        with the first request. Idempotent; ``record`` also starts it lazily."""
        if self._thread is None:
            self._ensure_started()
        return self

    def _ensure_started(self) -> None:
        try:
            with self._start_lock:
                if self._thread is not None:
                    return
                t = threading.Thread(target=self._run, name="kvlens-recorder", daemon=True)
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
            self._provider = self._factory()
            if self._provider is not None:
                self._tracer = self._provider.get_tracer("kvlens")
        except Exception:
            log_once("pipeline", "telemetry pipeline setup failed; spans are dropped", exc_info=True)
            self._provider = None
            self._tracer = None

    def _run(self) -> None:
        self._setup()
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            self.drain()
        self.drain()

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
                self._emit(ev)
            except Exception as e:
                log_once("emit:" + type(e).__name__, "failed to build a span (%s); skipped", e, exc_info=True)
        self.recorded += n
        return n

    def _emit(self, ev: Event) -> None:
        tracer = self._tracer
        if tracer is None:
            return
        from opentelemetry import trace as otel_trace
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanContext, TraceFlags, NonRecordingSpan, Status, StatusCode

        phase, rid, t0, t1, outcome, attrs = ev
        name = phase.value if isinstance(phase, sc.Phase) else str(phase)
        tid = attrs.get("_trace_id") if attrs else None
        if tid is None:
            tid = trace_id_for(rid)
        root = root_span_id(tid)
        a = dict(self._base_attrs)
        a[sc.ATTR_REQUEST_ID] = rid
        a[sc.ATTR_OUTCOME] = sc.closed(outcome, sc.Outcome)
        if attrs:
            for k, v in attrs.items():
                if k[0] != "_" and v is not None:
                    a[k] = v
        if name == sc.Phase.REQUEST.value:
            # The root span takes the derived root id, so P and D spans that
            # never talked to the router are its children. Its parent is the
            # caller's traceparent span when there was one; otherwise it is a
            # root, and the id generator supplies the trace id.
            parent_sid = attrs.get("_parent_span_id") if attrs else None
            if parent_sid:
                ctx = otel_trace.set_span_in_context(
                    NonRecordingSpan(SpanContext(tid, parent_sid, True, TraceFlags(TraceFlags.SAMPLED)))
                )
            else:
                ctx = Context()
                _FORCED.trace_id = tid
            _FORCED.span_id = root
        else:
            ctx = otel_trace.set_span_in_context(
                NonRecordingSpan(SpanContext(tid, root, True, TraceFlags(TraceFlags.SAMPLED)))
            )
        try:
            span = tracer.start_span(name, context=ctx, attributes=a, start_time=t0)
        finally:
            _FORCED.span_id = None
            _FORCED.trace_id = None
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

    def close(self, timeout_s: float = 3.0) -> None:
        """Stop the thread, export what is buffered, shut exporters down."""
        try:
            self._stop.set()
            self._wake.set()
            t = self._thread
            if t is not None and t is not threading.current_thread():
                t.join(timeout_s)
            self.drain()
            if self._provider is not None:
                self._provider.force_flush(int(timeout_s * 1000))
                self._provider.shutdown()
                self._provider = None
                self._tracer = None
        except Exception:
            log_once("close", "recorder shutdown failed", exc_info=True)


class _Forced(threading.local):
    """Ids the recorder thread pins for the next span it starts (root spans)."""

    span_id: int | None = None
    trace_id: int | None = None


_FORCED = _Forced()


def make_id_generator():
    """IdGenerator that lets the recorder thread pin the root span's ids."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class KvlensIdGenerator(RandomIdGenerator):
        def generate_span_id(self) -> int:
            sid = _FORCED.span_id
            if sid is not None:
                return sid
            return super().generate_span_id()

        def generate_trace_id(self) -> int:
            tid = _FORCED.trace_id
            if tid is not None:
                return tid
            return super().generate_trace_id()

    return KvlensIdGenerator()


# ----------------------------------------------------------------- per process
_recorders: dict[tuple, Recorder] = {}
_recorders_lock = threading.Lock()


def get_recorder(role: str, mode: str, engine_id: str | None = None, config: Mapping[str, Any] | None = None) -> Recorder:
    """The process-wide recorder for (role, mode, engine). Fork-safe: a child
    process gets a fresh one (the parent's thread does not survive fork)."""
    key = (os.getpid(), role, mode, engine_id)
    r = _recorders.get(key)
    if r is not None:
        return r
    with _recorders_lock:
        r = _recorders.get(key)
        if r is None:
            from exporters.pipeline import provider_factory

            cfg = dict(config or {})
            r = Recorder(
                role=role,
                mode=mode,
                engine_id=engine_id,
                capacity=int(cfg.get("kvlens_buffer_events", DEFAULT_CAPACITY)),
                pipeline_factory=provider_factory(role=role, mode=mode, engine_id=engine_id, config=cfg),
            )
            _recorders[key] = r
    return r
