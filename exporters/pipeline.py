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

Configuration is a checked :class:`kvrecord.config.Options`, built once where
the options enter (the connector, the router, the sidecar), so a typo fails
at start-up with a clear message; everything after that is forgiving. The
functions here also take the ``kv_connector_extra_config``-style dict
(tests, benchmarks) and build the options from it once, on entry.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from typing import Any, Callable, Mapping

from opentelemetry.sdk.resources import Resource

from kvtrace import store
from exporters.batching import BoundedTracerProvider, CountingBatchSpanProcessor, LossCounter
from exporters.metrics import PhaseMetricsProcessor
from exporters.shipping import ShippingRecorder
from kvrecord.config import COLLECTORS_ENV, SPAN_BUILDERS, Options, default_store, ingest_token
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
#: Roles whose recorder ships to a sidecar (vLLM's processes; the router is kvlens' own).
SIDECAR_ROLES = frozenset({"prefill", "decode"})


Config = Options | Mapping[str, Any]


def options_of(config: Config | None) -> Options:
    """``config`` as :class:`Options`: as it is, or built (and checked) from a dict."""
    return config if isinstance(config, Options) else Options.from_config(config)


def span_builder(config: Config | None = None, override: str | None = None) -> str:
    """``sidecar`` or ``inline``: ``override``, else ``$KVLENS_SPAN_BUILDER``,
    else the ``kvlens_span_builder`` option, else ``sidecar``. ValueError
    naming the source for anything else."""
    option = config.span_builder if isinstance(config, Options) else (config or {}).get(SPAN_BUILDER_KEY)
    for source, v in (
        ("span_builder", override),
        (SPAN_BUILDER_ENV, os.environ.get(SPAN_BUILDER_ENV)),
        (SPAN_BUILDER_KEY, option),
    ):
        if v is not None and str(v).strip():
            v = str(v).strip().lower()
            if v not in SPAN_BUILDERS:
                raise ValueError(f"{source} must be one of {', '.join(SPAN_BUILDERS)}, got {v!r}")
            return v
    return "sidecar"


def get_recorder(
    role: str, mode: str, engine_id: str | None = None, config: Config | None = None, span_builder: str | None = None
) -> Recorder:
    """The process-wide recorder for (role, mode, engine).

    ``config``: the process's :class:`Options` (or the kvlens keys of
    ``kv_connector_extra_config``, checked here: a bad option raises
    ValueError). Used when the recorder is first made. ``span_builder``:
    see the module docstring (roles ``prefill`` and ``decode`` only; other
    roles build inline). Any thread. Fork-safe: a
    child process gets a fresh recorder (the parent's thread does not
    survive fork)."""
    key = (os.getpid(), role, mode, engine_id)
    r = _recorders.get(key)
    if r is not None:
        return r
    with _recorders_lock:
        r = _recorders.get(key)
        if r is None:
            r = _make_recorder(role, mode, engine_id, options_of(config), span_builder)
            _recorders[key] = r
    return r


