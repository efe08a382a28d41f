""":class:`StackSpec`: what a :class:`~kvlens.stack.launch.Stack` is asked to
be, checked and normalized at construction (modes and their counts, TP sizes
per instance, routers, links, the store's namespace, the API key, the homes
and log directory). A StackError names what is wrong before anything starts.
:func:`~kvlens.stack.preflight.preflight` then completes it (the model
directory, the ports it picks); nothing else changes it. No I/O but the
environment it reads (``$KVLENS_API_KEY``, kvlens' home).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from frontdoor.flags import env_api_key
from kvrecord import config as kvconfig
from kvrecord.ports import DEFAULT_HOST
from kvlens.stack.commands import DEFAULT_KV_LEASE_S, DEFAULT_PUSH_REGISTRATION_TIMEOUT_S
from kvlens.stack.errors import StackError
from kvlens.stack.instances import check_count, check_routers, parse_modes, parse_routers
from kvlens.stack.linkspec import parse_links
from kvlens.stack.netstack import check_store
from kvlens.stack.spinners import OFF_OPTION, check_mode
from kvlens.stack.topology import COLLECTORS
from kvlens.stack.tp import check_tp, check_vllm_args, engine_processes, per_mode_tp, startup_timeout_s


@dataclass
class StackSpec:
    """A stack's configuration (:class:`~kvlens.stack.launch.Stack`'s
    keywords, which it hands here). ``prefill_port`` / ``prefill_side_port``
    (and D's) are the first instance's; the others get free ports
    (``more_ports``, filled by preflight). ``routers``: ``"kvlens"``,
    ``"vllm-router"`` or both (comma-separated or a list); ``port`` is kvlens'
    router's, or vLLM's router's when it runs alone (else
    ``vllm_router_port``, default a free one). ``mode``: ``push``, ``pull``
    or ``push,pull``: a mixed fleet, ``prefill_instances`` P and
    ``decode_instances`` D per mode (the fields then hold the totals after
    init; ``per_mode`` the counts given), one kvlens router in front of all."""

    mode: str = "push"
    dispatch: str = "overlapped"
    model: Path | str | None = None
    port: int | None = 8000
    prefill_port: int | None = None
    decode_port: int | None = None
    stock: bool = False
    log_dir: Path | str | None = None
    env_extra: Mapping[str, str] | None = None
    host: str = DEFAULT_HOST
    kvlens_home: Path | str | None = None
    prefill_side_port: int | None = None
    decode_side_port: int | None = None
    vllm_args: list[str] = field(default_factory=list)
    quiet: bool = False
    warmup: bool = True
    kv_lease_s: int = DEFAULT_KV_LEASE_S
    push_registration_timeout_s: int = DEFAULT_PUSH_REGISTRATION_TIMEOUT_S
    prometheus: bool = False
    prometheus_port: int = 9090
    #: separate homes per process + an OTLP collector (:mod:`kvlens.stack.topology`)
    separate_homes: bool = False
    collector: str = "process"
    collector_port: int | None = None
    collector_store: kvconfig.StoreLocation | str | None = None  #: the collector's store (a path or URL is parsed)
    #: extra environment per role (prefill, decode, router, collector), on top of env_extra
    role_env: Mapping[str, Mapping[str, str]] | None = None
    #: required by P, D and the router (default: $KVLENS_API_KEY, else $VLLM_API_KEY, else none)
    api_key: str | None = field(default=None, repr=False)
    #: bind beyond loopback with no token and no API key: ``--insecure`` to the router and the collector
    insecure: bool = False
    prefill_instances: int = 1
    decode_instances: int = 1
    routers: str | Sequence[str] = "kvlens"
    vllm_router_port: int | None = None
    vllm_router_metrics_port: int | None = None
    #: TP size of the P (D): one for all or one per instance (:mod:`kvlens.stack.tp`); tuples after init
    prefill_tp: int | Sequence[int] = 1
    decode_tp: int | Sequence[int] = 1
    #: NIXL's spinning UCX progress threads: auto, idle, startup or as-is (:mod:`kvlens.stack.spinners`)
    nixl_progress: str = "auto"
    #: D's vLLM kv_load_failure_policy: None (vLLM's default, fail) or "fail" / "recompute"
    kv_load_failure_policy: str | None = None
    #: more ``kvlens_*`` keys for kvlens' connector (benchmarks: e.g. the store off)
    connector_options: Mapping[str, Any] | None = None
    #: a mixed fleet's push weight at start (None: the router's default, 0.5)
    split: float | None = None
    #: every role in its own network namespace (:mod:`kvlens.stack.netns`, docs/links.md); root only
    hosts: bool = False
    #: ``--link`` specs (:mod:`kvlens.stack.linkspec`): each direction's delay, jitter, rate, loss; needs ``hosts``
    links: Sequence[str] = ()
    #: with ``hosts``: the collector's database server, run in a ``store`` namespace (:mod:`kvlens.stack.netstack`)
    store_command: str | Sequence[str] | None = None
    #: keep the kernel's scheduler record in ``<log_dir>/sched`` once ready (:mod:`kvlens.stack.schedrec`)
    sched_trace: bool = False
    #: the kernel memory that record may take, MiB in all (the newest events kept)
    sched_buffer_mb: int = 128
    #: ports of the instances after the first, by :func:`~kvlens.stack.instances.port_names` (preflight's)
    more_ports: dict[str, int] = field(default_factory=dict, repr=False)

    # set by __post_init__
    #: the modes (one, or push and pull: a mixed fleet) and the P and D count of each
    modes: tuple[str, ...] = field(default=(), init=False)
    per_mode: tuple[int, int] = field(default=(1, 1), init=False)
    #: ``links`` parsed: (src, dst) -> shape (:func:`~kvlens.stack.linkspec.parse_links`)
    link_shapes: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.modes = parse_modes(self.mode)
        self.mode = ",".join(self.modes)
        if not 1 <= self.sched_buffer_mb <= 65536:
            raise StackError(f"the kernel record's buffer must be 1..65536 MiB, got {self.sched_buffer_mb}")
        if self.dispatch not in ("overlapped", "sequential"):
            raise StackError(f"dispatch must be overlapped or sequential, got {self.dispatch!r}")
        if self.collector not in COLLECTORS:
            raise StackError(f"collector must be one of {', '.join(COLLECTORS)}, got {self.collector!r}")
        if self.collector_store and not (self.separate_homes and self.collector == "process"):
            raise StackError("--collector-store needs --separate-homes with --collector process")
        check_count("--prefill-instances", self.prefill_instances)
        check_count("--decode-instances", self.decode_instances)
        self.per_mode = (self.prefill_instances, self.decode_instances)
        if self.split is not None and not self.mixed:
            raise StackError("--split needs --mode push,pull (a mixed fleet)")
        if self.mixed:  # the TP sizes given per mode's instances count for each mode
            k = len(self.modes)
            self.prefill_tp = per_mode_tp(self.prefill_tp, self.prefill_instances, k)
            self.decode_tp = per_mode_tp(self.decode_tp, self.decode_instances, k)
            self.prefill_instances *= k
            self.decode_instances *= k
        self.prefill_tp = check_tp("--prefill-tp", self.prefill_tp, self.prefill_instances)
        self.decode_tp = check_tp("--decode-tp", self.decode_tp, self.decode_instances)
        check_vllm_args(self.vllm_args)
        try:
            check_mode(self.nixl_progress)
        except ValueError as e:
            raise StackError(str(e)) from None
        if self.nixl_progress == "off":  # no progress thread: an option of kvlens' connector (spinners.OFF_OPTION)
            if self.stock:
                raise StackError("--nixl-progress off needs kvlens' connector (vLLM's own does not expose it)")
            self.connector_options = {**(self.connector_options or {}), **OFF_OPTION}
        if self.kv_load_failure_policy not in (None, "fail", "recompute"):
            raise StackError(f"kv_load_failure_policy must be fail or recompute, got {self.kv_load_failure_policy!r}")
        self.routers = parse_routers(self.routers)
        self.check_links()
        self.kvlens_home = Path(self.kvlens_home).resolve() if self.kvlens_home else kvconfig.home()
        self.api_key = self.api_key or env_api_key()
        check_routers(self.routers, self.mode, self.api_key, self.separate_homes, self.collector)
        if self.log_dir is None:
            tag = (
                f"{'+'.join(self.modes)}{'-stock' if self.stock else ''}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            )
            self.log_dir = Path(self.kvlens_home) / "runs" / tag
        self.log_dir = Path(self.log_dir).resolve()

    def check_links(self) -> None:
        """Parse ``links`` into ``link_shapes`` (StackError on a bad spec, before anything
        starts) and check they fit ``hosts``, as ``store_command`` must (:func:`~kvlens.stack.netstack.check_store`)."""
        self.link_shapes = parse_links(self.links)
        if self.link_shapes and not self.hosts:
            raise StackError("--link needs --hosts (the links join the roles' network namespaces)")
        if self.hosts and "vllm-router" in self.routers:
            raise StackError("--hosts runs kvlens' router only (vllm-router is not placed in a namespace)")
        check_store(self.store_command, self.hosts, self.separate_homes, self.collector, self.collector_store)

    @property
    def mixed(self) -> bool:
        """Push and pull pairs together behind one router (a canary)."""
        return len(self.modes) > 1

    def mode_of(self, role: str, index: int) -> str:
        """The mode of the ``index``-th P or D (a mixed fleet numbers push's first)."""
        n = self.per_mode[0 if role == "prefill" else 1]
        return self.modes[min(index // n, len(self.modes) - 1)]

    def env(self, role: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env_extra``, then ``extra`` (the topology's), then ``role_env[role]``."""
        return {**(self.env_extra or {}), **(extra or {}), **((self.role_env or {}).get(role) or {})}

    @property
    def default_timeout_s(self) -> float:
        """``start``'s default seconds: more per TP rank (:func:`~kvlens.stack.tp.startup_timeout_s`)."""
        return startup_timeout_s(engine_processes(self.prefill_tp, self.decode_tp))  # type: ignore[arg-type]

    @property
    def router_key(self) -> str | None:
        """What kvlens' router asks its clients for (``kvlens proxy``'s rule):
        the token its environment gives it (``$KVLENS_TOKEN``, inherited from
        ours), else the stack's API key, else None."""
        return kvconfig.client_token() or self.api_key

    @property
    def open_bind(self) -> bool:
        """Whether the router and the collector get ``--insecure``: ``kvlens up
        --insecure`` (a host beyond loopback with no token, on purpose), or a
        ``--hosts`` stack with no token: its 198.18.N.0/24 addresses live on a
        bridge in the stack's own namespaces, with no route out, reachable from
        this host alone (docs/links.md), as loopback is. ``kvlens up --hosts``
        itself refuses that case unless ``--insecure`` is given
        (:func:`kvlens.up.check_hosts`); this is the :class:`~kvlens.stack.launch.Stack` API's rule."""
        return bool(self.insecure or (self.hosts and not kvconfig.client_token()))
