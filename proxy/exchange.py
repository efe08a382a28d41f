"""One client request on its way through P and D (:class:`Exchange`): its
trace, its body and headers, the calls to P and D, and its end (root span).

Everything here runs on the event loop; the calls to P and D await the
network (timeouts from :class:`~proxy.config.ProxyConfig`) and are
retried once only when they provably never reached the server
(:mod:`proxy.retry`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
from opentelemetry.trace import format_span_id

from kvrecord import semconv as sc
from kvrecord.ids import root_span_id
from proxy.balancer import Route
from proxy.bodies import prefill_body
from proxy.config import ProxyConfig
from proxy.errors import from_http_error, from_status, unexpected
from proxy.retry import send_once_more
from proxy.telemetry import RouterTelemetry


def traceparent(trace_id: str) -> str:
    """W3C ``traceparent`` naming the router's root ``request`` span of
    ``trace_id`` (span id :func:`~kvrecord.ids.root_span_id`)
    as the parent, sampled: vLLM's own OpenTelemetry tracing
    (``--otlp-traces-endpoint``) then puts its ``llm_request`` span in the
    same trace, under the router's root span."""
    return f"00-{trace_id}-{format_span_id(root_span_id(int(trace_id, 16)))}-01"


@dataclass
class Exchange:
    """State of one client request. ``t0_ns``: wall clock when it arrived
    (the root span's start and the zero of client-seen TTFT). ``route``: the
    P and D it goes to (:class:`~proxy.balancer.Balancer`), chosen
    once the request passed intake (a refused one names none). ``p_task``:
    P's call when it runs in the background (overlapped push).
    ``client_attrs``: what the client sent as ids, when not the trace id
    (:mod:`proxy.isolation`). ``on_finish``: called once, when the
    request ends (frees its trace id). ``mode``: the handoff mode it goes
    by (None until chosen: the router's); ``split``: the push weight its
    mode was drawn with (a mixed fleet's draw; None: not drawn).
    ``prompt_tokens``: P's count (its answer's ``usage``); ``tpot_s``: the
    client-seen time per output token after the first (streams, set by the
    relay). ``on_end(mode, outcome)``: called once with what it came to."""

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
    client_attrs: dict[str, str] = field(default_factory=dict)
    on_finish: Callable[[], None] | None = None
    finished: bool = False
    route: Route | None = None
    mode: str | None = None
    split: float | None = None
    prompt_tokens: int | None = None
    tpot_s: float | None = None
    on_end: Callable[[str, str], None] | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def elapsed_s(self) -> float:
        """Seconds since the request arrived."""
        return (time.time_ns() - self.t0_ns) / 1e9

    def finish(self, status: int, outcome: str, ttft_s: float | None = None, error: str | None = None) -> None:
        """Record the root span, ending now, and free the trace id. The first
        call counts; later ones do nothing (several paths may end a request)."""
        if self.finished:
            return
        self.finished = True
        mode = self.mode or self.cfg.mode
        try:
            self.tel.request(
                self.trace_id,
                self.parent,
                self.t0_ns,
                time.time_ns(),
                outcome,
                ttft_s,
                self.cfg.dispatch_for(mode),
                status,
                error=error,
                attrs={**(self.route.attrs() if self.route else {}), **self.client_attrs, **self._canary_attrs()},
            )
        finally:
            if self.on_finish is not None:
                self.on_finish()
            if self.on_end is not None:
                self.on_end(mode, outcome)

    def _canary_attrs(self) -> dict:
        """The root span's mode, split weight, prompt tokens and TPOT (what
        ``kvlens verdict`` reads), those known."""
        a: dict = {sc.ATTR_MODE: self.mode or self.cfg.mode}
        if self.split is not None:
            a[sc.ATTR_SPLIT] = self.split
        tokens = self.prompt_tokens if self.prompt_tokens is not None else self._p_task_tokens()
        if tokens is not None:
            a[sc.ATTR_TOKENS] = tokens
        if self.tpot_s is not None:
            a[sc.ATTR_TPOT_S] = self.tpot_s
        return a

    def _p_task_tokens(self) -> int | None:
        """The prompt tokens of an overlapped P call that answered."""
        t = self.p_task
        if t is None or not t.done() or t.cancelled() or t.exception() is not None:
            return None
        return prompt_tokens(t.result())

    def upstream_headers(self, authorization: str | None) -> None:
        """Headers for P and D: the trace id as ``X-Request-Id`` (vLLM builds
        its request id from it), the root span as W3C ``traceparent``
        (:func:`traceparent`), JSON, and ``authorization`` when given."""
        self.headers = {
            "X-Request-Id": self.trace_id,
            "traceparent": traceparent(self.trace_id),
            "Content-Type": "application/json",
        }
        if authorization:
            self.headers["Authorization"] = authorization

    async def call_prefill(self) -> dict:
        """P's JSON object answering :func:`prefill_body`; raises
        :class:`Upstream` (also for a 200 that is not a JSON object)."""
        url = self.route.prefill.url
        p_body = prefill_body(self.body)

        def build(ext: dict) -> httpx.Request:
            return self.client.build_request(
                "POST", url + self.endpoint, json=p_body, headers=self.headers, extensions=ext
            )

        try:
            r = await send_once_more(self.client, build)
        except httpx.HTTPError as e:
            raise from_http_error("prefill", url, e) from e
        if r.status_code != 200:
            raise await from_status("prefill", r)
        try:
            p_json = r.json()
        except ValueError as e:
            raise unexpected("prefill", "a body that is not JSON", r.content) from e
        if not isinstance(p_json, dict):
            raise unexpected("prefill", f"JSON that is not an object ({type(p_json).__name__})", r.content)
        return p_json

    async def open_decode(self, d_body: dict) -> httpx.Response:
        """D's response with status 200 and its body not read yet (the caller
        closes it); raises :class:`Upstream`."""
        url = self.route.decode.url

        def build(ext: dict) -> httpx.Request:
            return self.client.build_request(
                "POST", url + self.endpoint, json=d_body, headers=self.headers, extensions=ext
            )

        try:
            resp = await send_once_more(self.client, build, stream=True)
        except httpx.HTTPError as e:
            raise from_http_error("decode", url, e) from e
        if resp.status_code != 200:
            try:
                raise await from_status("decode", resp)
            finally:
                await resp.aclose()
        return resp


def prompt_tokens(answer: object) -> int | None:
    """``usage.prompt_tokens`` of a completion answer (P's), None when absent."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


async def settle(task: asyncio.Task, cancel: bool = False) -> None:
    """Wait (up to 30 s) for a background P call, ignoring its errors (the
    client has its answer already); with ``cancel``, cancel it first. When
    the caller itself is cancelled meanwhile (client gone), P's call is
    cancelled too and the cancellation goes on."""
    if cancel and not task.done():
        task.cancel()
    try:
        await asyncio.wait({task}, timeout=30)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" log
