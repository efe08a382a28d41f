"""The router's settings (one :class:`ProxyConfig` per app)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrecord import config as kvconfig
from kvrecord.location import StoreLocation

#: Default largest request body the router reads (bytes): far above any
#: prompt the stacks kvlens starts accept, far below what hurts the router.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

#: How long (s) a trace id stays taken after its request ended. P may hold a
#: request's KV for D until vLLM's ``push_registration_timeout`` (480 s by
#: default) or ``kv_lease_duration`` ends; an id reused inside that window
#: could meet that request's leftovers on P (see :mod:`kvlens.proxy.isolation`).
DEFAULT_REUSE_WINDOW_S = 600.0


@dataclass(frozen=True)
class Prefill:
    """One P instance as the router needs it: its base URL and, for an
    overlapped push (D's request goes out before P has answered), its
    identity as D needs it: ``kv_transfer_config.engine_id``, NIXL
    side-channel host and port (``VLLM_NIXL_SIDE_CHANNEL_PORT``), TP size."""

    url: str
    engine_id: str = "p0"
    side_host: str = "127.0.0.1"
    side_port: int | None = None
    tp_size: int = 1


@dataclass(frozen=True)
class Decode:
    """One D instance: its base URL and engine id (named on root spans and
    in ``/health``; D's own spans carry the id it really has)."""

    url: str
    engine_id: str = "d0"


@dataclass
class ProxyConfig:
    """Where P and D are, how to dispatch, and the HTTP client's limits.

    ``prefill_url`` / ``prefill_engine_id`` / ``prefill_side_host`` /
    ``prefill_side_port`` / ``prefill_tp_size``: the first (often only) P,
    ``decode_url`` / ``decode_engine_id`` the first D; ``more_prefills`` /
    ``more_decodes``: the instances after them. :attr:`prefills` and
    :attr:`decodes` list them all (the router balances over those, see
    :mod:`kvlens.proxy.balancer`); :meth:`of` builds a config from lists.
    Timeouts in seconds.
    ``kvlens_home``: where spans go (default: the kvlens home).
    ``store``: a PostgreSQL URL (``postgresql://user@host:port/db``) to
    write spans to instead of ``<kvlens_home>/traces.db``: the router's own
    spans and, with ``collect``, the ones P and D send. ``retention``: prune
    traces older than this from the store written (``"7d"``; default keep all).
    ``token``: the router's own bearer token (``$KVLENS_TOKEN`` or
    ``--token-file``): clients must send ``Authorization: Bearer <token>`` on
    every route but ``/health`` (``/v1/*``, ``/metrics``, the receiver's
    ``/v1/traces``); it never goes to P or D. ``api_key``: what P and D
    require (vLLM's ``--api-key``): the router sends ``Bearer <api_key>`` to
    them, and when no ``token`` is set clients must send the key instead
    (:attr:`client_key`). Neither set: the client's Authorization is passed
    on to P and D as it came. ``max_body_bytes``: the
    largest request body read (413 beyond). ``reuse_window_s``: see
    :data:`DEFAULT_REUSE_WINDOW_S`. :attr:`options`: the telemetry
    pipeline's options, built from these and checked once, at construction."""

    prefill_url: str
    decode_url: str
    mode: str = "push"
    dispatch: str = "overlapped"
    prefill_engine_id: str = "p0"
    prefill_side_host: str = "127.0.0.1"
    prefill_side_port: int | None = None
    prefill_tp_size: int = 1
    decode_engine_id: str = "d0"
    more_prefills: list[Prefill] = field(default_factory=list)
    more_decodes: list[Decode] = field(default_factory=list)
    kvlens_home: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    max_connections: int = 256
    telemetry: bool = True
    api_key: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    reuse_window_s: float = DEFAULT_REUSE_WINDOW_S
    #: host the OTLP receiver (``POST /v1/traces`` into this router's store)
    collect: bool = False
    store: str | None = None
    retention: str | None = None
    #: ``kvlens_keep*`` keys (``--keep``, ``--keep-ratio``, ``--keep-slow``): which requests keep their spans
    keep: dict | None = None
    options: kvconfig.Options = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prefill_url = self.prefill_url.rstrip("/")
        self.decode_url = self.decode_url.rstrip("/")
        self.more_prefills = [
            Prefill(p.url.rstrip("/"), p.engine_id, p.side_host, p.side_port, p.tp_size) for p in self.more_prefills
        ]
        self.more_decodes = [Decode(d.url.rstrip("/"), d.engine_id) for d in self.more_decodes]
        for side, ids in (
            ("prefill", [p.engine_id for p in self.prefills]),
            ("decode", [d.engine_id for d in self.decodes]),
        ):
            if len(set(ids)) != len(ids):  # D would be told the wrong P; traces would name the wrong one
                raise ValueError(f"{side} engine ids must be distinct, got {', '.join(ids)}")
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
        if self.token is not None and not self.token.strip():
            raise ValueError("token must not be empty (leave it unset for no token)")
        if self.kvlens_home is None:
            self.kvlens_home = str(kvconfig.home())
        if self.store is not None:
            location = StoreLocation.parse(self.store)
            if not location.is_postgres:
                raise ValueError(
                    f"store must be a postgresql://user@host:port/dbname URL (a file store is "
                    f"<kvlens_home>/traces.db), got {self.store!r}"
                )
            self.store = location.text
        self.options = kvconfig.Options.from_config(self.pipeline_config())

    @classmethod
    def of(cls, prefills: list[Prefill], decodes: list[Decode], **kw) -> "ProxyConfig":
        """A config for these P and D instances (at least one of each)."""
        if not prefills or not decodes:
            raise ValueError("need at least one prefill and one decode instance")
        p0, d0 = prefills[0], decodes[0]
        return cls(
            prefill_url=p0.url,
            decode_url=d0.url,
            prefill_engine_id=p0.engine_id,
            prefill_side_host=p0.side_host,
            prefill_side_port=p0.side_port,
            prefill_tp_size=p0.tp_size,
            decode_engine_id=d0.engine_id,
            more_prefills=list(prefills[1:]),
            more_decodes=list(decodes[1:]),
            **kw,
        )

    @property
    def prefills(self) -> list[Prefill]:
        """Every P, the first from the ``prefill_*`` fields (read now: a
        change to them after construction counts)."""
        first = Prefill(
            self.prefill_url,
            self.prefill_engine_id,
            self.prefill_side_host,
            self.prefill_side_port,
            self.prefill_tp_size,
        )
        return [first, *self.more_prefills]

    @property
    def decodes(self) -> list[Decode]:
        """Every D, the first from ``decode_url`` / ``decode_engine_id``."""
        return [Decode(self.decode_url, self.decode_engine_id), *self.more_decodes]

    def pipeline_config(self) -> dict[str, str]:
        """The connector-style config for this router's telemetry pipeline
        and store (``kvlens_home``; ``kvlens_store`` / ``kvlens_retention`` when set)."""
        out = {"kvlens_home": str(self.kvlens_home)}
        if self.store:
            out["kvlens_store"] = self.store
        if self.retention:
            out["kvlens_retention"] = self.retention
        out.update(self.keep or {})
        return out

    @property
    def client_key(self) -> str | None:
        """What clients must send as ``Authorization: Bearer ...`` (every route
        but ``/health``): the token, else the API key, else None (no check)."""
        return self.token or self.api_key

    @property
    def overlapped_push(self) -> bool:
        return self.mode == "push" and self.dispatch == "overlapped"

    @property
    def effective_dispatch(self) -> str:
        """``dispatch`` for push; pull is always sequential (D needs P's answer)."""
        return self.dispatch if self.mode == "push" else "sequential"
