"""TCP ports for a stack: check and complete a set of them
(:func:`assign_ports`, through :mod:`kvrecord.ports`' bind tests); plus the
argparse checks of port flags (:func:`port_arg`; :func:`is_loopback` is
:mod:`kvlens.auth`'s, the one rule for "beyond loopback").

All functions are plain, blocking-free bind tests on the calling thread.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from kvrecord.ports import free_port, port_in_use
from kvlens.argtypes import int_in
from kvlens.auth import is_loopback  # noqa: F401 - re-exported: the stack's and the router's flag checks
from kvlens.stack.errors import StackError

MAX_PORT = 65535


def port_arg(allow_zero: bool = False):
    """An argparse ``type=``: a TCP port 1..65535 (0 too with ``allow_zero``:
    "pick a free one"); anything else is a usage error naming the value."""
    return int_in(0 if allow_zero else 1, MAX_PORT, "a port number")


def assign_ports(wanted: Mapping[str, int | None], host: str, auto: Iterable[str]) -> dict[str, int | None]:
    """Check and complete a stack's ports.

    ``wanted``: port by what it is for ("router port", ...); None or 0 means
    "not chosen". Every chosen port must be distinct and free on ``host``,
    else StackError names it. Then each name in ``auto`` (in order) that is
    not chosen gets a free port distinct from all others. Returns the
    completed mapping."""
    used: set[int] = set()
    for what, p in wanted.items():
        if not p:
            continue
        if p in used:
            raise StackError(f"{what} {p} is given twice")
        if port_in_use(p, host):
            raise StackError(f"{what} {p} is already in use on {host}")
        used.add(p)
    out = dict(wanted)
    for what in auto:
        if not out.get(what):
            try:
                out[what] = free_port(host, used)
            except OSError as e:
                raise StackError(str(e)) from None
            used.add(out[what])
    return out
