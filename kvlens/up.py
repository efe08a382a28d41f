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
import os
import sys
import time

from frontdoor import flags
from frontdoor.credentials import is_loopback
from frontdoor.flags import api_key_arg, env_api_key
from kvlens import exits
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.errors import StackError
from kvlens.stack.instances import check_routers
from kvlens.stack.launch import Stack
from kvlens.stack.supervise import signals_ignored
from kvlens.stack.tp import tp_note
from kvrecord.config import TOKEN_ENV, client_token


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


def use_token(args: argparse.Namespace) -> None:
    """``--token-file`` (else ``$KVLENS_TOKEN``), checked as every kvlens server
    checks it (:func:`frontdoor.flags.from_args`: 16 characters at least, no
    spaces; SecurityError naming the problem), put in our environment as
    ``$KVLENS_TOKEN``: every child inherits it, none gets it on its command line."""
    sec = flags.from_args(args, "127.0.0.1", warn=lambda line: print(f"kvlens up: {line}", file=sys.stderr, flush=True))
    if sec.token:
        os.environ[TOKEN_ENV] = sec.token.decode()


def check_hosts(args: argparse.Namespace) -> None:
    """``--hosts`` with no token is refused unless ``--insecure`` says so
    (StackError): the stack needs root (sudo, which drops ``$KVLENS_TOKEN``),
    and its router and collector, bound on the stack's bridge, would take
    anyone who reaches it."""
    if getattr(args, "hosts", False) and not client_token() and not getattr(args, "insecure", False):
        raise StackError(
            f"refusing --hosts with no token: the router and the collector would take anyone who reaches the "
            f"stack's bridge (sudo drops ${TOKEN_ENV}); give --token-file PATH, or pass --insecure to run them "
            "without one"
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
        store_command=getattr(args, "store_command", None),
        sched_trace=getattr(args, "sched_trace", False),
        sched_buffer_mb=getattr(args, "sched_buffer_mb", 128),
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
    (exit 0) or a child's death (1). A flag refused before anything starts
    exits 2, a start that fails its StackError's code (:mod:`kvlens.exits`:
    2 for a model directory that is none, 1 for a busy port or a child that
    did not come up). Main thread."""
    checked = False
    stack: Stack | None = None
    try:
        args.api_key = api_key_arg(args, lambda line: print(f"kvlens up: {line}", file=sys.stderr, flush=True))
        use_token(args)
        check_args(args)
    except (StackError, ValueError) as e:  # frontdoor's SecurityError included
        print(f"kvlens up: error: {e}", file=sys.stderr, flush=True)
        return exits.USAGE
    with sigterm_as_interrupt():
        try:
            stack = _stack(args)
            check_hosts(args)  # after the stack's own checks (a bad --link is named first); nothing started yet
            checked = True
            stack.start(timeout=args.timeout)
            _print_ready(args, stack)
            return _watch(stack)
        except StackError as e:
            print(f"kvlens up: error: {e}", file=sys.stderr, flush=True)
            return e.exit_code if checked else exits.USAGE
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (signals.Terminated)
            print("kvlens up: stopping", flush=True)
            return 0
        finally:
            with signals_ignored():  # a second signal while stopping must not leave orphans
                if stack is not None:
                    stack.stop()
