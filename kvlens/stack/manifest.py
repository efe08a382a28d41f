"""``stack.json``: what a running :class:`~kvlens.stack.launch.Stack` is
(URLs, ports, engine ids, every instance, process groups), for other tools
and for :mod:`kvlens.stack.leftovers` (which reads ``ports``, ``pids``,
``processes`` and ``supervisor``). Written at each child's start and once
ready; blocking file write on the calling thread.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvlens.stack.commands import CONNECTORS
from kvlens.stack.leftovers import processes_record


def _ports(stack) -> dict:
    """Every port the stack uses, flat (name -> int or None): the first P and
    D under the names a one-pair stack always used, the others by engine id."""
    ports = {
        "router": stack.port if "kvlens" in stack.routers else None,
        "prefill": stack.prefill_port,
        "decode": stack.decode_port,
        "prefill_side_channel": stack.prefill_side_port,
        "decode_side_channel": stack.decode_side_port,
    }
    for inst in [*stack.prefills[1:], *stack.decodes[1:]]:
        ports[inst.engine_id] = inst.port
        ports[f"{inst.engine_id}_side_channel"] = inst.side_port
    if "vllm-router" in stack.routers:
        ports["vllm_router"] = stack.vllm_router_port
        ports["vllm_router_metrics"] = stack.vllm_router_metrics_port
    return ports


def manifest(stack) -> dict:
    """What ``stack.json`` holds (the format other tools read). The
    one-pair keys (``prefill_url``, ``engine_ids``, ...) name the first P
    and D; ``instances`` lists all of them."""
    return {
        "mode": stack.mode,  # "push,pull" for a mixed fleet (each instance names its own)
        "modes": list(stack.modes),
        "per_mode": {"prefill": stack.per_mode[0], "decode": stack.per_mode[1]} if stack.mixed else None,
        "dispatch": stack.dispatch,
        "stock": stack.stock,
        "connector": CONNECTORS[(stack.modes[0], stack.stock)][0]
        if not stack.mixed
        else {m: CONNECTORS[(m, stack.stock)][0] for m in stack.modes},
        "model": str(stack.model),
        "kvlens_home": str(stack.kvlens_home),
        "log_dir": str(stack.log_dir),
        "routers": list(stack.routers),
        "router_url": stack.router_url,
        "vllm_router_url": stack.vllm_router_url or None,
        "prefill_url": stack.prefill_url,
        "decode_url": stack.decode_url,
        "ports": _ports(stack),
        "engine_ids": {"prefill": "p0", "decode": "d0"},
        "instances": {"prefill": [i.record() for i in stack.prefills], "decode": [i.record() for i in stack.decodes]},
        "store": stack.store.without_password().text,  # a URL's password never in a file
        "collector_url": stack.collector_url,
        "homes": {r: str(stack.topology.home_for(r)) for r in ("prefill", "decode", "router", "collector")},
        "pids": {c.name: c.proc.pid for c in stack.children if c.proc is not None},
        **processes_record(stack.children),  # groups, members' command lines (kvlens.stack.leftovers)
        "api_key": bool(stack.api_key),  # whether the servers require one (never the key)
        "logs": {c.name: str(c.log) for c in stack.children},
        "startup_s": stack.startup_s,
        # NIXL's spinning progress threads: what was demoted, per server (kvlens.stack.spinners)
        "nixl_progress": stack.progress.to_json() if stack.progress is not None else {"mode": stack.nixl_progress},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **_network(stack),
    }


def _network(stack) -> dict:
    """``network`` of a ``kvlens up --hosts`` stack (:meth:`kvlens.stack.netns.Net.to_json`:
    namespaces, addresses, each link asked and measured) with the delayers' CPU and deaths."""
    net = getattr(stack, "net", None)
    if net is None:
        return {}
    return {
        "network": {
            **net.to_json(),
            "delayer_cpu_s": stack.delayer_cpu_s(),
            "delayers_dead": sorted(stack.network.dead_delayers),
        }
    }


def scrape_targets(stack) -> dict[str, list[str]]:
    """Prometheus jobs -> ``host:port`` targets: kvlens' routers, the
    collector, vLLM's router's exporter, every P and every D."""
    hostport = lambda u: u.split("://", 1)[-1].rstrip("/")  # noqa: E731
    kvlens_routers = [stack.router_url] if "kvlens" in stack.routers else []
    jobs = {}
    if kvlens_routers or stack.extra_routers:
        jobs["kvlens-router"] = [hostport(u) for u in [*kvlens_routers, *stack.extra_routers.values()]]
    if stack.separate_homes and stack.collector == "process":
        jobs["kvlens-collector"] = [hostport(stack.collector_url)]
    if "vllm-router" in stack.routers:
        jobs["vllm-router"] = [f"{stack.host}:{stack.vllm_router_metrics_port}"]
    jobs["vllm-prefill"] = [hostport(p.url) for p in stack.prefills]
    jobs["vllm-decode"] = [hostport(d.url) for d in stack.decodes]
    return jobs


def scrape_credentials(stack) -> dict[str, str]:
    """Prometheus jobs -> the bearer token their ``/metrics`` asks for: kvlens'
    routers (:attr:`Stack.router_key`) and the collector (``$KVLENS_TOKEN``);
    vLLM's ``/metrics`` needs none (its ``--api-key`` guards ``/v1`` only)."""
    from kvrecord.config import client_token

    out = {}
    if stack.router_key and ("kvlens" in stack.routers or stack.extra_routers):
        out["kvlens-router"] = stack.router_key
    if client_token() and stack.separate_homes and stack.collector == "process":
        out["kvlens-collector"] = client_token()
    return out


def write(stack) -> None:
    p = Path(stack.log_dir) / "stack.json"
    p.write_text(json.dumps(manifest(stack), indent=2) + "\n")
