"""``kvlens`` command line. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int`` (or :class:`Sub` names
the module that defines its flags: ``kvlens up``'s are in
:mod:`kvlens.upargs`); modules are imported only when their subcommand runs,
so ``kvlens --help`` stays fast. Every command
exits with :mod:`kvlens.exits`' codes (2: bad input, as argparse's own)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NamedTuple

from kvlens import exits


class Sub(NamedTuple):
    """A subcommand: the module with its ``run(args)``, its help line, and
    the module with its ``add_arguments(parser)`` where that is another."""

    module: str
    help: str
    flags: str | None = None


SUBCOMMANDS = {
    "up": Sub(
        "kvlens.up", "start P and D (real vLLM with the instrumented connector) and the router", flags="kvlens.upargs"
    ),
    "proxy": Sub("proxy.cli", "OpenAI-compatible P/D router that emits the root span per request"),
    "bench": Sub("kvlens.bench.cli", "push-vs-pull benchmark grid on a real stack"),
    "traces": Sub("kvlens.traces", "slowest requests by handoff, with a text waterfall"),
    "verdict": Sub("kvlens.verdict", "push vs pull on the live traffic of a window, like with like, with intervals"),
    "whatif": Sub("kvlens.whatif", "the other mode's handoff and TTFT, predicted from one mode's traces"),
    "dashboard": Sub("kvlens.dashboard_cmd", "start the Streamlit dashboard"),
    "collect": Sub(
        "kvlens.collect",
        "OTLP/HTTP and OTLP/gRPC span receiver writing the trace store (P, D, router on several hosts)",
    ),
    "demo": Sub("kvlens.demo", "the main job: model, push and pull runs, table, traces, dashboard"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlens",
        description="Measure vLLM's prefill->decode KV handoff over NIXL, push vs pull. "
        "Files live under $KVLENS_HOME (default ./.kvlens).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (modname, help_, flags) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=modname)
        importlib.import_module(flags or modname).add_arguments(sp)
    return p


def warn_password_in_argv(command: str, argv: list[str]) -> bool:
    """One warning on stderr when a PostgreSQL URL on this command line holds
    a password (``ps`` shows a command line to every user of the host); True
    when it warned. It still works: the processes kvlens starts get the URL
    without it and the password in ``PGPASSWORD``."""
    from kvrecord.location import redact_text

    if not any(redact_text(a) != a for a in argv):
        return False
    print(
        f"kvlens {command}: warning: a store URL on this command line holds a password, which `ps` shows "
        "to every user of this host; give it as PGPASSWORD or in ~/.pgpass instead and leave it out of the "
        "URL (the processes kvlens starts get it in their environment, never on their command line)",
        file=sys.stderr,
        flush=True,
    )
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "command", None):
        warn_password_in_argv(args.command, sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "command", None):
        parser.print_help()
        return exits.USAGE
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        return exits.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
