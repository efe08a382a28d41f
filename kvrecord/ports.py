"""TCP ports on this host: is one taken (:func:`port_in_use`), pick a free
one (:func:`free_port`). Plain bind tests on the calling thread; used by a
stack (:mod:`kvlens.stack.ports`) and by the Prometheus server kvlens runs."""

from __future__ import annotations

import random
import socket
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"


def port_in_use(port: int, host: str = DEFAULT_HOST) -> bool:
    """True when something already listens on ``host:port`` (bind test;
    ``SO_REUSEADDR``, as servers bind, so a port left in TIME_WAIT is free)."""
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
    pair starts, and one of them took a router port before it could bind.
    OSError when none is found."""
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
    raise OSError("could not find a free port")
