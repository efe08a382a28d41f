"""``kvlens up``: start real prefill (P) and decode (D) vLLM servers (one of
each, or ``--prefill-instances N --decode-instances M``, each at
tensor-parallel size ``--tp N`` or ``--prefill-tp`` / ``--decode-tp``) plus a router
(kvlens', vLLM's ``vllm-router``, or both: ``--router``), wait until all
answer ``/health``, print the endpoints, and stop everything on Ctrl-C /
SIGTERM.

The work is done by :mod:`kvlens.stack`; this module is the command line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvrecord.ports import DEFAULT_HOST
from kvlens.argtypes import from_parser, int_in, positive
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.commands import (
    DEFAULT_KV_LEASE_S,
    DEFAULT_PUSH_REGISTRATION_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    env_api_key,
)
from kvlens.stack.errors import StackError
from kvlens.proxy.split import parse_split
from kvlens.stack.instances import MAX_INSTANCES, ROUTERS, check_routers, parse_modes, parse_routers
from kvlens.stack.launch import Stack
from kvlens.stack.ports import is_loopback, port_arg
from kvlens.stack.supervise import signals_ignored
from kvlens.stack.spinners import MODES as SPIN_MODES
from kvlens.stack.tp import MAX_TP, STARTUP_S_PER_EXTRA_PROCESS, parse_tp, tp_note
from kvrecord.config import TOKEN_ENV, client_token
from kvrecord.location import StoreLocation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        type=_MODES,
        required=True,
        metavar="push|pull|push,pull",
        help="KV handoff protocol; push,pull: a mixed fleet (a canary), push pairs and pull pairs behind "
        "one kvlens router that draws each request's mode (kvlens proxy --split, default push=0.5; "
        "live: POST /admin/split); --prefill-instances / --decode-instances then count per mode",
    )
    p.add_argument(
        "--dispatch",
        choices=["overlapped", "sequential"],
        default="overlapped",
        help="push only: send D its request at once (overlapped) or after P answers (sequential)",
    )
    p.add_argument(
        "--split",
        type=_SPLIT,
        default=None,
        metavar="push=W",
        help="with --mode push,pull: the router's push weight at start (pull=W: pull's; default push=0.5); "
        "change it live with POST /admin/split on the router",
    )
    p.add_argument(
        "--model", type=Path, default=None, help="model dir (default: generated tiny model in $KVLENS_HOME/model)"
    )
    p.add_argument(
        "--port", type=port_arg(allow_zero=True), default=8000, help="router port (default 8000; 0: a free one)"
    )
    p.add_argument(
        "--prefill-port",
        type=port_arg(allow_zero=True),
        default=None,
        help="the first P's HTTP port (default: a free one; the other P always get free ones)",
    )
    p.add_argument(
        "--decode-port",
        type=port_arg(allow_zero=True),
        default=None,
        help="the first D's HTTP port (default: a free one; the other D always get free ones)",
    )
    p.add_argument(
        "--prefill-instances",
        type=int_in(1, MAX_INSTANCES, "a number of instances"),
        default=1,
        metavar="N",
        help=f"how many P to start, engine ids p0..p(N-1) (default 1, at most {MAX_INSTANCES}); per mode "
        "with --mode push,pull (push's first, then pull's)",
    )
    p.add_argument(
        "--decode-instances",
        type=int_in(1, MAX_INSTANCES, "a number of instances"),
        default=1,
        metavar="M",
        help=f"how many D to start, engine ids d0..d(M-1) (default 1, at most {MAX_INSTANCES}); per mode "
        "with --mode push,pull",
    )
    _add_tp_arguments(p)
    _add_router_arguments(p)
    _add_push_arguments(p)
    _add_topology_arguments(p)


def _add_router_arguments(p: argparse.ArgumentParser) -> None:
    """Which routers front the stack, where, and the stack's logs, timeout and Prometheus."""
    p.add_argument(
        "--router",
        type=_ROUTERS,
        default=("kvlens",),
        metavar="|".join(ROUTERS),
        help="which router(s) to start in front of P and D: kvlens (default), vllm-router (vLLM's own, "
        "pull only, pip package vllm-router), or both: kvlens,vllm-router",
    )
    p.add_argument(
        "--vllm-router-port",
        type=port_arg(),
        default=None,
        help="vllm-router's port next to kvlens' router (default: a free one; alone it takes --port)",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="bind address for all servers (default loopback). Any other address needs $KVLENS_TOKEN "
        "(the router and the collector ask for it) or an API key (--api-key: P, D and the router; not the "
        "collector), or --insecure; P's NIXL side channel stays open to everyone who can reach the host",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow --host beyond loopback with no token and no API key (anyone who reaches it may use it)",
    )
    _add_engine_arguments(p)
    p.add_argument("--log-dir", type=Path, default=None, help="where child logs and stack.json go")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=None,
        help=f"seconds to wait for readiness (default {DEFAULT_TIMEOUT_S:g} for one P and one D, plus "
        f"{STARTUP_S_PER_EXTRA_PROCESS:g} per further engine process: every instance, and every TP "
        "rank, is one)",
    )
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a Prometheus server (Debian package prometheus) scraping router, P and D, "
        "with the kvlens recording rules and exemplar storage; data under the log dir",
    )
    p.add_argument("--prometheus-port", type=port_arg(), default=9090, help="Prometheus port (default 9090)")


