""":class:`Stack`: vLLM P and D instances (one of each by default, up to
:data:`~kvlens.stack.instances.MAX_INSTANCES` of each) plus a router (kvlens',
vLLM's ``vllm-router``, or both), started together.

It starts the P and D instances concurrently (in waves, largest TP first,
when their TP sizes differ) and then the routers (command
lines from :mod:`kvlens.stack.commands`), waits for health, re-pins the
workers' CPUs (:mod:`kvlens.stack.pinning`), warms every instance up and
writes ``stack.json`` (:mod:`kvlens.stack.manifest`, at each child's start
too: :mod:`kvlens.stack.leftovers` reads it). It is a facade over what it
is made of, each passed what it needs: its configuration
(:class:`~kvlens.stack.spec.StackSpec`, checked when the stack is made), its
children (:class:`~kvlens.stack.children.Children`), a ``hosts`` stack's
network and links (:class:`~kvlens.stack.netstack.StackNetwork`) and what
builds each child (:class:`~kvlens.stack.roles.Roles`). With
an API key, P, D and the router require it and the stack's calls send it.
Tests and the benchmark start a stack in-process with it
(``with Stack("push") as s: ... s.router_url``). Its methods block the
calling thread; ``start`` may take minutes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from kvrecord import config as kvconfig
from kvlens.stack import extras
from kvlens.stack import manifest as stack_manifest
from kvlens.stack import pinning
from kvlens.stack.children import Children
from kvlens.stack.commands import auth_headers
from kvlens.stack.instances import Instance
from kvlens.stack.netstack import StackNetwork
from kvlens.stack.preflight import preflight
from kvlens.stack import schedrec
from kvlens.stack.roles import Roles
from kvlens.stack.schedrec import SchedRecording
from kvlens.stack.spec import StackSpec
from kvlens.stack.spinners import ProgressThreads, resolve_mode
from kvlens.stack.supervise import Child, wait_healthy
from kvlens.stack.topology import Topology
from kvlens.stack.tp import engine_processes, start_waves, tp_note
from kvlens.stack.warmup import warm_up, where_stuck

logger = logging.getLogger("kvlens.up")


class Stack:
    """P and D instances plus router(s). ``start()`` blocks until all are
    healthy. Its keywords are its :class:`~kvlens.stack.spec.StackSpec`'s
    (checked there: a StackError names what is wrong), each also an
    attribute of the stack (read from, and set on, ``spec``); what start
    fills in (``router_url``, ``startup_s``, ...) is the stack's own.

    Made of: ``spec`` (the configuration), ``supervised`` (the
    :class:`~kvlens.stack.children.Children`, whose list is ``children``),
    ``network`` (the :class:`~kvlens.stack.netstack.StackNetwork`; its
    ``net`` is the stack's) and ``roles`` (the
    :class:`~kvlens.stack.roles.Roles` that build each child)."""

    def __init__(self, *args: Any, prometheus_server: Any = None, **config: Any) -> None:
        self.spec = StackSpec(*args, **config)
        self.supervised = Children(self.write_manifest, lambda c: self.network.delayer_died(c))
        self.network = StackNetwork(self.spec, self.say, self.supervised.spawn, self.dead_child, self.write_manifest)
        self.roles = Roles(self.spec, self.network, self.supervised.pid_of)
        self.prometheus_server = prometheus_server  #: :meth:`start_prometheus`'s server, stopped with the stack
        # filled by start()
        self.router_url = ""  #: kvlens' router; vLLM's when it runs alone
        self.vllm_router_url = ""
        self.prefill_url = ""  #: the first P (``prefills`` lists all)
        self.decode_url = ""  #: the first D (``decodes`` lists all)
        self.startup_s: float | None = None
        self.progress: ProgressThreads | None = None
        self.extra_routers: dict[str, str] = {}  #: dispatch -> URL of the routers :meth:`router_for` added
        self.sched: SchedRecording | None = None  #: the kernel's record (``sched_trace``, :meth:`record_sched`)

    def __repr__(self) -> str:
        return f"Stack({self.spec!r}, router_url={self.router_url!r})"

    @property
    def mixed(self) -> bool:
        """Push and pull pairs together behind one router (a canary)."""
        return self.spec.mixed

    def mode_of(self, role: str, index: int) -> str:
        """The mode of the ``index``-th P or D (a mixed fleet numbers push's first)."""
        return self.spec.mode_of(role, index)

    @property
    def children(self) -> list[Child]:
        """Every child started, oldest first (emptied by :meth:`stop`)."""
        return self.supervised.started

    @property
    def net(self):
        """The :class:`~kvlens.stack.netns.Net` of a started ``hosts`` stack, else None."""
        return self.network.net

    @net.setter
    def net(self, net) -> None:
        self.network.net = net

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def say(self, msg: str) -> None:
        """Print ``msg`` as ``kvlens up`` does (logged instead when ``quiet``)."""
        (logger.info if self.quiet else lambda m: print(f"[kvlens up] {m}", flush=True))(msg)

    # -------------------------------------------------------------- start
    def preflight(self) -> None:
        """Checks that need no child: model dir and ports (:func:`~kvlens.stack.preflight.preflight`)."""
        preflight(self)

    @property
    def topology(self) -> Topology:
        return self.roles.topology

    @property
    def prefills(self) -> list[Instance]:
        """Every P instance (URL, engine id, ports, pid once started), first first."""
        return self.roles.prefills

    @property
    def decodes(self) -> list[Instance]:
        """Every D instance, first first."""
        return self.roles.decodes

    def role_host(self, role: str, index: int = 0) -> str:
        """The address ``role`` binds and is reached at (:meth:`~kvlens.stack.netstack.StackNetwork.role_host`)."""
        return self.network.role_host(role, index)

    @property
    def default_timeout_s(self) -> float:
        """``start``'s default seconds: more per TP rank (:func:`~kvlens.stack.tp.startup_timeout_s`)."""
        return self.spec.default_timeout_s

    def start(self, timeout: float | None = None) -> "Stack":
        """Start every P and D at once, wait for health, re-pin their
        workers, start the router(s), warm up, start Prometheus if asked,
        write ``stack.json``. ``timeout``: seconds for all of it (default
        :attr:`default_timeout_s`). On any failure everything started is
        stopped and the error (StackError mostly) propagates."""
        t0 = time.monotonic()
        timeout = self.default_timeout_s if timeout is None else timeout
        self.network.check_tools()
        if self.sched_trace:
            schedrec.check()  # root and tracefs, before minutes of start-up
        self.preflight()
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        Path(self.kvlens_home).mkdir(parents=True, exist_ok=True)
        auth = auth_headers(self.api_key)
        spawn = self.supervised.spawn
        try:
            if self.hosts:
                self.network.start(t0 + timeout)
            if self.separate_homes and self.collector == "process":
                wait_healthy([spawn(self.roles.collector())], t0 + timeout, self.say, auth)
            servers = [self.roles.server(i.role, i.index) for i in [*self.prefills, *self.decodes]]
            self.prefill_url, self.decode_url = self.prefills[0].url, self.decodes[0].url
            self.say(
                f"starting {self.mode} {self.prefill_instances}P x {self.decode_instances}D"
                f"{tp_note(self.prefill_tp, self.decode_tp)} ({'stock' if self.stock else 'instrumented'} "
                f"connector) model={self.model} logs={self.log_dir}"
            )
            self._start_servers(servers, t0 + timeout, auth)
            self._start_routers(t0 + timeout)
            if self.warmup:
                for mode in self.modes:  # every pair's handshake; a mixed fleet's one mode at a time
                    n_p, n_d = self.per_mode
                    self.warm_up(rounds=n_p * n_d, mode=mode if self.mixed else None, deadline=t0 + timeout)
            if self.prometheus:
                self.start_prometheus(self.prometheus_port)
            if self.sched_trace:  # after the warm-up: the record holds serving, not start-up
                self.record_sched()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.write_manifest()
        self.say(f"ready in {self.startup_s:.0f}s")
        return self

    def _start_servers(self, servers: list[Child], deadline: float, auth: Mapping[str, str]) -> None:
        """Spawn P and D in waves (largest TP first, :func:`~kvlens.stack.tp.start_waves`),
        each health-waited; re-pin every poll (a ready engine's workers spin on vLLM's
        pinned core and starved a still-starting one for 10+ min: pinning's docstring)
        and demote a ready server's NIXL progress threads (:mod:`~kvlens.stack.spinners`)."""
        processes = engine_processes(self.prefill_tp, self.decode_tp)  # type: ignore[arg-type]
        self.progress = ProgressThreads(
            resolve_mode(self.nixl_progress, processes, len(pinning.available_cpus())), self.say
        )
        by_name = {c.name: c for c in servers}

        def each_poll(c: Child) -> None:
            pinning.repin(c, pinning.quiet)  # its workers may not exist yet
            self.progress.on_poll(c)

        waves = start_waves([(i.name, i.tp) for i in [*self.prefills, *self.decodes]])
        for n, wave in enumerate(waves):
            if len(waves) > 1:
                self.say(f"start-up wave {n + 1}/{len(waves)}: {', '.join(wave)} (largest TP first)")
            for name in wave:
                self.supervised.spawn(by_name[name])
            wait_healthy([by_name[name] for name in wave], deadline, self.say, auth, each_poll=each_poll)
            for name in wave:
                pinning.repin(by_name[name], self.say)
                self.progress.on_poll(by_name[name])
        self.progress.restore()

    def _start_routers(self, deadline: float) -> None:
        """kvlens' router and/or vLLM's, started together, health-waited."""
        started = []
        if "kvlens" in self.routers:
            started.append(r := self.supervised.spawn(self.roles.router(self.dispatch, int(self.port))))
            self.router_url = r.url
        if "vllm-router" in self.routers:
            started.append(v := self.supervised.spawn(self.roles.vllm_router()))
            self.vllm_router_url = v.url
            self.router_url = self.router_url or v.url
        wait_healthy(started, deadline, self.say, auth_headers(self.router_key))

    def warm_up(
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
            self.say,
            self.dead_child,
            tries,
            timeout_s,
            rounds,
            deadline=deadline,
            where_stuck=lambda tid: where_stuck(self.store, tid),
        )

    @property
    def router_key(self) -> str | None:
        """What kvlens' router asks its clients for (:attr:`~kvlens.stack.spec.StackSpec.router_key`)."""
        return self.spec.router_key

    @property
    def open_bind(self) -> bool:
        """Whether the router and the collector get ``--insecure`` (:attr:`~kvlens.stack.spec.StackSpec.open_bind`)."""
        return self.spec.open_bind

    @property
    def store(self) -> kvconfig.StoreLocation:
        """Where this stack's traces join (:attr:`Topology.store`)."""
        return self.topology.store

    @property
    def collector_url(self) -> str | None:
        """The OTLP receiver's base URL (``/v1/traces``, ``/metrics``), if any."""
        return self.topology.collector_url

    # ------------------------------------------------------ what it may add
    def add_router(self, dispatch: str, port: int | None = None, timeout: float = 60.0) -> str:
        """One more router on the same P/D (:func:`kvlens.stack.extras.add_router`); returns its URL."""
        return extras.add_router(self, dispatch, port, timeout)

    def router_for(self, dispatch: str) -> str:
        """A kvlens router with this dispatch, started on first use (:func:`kvlens.stack.extras.router_for`)."""
        return extras.router_for(self, dispatch)

    @property
    def sequential_router_url(self) -> str:
        return self.router_for("sequential")

    def start_prometheus(self, port: int = 9090, timeout: float = 60.0):
        """A real Prometheus scraping this stack (:func:`kvlens.stack.extras.start_prometheus`)."""
        return extras.start_prometheus(self, port, timeout)

    # ------------------------------------------------- its links (``hosts``)
    def probe_links(self, only=None) -> list[dict]:
        """Measure the shaped directions (:meth:`~kvlens.stack.netstack.StackNetwork.probe_links`)."""
        return self.network.probe_links(only)

    def reshape(self, spec: str, probe: bool = True) -> list[dict]:
        """Change shaped directions of a running ``hosts`` stack (:meth:`~kvlens.stack.netstack.StackNetwork.reshape`)."""
        return self.network.reshape(spec, probe)

    def delayer_cpu_s(self) -> dict[str, float | None]:
        """CPU seconds (user + system) each delayer used so far (None: gone)."""
        return self.network.delayer_cpu_s()

    def delayer_death(self, c: Child) -> str:
        """What is said of a link delayer that died."""
        return self.network.delayer_death(c)

    # ---------------------------------------------------------- run, stop
    def dead_child(self, delayers: bool = False) -> Child | None:
        """The first child that exited. A link delayer's death is not the
        stack's (``delayers`` False): its packets then pass undelayed
        (``--queue-bypass``), which is said loudly, once, and recorded in ``stack.json``."""
        return self.supervised.dead(delayers)

    def pids(self) -> list[int]:
        return self.supervised.pids()

    def record_sched(self, folder: Path | str | None = None, buffer_mb: int | None = None) -> SchedRecording:
        """Start keeping the kernel's scheduler record of this running stack
        in ``folder`` (default ``<log_dir>/sched``), in ``buffer_mb`` MiB of
        kernel memory (default ``sched_buffer_mb``): what ``--sched-trace``
        does once the stack is ready. Returned started (a context manager
        that stops it); :meth:`stop` stops it too."""
        if self.sched is not None:
            self.sched.stop()
        folder = Path(folder or Path(self.log_dir) / "sched")
        total_kb = (buffer_mb or self.sched_buffer_mb) * 1024
        self.sched = SchedRecording(folder, self.pids(), self.say, total_kb=total_kb).start()
        return self.sched

    def stop(self) -> None:
        """Stop the kernel's record, Prometheus and every child (newest first). Idempotent.
        The record ends first; it is written out last, once the children no longer take the CPUs."""
        sched, self.sched = self.sched, None
        try:
            if sched is not None:
                sched.freeze()
            if self.prometheus_server is not None:
                try:
                    self.prometheus_server.stop()
                finally:
                    self.prometheus_server = None
            if self.children:
                self.network.record_before_stop()
                self.supervised.stop()
                self.say("stopped")
            self.network.stop()
        finally:
            if sched is not None:
                sched.stop()

    def manifest(self) -> dict:
        """What ``stack.json`` holds (:func:`kvlens.stack.manifest.manifest`)."""
        return stack_manifest.manifest(self)

    def write_manifest(self) -> None:
        """Write ``stack.json`` under ``log_dir`` (:func:`kvlens.stack.manifest.write`)."""
        stack_manifest.write(self)


def _spec_field(name: str) -> property:
    """``Stack.<name>``: the spec's field, read and set there."""
    return property(
        lambda stack: getattr(stack.spec, name),
        lambda stack, value: setattr(stack.spec, name, value),
        doc=f"The spec's ``{name}`` (:class:`~kvlens.stack.spec.StackSpec`).",
    )


for _f in fields(StackSpec):  # mode, routers, log_dir, ports, ...: every field of the spec
    setattr(Stack, _f.name, _spec_field(_f.name))
del _f
