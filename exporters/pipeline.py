"""Builds each process's OTel pipeline: TracerProvider + span processors.

* SQLite trace store (always, unless ``kvlens_store: off``): BatchSpanProcessor
  with a bounded queue -> :class:`exporters.store.SQLiteSpanExporter`.
* OTLP/HTTP (the standard exporter) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set or the connector's
  ``kv_connector_extra_config`` names ``otlp_endpoint``.
* Span-derived Prometheus metrics (:mod:`exporters.metrics`) when available.

Configuration is validated up front (``validate_config``) so a typo fails at
start-up with a clear message; everything after that is forgiving.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

logger = logging.getLogger("kvlens")

#: Bounded SDK queue per exporter; spans beyond it are dropped by the SDK.
MAX_QUEUE = 4096

KNOWN_KEYS = {
    "kvlens_home",
    "kvlens_store",
    "otlp_endpoint",
    "kvlens_buffer_events",
    "kvlens_metrics",
    "kvlens_service_name",
}


def validate_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check kvlens keys of ``kv_connector_extra_config``; raise ValueError naming the bad one."""
    out = {k: v for k, v in cfg.items() if k in KNOWN_KEYS}
    for k in cfg:
        if k.startswith("kvlens") and k not in KNOWN_KEYS:
            raise ValueError(f"unknown kvlens option {k!r} in kv_connector_extra_config (known: {sorted(KNOWN_KEYS)})")
    if "kvlens_buffer_events" in out:
        try:
            n = int(out["kvlens_buffer_events"])
        except (TypeError, ValueError):
            n = 0
        if n <= 0:
            raise ValueError(f"kvlens_buffer_events must be a positive integer, got {out['kvlens_buffer_events']!r}")
    if "kvlens_store" in out and str(out["kvlens_store"]).lower() not in ("on", "off", "true", "false"):
        raise ValueError(f"kvlens_store must be 'on' or 'off', got {out['kvlens_store']!r}")
    ep = out.get("otlp_endpoint")
    if ep is not None and not str(ep).startswith(("http://", "https://")):
        raise ValueError(f"otlp_endpoint must be an http(s) URL, got {ep!r}")
    return out


def store_file(cfg: Mapping[str, Any]) -> Path:
    home = cfg.get("kvlens_home") or os.environ.get("KVLENS_HOME") or ".kvlens"
    return Path(home).resolve() / "traces.db"


def provider_factory(*, role: str, mode: str, engine_id: str | None, config: Mapping[str, Any]) -> Callable[[], Any]:
    """A zero-arg callable building the TracerProvider (run on the recorder thread)."""
    cfg = validate_config(config)

    def build():
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from instrumented_connector.recorder import make_id_generator

        attrs = {"service.name": cfg.get("kvlens_service_name") or f"kvlens-{role}", "kvlens.role": role}
        if engine_id:
            attrs["service.instance.id"] = engine_id
        provider = TracerProvider(resource=Resource.create(attrs), id_generator=make_id_generator())
        if str(cfg.get("kvlens_store", "on")).lower() not in ("off", "false"):
            from exporters.store import SQLiteSpanExporter

            provider.add_span_processor(
                BatchSpanProcessor(SQLiteSpanExporter(store_file(cfg)), max_queue_size=MAX_QUEUE,
                                   schedule_delay_millis=200, max_export_batch_size=512)
            )
        endpoint = cfg.get("otlp_endpoint") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        if endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
                provider.add_span_processor(
                    BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5), max_queue_size=MAX_QUEUE)
                )
            except Exception:
                logger.warning("kvlens: OTLP exporter unavailable; spans go to the store only", exc_info=True)
        if str(cfg.get("kvlens_metrics", "on")).lower() not in ("off", "false"):
            try:
                from exporters.metrics import PhaseMetricsProcessor
            except ImportError:
                PhaseMetricsProcessor = None  # metrics module optional
            if PhaseMetricsProcessor is not None:
                provider.add_span_processor(PhaseMetricsProcessor(store_path=store_file(cfg)))
        return provider

    return build
