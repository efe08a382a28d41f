""":class:`Stack`: vLLM P and D instances (one of each by default, up to
:data:`~kvlens.stack.instances.MAX_INSTANCES` of each) plus a router (kvlens',
vLLM's ``vllm-router``, or both), started together.

It starts the P and D instances concurrently (in waves, largest TP first,
when their TP sizes differ) and then the routers (command
lines from :mod:`kvlens.stack.commands`), waits for health, re-pins the
workers' CPUs (:mod:`kvlens.stack.pinning`), warms every instance up and
writes ``stack.json`` (:mod:`kvlens.stack.manifest`, at each child's start
too: :mod:`kvlens.stack.leftovers` reads it). A ``hosts`` stack's network
and links are its mixin :class:`~kvlens.stack.netstack.StackNetwork`'s. With
an API key, P, D and the router require it and the stack's calls send it.
Tests and the benchmark start a stack in-process with it
(``with Stack("push") as s: ... s.router_url``). Its methods block the
calling thread; ``start`` may take minutes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from frontdoor.flags import env_api_key
from kvrecord import config as kvconfig
from kvrecord.ports import DEFAULT_HOST
from kvlens.stack import manifest as stack_manifest
from kvlens.stack import pinning
from kvlens.stack.commands import DEFAULT_KV_LEASE_S, DEFAULT_PUSH_REGISTRATION_TIMEOUT_S, auth_headers
from kvlens.stack.errors import StackError
from kvlens.stack.extras import StackExtras
from kvlens.stack.instances import (
    Instance,
    check_count,
    check_routers,
    child_name,
    parse_modes,
    parse_routers,
    port_names,
)
from kvlens.stack.netstack import StackNetwork
from kvlens.stack.preflight import preflight
from kvlens.stack.roles import StackRoles
from kvlens.stack import schedrec
from kvlens.stack.schedrec import SchedRecording
from kvlens.stack.spinners import OFF_OPTION, ProgressThreads, check_mode, resolve_mode
from kvlens.stack.supervise import Child, stop_children, wait_healthy
from kvlens.stack.topology import COLLECTORS, Topology
from kvlens.stack.tp import check_tp, check_vllm_args, engine_processes, per_mode_tp, start_waves
from kvlens.stack.tp import startup_timeout_s, tp_note
from kvlens.stack.warmup import warm_up, where_stuck

logger = logging.getLogger("kvlens.up")


@dataclass
class Stack(StackRoles, StackExtras, StackNetwork):
    """P and D instances plus router(s). ``start()`` blocks until all are
    healthy. ``prefill_port`` / ``prefill_side_port`` (and D's) are the first
    instance's; the others get free ports. ``routers``: ``"kvlens"``,
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
    prometheus_server: Any = None
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

    # filled by start()
    router_url: str = ""  #: kvlens' router; vLLM's when it runs alone
    vllm_router_url: str = ""
    prefill_url: str = ""  #: the first P (``prefills`` lists all)
    decode_url: str = ""  #: the first D (``decodes`` lists all)
    #: ports of the instances after the first, by :func:`~kvlens.stack.instances.port_names`
    more_ports: dict[str, int] = field(default_factory=dict, repr=False)
    children: list[Child] = field(default_factory=list)
    startup_s: float | None = None
    progress: ProgressThreads | None = field(default=None, repr=False)
    extra_routers: dict[str, str] = field(default_factory=dict, repr=False)
    #: the modes (one, or push and pull: a mixed fleet) and the P and D count of each
    modes: tuple[str, ...] = field(default=(), init=False)
    per_mode: tuple[int, int] = field(default=(1, 1), init=False)
    net: Any = field(default=None, repr=False)  #: the :class:`~kvlens.stack.netns.Net` of a ``hosts`` stack
    _dead_delayers: set = field(default_factory=set, repr=False)
    sched: SchedRecording | None = field(default=None, repr=False)  #: the kernel's record, with ``sched_trace``

    def __post_init__(self) -> None:
        self.modes = parse_modes(self.mode)
        self.mode = ",".join(self.modes)
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
        self._check_links()
        self.kvlens_home = Path(self.kvlens_home).resolve() if self.kvlens_home else kvconfig.home()
        self.api_key = self.api_key or env_api_key()
        check_routers(self.routers, self.mode, self.api_key, self.separate_homes, self.collector)
        if self.log_dir is None:
            tag = (
                f"{'+'.join(self.modes)}{'-stock' if self.stock else ''}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            )
            self.log_dir = Path(self.kvlens_home) / "runs" / tag
        self.log_dir = Path(self.log_dir).resolve()

    @property
    def mixed(self) -> bool:
        """Push and pull pairs together behind one router (a canary)."""
        return len(self.modes) > 1

    def mode_of(self, role: str, index: int) -> str:
        """The mode of the ``index``-th P or D (a mixed fleet numbers push's first)."""
        n = self.per_mode[0 if role == "prefill" else 1]
        return self.modes[min(index // n, len(self.modes) - 1)]

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _say(self, msg: str) -> None:
        (logger.info if self.quiet else lambda m: print(f"[kvlens up] {m}", flush=True))(msg)

    # -------------------------------------------------------------- start
    def preflight(self) -> None:
        """Checks that need no child: model dir and ports (:func:`~kvlens.stack.preflight.preflight`)."""
        preflight(self)

    @property
    def topology(self) -> Topology:
        return Topology(
            Path(self.kvlens_home),
            self.role_host("router"),
            int(self.port or 0),
            self.separate_homes,
            self.collector,
            self.collector_port,
            self._collector_store(),
            kvlens_router="kvlens" in self.routers,
            collector_host=self.role_host("collector"),
        )

    def _instance(self, role: str, index: int) -> Instance:
        if index == 0:
            port = self.prefill_port if role == "prefill" else self.decode_port
            side = self.prefill_side_port if role == "prefill" else self.decode_side_port
        else:
            port, side = (self.more_ports.get(n) for n in port_names(role, index))
        name = child_name(role, index)
        pid = next((c.proc.pid for c in self.children if c.name == name and c.proc is not None), None)
        tp = (self.prefill_tp if role == "prefill" else self.decode_tp)[index]  # type: ignore[index]
        return Instance(role, index, self.role_host(role, index), port, side, pid, tp, self.mode_of(role, index))

    @property
    def prefills(self) -> list[Instance]:
        """Every P instance (URL, engine id, ports, pid once started), first first."""
        return [self._instance("prefill", i) for i in range(self.prefill_instances)]

    @property
    def decodes(self) -> list[Instance]:
        """Every D instance, first first."""
        return [self._instance("decode", i) for i in range(self.decode_instances)]

    def _env(self, role: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env_extra``, then ``extra`` (the topology's), then ``role_env[role]``."""
        return {**(self.env_extra or {}), **(extra or {}), **((self.role_env or {}).get(role) or {})}

    def _spawn(self, c: Child) -> Child:
        """Start ``c``, keep it, and record it in ``stack.json`` at once."""
        c.start()
        self.children.append(c)
        self._write_manifest()
        return c

    @property
    def default_timeout_s(self) -> float:
        """``start``'s default seconds: more per TP rank (:func:`~kvlens.stack.tp.startup_timeout_s`)."""
        return startup_timeout_s(engine_processes(self.prefill_tp, self.decode_tp))  # type: ignore[arg-type]

    def start(self, timeout: float | None = None) -> "Stack":
        """Start every P and D at once, wait for health, re-pin their
        workers, start the router(s), warm up, start Prometheus if asked,
        write ``stack.json``. ``timeout``: seconds for all of it (default
        :attr:`default_timeout_s`). On any failure everything started is
        stopped and the error (StackError mostly) propagates."""
        t0 = time.monotonic()
        timeout = self.default_timeout_s if timeout is None else timeout
        self._check_network_tools()
        if self.sched_trace:
            schedrec.check()  # perf and root, before minutes of start-up
        self.preflight()
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        Path(self.kvlens_home).mkdir(parents=True, exist_ok=True)
        auth = auth_headers(self.api_key)
        try:
            if self.hosts:
                self._start_network(t0 + timeout)
            if self.separate_homes and self.collector == "process":
                wait_healthy([self._spawn(self._collector())], t0 + timeout, self._say, auth)
            servers = [self._server(i.role, i.index) for i in [*self.prefills, *self.decodes]]
            self.prefill_url, self.decode_url = self.prefills[0].url, self.decodes[0].url
            self._say(
                f"starting {self.mode} {self.prefill_instances}P x {self.decode_instances}D"
                f"{tp_note(self.prefill_tp, self.decode_tp)} ({'stock' if self.stock else 'instrumented'} "
                f"connector) model={self.model} logs={self.log_dir}"
            )
            self._start_servers(servers, t0 + timeout, auth)
            self._start_routers(t0 + timeout)
            if self.warmup:
                for mode in self.modes:  # every pair's handshake; a mixed fleet's one mode at a time
                    n_p, n_d = self.per_mode
                    self._warm_up(rounds=n_p * n_d, mode=mode if self.mixed else None, deadline=t0 + timeout)
            if self.prometheus:
                self.start_prometheus(self.prometheus_port)
            if self.sched_trace:  # after the warm-up: the record holds serving, not start-up
                self.record_sched()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self._write_manifest()
        self._say(f"ready in {self.startup_s:.0f}s")
        return self

    def _start_servers(self, servers: list[Child], deadline: float, auth: Mapping[str, str]) -> None:
        """Spawn P and D in waves (largest TP first, :func:`~kvlens.stack.tp.start_waves`),
        each health-waited; re-pin every poll (a ready engine's workers spin on vLLM's
        pinned core and starved a still-starting one for 10+ min: pinning's docstring)
        and demote a ready server's NIXL progress threads (:mod:`~kvlens.stack.spinners`)."""
        processes = engine_processes(self.prefill_tp, self.decode_tp)  # type: ignore[arg-type]
        self.progress = ProgressThreads(
            resolve_mode(self.nixl_progress, processes, len(pinning.available_cpus())), self._say
        )
        by_name = {c.name: c for c in servers}

        def each_poll(c: Child) -> None:
            pinning.repin(c, pinning.quiet)  # its workers may not exist yet
            self.progress.on_poll(c)

        waves = start_waves([(i.name, i.tp) for i in [*self.prefills, *self.decodes]])
        for n, wave in enumerate(waves):
            if len(waves) > 1:
                self._say(f"start-up wave {n + 1}/{len(waves)}: {', '.join(wave)} (largest TP first)")
            for name in wave:
                self._spawn(by_name[name])
            wait_healthy([by_name[name] for name in wave], deadline, self._say, auth, each_poll=each_poll)
            for name in wave:
                pinning.repin(by_name[name], self._say)
                self.progress.on_poll(by_name[name])
        self.progress.restore()

    def _start_routers(self, deadline: float) -> None:
        """kvlens' router and/or vLLM's, started together, health-waited."""
        started = []
        if "kvlens" in self.routers:
            started.append(r := self._spawn(self._router(self.dispatch, int(self.port))))
            self.router_url = r.url
        if "vllm-router" in self.routers:
            started.append(v := self._spawn(self._vllm_router()))
            self.vllm_router_url = v.url
            self.router_url = self.router_url or v.url
        wait_healthy(started, deadline, self._say, auth_headers(self.router_key))

    def _warm_up(
        self,
        tries: int = 3,
        timeout_s: float = 90.0,
        rounds: int = 1,
        mode: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """Tiny requests through :attr:`router_url` before reporting ready
        (:func:`kvlens.stack.warmup.warm_up`); ``mode``: a mixed fleet's
        half they go to (``X-Kvlens-Mode``: no draw, so no canary trace);
        ``deadline``: the start timeout, past which it fails naming the stuck side."""
        headers = {**auth_headers(self.router_key), **({"X-Kvlens-Mode": mode} if mode else {})}
        warm_up(
            self.router_url,
            headers,
            self._say,
            self.dead_child,
            tries,
            timeout_s,
            rounds,
            deadline=deadline,
            where_stuck=lambda tid: where_stuck(self.store, tid),
        )

    def record_sched(self, folder: Path | str | None = None) -> SchedRecording:
        """Start keeping the kernel's scheduler record of this running stack
        in ``folder`` (default ``<log_dir>/sched``): what ``--sched-trace``
        does once the stack is ready. Returned started (a context manager
        that stops it); :meth:`stop` stops it too."""
        if self.sched is not None:
            self.sched.stop()
        self.sched = SchedRecording(Path(folder or Path(self.log_dir) / "sched"), self.pids(), self._say).start()
        return self.sched

    @property
    def router_key(self) -> str | None:
        """What kvlens' router asks its clients for (``kvlens proxy``'s rule):
        the token its environment gives it (``$KVLENS_TOKEN``, inherited from
        ours), else the stack's API key, else None."""
        return kvconfig.client_token() or self.api_key

    @property
    def store(self) -> kvconfig.StoreLocation:
        """Where this stack's traces join (:attr:`Topology.store`)."""
        return self.topology.store

    @property
    def collector_url(self) -> str | None:
        """The OTLP receiver's base URL (``/v1/traces``, ``/metrics``), if any."""
        return self.topology.collector_url

    # ---------------------------------------------------------- run, stop
    def dead_child(self, delayers: bool = False) -> Child | None:
        """The first child that exited. A link delayer's death is not the
        stack's (``delayers`` False): its packets then pass undelayed
        (``--queue-bypass``), which is said loudly, once, and recorded in ``stack.json``."""
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                if c.name.startswith("delay-") and not delayers:
                    self._delayer_died(c)
                    continue
                return c
        return None

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None]

    def stop(self) -> None:
        """Stop the kernel's record, Prometheus and every child (newest first). Idempotent."""
        if self.sched is not None:
            try:
                self.sched.stop()
            finally:
                self.sched = None
        if self.prometheus_server is not None:
            try:
                self.prometheus_server.stop()
            finally:
                self.prometheus_server = None
        if self.children:
            self._record_network()
            stop_children(list(reversed(self.children)))
            self._say("stopped")
        self.children = []
        self._stop_network()

    def manifest(self) -> dict:
        """What ``stack.json`` holds (:func:`kvlens.stack.manifest.manifest`)."""
        return stack_manifest.manifest(self)

    def _write_manifest(self) -> None:
        stack_manifest.write(self)
