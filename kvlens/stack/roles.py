"""What each child of a :class:`~kvlens.stack.launch.Stack` runs (its
:class:`Roles`): a P or D vLLM server, kvlens' router, vLLM's
``vllm-router`` and the OTLP collector, each a
:class:`~kvlens.stack.supervise.Child` with its command line (from
:mod:`kvlens.stack.commands`), environment, log file and health URL; and the
P and D instances and the topology they are built from. Builds only, from
the stack's spec and network; :class:`~kvlens.stack.children.Children` starts them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import quote

from kvlens.stack import pinning
from kvlens.stack.commands import (
    api_key_env,
    base_env,
    collector_argv,
    find_vllm_router,
    kv_transfer_config,
    router_argv,
    server_env,
    vllm_argv,
    vllm_router_argv,
    without_store_password,
)
from kvlens.stack.instances import Instance, child_name, port_names
from kvlens.stack.netstack import StackNetwork
from kvlens.stack.spec import StackSpec
from kvlens.stack.supervise import Child
from kvlens.stack.topology import Topology
from kvlens.stack.tp import tp_args
from kvrecord import config as kvconfig


def otlp_token_env(topo, given: Mapping[str, str]) -> dict[str, str]:
    """With separate homes and ``$KVLENS_TOKEN`` set: the header vLLM's own
    OTLP exporter (``--otlp-traces-endpoint``) sends to the collector, which
    asks for the token (the connector's exporter sends ``$KVLENS_TOKEN``
    itself). In the environment, as the OpenTelemetry SDK reads it, never on a
    command line. Headers the caller set (either variable, in ``given``: our
    environment and the role's) win: they are left as they are."""
    token = kvconfig.ingest_token()
    mine = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
    if not topo.separate or not token or any(given.get(k) for k in mine):
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "authorization=" + quote(f"Bearer {token}", safe="")}


