"""Where a stack's processes keep their telemetry.

* **One host** (the default): P, D and the router share one ``KVLENS_HOME``
  and so one trace store, where the handoff's two ends meet.
* **Separate homes** (``kvlens up --separate-homes``): what P, D and the
  router on three hosts look like, on one machine. Each gets its own home
  (``<home>/hosts/<role>``, its own store) and every span also goes over
  OTLP/HTTP to one collector, whose store is where traces join:

  - ``collector="process"``: a ``kvlens collect`` child (home
    ``<home>/hosts/collector``); the router exports there too
    (``OTEL_EXPORTER_OTLP_ENDPOINT``) and leaves the handoff metric to the
    collector (``KVLENS_HANDOFF_FROM=off``: its own store never holds both
    ends);
  - ``collector="router"``: the router hosts the receiver
    (``kvlens proxy --collect``) and writes P's and D's spans to its store.

  P and D send kvlens' spans with the connector's ``otlp_endpoint`` key and
  vLLM's own request spans with ``--otlp-traces-endpoint`` (OTLP over HTTP),
  so ``llm_request`` lands in the same trace (the router sends
  ``traceparent``).

Without kvlens' router (``kvlens up --router vllm-router``) no root span
exists to trigger the handoff metric, so D's ``kv.ready`` does
(``KVLENS_HANDOFF_FROM=decode``): on P and D on one host, on the collector
with separate homes (the only store holding both ends).

Pure: paths, URLs, environments and arguments; nothing is started here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrecord import config as kvconfig
from kvrecord.location import StoreLocation

COLLECTORS = ("process", "router")


@dataclass(frozen=True)
class Topology:
    home: Path
    host: str  #: the router's address (and everyone's, but for ``collector_host``)
    router_port: int
    separate: bool = False
    collector: str = "process"
    collector_port: int | None = None
    #: the collector's store when not its home's SQLite file: a path or a
    #: ``postgresql://`` URL (a store the whole fleet shares)
    collector_store: StoreLocation | str | None = None
    #: whether kvlens' own router runs (else only another router, e.g. vLLM's)
    kvlens_router: bool = True
    #: the collector process's address when not ``host`` (``kvlens up --hosts``: its namespace's)
    collector_host: str | None = None

    def home_for(self, role: str) -> Path:
        """The ``KVLENS_HOME`` of ``role`` (prefill, decode, router, collector)."""
        return self.home / "hosts" / role if self.separate else self.home

    @property
    def collector_url(self) -> str | None:
        """Base URL of the OTLP receiver (None on one host)."""
        if not self.separate:
            return None
        if self.collector == "router":
            return f"http://{self.host}:{self.router_port}"
        return f"http://{self.collector_host or self.host}:{self.collector_port}"

    @property
    def traces_url(self) -> str | None:
        """The receiver's ``/v1/traces`` URL (None on one host)."""
        return None if self.collector_url is None else self.collector_url + "/v1/traces"

    @property
    def store(self) -> StoreLocation:
        """The store where a request's spans from every process meet (a
        PostgreSQL database when the collector writes a shared server)."""
        if self.separate and self.collector == "process" and self.collector_store:
            return StoreLocation.parse(self.collector_store)
        where = "router" if self.collector == "router" else "collector"
        return kvconfig.default_store(self.home_for(where).expanduser().resolve())

    def server_env(self, role: str) -> dict[str, str]:
        """Extra environment of P or D: vLLM's tracing over OTLP/HTTP; the
        handoff metric from D's side when no kvlens router runs (module docstring)."""
        if self.separate:
            return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
        return {} if self.kvlens_router else {"KVLENS_HANDOFF_FROM": "decode"}

    def collector_env(self) -> dict[str, str]:
        """Extra environment of a ``kvlens collect`` child."""
        return {} if self.kvlens_router else {"KVLENS_HANDOFF_FROM": "decode"}

    def server_args(self, role: str) -> list[str]:
        """Extra vLLM arguments of P or D: its own request spans to the collector."""
        return ["--otlp-traces-endpoint", self.traces_url] if self.separate else []

    def router_env(self) -> dict[str, str]:
        if self.separate and self.collector == "process":
            return {
                "OTEL_EXPORTER_OTLP_ENDPOINT": str(self.collector_url),
                "KVLENS_HANDOFF_FROM": "off",
                # kvlens configured it: its exporter may send the ingest token there (exporters.pipeline)
                kvconfig.COLLECTORS_ENV: str(self.collector_url),
            }
        return {}

    def router_args(self) -> list[str]:
        return ["--collect"] if self.separate and self.collector == "router" else []
