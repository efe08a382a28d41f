"""The one place that wires a process's telemetry: recorder -> span processors.

* :func:`get_recorder`: the process-wide :class:`Recorder` per (role, mode,
  engine), what the connector and the router call.
* :func:`provider_factory`: builds the OTel ``TracerProvider`` with

  - the SQLite trace store (always, unless ``kvlens_store: off``):
    BatchSpanProcessor with a bounded queue -> :class:`exporters.store.SQLiteSpanExporter`;
  - OTLP/HTTP (the standard exporter) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set or the connector's
    ``kv_connector_extra_config`` names ``otlp_endpoint``;
  - span-derived Prometheus metrics (:mod:`exporters.metrics`) unless
    ``kvlens_metrics: off``.

* :func:`dropped_counts`: events this process's recorders dropped, by role
  (the source of ``kvlens_telemetry_dropped_total``).

Configuration is validated up front (:func:`config.validate_config`) so a typo
fails at start-up with a clear message; everything after that is forgiving.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from exporters import store
from exporters.metrics import PhaseMetricsProcessor
from instrumented_connector.config import enabled, store_path, validate_config
from instrumented_connector.ids import PinnedIdGenerator
from instrumented_connector.logutil import log_once
from instrumented_connector.recorder import DEFAULT_CAPACITY, Recorder

#: Bounded SDK queue per exporter; spans beyond it are dropped by the SDK.
MAX_QUEUE = 4096


# ----------------------------------------------------------------- per process
_recorders: dict[tuple, Recorder] = {}
_recorders_lock = threading.Lock()


def get_recorder(role: str, mode: str, engine_id: str | None = None,
                 config: Mapping[str, Any] | None = None) -> Recorder:
    """The process-wide recorder for (role, mode, engine).

    ``config``: the kvlens keys of ``kv_connector_extra_config`` (validated;
    a bad option raises ValueError here). Used when the recorder is first
    made. Any thread. Fork-safe: a child process gets a fresh recorder (the
    parent's thread does not survive fork)."""
    key = (os.getpid(), role, mode, engine_id)
    r = _recorders.get(key)
    if r is not None:
        return r
    with _recorders_lock:
        r = _recorders.get(key)
        if r is None:
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


def dropped_counts() -> dict[str, int]:
    """Events dropped (buffer full) by this process's recorders, by role.

    Monotonic per role. Any thread; never blocks."""
    out: dict[str, int] = {}
    pid = os.getpid()
    for key, r in list(_recorders.items()):
        if key[0] == pid:
            out[r.role] = out.get(r.role, 0) + int(r.dropped)
    return out


# ------------------------------------------------------------------ provider
def provider_factory(*, role: str, mode: str, engine_id: str | None,
                     config: Mapping[str, Any]) -> Callable[[PinnedIdGenerator], TracerProvider]:
    """The recorder's pipeline factory: ``build(id_generator)`` makes the
    TracerProvider (run once, on the recorder thread). ``config`` is checked
    here, so a bad option raises in the caller, not later."""
    cfg = validate_config(config)

    def build(id_generator: PinnedIdGenerator) -> TracerProvider:
        attrs = {"service.name": cfg.get("kvlens_service_name") or f"kvlens-{role}", "kvlens.role": role}
        if engine_id:
            attrs["service.instance.id"] = engine_id
        provider = TracerProvider(resource=Resource.create(attrs), id_generator=id_generator)
        if enabled(cfg, "kvlens_store"):
            provider.add_span_processor(
                BatchSpanProcessor(store.SQLiteSpanExporter(store_path(cfg)), max_queue_size=MAX_QUEUE,
                                   schedule_delay_millis=200, max_export_batch_size=512)
            )
        _add_otlp(provider, cfg)
        if enabled(cfg, "kvlens_metrics"):
            provider.add_span_processor(
                PhaseMetricsProcessor(store_path=store_path(cfg), dropped_source=dropped_counts)
            )
        return provider

    return build


def _add_otlp(provider: TracerProvider, cfg: Mapping[str, Any]) -> None:
    endpoint = cfg.get("otlp_endpoint") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return
    try:
        # Deferred for start-up cost: the OTLP exporter pulls in protobuf and
        # requests, paid only by processes that export over OTLP.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        # 0.5 s batches (the SDK's default is 5 s): a collector's handoff
        # resolver waits for the last end of a request, so export promptly.
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5), max_queue_size=MAX_QUEUE,
                               schedule_delay_millis=500, max_export_batch_size=512)
        )
    except Exception:
        log_once("otlp", "OTLP exporter unavailable; spans go to the store only", exc_info=True)