class Roles:
    """A stack's children, built: from its ``spec``, placed by its
    ``network`` (each role's address, namespace and UCX environment), with
    the pids ``pid_of`` knows (a started instance's, by child name)."""

    def __init__(self, spec: StackSpec, network: StackNetwork, pid_of: Callable[[str], int | None]) -> None:
        self.spec = spec
        self.network = network
        self.pid_of = pid_of

    @property
    def topology(self) -> Topology:
        spec, network = self.spec, self.network
        return Topology(
            Path(spec.kvlens_home),
            network.role_host("router"),
            int(spec.port or 0),
            spec.separate_homes,
            spec.collector,
            spec.collector_port,
            network.collector_store(),
            kvlens_router="kvlens" in spec.routers,
            collector_host=network.role_host("collector"),
        )

    def instance(self, role: str, index: int) -> Instance:
        """The ``index``-th P or D: its address, ports (the first's given or picked,
        the others' from ``more_ports``), pid once started, TP size and mode."""
        spec = self.spec
        if index == 0:
            port = spec.prefill_port if role == "prefill" else spec.decode_port
            side = spec.prefill_side_port if role == "prefill" else spec.decode_side_port
        else:
            port, side = (spec.more_ports.get(n) for n in port_names(role, index))
        tp = (spec.prefill_tp if role == "prefill" else spec.decode_tp)[index]  # type: ignore[index]
        host, pid = self.network.role_host(role, index), self.pid_of(child_name(role, index))
        return Instance(role, index, host, port, side, pid, tp, spec.mode_of(role, index))

    @property
    def prefills(self) -> list[Instance]:
        """Every P instance (URL, engine id, ports, pid once started), first first."""
        return [self.instance("prefill", i) for i in range(self.spec.prefill_instances)]

    @property
    def decodes(self) -> list[Instance]:
        """Every D instance, first first."""
        return [self.instance("decode", i) for i in range(self.spec.decode_instances)]

    def server(self, role: str, index: int = 0) -> Child:
        """The ``index``-th P or D: its own HTTP and side-channel ports,
        Prometheus dir, log and CPU (:func:`~kvlens.stack.pinning.cpu_binding`)."""
        spec = self.spec
        inst = self.instance(role, index)
        prom = Path(spec.log_dir) / f"prometheus-{inst.name}"
        shutil.rmtree(prom, ignore_errors=True)
        prom.mkdir(parents=True)
        topo = self.topology
        home = topo.home_for(role)
        tps = {"prefill": spec.prefill_tp, "decode": spec.decode_tp}
        cpus = pinning.cpu_binding(role, index, spec.prefill_instances, spec.decode_instances, tps=tps)
        options, secret = without_store_password(spec.connector_options)  # a password in the environment only
        env = server_env(
            base_env(home),
            role == "prefill",
            inst.host,
            inst.side_port,
            prom,
            spec.env(
                role,
                {
                    **self.network.ucx_env(),
                    **topo.server_env(role),
                    **otlp_token_env(topo, {**os.environ, **spec.env(role)}),
                    **api_key_env(spec.api_key),
                    **secret,
                },
            ),
            cpus,
        )
        ktc = kv_transfer_config(
            inst.mode,
            role,
            inst.engine_id,
            spec.stock,
            home,
            spec.kv_lease_s,
            spec.push_registration_timeout_s,
            topo.traces_url,
            spec.kv_load_failure_policy,
            options,
        )
        argv = vllm_argv(
            Path(spec.model), inst.host, inst.port, ktc, [*tp_args(inst.tp), *spec.vllm_args, *topo.server_args(role)]
        )
        return self.network.child(inst.name, argv, env, inst.url, inst.engine_id, writes=(home, prom))

    def router(self, dispatch: str, port: int, name: str = "router") -> Child:
        spec = self.spec
        topo = self.topology
        prefills, decodes = self.prefills, self.decodes
        argv = router_argv(
            [(p.url, p.engine_id, p.side_port, p.tp) for p in prefills],
            [(d.url, d.engine_id) for d in decodes],
            spec.mode,
            dispatch,
            self.network.role_host("router"),
            port,
            modes=([p.mode for p in prefills], [d.mode for d in decodes]) if spec.mixed else None,
            split=spec.split,
            side_hosts=[p.host for p in prefills],
        )
        # only the main router hosts the receiver (``--collect``); extra routers export to it
        hosts_receiver = name == "router"
        if hosts_receiver:
            argv += topo.router_args()
        if spec.open_bind:
            argv.append("--insecure")
        env = base_env(topo.home_for("router"))
        extra = topo.router_env()
        if topo.separate and topo.collector == "router" and not hosts_receiver:
            extra = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": str(topo.collector_url),
                "KVLENS_HANDOFF_FROM": "off",
                kvconfig.COLLECTORS_ENV: str(topo.collector_url),
            }
        if extra.get("OTEL_EXPORTER_OTLP_ENDPOINT"):  # it exports to a collector that may ask for the token
            extra.update(otlp_token_env(topo, {**os.environ, **spec.env("router")}))
        env.update(spec.env("router", {**extra, **api_key_env(spec.api_key)}))
        url = f"http://{self.network.role_host('router')}:{port}"
        return self.network.child(name, argv, env, url, "router", writes=(topo.home_for("router"),))

    def vllm_router(self) -> Child:
        """vLLM's own router in front of every P and D (pull only; a StackError
        when it is not installed). Its environment: the router role's."""
        spec = self.spec
        port = int(spec.vllm_router_port or 0)
        argv = vllm_router_argv(
            find_vllm_router(),
            [p.url for p in self.prefills],
            [d.url for d in self.decodes],
            spec.host,
            port,
            int(spec.vllm_router_metrics_port or 0),
        )
        env = base_env(self.topology.home_for("router"))
        env.update(spec.env("router"))
        return self.network.child("vllm-router", argv, env, f"http://{spec.host}:{port}")

    def collector(self) -> Child:
        spec = self.spec
        topo = self.topology
        env = base_env(topo.home_for("collector"))
        # the store's password (if its URL has one) in the environment: ps shows argv
        env.update(spec.env("collector", {**topo.collector_env(), **topo.store.password_env()}))
        argv = collector_argv(self.network.role_host("collector"), int(spec.collector_port), topo.store)
        if spec.open_bind:
            argv.append("--insecure")
        return self.network.child(
            "collector", argv, env, str(topo.collector_url), "collector", (topo.home_for("collector"),)
        )
