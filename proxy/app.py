"""The router's ASGI app: :func:`create_app` and its routes.

``POST /v1/completions`` and ``/v1/chat/completions`` go through P and D
(:mod:`proxy.dispatch`, :mod:`proxy.relay`) once
:mod:`proxy.intake` accepted them, to the P and D the
:class:`~proxy.balancer.Balancer` picks; ``GET /health`` asks every
P and D; ``GET /v1/models`` is the first D's; ``/metrics`` serves the router's span-derived
Prometheus metrics. With any credential every route but ``/health`` requires
one, scoped by role (:func:`~proxy.intake.client_auth`): ``/v1/*`` the
token or the API key; ``/metrics`` (a Prometheus scrape job sends it with
``authorization: {credentials_file: ...}``) and ``/health``'s details the
read token, the token or the API key; ``/admin/split`` the admin token or
the token; with ``--collect``, ``POST /v1/traces`` the ingest token or the
token. In front of it, :class:`frontdoor.samesite.SameSiteGuard` refuses a POST
that is not JSON, a foreign ``Host`` or ``Origin`` (cross-site requests, DNS
rebinding).

A mixed fleet (push and pull instances, a canary): each request's mode is
drawn with the split's push weight (:mod:`proxy.split`), then its P
and D are picked among that mode's instances and it is dispatched as that
mode needs; the root span records the mode and the weight. A request may
name its mode itself (header ``X-Kvlens-Mode: push|pull``: no draw, no
weight recorded, so the verdict leaves it out). ``GET /admin/split`` shows
the weight and the requests per mode; ``POST /admin/split`` with
``{"push": 0.25}`` (or ``{"pull": 0.75}``) changes it for the requests that
come next. All handlers run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from exporters.metrics import metrics_app
from frontdoor.bearer import DETAILS_SCOPE_KEY
from frontdoor.samesite import OTLP_TYPES, SameSiteGuard
from proxy import relay
from proxy.balancer import Balancer
from proxy.config import MODES, ProxyConfig
from proxy.dispatch import dispatcher
from proxy.errors import Upstream, from_http_error
from proxy.exchange import Exchange
from proxy.intake import TRACES_PATH, Refused, check_fields, client_auth, parse_object, read_limited
from proxy.isolation import TraceIds
from proxy.split import Split, push_of_pull
from proxy.telemetry import RouterTelemetry

logger = logging.getLogger("kvlens.proxy")

#: Request header naming the mode a request goes by (no draw).
MODE_HEADER = "x-kvlens-mode"
#: How long (s) ``/health`` reuses P's and D's answers, and its pool's connections.
HEALTH_CACHE_S = 1.0
HEALTH_POOL = 4


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (after its body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_gone(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s result, unless the client disconnects first: then ``work``
    is cancelled (which closes its calls to P and D) and :class:`ClientGone`
    raised. Starlette cancels nothing for a plain (non-streamed) answer by
    itself, and the wait for P and D comes before any streamed answer starts:
    without this watch P and D would work on for a client that left."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


class Router:
    """One app's shared state: the HTTP client towards P and D, the
    balancer, the telemetry, the trace ids in use
    (:class:`~proxy.isolation.TraceIds`) and D's model name (asked
    once, for bodies without one).
    ``client``/``tel`` exist between :meth:`open` and :meth:`close`."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.dispatch = dispatcher(cfg)
        self.balancer = Balancer.for_config(cfg)
        #: per mode: its dispatch function and its balancer (a mixed fleet has two)
        self.dispatches = {m: dispatcher(cfg, m) for m in cfg.modes}
        self.balancers = {m: Balancer(*cfg.fleet(m)) for m in cfg.modes}
        self.split = Split(cfg.split if cfg.mixed else (1.0 if cfg.modes == ("push",) else 0.0), cfg.split_seed)
        self.ids = TraceIds(cfg.reuse_window_s)
        self.client: httpx.AsyncClient | None = None
        #: ``/health``'s own pool, and its cached answer: (monotonic time, (ok, P states, D states))
        self.health_client: httpx.AsyncClient | None = None
        self._health: tuple[float, tuple[bool, list[str], list[str]]] | None = None
        self._health_lock: asyncio.Lock | None = None
        self.tel: RouterTelemetry | None = None
        self._model: str | None = None
        self._model_warned = False

    def open(self) -> None:
        cfg = self.cfg
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections),
            trust_env=False,
        )
        self.health_client = httpx.AsyncClient(
            timeout=httpx.Timeout(5.0, connect=min(5.0, cfg.connect_timeout_s)),
            limits=httpx.Limits(max_connections=HEALTH_POOL, max_keepalive_connections=HEALTH_POOL),
            trust_env=False,
        )
        self._health_lock = asyncio.Lock()
        self.tel = RouterTelemetry(cfg)

    async def close(self) -> None:
        try:
            await self.client.aclose()
            await self.health_client.aclose()
        finally:
            self.tel.close()

    def upstream_auth(self, request: Request | None) -> str | None:
        """Authorization for every call to P and D: the API key when the
        router has one (the client proved it knows the router's key), none
        when the router has only its own token (the client's header holds
        that token, which is not P's or D's to see), else the client's header
        as it came (P and D may have a key the router does not know)."""
        if self.cfg.api_key:
            return f"Bearer {self.cfg.api_key}"
        if self.cfg.any_token:
            return None
        return request.headers.get("authorization") if request is not None else None

    def _auth_headers(self, request: Request | None) -> dict[str, str]:
        auth = self.upstream_auth(request)
        return {"Authorization": auth} if auth else {}

    async def model_name(self, request: Request | None = None) -> str | None:
        """D's first model id, cached after the first success; None on failure
        (logged once: vLLM then answers the body without ``model`` itself)."""
        if self._model is None:
            try:
                r = await self.client.get(
                    self.cfg.decode_url + "/v1/models", timeout=10, headers=self._auth_headers(request)
                )
                r.raise_for_status()
                self._model = r.json()["data"][0]["id"]
            except Exception as e:
                if not self._model_warned:
                    self._model_warned = True
                    logger.warning(
                        "kvlens proxy: could not ask decode for its model name (%s: %s); "
                        "bodies without `model` are sent as they are",
                        type(e).__name__,
                        e,
                    )
                return None
        return self._model

    async def health(self, details: bool) -> Response:
        """200 when every P and every D answers its ``/health`` with 200, else
        503. ``details`` (the read role proved, :func:`client_auth`): each
        instance named by engine id, never by URL, the modes, dispatch and
        split; else ``{"status": ...}`` alone. The instances' answers are
        cached :data:`HEALTH_CACHE_S` and asked on a pool of their own
        (:data:`HEALTH_POOL` connections, never the serving pool), one fan-out
        at a time: a burst of probes costs P and D one GET each per second."""
        ok, p_got, d_got = await self._instance_states()
        status = "ok" if ok else "unhealthy"
        if not details:
            return JSONResponse({"status": status}, status_code=200 if ok else 503)
        cfg = self.cfg
        ps, ds = cfg.prefills, cfg.decodes

        def side(states: list[str]) -> str:  # "ok", or the first problem
            return next((s for s in states if s != "ok"), "ok")

        return JSONResponse(
            {
                "status": status,
                "prefill": side(p_got),
                "decode": side(d_got),
                "instances": {
                    "prefill": {p.engine_id: s for p, s in zip(ps, p_got)},
                    "decode": {d.engine_id: s for d, s in zip(ds, d_got)},
                },
                "mode": ",".join(cfg.modes),
                "dispatch": cfg.effective_dispatch
                if not cfg.mixed
                else ",".join(f"{m}={cfg.dispatch_for(m)}" for m in cfg.modes),
                **(
                    {"split": {"push": self.split.push_weight, "pull": 1 - self.split.push_weight}} if cfg.mixed else {}
                ),
            },
            status_code=200 if ok else 503,
        )

    async def _instance_states(self) -> tuple[bool, list[str], list[str]]:
        """(all ok, P states, D states), from the cache when younger than :data:`HEALTH_CACHE_S`."""

        async def one(url: str) -> str:
            try:
                r = await self.health_client.get(url + "/health", headers=self._auth_headers(None))
                return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                return f"{type(e).__name__}"

        async with self._health_lock:
            cached = self._health
            if cached is not None and time.monotonic() - cached[0] < HEALTH_CACHE_S:
                return cached[1]
            ps, ds = self.cfg.prefills, self.cfg.decodes
            got = await asyncio.gather(*(one(x.url) for x in [*ps, *ds]))
            state = (all(s == "ok" for s in got), list(got[: len(ps)]), list(got[len(ps) :]))
            self._health = (time.monotonic(), state)
            return state

    async def models(self, request: Request) -> Response:
        try:
            r = await self.client.get(
                self.cfg.decode_url + "/v1/models", timeout=10, headers=self._auth_headers(request)
            )
        except httpx.HTTPError as e:
            return from_http_error("decode", self.cfg.decode_url, e).response("")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def _intake(self, ex: Exchange, request: Request) -> None:
        """Read and check the client body into ``ex`` (raises
        :class:`~proxy.intake.Refused`); set upstream headers."""
        raw = await read_limited(request.headers, request.stream(), self.cfg.max_body_bytes)
        ex.body = parse_object(raw)
        check_fields(ex.body, ex.endpoint)
        ex.upstream_headers(self.upstream_auth(request))

    def _choose_mode(self, ex: Exchange, request: Request) -> None:
        """The request's mode: the one its ``X-Kvlens-Mode`` header names, else
        a mixed fleet's draw (the weight recorded), else the router's.
        Refused (400/503) for a mode that is not one or has no instances here."""
        asked = request.headers.get(MODE_HEADER)
        if asked is not None:
            asked = asked.strip().lower()
            if asked not in MODES:
                raise Refused(400, f"X-Kvlens-Mode must be push or pull, got {asked!r}", param="X-Kvlens-Mode")
            if asked not in self.cfg.modes:
                raise Refused(
                    503,
                    f"no {asked} instances behind this router (it has {', '.join(self.cfg.modes)})",
                    kind="no_instances",
                )
            ex.mode = asked
        elif self.cfg.mixed:
            ex.mode, ex.split = self.split.draw()
        else:
            ex.mode = self.cfg.mode

    async def _answer(self, ex: Exchange, request: Request) -> Response:
        """P and D for a checked request, and the relay of D's answer."""
        self._choose_mode(ex, request)
        ex.route = self.balancers[ex.mode].pick()  # after intake: a refused request takes no turn
        if "model" not in ex.body:
            name = await self.model_name(request)
            if name:
                ex.body["model"] = name
        try:
            d_resp = await self.dispatches[ex.mode](ex)
        except Upstream as u:
            ex.finish(u.status, u.outcome, None, u.message)
            return u.response(ex.trace_id)
        if not ex.stream:
            return await relay.whole(ex, d_resp)
        return relay.streamed(ex, d_resp)

    async def handle(self, request: Request, endpoint: str) -> Response:
        """One completion request (its key checked already: :func:`client_auth`):
        trace id, body, P and D, relay."""
        t0 = time.time_ns()
        tid, parent, client_ids = self.ids.claim(request.headers)
        ex = Exchange(
            self.cfg,
            self.client,
            self.tel,
            endpoint,
            tid,
            parent,
            t0,
            client_attrs=client_ids,
            on_finish=lambda: self.ids.release(tid),
            on_end=self.split.count,
        )
        try:
            await self._intake(ex, request)
            return await unless_client_gone(request, self._answer(ex, request))
        except Refused as r:
            ex.finish(r.status, "failed", None, r.message)
            return r.response(tid)
        except (ClientGone, ClientDisconnect):
            ex.finish(499, "failed", None, relay.CLIENT_GONE)
            return Response(status_code=499)  # nobody reads it
        except asyncio.CancelledError:
            ex.finish(499, "failed", None, relay.CLIENT_GONE)
            raise
        except Exception as e:  # a router bug: still a span, a JSON answer and the id
            logger.exception("kvlens proxy: request %s failed in the router", tid)
            ex.finish(500, "failed", None, f"router error: {type(e).__name__}: {e}")
            return Refused(500, f"router error: {type(e).__name__}", kind="internal_error").response(tid)

    def split_state(self) -> dict:
        """``GET /admin/split``'s answer."""
        return {"modes": list(self.cfg.modes), "mixed": self.cfg.mixed, **self.split.to_json()}

    async def admin_split(self, request: Request) -> Response:
        """``GET``: the split; ``POST {"push": W}`` or ``{"pull": W}``: a new
        weight for the requests that come next (400 naming the problem; 409
        on a fleet of one mode: there is nothing to split). Its key was
        checked already (:func:`client_auth`, as on every route but ``/health``)."""
        if request.method == "GET":
            return JSONResponse(self.split_state())
        if not self.cfg.mixed:
            return Refused(
                409,
                f"this router has only {self.cfg.modes[0]} instances: there is nothing to split "
                "(start it with instances of both modes: --prefill push=URL --prefill pull=URL ...)",
                kind="no_instances",
            ).response(None)
        try:
            body = parse_object(await read_limited(request.headers, request.stream(), 4096))
        except Refused as r:
            return r.response(None)
        keys = [k for k in body if k in MODES]
        if len(keys) != 1 or len(body) != 1:
            return Refused(400, 'send one of {"push": W} or {"pull": W}, W in [0, 1]', param="split").response(None)
        w = body[keys[0]]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            return Refused(400, f"{keys[0]} weight must be a number in [0, 1], got {w!r}", param=keys[0]).response(None)
        push = float(w) if keys[0] == "push" else push_of_pull(w)
        old = self.split.set(push)
        logger.info("kvlens proxy: split push=%.3g (was %.3g)", push, old)
        return JSONResponse({**self.split_state(), "previous": {"push": old, "pull": push_of_pull(old)}})


