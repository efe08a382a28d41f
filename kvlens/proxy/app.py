"""The router's ASGI app: :func:`create_app` and its routes.

``POST /v1/completions`` and ``/v1/chat/completions`` go through P and D
(:mod:`kvlens.proxy.dispatch`, :mod:`kvlens.proxy.relay`); ``GET /health``
asks both; ``GET /v1/models`` is D's; ``/metrics`` serves the router's
span-derived Prometheus metrics. All handlers run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from exporters.metrics import metrics_app
from instrumented_connector.ids import incoming_trace
from kvlens.proxy import relay
from kvlens.proxy.config import ProxyConfig
from kvlens.proxy.dispatch import dispatcher
from kvlens.proxy.errors import Upstream, from_http_error, invalid_body
from kvlens.proxy.exchange import Exchange
from kvlens.proxy.telemetry import RouterTelemetry

logger = logging.getLogger("kvlens.proxy")


class Router:
    """One app's shared state: the HTTP client towards P and D, the
    telemetry, and D's model name (asked once, for bodies without one).
    ``client``/``tel`` exist between :meth:`open` and :meth:`close`."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.dispatch = dispatcher(cfg)
        self.client: httpx.AsyncClient | None = None
        self.tel: RouterTelemetry | None = None
        self._model: str | None = None

    def open(self) -> None:
        cfg = self.cfg
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=cfg.max_connections,
                                max_keepalive_connections=cfg.max_connections),
            trust_env=False,
        )
        self.tel = RouterTelemetry(cfg)

    async def close(self) -> None:
        try:
            await self.client.aclose()
        finally:
            self.tel.close()

    async def model_name(self) -> str | None:
        """D's first model id, cached after the first success; None on failure."""
        if self._model is None:
            try:
                r = await self.client.get(self.cfg.decode_url + "/v1/models", timeout=10)
                self._model = r.json()["data"][0]["id"]
            except Exception:
                return None
        return self._model

    async def health(self) -> Response:
        async def one(url: str) -> str:
            try:
                r = await self.client.get(url + "/health", timeout=5)
                return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                return f"{type(e).__name__}"

        cfg = self.cfg
        p, d = await asyncio.gather(one(cfg.prefill_url), one(cfg.decode_url))
        ok = p == "ok" and d == "ok"
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "prefill": p, "decode": d,
             "mode": cfg.mode, "dispatch": cfg.effective_dispatch},
            status_code=200 if ok else 503,
        )

    async def models(self) -> Response:
        try:
            r = await self.client.get(self.cfg.decode_url + "/v1/models", timeout=10)
        except httpx.HTTPError as e:
            return from_http_error("decode", self.cfg.decode_url, e).response("")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def _prepare(self, ex: Exchange, request: Request) -> None:
        """Read the client body into ``ex`` (ValueError unless a JSON
        object), add D's model name when missing, set upstream headers."""
        body = json.loads(await request.body())
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        if "model" not in body:
            name = await self.model_name()
            if name:
                body["model"] = name
        ex.body = body
        ex.upstream_headers(request.headers.get("authorization"))

    async def handle(self, request: Request, endpoint: str) -> Response:
        """One completion request: trace id, body, P and D, relay."""
        t0 = time.time_ns()
        tid, parent = incoming_trace(request.headers)
        ex = Exchange(self.cfg, self.client, self.tel, endpoint, tid, parent, t0)
        try:
            await self._prepare(ex, request)
        except ValueError as e:
            ex.finish(400, "failed", None)
            return invalid_body(e, tid)
        try:
            d_resp = await self.dispatch(ex)
        except Upstream as u:
            ex.finish(u.status, u.outcome, None)
            return u.response(tid)
        except asyncio.CancelledError:
            if ex.p_task is not None:
                ex.p_task.cancel()
            ex.finish(499, "failed", None)
            raise
        if not ex.stream:
            return await relay.whole(ex, d_resp)
        return relay.streamed(ex, d_resp)


def create_app(config: ProxyConfig) -> FastAPI:
    """The router app for ``config`` (serve it with uvicorn; its lifespan
    opens and closes the HTTP client and the telemetry)."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.open()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="kvlens proxy", lifespan=lifespan)
    app.state.kvlens_config = config
    try:
        # The router's span-derived metrics (TTFT, handoff with trace-id
        # exemplars, requests by outcome) for the Prometheus users already run.
        app.mount("/metrics", metrics_app())
    except Exception:
        logger.warning("kvlens proxy: /metrics unavailable", exc_info=True)

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    return app
