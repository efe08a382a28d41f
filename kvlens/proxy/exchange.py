"""One client request on its way through P and D (:class:`Exchange`): its
trace, its body and headers, the calls to P and D, and its end (root span).

Everything here runs on the event loop; the calls to P and D await the
network (timeouts from :class:`~kvlens.proxy.config.ProxyConfig`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httpx

from kvlens.proxy.bodies import prefill_body
from kvlens.proxy.config import ProxyConfig
from kvlens.proxy.errors import Upstream, from_http_error, from_status
from kvlens.proxy.telemetry import RouterTelemetry


@dataclass
class Exchange:
    """State of one client request. ``t0_ns``: wall clock when it arrived
    (the root span's start and the zero of client-seen TTFT). ``p_task``:
    P's call when it runs in the background (overlapped push)."""

    cfg: ProxyConfig
    client: httpx.AsyncClient
    tel: RouterTelemetry
    endpoint: str
    trace_id: str
    parent: int | None
    t0_ns: int
    body: dict = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    p_task: asyncio.Task | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def elapsed_s(self) -> float:
        """Seconds since the request arrived."""
        return (time.time_ns() - self.t0_ns) / 1e9

    def finish(self, status: int, outcome: str, ttft_s: float | None = None) -> None:
        """Record the root span, ending now. Call exactly once per request."""
        self.tel.request(self.trace_id, self.parent, self.t0_ns, time.time_ns(), outcome, ttft_s,
                         self.cfg.effective_dispatch, status)

    def upstream_headers(self, authorization: str | None) -> None:
        """Headers for P and D: the trace id as ``X-Request-Id`` (vLLM builds
        its request id from it), JSON, and the client's Authorization."""
        self.headers = {"X-Request-Id": self.trace_id, "Content-Type": "application/json"}
        if authorization:
            self.headers["Authorization"] = authorization

    async def call_prefill(self) -> dict:
        """P's JSON answer to :func:`prefill_body`; raises :class:`Upstream`."""
        url = self.cfg.prefill_url
        try:
            r = await self.client.post(url + self.endpoint, json=prefill_body(self.body), headers=self.headers)
        except httpx.HTTPError as e:
            raise from_http_error("prefill", url, e) from e
        if r.status_code != 200:
            raise await from_status("prefill", r)
        try:
            return r.json()
        except ValueError as e:
            raise Upstream("prefill", 502, f"prefill instance returned invalid JSON: {e}") from e

    async def open_decode(self, d_body: dict) -> httpx.Response:
        """D's response with status 200 and its body not read yet (the caller
        closes it); raises :class:`Upstream`."""
        url = self.cfg.decode_url
        req = self.client.build_request("POST", url + self.endpoint, json=d_body, headers=self.headers)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise from_http_error("decode", url, e) from e
        if resp.status_code != 200:
            try:
                raise await from_status("decode", resp)
            finally:
                await resp.aclose()
        return resp


async def settle(task: asyncio.Task, cancel: bool = False) -> None:
    """Wait (up to 30 s) for a background P call, swallowing its errors (the
    client has its answer already); with ``cancel``, cancel it first."""
    if cancel and not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(task, timeout=30)
