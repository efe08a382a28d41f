"""``kvlens up``: start a real prefill (P) and decode (D) vLLM pair plus the
kvlens router, wait until all three answer ``/health``, print the endpoints,
and stop everything on Ctrl-C / SIGTERM.

The work is done by :mod:`kvlens.stack`; this module is the command line.
It re-exports what callers import from here (``Stack``, ``StackError``,
``parse_cpu_list``, ``free_port``, ``MAX_MODEL_LEN``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.commands import (
    DEFAULT_KV_LEASE_S,
    DEFAULT_PUSH_REGISTRATION_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MAX_MODEL_LEN,
    kv_transfer_config,
)
from kvlens.stack.errors import StackError
from kvlens.stack.launch import Stack
from kvlens.stack.pinning import parse_cpu_list
from kvlens.stack.ports import DEFAULT_HOST, free_port, port_in_use
from kvlens.stack.supervise import signals_ignored

__all__ = [
    "MAX_MODEL_LEN", "Stack", "StackError", "add_arguments", "free_port", "kv_transfer_config",
    "parse_cpu_list", "port_in_use", "run",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["push", "pull"], required=True, help="KV handoff protocol")
    p.add_argument(
        "--dispatch",
        choices=["overlapped", "sequential"],
        default="overlapped",
        help="push only: send D its request at once (overlapped) or after P answers (sequential)",
    )
    p.add_argument("--model", type=Path, default=None, help="model dir (default: generated tiny model in $KVLENS_HOME/model)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--prefill-port", type=int, default=None, help="P's HTTP port (default: a free one)")
    p.add_argument("--decode-port", type=int, default=None, help="D's HTTP port (default: a free one)")
    p.add_argument("--host", default=DEFAULT_HOST, help="bind address for all three servers")
    p.add_argument("--stock", action="store_true", help="use vLLM's own NIXL connectors (no kvlens telemetry)")
    p.add_argument("--log-dir", type=Path, default=None, help="where child logs and stack.json go")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for readiness")
    p.add_argument("--prometheus", action="store_true",
                   help="also start a Prometheus server (Debian package prometheus) scraping router, P and D, "
                        "with the kvlens recording rules and exemplar storage; data under the log dir")
    p.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus port (default 9090)")
    p.add_argument("--kv-lease", type=int, default=DEFAULT_KV_LEASE_S, metavar="S",
                   help=f"vLLM kv_lease_duration: how long P keeps a request's KV for D (default {DEFAULT_KV_LEASE_S}; vLLM's own default is 30)")
    p.add_argument("--push-registration-timeout", type=int, default=DEFAULT_PUSH_REGISTRATION_TIMEOUT_S, metavar="S",
                   help=f"vLLM push_registration_timeout on D (default {DEFAULT_PUSH_REGISTRATION_TIMEOUT_S}; vLLM's own default is 480)")


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
    )


def _print_ready(args: argparse.Namespace, stack: Stack) -> None:
    print(
        "\nkvlens stack is up "
        f"({args.mode}{', ' + args.dispatch if args.mode == 'push' else ''}, "
        f"{'stock' if args.stock else 'instrumented'} connector)\n"
        f"  router  (OpenAI API): {stack.router_url}/v1\n"
        f"  prefill (P):          {stack.prefill_url}\n"
        f"  decode  (D):          {stack.decode_url}\n"
        f"  model:                {stack.model}\n"
        f"  logs:                 {stack.log_dir}\n"
        "Ctrl-C to stop.",
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
