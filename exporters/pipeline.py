"""The one place that wires a process's telemetry: recorder -> span processors.

* :func:`get_recorder`: the process-wide :class:`Recorder` per (role, mode,
  engine), what the connector and the router call.
* :func:`provider_factory`: builds the OTel ``TracerProvider`` with

  - the SQLite trace store (always, unless ``kvlens_store: off``): a
    :class:`exporters.batching.CountingBatchSpanProcessor` (bounded queue,
    every loss counted) -> :class:`kvtrace.store.StoreSpanExporter`
    (at most ``store_max_block_s`` per batch);
  - OTLP/HTTP (the standard exporter, :data:`OTLP_TIMEOUT_S` per batch,
    through the same counting processor) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set or the connector's
    ``kv_connector_extra_config`` names ``otlp_endpoint``;
  - span-derived Prometheus metrics (:mod:`exporters.metrics`) unless
    ``kvlens_metrics: off``.

* Where spans are built (off the engine's GIL, :mod:`exporters.shipping`
  says why): for the roles ``prefill`` and ``decode``
  (the connector in vLLM's EngineCore/worker processes) the recorder is an
  :class:`exporters.shipping.ShippingRecorder`: it ships raw events to a
  sidecar process (:mod:`exporters.sidecar`) that runs this same pipeline,
  so span building, the processors and the metrics cost the engine's GIL
  nothing. ``span_builder``: ``sidecar`` (default) or ``inline`` (the
  spans are built on the recorder's thread in this process, as the router
  always does), from the argument, else ``$KVLENS_SPAN_BUILDER``, else the
  connector option ``kvlens_span_builder``.

* :func:`dropped_counts`: spans this process lost, by (role, reason) (the
  source of ``kvlens_telemetry_dropped_total{role,reason}``): the recorders'
  full buffers and the processors' losses (queue full, store, export
  failed, shutdown; :mod:`exporters.batching`).

The provider is an :class:`exporters.batching.BoundedTracerProvider`, so the
recorder's close at exit (flush and shutdown of every processor) is bounded
(:data:`kvrecord.recorder.CLOSE_TIMEOUT_S`).

Configuration is validated up front (:func:`config.validate_config`) so a typo
fails at start-up with a clear message; everything after that is forgiving.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping

from opentelemetry.sdk.resources import Resource

from kvtrace import store
from exporters.batching import BoundedTracerProvider, CountingBatchSpanProcessor, LossCounter
from exporters.metrics import PhaseMetricsProcessor
from exporters.shipping import ShippingRecorder
from kvrecord.config import enabled, retention_s, store_path, validate_config
from kvrecord.ids import PinnedIdGenerator
from kvrecord.logutil import log_once
from kvrecord.recorder import DEFAULT_CAPACITY, DropReason, Recorder

#: Bounded queue per exporter; spans beyond it are dropped and counted (queue_full).
MAX_QUEUE = 4096
#: One OTLP export (every retry included) gives up after this long.
OTLP_TIMEOUT_S = 3.0


# ----------------------------------------------------------------- per process
_recorders: dict[tuple, Recorder] = {}
_recorders_lock = threading.Lock()

SPAN_BUILDER_ENV = "KVLENS_SPAN_BUILDER"
SPAN_BUILDER_KEY = "kvlens_span_builder"
SPAN_BUILDERS = ("sidecar", "inline")
#: Roles whose recorder ships to a sidecar (vLLM's processes; the router is kvlens' own).
SIDECAR_ROLES = frozenset({"prefill", "decode"})


def span_builder(config: Mapping[str, Any] | None = None, override: str | None = None) -> str:
    """``sidecar`` or ``inline``: ``override``, else ``$KVLENS_SPAN_BUILDER``,
    else the ``kvlens_span_builder`` option, else ``sidecar``. ValueError
    naming the source for anything else."""
    for source, v in (
        ("span_builder", override),
        (SPAN_BUILDER_ENV, os.environ.get(SPAN_BUILDER_ENV)),
        (SPAN_BUILDER_KEY, (config or {}).get(SPAN_BUILDER_KEY)),
    ):
        if v is not None and str(v).strip():
            v = str(v).strip().lower()
            if v not in SPAN_BUILDERS:
                raise ValueError(f"{source} must be one of {', '.join(SPAN_BUILDERS)}, got {v!r}")
            return v
    return "sidecar"


def get_recorder(
    role: str,
    mode: str,
    engine_id: str | None = None,
    config: Mapping[str, Any] | None = None,
    span_builder: str | None = None,
) -> Recorder:
    """The process-wide recorder for (role, mode, engine).

    ``config``: the kvlens keys of ``kv_connector_extra_config`` (validated;
    a bad option raises ValueError here). Used when the recorder is first
    made. ``span_builder``: see the module docstring (roles ``prefill`` and
    ``decode`` only; other roles build inline). Any thread. Fork-safe: a
    child process gets a fresh recorder (the parent's thread does not
    survive fork)."""
    key = (os.getpid(), role, mode, engine_id)
    r = _recorders.get(key)
    if r is not None:
        return r
    with _recorders_lock:
        r = _recorders.get(key)
        if r is None:
            r = _make_recorder(role, mode, engine_id, dict(config or {}), span_builder)
            _recorders[key] = r
    return r


def _make_recorder(role: str, mode: str, engine_id: str | None, raw: dict, builder: str | None) -> Recorder:
    # read here until config.validate_config knows the key (then it returns it too)
    builder = span_builder(raw, builder)
    raw.pop(SPAN_BUILDER_KEY, None)
    cfg = validate_config(raw)
    kw = dict(
        role=role,
        mode=mode,
        engine_id=engine_id,
        capacity=int(cfg.get("kvlens_buffer_events", DEFAULT_CAPACITY)),
        pipeline_factory=provider_factory(role=role, mode=mode, engine_id=engine_id, config=cfg),
    )
    if builder == "sidecar" and role in SIDECAR_ROLES:
        cfg = {k: v for k, v in cfg.items() if k != SPAN_BUILDER_KEY}
        return ShippingRecorder(sidecar_spec={"role": role, "mode": mode, "engine_id": engine_id, "config": cfg}, **kw)
    return Recorder(**kw)


#: Every provider's loss counter, with its process and role (appended by
#: ``build``; a provider lives as long as its process's recorder).
_ledgers: list[tuple[int, str, LossCounter]] = []
#: Losses of the engine process a sidecar works for: (pid, role) -> reason -> total.
_remote: dict[tuple[int, str], dict[str, int]] = {}


def report_remote_drops(role: str, totals: Mapping[str, int]) -> None:
    """The sidecar's call: the engine's loss totals by reason (monotonic),
    counted in :func:`dropped_counts` under ``role``. Any thread."""
    if totals:
        _remote[(os.getpid(), role)] = dict(totals)


def dropped_counts() -> dict[tuple[str, str], int]:
    """Spans this process lost, by (role, reason) (:class:`DropReason` values):
    ``buffer_full``, ``shutdown`` and ``export_failed`` (no span built) from
    the recorders of :func:`get_recorder` (a shipping recorder's only until
    they are handed to its sidecar, which reports them through
    :func:`report_remote_drops`),
    the rest from every provider :func:`provider_factory` built here.

    Monotonic per key. Any thread; never blocks on I/O."""
    out: dict[tuple[str, str], int] = {}
    pid = os.getpid()

    def add(role: str, reason: str, n: int) -> None:
        if n:
            out[(role, reason)] = out.get((role, reason), 0) + int(n)

    for key, r in list(_recorders.items()):
        if key[0] == pid:
            for reason, n in r.unreported_drops().items():
                add(r.role, reason, n)
    for (rpid, role), totals in list(_remote.items()):
        if rpid == pid:
            for reason, n in totals.items():
                add(role, reason, n)
    for lpid, role, losses in list(_ledgers):
        if lpid == pid:
            for reason, n in losses.counts().items():
                add(role, reason, n)
    return out


# ------------------------------------------------------------------ provider
def provider_factory(
    *, role: str, mode: str, engine_id: str | None, config: Mapping[str, Any], store_max_block_s: float | None = None
) -> Callable[[PinnedIdGenerator], BoundedTracerProvider]:
    """The recorder's pipeline factory: ``build(id_generator)`` makes the
    TracerProvider (run once, on the recorder thread). ``config`` is checked
    here, so a bad option raises in the caller, not later.
    ``store_max_block_s``: the most one store batch may wait for the write
    lock (default :attr:`kvtrace.store.StoreSpanExporter.MAX_BLOCK_S`)."""
    cfg = validate_config(config)

    def build(id_generator: PinnedIdGenerator) -> BoundedTracerProvider:
        attrs = {"service.name": cfg.get("kvlens_service_name") or f"kvlens-{role}", "kvlens.role": role}
        if engine_id:
            attrs["service.instance.id"] = engine_id
        losses = LossCounter()
        _ledgers.append((os.getpid(), role, losses))
        provider = BoundedTracerProvider(resource=Resource.create(attrs), id_generator=id_generator, losses=losses)
        if enabled(cfg, "kvlens_store"):
            exporter = store.StoreSpanExporter(
                store_path(cfg), max_block_s=store_max_block_s, retention=retention_s(cfg)
            )
            provider.add_span_processor(
                CountingBatchSpanProcessor(
                    exporter,
                    losses=losses,
                    max_queue_size=MAX_QUEUE,
                    schedule_delay_s=0.2,
                    max_export_batch_size=512,
                    name="store",
                )
            )
        _add_otlp(provider, cfg, losses)
        if enabled(cfg, "kvlens_metrics"):
            provider.add_span_processor(
                PhaseMetricsProcessor(store_path=store_path(cfg), dropped_source=dropped_counts)
            )
        return provider

    return build


def _add_otlp(provider: BoundedTracerProvider, cfg: Mapping[str, Any], losses: LossCounter) -> None:
    endpoint = (
        cfg.get("otlp_endpoint")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
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
            CountingBatchSpanProcessor(
                OTLPSpanExporter(endpoint=url, timeout=OTLP_TIMEOUT_S),
                losses=losses,
                max_queue_size=MAX_QUEUE,
                schedule_delay_s=0.5,
                max_export_batch_size=512,
                loss_reason=DropReason.EXPORT_FAILED.value,
                name="otlp",
            )
        )
    except Exception:
        log_once("otlp", "OTLP exporter unavailable; spans go to the store only", exc_info=True)
