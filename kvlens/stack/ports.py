"""TCP ports for a stack: is one taken, pick a free one, check a set of them;
plus the argparse checks of port and host flags (:func:`port_arg`,
:func:`is_loopback`).

All functions are plain, blocking-free bind tests on the calling thread.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path
from typing import Iterable, Mapping

from kvlens.argtypes import int_in
from kvlens.stack.errors import StackError

DEFAULT_HOST = "127.0.0.1"
MAX_PORT = 65535


def port_arg(allow_zero: bool = False):
    """An argparse ``type=``: a TCP port 1..65535 (0 too with ``allow_zero``:
    "pick a free one"); anything else is a usage error naming the value."""
    return int_in(0 if allow_zero else 1, MAX_PORT, "a port number")


def is_loopback(host: str) -> bool:
    """True when ``host`` only binds the loopback interface (``localhost``,
    127.0.0.0/8, ``::1``); False for ``0.0.0.0``, ``::``, names and
    addresses others can reach."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def port_in_use(port: int, host: str = DEFAULT_HOST) -> bool:
    """True when something already listens on ``host:port`` (bind test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux), or its usual default."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except Exception:
        return 32768, 60999


def free_port(host: str = DEFAULT_HOST, avoid: set[int] | None = None) -> int:
    """A currently free TCP port (not in ``avoid``), chosen outside the
    kernel's ephemeral range: a port handed out by ``bind(0)`` is free now,
    but vLLM's ZMQ, NIXL and UCX sockets draw from that same range while the
    pair starts, and one of them took a router port before it could bind."""
    lo, hi = ephemeral_range()
    pool = [(a, b) for a, b in ((20000, min(lo, 32768) - 1), (hi + 1, 65535)) if b - a > 100]
    for _ in range(200):
        if not pool:
            break
        a, b = random.choice(pool)
        p = random.randint(a, b)
        if (not avoid or p not in avoid) and not port_in_use(p, host):
            return p
    for _ in range(50):  # fall back to the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if not avoid or p not in avoid:
            return p
    raise StackError("could not find a free port")


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
            out[what] = free_port(host, used)
            used.add(out[what])
    return out
