"""What a started :class:`~kvlens.stack.launch.Stack` can add (its mixin
:class:`StackExtras`): more kvlens routers on the same P and D (another
dispatch next to the first, for the bench and the tests), and a real
Prometheus scraping the stack. Stopped with the stack. Blocking.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvlens.stack import manifest as stack_manifest
from kvlens.stack.commands import auth_headers
from kvrecord.ports import free_port
from kvlens.stack.supervise import wait_healthy


class StackExtras:
    """Methods of :class:`~kvlens.stack.launch.Stack` (its fields and
    ``_spawn`` / ``_router`` / ``_say``) for what a stack may add."""

    def add_router(self, dispatch: str, port: int | None = None, timeout: float = 60.0) -> str:
        """Start one more router on the same P/D (e.g. sequential next to
        overlapped); stopped with the stack. Returns its URL."""
        port = port or free_port(self.host)
        c = self._spawn(self._router(dispatch, port, f"router-{dispatch}-{port}"))
        wait_healthy([c], time.monotonic() + timeout, self._say, auth_headers(self.router_key))
        return c.url

    def router_for(self, dispatch: str) -> str:
        """URL of a kvlens router with this dispatch on this stack's P and D,
        started on first use (tests and the bench share one pair per mode)."""
        if dispatch == self.dispatch and self.router_url and "kvlens" in self.routers:
            return self.router_url
        if dispatch not in self.extra_routers:
            self.extra_routers[dispatch] = self.add_router(dispatch)
        return self.extra_routers[dispatch]

    @property
    def sequential_router_url(self) -> str:
        return self.router_for("sequential")

    def start_prometheus(self, port: int = 9090, timeout: float = 60.0):
        """Start a real Prometheus scraping this stack's router, P and D
        (data and config under the log dir). Returns the server; its URL is
        ``self.prometheus_server.url``. Stopped with the stack."""
        from exporters.prometheus_server import PrometheusServer  # start-up cost (httpx)

        if self.prometheus_server is not None:
            return self.prometheus_server
        server = PrometheusServer(
            stack_manifest.scrape_targets(self),
            port=port,
            data_dir=Path(self.log_dir) / "prometheus",
            credentials=stack_manifest.scrape_credentials(self),
        )
        server.start(timeout=timeout)
        self.prometheus_server = server
        self._say(f"prometheus ready at {server.url}")
        return server
