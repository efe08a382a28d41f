"""What each child of a :class:`~kvlens.stack.launch.Stack` runs (its mixin
:class:`StackRoles`): a P or D vLLM server, kvlens' router, vLLM's
``vllm-router`` and the OTLP collector, each a
:class:`~kvlens.stack.supervise.Child` with its command line (from
:mod:`kvlens.stack.commands`), environment, log file and health URL. Builds
only; :meth:`Stack._spawn` starts them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping
from urllib.parse import quote

from kvlens.stack import pinning
from kvlens.stack.commands import (
    REPO_ROOT,
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
from kvlens.stack.sudo import as_user, hand_over, sudo_user, user_env
from kvlens.stack.supervise import Child
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


class StackRoles:
    """Methods of :class:`~kvlens.stack.launch.Stack` (its fields,
    ``topology``, ``_instance``, ``prefills`` / ``decodes`` and ``_env``)
    that build its children."""

    def _child(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        url: str,
        key: str | None = None,
        writes: tuple[Path, ...] | None = None,
    ) -> Child:
        """A child logging to ``<log_dir>/<name>.log``, run from the repository
        root; on a ``hosts`` stack in the network namespace of ``key`` (``p0``,
        ``router``, ...: ``ip netns exec`` execs the command in place, so the
        pid and its process group stay the child's). ``writes``: a server's
        directories; given, under ``sudo`` the server runs as the invoking
        user, who is handed them first (:mod:`kvlens.stack.sudo`)."""
        if key is not None and self.net is not None:
            user = sudo_user() if writes is not None else None
            if user is not None:
                hand_over(user, *writes)
                argv, env = as_user(user, argv), user_env(user, env)
            argv = ["ip", "netns", "exec", self.net.ns(key), *argv]
        return Child(name, argv, env, Path(self.log_dir) / f"{name}.log", url, cwd=str(REPO_ROOT))

    def _net_env(self) -> dict[str, str]:
        """On a ``hosts`` stack: UCX (NIXL's transport) over TCP on the
        namespace's veth only. Left to itself UCX picks shared memory or
        CMA between processes of one machine, and the link would be bypassed."""
        if self.net is None:
            return {}
        from kvlens.stack.netns import IFACE

        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": IFACE}

    def _server(self, role: str, index: int = 0) -> Child:
        """The ``index``-th P or D: its own HTTP and side-channel ports,
        Prometheus dir, log and CPU (:func:`~kvlens.stack.pinning.cpu_binding`)."""
        inst = self._instance(role, index)
        prom = Path(self.log_dir) / f"prometheus-{inst.name}"
        shutil.rmtree(prom, ignore_errors=True)
        prom.mkdir(parents=True)
        topo = self.topology
        home = topo.home_for(role)
        tps = {"prefill": self.prefill_tp, "decode": self.decode_tp}
        cpus = pinning.cpu_binding(role, index, self.prefill_instances, self.decode_instances, tps=tps)
        options, secret = without_store_password(self.connector_options)  # a password in the environment only
        env = server_env(
            base_env(home),
            role == "prefill",
            inst.host,
            inst.side_port,
            prom,
            self._env(
                role,
                {
                    **self._net_env(),
                    **topo.server_env(role),
                    **otlp_token_env(topo, {**os.environ, **self._env(role)}),
                    **api_key_env(self.api_key),
                    **secret,
                },
            ),
            cpus,
        )
        ktc = kv_transfer_config(
            inst.mode,
            role,
            inst.engine_id,
            self.stock,
            home,
            self.kv_lease_s,
            self.push_registration_timeout_s,
            topo.traces_url,
            self.kv_load_failure_policy,
            options,
        )
        argv = vllm_argv(
            Path(self.model), inst.host, inst.port, ktc, [*tp_args(inst.tp), *self.vllm_args, *topo.server_args(role)]
        )
        return self._child(inst.name, argv, env, inst.url, inst.engine_id, writes=(home, prom))

    def _router(self, dispatch: str, port: int, name: str = "router") -> Child:
        topo = self.topology
        argv = router_argv(
            [(p.url, p.engine_id, p.side_port, p.tp) for p in self.prefills],
            [(d.url, d.engine_id) for d in self.decodes],
            self.mode,
            dispatch,
            self.role_host("router"),
            port,
            modes=([p.mode for p in self.prefills], [d.mode for d in self.decodes]) if self.mixed else None,
            split=self.split,
            side_hosts=[p.host for p in self.prefills],
        )
        # only the main router hosts the receiver (``--collect``); extra routers export to it
        hosts_receiver = name == "router"
        if hosts_receiver:
            argv += topo.router_args()
        if self.open_bind:
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
            extra.update(otlp_token_env(topo, {**os.environ, **self._env("router")}))
        env.update(self._env("router", {**extra, **api_key_env(self.api_key)}))
        url = f"http://{self.role_host('router')}:{port}"
        return self._child(name, argv, env, url, "router", writes=(topo.home_for("router"),))

    def _vllm_router(self) -> Child:
        """vLLM's own router in front of every P and D (pull only; a StackError
        when it is not installed). Its environment: the router role's."""
        port = int(self.vllm_router_port or 0)
        argv = vllm_router_argv(
            find_vllm_router(),
            [p.url for p in self.prefills],
            [d.url for d in self.decodes],
            self.host,
            port,
            int(self.vllm_router_metrics_port or 0),
        )
        env = base_env(self.topology.home_for("router"))
        env.update(self._env("router"))
        return self._child("vllm-router", argv, env, f"http://{self.host}:{port}")

    @property
    def open_bind(self) -> bool:
        """Whether the router and the collector get ``--insecure``: ``kvlens up
        --insecure`` (a host beyond loopback with no token, on purpose), or a
        ``--hosts`` stack with no token: its 198.18.N.0/24 addresses live on a
        bridge in the stack's own namespaces, with no route out, reachable from
        this host alone (docs/links.md), as loopback is. ``kvlens up --hosts``
        itself refuses that case unless ``--insecure`` is given
        (:func:`kvlens.up.check_hosts`); this is the :class:`Stack` API's rule."""
        return bool(self.insecure or (getattr(self, "hosts", False) and not kvconfig.client_token()))

    def _collector(self) -> Child:
        topo = self.topology
        env = base_env(topo.home_for("collector"))
        # the store's password (if its URL has one) in the environment: ps shows argv
        env.update(self._env("collector", {**topo.collector_env(), **topo.store.password_env()}))
        argv = collector_argv(self.role_host("collector"), int(self.collector_port), topo.store)
        if self.open_bind:
            argv.append("--insecure")
        return self._child("collector", argv, env, str(topo.collector_url), "collector", (topo.home_for("collector"),))
