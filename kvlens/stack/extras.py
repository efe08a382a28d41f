"""What a started :class:`~kvlens.stack.launch.Stack` can add (the stack's
methods of the same names call these with itself): more kvlens routers on
the same P and D (another dispatch next to the first, for the bench and the
tests), and a real Prometheus scraping the stack. Stopped with the stack.
Blocking.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvlens.stack import manifest as stack_manifest
from kvlens.stack.commands import auth_headers
from kvrecord.ports import free_port
from kvlens.stack.supervise import wait_healthy


def add_router(stack, dispatch: str, port: int | None = None, timeout: float = 60.0) -> str:
    """Start one more router on the same P/D (e.g. sequential next to
    overlapped); stopped with the stack. Returns its URL."""
    port = port or free_port(stack.host)
    c = stack.supervised.spawn(stack.roles.router(dispatch, port, f"router-{dispatch}-{port}"))
    wait_healthy([c], time.monotonic() + timeout, stack.say, auth_headers(stack.router_key))
    return c.url


def router_for(stack, dispatch: str) -> str:
    """URL of a kvlens router with this dispatch on this stack's P and D,
    started on first use (tests and the bench share one pair per mode)."""
    if dispatch == stack.dispatch and stack.router_url and "kvlens" in stack.routers:
        return stack.router_url
    if dispatch not in stack.extra_routers:
        stack.extra_routers[dispatch] = stack.add_router(dispatch)
    return stack.extra_routers[dispatch]


def start_prometheus(stack, port: int = 9090, timeout: float = 60.0):
    """Start a real Prometheus scraping this stack's router, P and D
    (data and config under the log dir). Returns the server; its URL is
    ``stack.prometheus_server.url``. Stopped with the stack."""
    from exporters.prometheus_server import PrometheusServer  # start-up cost (httpx)

    if stack.prometheus_server is not None:
        return stack.prometheus_server
    server = PrometheusServer(
        stack_manifest.scrape_targets(stack),
        port=port,
        data_dir=Path(stack.log_dir) / "prometheus",
        credentials=stack_manifest.scrape_credentials(stack),
    )
    server.start(timeout=timeout)
    stack.prometheus_server = server
    stack.say(f"prometheus ready at {server.url}")
    return server
