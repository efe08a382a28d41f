"""The router's settings (one :class:`ProxyConfig` per app)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvrecord import config as kvconfig
from kvrecord.location import StoreLocation

#: Default largest request body the router reads (bytes): far above any
#: prompt the stacks kvlens starts accept, far below what hurts the router.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

#: How long (s) a trace id stays taken after its request ended. P may hold a
#: request's KV for D until vLLM's ``push_registration_timeout`` (480 s by
#: default) or ``kv_lease_duration`` ends; an id reused inside that window
#: could meet that request's leftovers on P (see :mod:`proxy.isolation`).
DEFAULT_REUSE_WINDOW_S = 600.0

#: The handoff modes, in the order the router lists them.
MODES = ("push", "pull")
#: Default push weight of a mixed fleet's split (``--split push=0.5``).
DEFAULT_SPLIT = 0.5


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
    #: its handoff mode (push / pull); None: the router's ``mode`` (not part
    #: of equality: an instance is its URL and identity)
    mode: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Decode:
    """One D instance: its base URL and engine id (named on root spans and
    in ``/health``; D's own spans carry the id it really has) and its mode
    (None: the router's)."""

    url: str
    engine_id: str = "d0"
    mode: str | None = field(default=None, compare=False)


@dataclass
class ProxyConfig:
    """Where P and D are, how to dispatch, and the HTTP client's limits.

    ``prefill_url`` / ``prefill_engine_id`` / ``prefill_side_host`` /
    ``prefill_side_port`` / ``prefill_tp_size``: the first (often only) P,
    ``decode_url`` / ``decode_engine_id`` the first D; ``more_prefills`` /
    ``more_decodes``: the instances after them. :attr:`prefills` and
    :attr:`decodes` list them all (the router balances over those, see
    :mod:`proxy.balancer`); :meth:`of` builds a config from lists.
    A **mixed fleet** (a canary): instances of both modes (each
    :class:`Prefill` / :class:`Decode` names its ``mode``; ``prefill_mode``
    / ``decode_mode`` the first's; None: ``mode``); ``split`` is the push
    weight with which each request's mode is drawn (``split_seed``: a seeded
    draw, for tests), changeable live (``POST /admin/split``).
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
    on to P and D as it came. ``ingest_token`` / ``read_token`` /
    ``admin_token``: the role tokens (:func:`~proxy.intake.client_auth`
    says which route takes which; the API key never opens ``/admin/*`` or
    ``/v1/traces``). ``bind_host`` / ``allowed_hosts``: the Host names the
    router answers (:mod:`frontdoor.samesite`). ``max_body_bytes``: the
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
    prefill_mode: str | None = None
    decode_mode: str | None = None
    more_prefills: list[Prefill] = field(default_factory=list)
    more_decodes: list[Decode] = field(default_factory=list)
    kvlens_home: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    max_connections: int = 256
    telemetry: bool = True
    api_key: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    #: role tokens (``--ingest-token-file`` / ``$KVLENS_INGEST_TOKEN``, ...; :mod:`frontdoor.flags`)
    ingest_token: str | None = field(default=None, repr=False)
    read_token: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    #: the address the router listens on and the other names clients use (:mod:`frontdoor.samesite`)
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    reuse_window_s: float = DEFAULT_REUSE_WINDOW_S
    #: host the OTLP receiver (``POST /v1/traces`` into this router's store)
    collect: bool = False
    store: str | None = None
    retention: str | None = None
    #: ``kvlens_keep*`` keys (``--keep``, ``--keep-ratio``, ``--keep-slow``): which requests keep their spans
    keep: dict | None = None
    #: push weight of a mixed fleet's split; ``split_seed``: seed of its draws (None: random)
    split: float = DEFAULT_SPLIT
    split_seed: int | None = None
    options: kvconfig.Options = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prefill_url = self.prefill_url.rstrip("/")
        self.decode_url = self.decode_url.rstrip("/")
        self.more_prefills = [replace(p, url=p.url.rstrip("/")) for p in self.more_prefills]
        self.more_decodes = [replace(d, url=d.url.rstrip("/")) for d in self.more_decodes]
        for side, ids in (
            ("prefill", [p.engine_id for p in self.prefills]),
            ("decode", [d.engine_id for d in self.decodes]),
        ):
            if len(set(ids)) != len(ids):  # D would be told the wrong P; traces would name the wrong one
                raise ValueError(f"{side} engine ids must be distinct, got {', '.join(ids)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be push or pull, got {self.mode!r}")
        self._check_modes()
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

    def _check_modes(self) -> None:
        """Every instance's mode is push or pull, and each mode with a P has
        a D and the reverse (ValueError naming what is missing); the split's
        weight lies in [0, 1]."""
        for inst in [*self.prefills, *self.decodes]:
            if inst.mode not in MODES:
                raise ValueError(f"{inst.engine_id}'s mode must be push or pull, got {inst.mode!r}")
        p_modes = {p.mode for p in self.prefills}
        d_modes = {d.mode for d in self.decodes}
        for mode in MODES:
            if (mode in p_modes) != (mode in d_modes):
                has, lacks = ("prefill", "decode") if mode in p_modes else ("decode", "prefill")
                raise ValueError(
                    f"mode {mode} has {has} instances but no {lacks} instance (give one: --{lacks} {mode}=URL)"
                )
        w = self.split
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            raise ValueError(f"split must be a push weight in [0, 1], got {w!r}")
        self.split = float(w)

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
            prefill_mode=p0.mode,
            decode_engine_id=d0.engine_id,
            decode_mode=d0.mode,
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
            self.prefill_mode,
        )
        return [p if p.mode else replace(p, mode=self.mode) for p in [first, *self.more_prefills]]

    @property
    def decodes(self) -> list[Decode]:
        """Every D, the first from ``decode_url`` / ``decode_engine_id``."""
        first = Decode(self.decode_url, self.decode_engine_id, self.decode_mode)
        return [d if d.mode else replace(d, mode=self.mode) for d in [first, *self.more_decodes]]

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes with instances, in :data:`MODES` order."""
        have = {p.mode for p in self.prefills}
        return tuple(m for m in MODES if m in have)

    @property
    def mixed(self) -> bool:
        """Instances of both modes: each request's mode is drawn (``split``)."""
        return len(self.modes) > 1

    def fleet(self, mode: str) -> tuple[list[Prefill], list[Decode]]:
        """The P and D instances of ``mode``."""
        return [p for p in self.prefills if p.mode == mode], [d for d in self.decodes if d.mode == mode]

    def dispatch_for(self, mode: str) -> str:
        """``dispatch`` for push; pull is always sequential (D needs P's answer)."""
        return self.dispatch if mode == "push" else "sequential"

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

    def security(self):
        """The router's tokens as a :class:`frontdoor.credentials.Security` (no TLS: that is uvicorn's)."""
        from frontdoor.credentials import Security

        def b(t: str | None) -> bytes | None:
            return t.encode() if t else None

        return Security(
            token=b(self.token),
            ingest_token=b(self.ingest_token),
            read_token=b(self.read_token),
            admin_token=b(self.admin_token),
        )

    @property
    def any_token(self) -> bool:
        """Some kvlens token (the all-roles one or a role's) is set."""
        return bool(self.token or self.ingest_token or self.read_token or self.admin_token)

    @property
    def client_key(self) -> str | None:
        """What clients must send as ``Authorization: Bearer ...`` (every route
        but ``/health``): the token, else the API key, else None (no check)."""
        return self.token or self.api_key

    @property
    def overlapped_push(self) -> bool:
        """Some requests go as overlapped push (push instances, dispatch overlapped)."""
        return "push" in self.modes and self.dispatch == "overlapped"

    @property
    def effective_dispatch(self) -> str:
        """``dispatch`` for push; pull is always sequential (D needs P's answer)."""
        return self.dispatch_for(self.mode)
