"""TCP ports for a stack: check and complete a set of them
(:func:`assign_ports`, through :mod:`kvrecord.ports`' bind tests). The
argparse check of a port flag is :func:`kvrecord.argtypes.port_arg`; "beyond
loopback" is :func:`frontdoor.credentials.is_loopback`.

All functions are plain, blocking-free bind tests on the calling thread.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from kvrecord.ports import free_port, port_in_use
from kvlens.stack.errors import StackError


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