def _add_push_arguments(p: argparse.ArgumentParser) -> None:
    """P's KV lease and push's registration timeout."""
    p.add_argument(
        "--kv-lease",
        type=positive(int),
        default=DEFAULT_KV_LEASE_S,
        metavar="S",
        help=f"vLLM kv_lease_duration: how long P keeps a request's KV for D (default {DEFAULT_KV_LEASE_S}; vLLM's own default is 30)",
    )
    p.add_argument(
        "--push-registration-timeout",
        type=positive(int),
        default=DEFAULT_PUSH_REGISTRATION_TIMEOUT_S,
        metavar="S",
        help=f"vLLM push_registration_timeout on D (default {DEFAULT_PUSH_REGISTRATION_TIMEOUT_S}; vLLM's own default is 480)",
    )


def _add_topology_arguments(p: argparse.ArgumentParser) -> None:
    """Separate homes and the collector (the cross-host layout on one host), and the API key."""
    p.add_argument(
        "--separate-homes",
        action="store_true",
        help="run P, D and the router as if on three hosts: each with its own KVLENS_HOME "
        "(<home>/hosts/<role>, its own trace store) and every span sent over OTLP/HTTP to one "
        "collector, where traces join and the handoff is corrected for the P/D clock offset; "
        "vLLM's own request spans go there too (--otlp-traces-endpoint)",
    )
    p.add_argument(
        "--collector",
        choices=["process", "router"],
        default="process",
        help="with --separate-homes: a `kvlens collect` process (default) or the router hosting "
        "the receiver (`kvlens proxy --collect`)",
    )
    p.add_argument(
        "--collector-port",
        type=port_arg(),
        default=None,
        help="with --separate-homes and --collector process: its port (default: a free one)",
    )
    p.add_argument(
        "--collector-store",
        type=_STORE,
        metavar="STORE",
        help="with --separate-homes and --collector process: the collector's trace store, a path or "
        "a postgresql://user@host:port/db URL shared by the fleet (default: the SQLite file in "
        "the collector's home)",
    )
    p.add_argument(
        "--hosts",
        action="store_true",
        help="every role in its own network namespace (each P, each D, the router, the collector), "
        "joined by veths on a bridge, addresses in 198.18.0.0/15, no route out; NIXL over TCP on "
        "those links. Root only; needs ip, tc, iptables-legacy (docs/links.md)",
    )
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="A-B=DELAY[,JITTER][,RATE][,LOSS]",
        help="with --hosts: shape the link between roles p, d, router, collector, client (A-B: both "
        "directions, A>B: one), e.g. p-d=20ms,200mbit or p-d=2ms,1ms,10gbit,0.1%%; measured at start "
        "(stack.json's network.links). Repeatable",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="API key P, D (vLLM's --api-key, handed over as VLLM_API_KEY) and the router require "
        "on /v1/*; the stack's own health checks and warm-up send it (default: "
        "$KVLENS_API_KEY, else $VLLM_API_KEY, else none; the environment keeps it out of `ps`)",
    )


_STORE = from_parser(StoreLocation.parse, ValueError)  #: argparse ``type=`` of ``--collector-store``
_ROUTERS = from_parser(parse_routers, StackError)
_SPLIT = from_parser(parse_split, ValueError)  #: argparse ``type=`` of ``--split``
_MODES = from_parser(
    lambda text: ",".join(parse_modes(text)), StackError
)  #: argparse ``type=`` of ``--mode``  #: argparse ``type=`` of ``--router``
_TP_SIZES = from_parser(parse_tp, ValueError)  #: argparse ``type=`` of ``--prefill-tp`` / ``--decode-tp``


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """What kvlens up sets in the engines it starts besides their sizes."""
    p.add_argument("--stock", action="store_true", help="use vLLM's own NIXL connectors (no kvlens telemetry)")
    p.add_argument(
        "--kv-load-failure-policy",
        choices=["fail", "recompute"],
        default=None,
        help="D's vLLM kv_load_failure_policy: fail the request when its KV does not arrive (vLLM's "
        "default) or recompute the prompt on D (kvlens then marks and counts the request: "
        "kvlens_kv_recomputed_total)",
    )
    p.add_argument(
        "--nixl-progress",
        choices=SPIN_MODES,
        default="auto",
        help="NIXL's UCX progress thread in every vLLM worker polls with timeout 0 and takes a whole CPU "
        "when it runs. idle: SCHED_IDLE once its server is up (it runs only when its CPU has "
        "nothing else to do); startup: idle only until every server is up, then as vLLM runs it; "
        "as-is: never touched; auto (default): idle when the engine processes (one per TP rank) "
        "outnumber the CPUs, else startup. Stock and instrumented stacks alike",
    )