def _make_recorder(role: str, mode: str, engine_id: str | None, opts: Options, builder: str | None) -> Recorder:
    builder = span_builder(opts, builder)
    kw = dict(
        role=role,
        mode=mode,
        engine_id=engine_id,
        capacity=opts.buffer_events or DEFAULT_CAPACITY,
        pipeline_factory=provider_factory(role=role, mode=mode, engine_id=engine_id, config=opts),
    )
    if builder == "sidecar" and role in SIDECAR_ROLES:
        # the sidecar builds inline: the span builder stays here
        cfg = replace(opts, span_builder=None).to_config()
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

    Every reason of every role recording here is in it, 0 before its first
    loss, so ``kvlens_telemetry_dropped_total`` reads 0, not "no data", when
    nothing was lost (a dashboard then shows 0 lost spans, not unknown).

    Monotonic per key. Any thread; never blocks on I/O."""
    out: dict[tuple[str, str], int] = {}
    pid = os.getpid()

    def add(role: str, reason: str, n: int) -> None:
        out[(role, reason)] = out.get((role, reason), 0) + int(n or 0)

    def seed(role: str) -> None:
        for reason in DropReason:
            out.setdefault((role, reason.value), 0)

    for key, r in list(_recorders.items()):
        if key[0] == pid:
            seed(r.role)
            for reason, n in r.unreported_drops().items():
                add(r.role, reason, n)
    for (rpid, role), totals in list(_remote.items()):
        if rpid == pid:
            seed(role)
            for reason, n in totals.items():
                add(role, reason, n)
    for lpid, role, losses in list(_ledgers):
        if lpid == pid:
            seed(role)
            for reason, n in losses.counts().items():
                add(role, reason, n)
    return out


# ------------------------------------------------------------------ OTLP
def otlp_protocol(opts: Options, env: Mapping[str, str] = os.environ) -> str:
    """``grpc`` or ``http/protobuf``. ``otlp_endpoint`` and ``otlp_protocol``
    in the options go together (an endpoint without a protocol: OTLP/HTTP);
    an endpoint from the standard variables goes with the standard
    ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``$OTEL_EXPORTER_OTLP_PROTOCOL``,
    so a variable set for vLLM's own exporter cannot turn kvlens' configured
    OTLP/HTTP endpoint into a gRPC one."""
    if opts.otlp_protocol:
        p = opts.otlp_protocol
    elif opts.otlp_endpoint:
        p = "http/protobuf"
    else:
        p = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return "grpc" if (p or "").strip().lower() == "grpc" else "http/protobuf"


def otlp_headers(
    env: Mapping[str, str] = os.environ, endpoint: str | None = None, kvlens_collector: bool = False
) -> dict[str, str] | None:
    """Headers for the OTLP exporter: None when no kvlens token goes with
    the spans (the SDK then reads ``$OTEL_EXPORTER_OTLP_TRACES_HEADERS`` /
    ``$OTEL_EXPORTER_OTLP_HEADERS`` itself); else those standard headers plus
    ``authorization: Bearer <token>``, the token :func:`kvrecord.config.ingest_token`
    (``$KVLENS_INGEST_TOKEN``, else ``$KVLENS_TOKEN``; a standard
    ``authorization`` header, when given, wins). Keys lower-case: gRPC
    metadata wants them so. The token comes from the environment only, never
    from ``kv_connector_extra_config`` (that is vLLM's argv, which ``ps`` shows).

    The token goes only to a kvlens collector (:func:`token_refusal`):
    ``kvlens_collector`` (the endpoint is kvlens' own ``otlp_endpoint``
    option) or ``endpoint`` listed in ``$KVLENS_COLLECTOR_ENDPOINTS``, and
    never over plain http beyond loopback. Refused, it is left out and one
    error says why (telemetry never stops serving: the spans still go, and
    a collector that wants the token refuses them, counted ``export_failed``)."""
    token = ingest_token(env)
    if token is None:
        return None
    from opentelemetry.util.re import parse_env_headers

    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
    headers = {k.lower(): v for k, v in parse_env_headers(raw, liberal=True).items()}
    if "authorization" in headers:  # the operator's explicit header: nothing of kvlens' goes with it
        return headers
    why = token_refusal(endpoint, kvlens_collector, env) if endpoint is not None else None
    if why is not None:
        log_error_once(f"otlp-token:{endpoint}", why)
        return None
    headers["authorization"] = f"Bearer {token}"
    return headers


def _origin(url: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) of a URL or ``host:port``, lower case; None when unreadable."""
    from urllib.parse import urlsplit

    text = url.strip() if "://" in url else "//" + url.strip()
    try:
        u = urlsplit(text)
        port = u.port
    except ValueError:
        return None
    if not u.hostname:
        return None
    scheme = u.scheme.lower()
    return scheme, u.hostname.lower(), port or {"http": 80, "https": 443}.get(scheme)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_refusal(endpoint: str, kvlens_collector: bool, env: Mapping[str, str] = os.environ) -> str | None:
    """Why a kvlens token must not go to ``endpoint``, or None. It goes only
    (1) over https, or plain http to loopback (anyone on the path reads a
    header sent in clear), and (2) to an endpoint the operator marked as a
    kvlens collector: kvlens' own ``otlp_endpoint`` option
    (``kvlens_collector``), or one listed (``scheme://host:port``, or
    ``host:port`` for any scheme) in ``$KVLENS_COLLECTOR_ENDPOINTS``, comma
    separated: a vendor's OTLP endpoint named by the standard variables must
    not receive a token that opens the fleet's collector, router and dashboard."""
    o = _origin(endpoint)
    if o is None:
        return f"not sending the kvlens token to the OTLP endpoint {endpoint!r}: not a URL"
    scheme, host, port = o
    if scheme != "https" and not _is_loopback(host):
        return (
            f"not sending the kvlens token to the OTLP endpoint {endpoint}: plain http beyond loopback shows it "
            "to the network; serve the collector with TLS (--tls-cert) and use https://"
        )
    if kvlens_collector:
        return None
    for item in env.get(COLLECTORS_ENV, "").split(","):
        m = _origin(item) if item.strip() else None
        if m and m[1:] == (host, port) and (m[0] == scheme or "://" not in item):
            return None
    return (
        f"not sending the kvlens token to the OTLP endpoint {endpoint}: it is not marked as a kvlens collector "
        f"(list it in ${COLLECTORS_ENV}, or give it as kvlens' otlp_endpoint option)"
    )


def log_error_once(key: str, msg: str) -> None:
    """``msg`` at ERROR once per ``key`` in this process; never raises."""
    import logging

    with _errors_lock:
        if key in _errors_logged:
            return
        _errors_logged.add(key)
    try:
        logging.getLogger("kvlens").error("kvlens: %s", msg)
    except Exception:
        pass


_errors_logged: set[str] = set()
_errors_lock = threading.Lock()


def otlp_exporter(endpoint: str, protocol: str = "http/protobuf", kvlens_collector: bool = False):
    """The SDK's OTLP span exporter for ``endpoint``: OTLP/HTTP (``/v1/traces``
    appended when missing) or, with ``protocol`` ``grpc``, OTLP/gRPC
    (``http://HOST:4317`` plain, ``https://`` TLS; the CA in the standard
    ``$OTEL_EXPORTER_OTLP_CERTIFICATE``). Headers: :func:`otlp_headers`
    (``kvlens_collector``: the endpoint is kvlens' own ``otlp_endpoint`` option).
    Deferred imports for start-up cost: the exporters pull in protobuf and
    requests or grpc, paid only by processes that export over OTLP."""
    headers = otlp_headers(os.environ, endpoint, kvlens_collector)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, timeout=OTLP_TIMEOUT_S, headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    ca = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE") or os.environ.get("OTEL_EXPORTER_OTLP_CERTIFICATE")
    session = _ca_session() if ca else None
    return OTLPSpanExporter(endpoint=url, timeout=OTLP_TIMEOUT_S, headers=headers, session=session)


def _ca_session():
    """A ``requests.Session`` that keeps the CA the exporter sets on it
    (``session.verify``). A plain one drops it for ``$REQUESTS_CA_BUNDLE`` /
    ``$CURL_CA_BUNDLE`` whenever either is set (requests merges the
    environment over the session's own setting; many images set them), so
    ``$OTEL_EXPORTER_OTLP_CERTIFICATE`` would be ignored and TLS to a
    collector with a private CA fail."""
    import requests

    class CASession(requests.Session):
        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            out = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if verify is None:
                out["verify"] = self.verify
            return out

    return CASession()


# ------------------------------------------------------------------ provider
def provider_factory(
    *, role: str, mode: str, engine_id: str | None, config: Config, store_max_block_s: float | None = None
) -> Callable[[PinnedIdGenerator], BoundedTracerProvider]:
    """The recorder's pipeline factory: ``build(id_generator)`` makes the
    TracerProvider (run once, on the recorder thread). ``config``: the
    :class:`Options` (a dict is checked here, so a bad option raises in the
    caller, not later).
    ``store_max_block_s``: the most one store batch may wait for the write
    lock (default :attr:`kvtrace.store.StoreSpanExporter.MAX_BLOCK_S`)."""
    opts = options_of(config)

    def build(id_generator: PinnedIdGenerator) -> BoundedTracerProvider:
        attrs = {"service.name": opts.service_name or f"kvlens-{role}", "kvlens.role": role}
        if engine_id:
            attrs["service.instance.id"] = engine_id
        losses = LossCounter()
        _ledgers.append((os.getpid(), role, losses))
        provider = BoundedTracerProvider(resource=Resource.create(attrs), id_generator=id_generator, losses=losses)
        if opts.store is not None:
            exporter = store.StoreSpanExporter(
                opts.store, max_block_s=store_max_block_s, retention=opts.retention_s, keep=opts.keep
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
        _add_otlp(provider, opts, losses)
        if opts.metrics:
            # the handoff is read from the home's file even when this process writes no store
            handoff_store = opts.store or default_store(opts.home)
            provider.add_span_processor(PhaseMetricsProcessor(store_path=handoff_store, dropped_source=dropped_counts))
        return provider

    return build


def _add_otlp(provider: BoundedTracerProvider, opts: Options, losses: LossCounter) -> None:
    endpoint = (
        opts.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not endpoint:
        return
    try:
        # 0.5 s batches (the SDK's default is 5 s): a collector's handoff
        # resolver waits for the last end of a request, so export promptly.
        provider.add_span_processor(
            CountingBatchSpanProcessor(
                otlp_exporter(endpoint, otlp_protocol(opts), kvlens_collector=bool(opts.otlp_endpoint)),
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