def _receiver_ingest(config: ProxyConfig):
    """The OTLP receiver's write queue into the router's store (``--collect``),
    else None. Its own registry (forwarded into the router's ``/metrics``):
    the handoff metric stays the router's own, resolved when its root span
    ends, now that P's and D's spans reach its store."""
    if not config.collect:
        return None
    from collector.ingest import Ingest
    from prometheus_client import CollectorRegistry

    return Ingest(
        config.options.store, registry=CollectorRegistry(), retention=config.retention, keep=config.options.keep
    )


def create_app(config: ProxyConfig) -> FastAPI:
    """The router app for ``config`` (serve it with uvicorn; its lifespan
    opens and closes the HTTP client and the telemetry)."""
    router = Router(config)
    ingest = _receiver_ingest(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.open()
        try:
            yield
        finally:
            await router.close()
            if ingest is not None:  # flush what P and D sent before going
                await asyncio.get_running_loop().run_in_executor(None, ingest.close, 10.0)

    app = FastAPI(title="kvlens proxy", lifespan=lifespan)
    app.state.kvlens_config = config
    # every route but /health, the receiver and /metrics included; then, outermost, the Host /
    # Origin / Content-Type guard (frontdoor.samesite: no cross-site POST, no DNS rebinding)
    app.add_middleware(client_auth, security=config.security(), api_key=config.api_key)
    app.add_middleware(
        SameSiteGuard,
        bind_host=config.bind_host,
        allowed_hosts=config.allowed_hosts,
        post_types={TRACES_PATH: OTLP_TYPES},
        body=lambda status, msg: (
            Refused(status, msg, kind="forbidden" if status == 403 else "invalid_request_error").response(None).body
        ),
    )
    if ingest is not None:
        from collector.app import mount_receiver
        from prometheus_client import REGISTRY

        mount_receiver(app, ingest, REGISTRY)
    try:
        # The router's span-derived metrics (TTFT, handoff with trace-id
        # exemplars, requests by outcome) for the Prometheus users already run.
        app.mount("/metrics", metrics_app())
    except Exception:
        logger.warning("kvlens proxy: /metrics unavailable", exc_info=True)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await router.health(bool(request.scope.get(DETAILS_SCOPE_KEY, False)))

    @app.api_route("/admin/split", methods=["GET", "POST"])
    async def admin_split(request: Request) -> Response:
        return await router.admin_split(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    return app