def _add_tp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=int_in(1, MAX_TP, "a tensor-parallel size"),
        default=1,
        metavar="N",
        help="tensor-parallel size of every P and D (vLLM's --tensor-parallel-size; each rank gets its "
        f"own CPU list, docs/tensor-parallel.md; default 1, at most {MAX_TP})",
    )
    p.add_argument(
        "--prefill-tp",
        type=_TP_SIZES,
        default=None,
        metavar="N[,N...]",
        help="P's tensor-parallel size, overriding --tp: one for all P, or one per P in engine-id order",
    )
    p.add_argument(
        "--decode-tp",
        type=_TP_SIZES,
        default=None,
        metavar="N[,N...]",
        help="D's tensor-parallel size, overriding --tp: one for all D, or one per D (--decode-tp 2,1: "
        "d0 at TP 2, d1 at TP 1)",
    )


def check_args(args: argparse.Namespace) -> None:
    """Flag combinations refused before anything starts (StackError): what
    vllm-router cannot do (push; an API key it could only take on its
    command line)."""
    routers = tuple(getattr(args, "router", ("kvlens",)))
    check_routers(
        routers, args.mode, getattr(args, "api_key", None) or env_api_key(), args.separate_homes, args.collector
    )
    if getattr(args, "vllm_router_port", None) and "vllm-router" not in routers:
        raise StackError("--vllm-router-port needs --router vllm-router or kvlens,vllm-router")
    check_open(
        args.host, getattr(args, "api_key", None), getattr(args, "insecure", False), args.separate_homes, args.collector
    )


def check_open(
    host: str, api_key: str | None, insecure: bool, separate: bool = False, collector: str = "process"
) -> None:
    """Refuse (StackError) a host beyond loopback that the router (token or
    API key) or the collector process (token) would leave open, unless
    ``insecure``; warn once when ``insecure`` does open it. The token is
    ``$KVLENS_TOKEN``: every child inherits it (never a command line)."""
    if is_loopback(host):
        return
    token = client_token()
    if insecure:
        if not token and not (api_key or env_api_key()):
            print(
                f"kvlens up: warning: --host {host} with --insecure and no token: the router"
                f"{' and the collector' if separate and collector == 'process' else ''} accept anyone who can "
                "reach this host",
                file=sys.stderr,
                flush=True,
            )
        return
    if not token and not (api_key or env_api_key()):
        raise StackError(
            f"refusing --host {host} (beyond loopback) with no token and no API key: set ${TOKEN_ENV} "
            "(or --api-key), or pass --insecure to let anyone who reaches it in"
        )
    if not token and separate and collector == "process":
        raise StackError(
            f"refusing --host {host} with --separate-homes: the collector asks for ${TOKEN_ENV} (an API key "
            "is P's, D's and the router's only); set it, or pass --insecure"
        )


def _stack(args: argparse.Namespace) -> Stack:
    return Stack(
        mode=args.mode,
        dispatch=args.dispatch,
        model=args.model,
        port=args.port,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        stock=args.stock,
        log_dir=args.log_dir,
        host=args.host,
        kv_lease_s=args.kv_lease,
        push_registration_timeout_s=args.push_registration_timeout,
        prometheus=args.prometheus,
        prometheus_port=args.prometheus_port,
        separate_homes=args.separate_homes,
        collector=args.collector,
        collector_port=args.collector_port or None,
        collector_store=getattr(args, "collector_store", None) or None,
        api_key=getattr(args, "api_key", None) or None,
        insecure=getattr(args, "insecure", False),
        prefill_instances=getattr(args, "prefill_instances", 1),
        decode_instances=getattr(args, "decode_instances", 1),
        routers=getattr(args, "router", ("kvlens",)),
        vllm_router_port=getattr(args, "vllm_router_port", None),
        prefill_tp=getattr(args, "prefill_tp", None) or getattr(args, "tp", 1),
        decode_tp=getattr(args, "decode_tp", None) or getattr(args, "tp", 1),
        nixl_progress=getattr(args, "nixl_progress", "auto"),
        kv_load_failure_policy=getattr(args, "kv_load_failure_policy", None),
        split=getattr(args, "split", None),
        hosts=getattr(args, "hosts", False),
        links=tuple(getattr(args, "link", None) or ()),
    )


