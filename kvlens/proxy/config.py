"""The router's settings (one :class:`ProxyConfig` per app)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from instrumented_connector import config as kvconfig

#: Default largest request body the router reads (bytes): far above any
#: prompt the stacks kvlens starts accept, far below what hurts the router.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

#: How long (s) a trace id stays taken after its request ended. P may hold a
#: request's KV for D until vLLM's ``push_registration_timeout`` (480 s by
#: default) or ``kv_lease_duration`` ends; an id reused inside that window
#: could meet that request's leftovers on P (see :mod:`kvlens.proxy.isolation`).
DEFAULT_REUSE_WINDOW_S = 600.0


@dataclass
class ProxyConfig:
    """Where P and D are, how to dispatch, and the HTTP client's limits.

    ``prefill_engine_id`` / ``prefill_side_host`` / ``prefill_side_port`` /
    ``prefill_tp_size``: P's identity as D needs it for an overlapped push
    (D's request goes out before P has answered). Timeouts in seconds.
    ``kvlens_home``: where spans go (default: the kvlens home).
    ``store``: a PostgreSQL URL (``postgresql://user@host:port/db``) to
    write spans to instead of ``<kvlens_home>/traces.db``: the router's own
    spans and, with ``collect``, the ones P and D send. ``retention``: prune
    traces older than this from the store written (``"7d"``; default keep all).
    ``api_key``: when set, clients must send ``Authorization: Bearer <key>``
    on ``/v1/*`` and the router sends the same to P and D; when None the
    client's Authorization is passed on as it came. ``max_body_bytes``: the
    largest request body read (413 beyond). ``reuse_window_s``: see
    :data:`DEFAULT_REUSE_WINDOW_S`."""

    prefill_url: str
    decode_url: str
    mode: str = "push"
    dispatch: str = "overlapped"
    prefill_engine_id: str = "p0"
    prefill_side_host: str = "127.0.0.1"
    prefill_side_port: int | None = None
    prefill_tp_size: int = 1
    kvlens_home: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    max_connections: int = 256
    telemetry: bool = True
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    reuse_window_s: float = DEFAULT_REUSE_WINDOW_S
    #: host the OTLP receiver (``POST /v1/traces`` into this router's store)
    collect: bool = False
    store: str | None = None
    retention: str | None = None

    def __post_init__(self) -> None:
        self.prefill_url = self.prefill_url.rstrip("/")
        self.decode_url = self.decode_url.rstrip("/")
        if self.mode not in ("push", "pull"):
            raise ValueError(f"mode must be push or pull, got {self.mode!r}")
        if self.dispatch not in ("overlapped", "sequential"):
            raise ValueError(f"dispatch must be overlapped or sequential, got {self.dispatch!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        if not math.isfinite(self.reuse_window_s) or self.reuse_window_s < 0:
            raise ValueError(f"reuse_window_s must be >= 0 and finite, got {self.reuse_window_s!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        if self.kvlens_home is None:
            self.kvlens_home = str(kvconfig.home())
        if self.store is not None:
            from exporters.store.dialect import check_url, is_url

            if not is_url(self.store):
                raise ValueError(f"store must be a postgresql://user@host:port/dbname URL (a file store is "
                                 f"<kvlens_home>/traces.db), got {self.store!r}")
            self.store = check_url(self.store)
        if self.retention is not None:
            kvconfig.retention_s({"kvlens_retention": self.retention})

    def pipeline_config(self) -> dict[str, str]:
        """The connector-style config for this router's telemetry pipeline
        and store (``kvlens_home``; ``kvlens_store`` / ``kvlens_retention`` when set)."""
        out = {"kvlens_home": str(self.kvlens_home)}
        if self.store:
            out["kvlens_store"] = self.store
        if self.retention:
            out["kvlens_retention"] = self.retention
        return out

    @property
    def overlapped_push(self) -> bool:
        return self.mode == "push" and self.dispatch == "overlapped"

    @property
    def effective_dispatch(self) -> str:
        """``dispatch`` for push; pull is always sequential (D needs P's answer)."""
        return self.dispatch if self.mode == "push" else "sequential"