def _endpoints(stack: Stack) -> str:
    """The ready message's lines naming every router and instance."""
    lines = []
    if "kvlens" in stack.routers:
        lines.append(f"  router  (OpenAI API): {stack.router_url}/v1")
    if stack.vllm_router_url:
        lines.append(f"  vllm-router (OpenAI): {stack.vllm_router_url}/v1")
    for inst in [*stack.prefills, *stack.decodes]:
        label = f"{inst.role} ({'P' if inst.role == 'prefill' else 'D'} {inst.engine_id})"
        if stack.mixed:
            label = f"{inst.mode} {label}"
        lines.append(f"  {label + ':':<22}{inst.url}")
    return "\n".join(lines) + "\n"


def _network_lines(stack: Stack) -> str:
    """The ready message's lines for a ``--hosts`` stack: its subnet and each link as asked and measured."""
    if stack.net is None:
        return ""
    net = stack.net.to_json()
    lines = [f"  network:              {net['subnet']}, namespaces kvl-{net['id']}-* (stack.json: network)\n"]
    for link in net["links"]:
        a, m = link["asked"], link["measured"] or {}
        rate = f", {a['rate_bps'] / 1e6:g} Mbit/s" if a["rate_bps"] else ""
        rtt, gp = m.get("rtt_s"), m.get("goodput_bps")
        got = f"rtt {rtt * 1e3:.2f} ms" if rtt is not None else "rtt unknown (every echo lost)"
        got += f", goodput {gp / 1e6:.0f} Mbit/s" if gp else ", goodput unknown"
        name = f"link {link['src']}>{link['dst']}:"
        lines.append(f"  {name:<22}asked {a['delay_s'] * 1e3:g} ms{rate}; measured {got}\n")
    return "".join(lines)


def _print_ready(args: argparse.Namespace, stack: Stack) -> None:
    print(
        "\nkvlens stack is up "
        f"({args.mode}{', push ' + args.dispatch if 'push' in stack.modes else ''}, "
        + (
            f"{stack.per_mode[0]}P x {stack.per_mode[1]}D per mode, split push="
            f"{0.5 if stack.split is None else stack.split:g} (POST /admin/split), "
            if stack.mixed
            else f"{stack.prefill_instances}P x {stack.decode_instances}D"
        )
        + f"{tp_note(stack.prefill_tp, stack.decode_tp)}, "
        f"{'stock' if args.stock else 'instrumented'} connector)\n"
        + _endpoints(stack)
        + _network_lines(stack)
        + f"  model:                {stack.model}\n"
        f"  logs:                 {stack.log_dir}\n"
        + (
            f"  token:                ${TOKEN_ENV} required by the router on every route but /health"
            f"{' (and by the collector)' if stack.separate_homes and stack.collector == 'process' else ''}\n"
            if client_token()
            else ""
        )
        + ("  API key:              required on /v1/* by P, D and the router\n" if stack.api_key else "")
        + (
            f"  collector (OTLP):     {stack.collector_url}/v1/traces ({stack.collector})\n"
            f"  joined trace store:   {stack.store}\n"
            if stack.separate_homes
            else f"  trace store:          {stack.store}\n"
        )
        + "Ctrl-C to stop.",
        flush=True,
    )


def _watch(stack: Stack) -> int:
    """Block until a child dies (returns 1) or a signal interrupts."""
    while True:
        dead = stack.dead_child()
        if dead is not None:
            print(f"kvlens up: {dead.died_message()}", file=sys.stderr, flush=True)
            return 1
        time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    """Start the stack, print its endpoints, serve until Ctrl-C / SIGTERM
    (exit 0), a child's death (1) or a start-up error (2). Main thread."""
    stack: Stack | None = None
    try:
        check_args(args)
    except StackError as e:
        print(f"kvlens up: error: {e}", file=sys.stderr, flush=True)
        return 2
    with sigterm_as_interrupt():
        try:
            stack = _stack(args)
            stack.start(timeout=args.timeout)
            _print_ready(args, stack)
            return _watch(stack)
        except StackError as e:
            print(f"kvlens up: error: {e}", file=sys.stderr, flush=True)
            return 2
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (signals.Terminated)
            print("kvlens up: stopping", flush=True)
            return 0
        finally:
            with signals_ignored():  # a second signal while stopping must not leave orphans
                if stack is not None:
                    stack.stop()
