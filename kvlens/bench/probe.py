"""What a running router says about itself: mode and dispatch on
``/health``, served model and its max length on ``/v1/models``. Blocking
HTTP (10 s timeout per call); used before any load is sent."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from kvlens.bench.grid import DISPATCHES, MODES, BenchError


@dataclass
class RouterInfo:
    url: str
    mode: str | None  # None: the router does not report it
    dispatch: str | None
    model: str | None  # served model name
    root: str | None  # served model's directory
    max_model_len: int | None


def _get_json(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    import httpx  # here for start-up cost: `kvlens --help` imports this module

    with httpx.Client(timeout=timeout, trust_env=False) as c:
        r = c.get(url)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def _served_model(url: str) -> tuple[str | None, str | None, int | None]:
    """(model id, root, max_model_len) from ``/v1/models``; Nones when unknown."""
    import httpx  # here for start-up cost

    try:
        st, models = _get_json(url + "/v1/models")
    except httpx.HTTPError:
        return None, None, None
    if st == 200 and isinstance(models, dict) and models.get("data"):
        m0 = models["data"][0]
        mml = m0.get("max_model_len")
        return m0.get("id"), m0.get("root"), int(mml) if mml else None
    return None, None, None


def probe_router(url: str) -> RouterInfo:
    """``/health`` and ``/v1/models`` of a router; BenchError when it is not
    reachable or not healthy."""
    import httpx  # here for start-up cost

    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--proxy must be an http(s) URL, got {url!r}")
    try:
        status, health = _get_json(url + "/health")
    except httpx.HTTPError as e:
        raise BenchError(f"router at {url} is unreachable ({type(e).__name__}: {e})") from None
    if status != 200:
        raise BenchError(f"router at {url} is not healthy: HTTP {status} {json.dumps(health) if health else ''}".strip())
    health = health if isinstance(health, dict) else {}
    model, root, mml = _served_model(url)
    mode = health.get("mode") if health.get("mode") in MODES else None
    dispatch = health.get("dispatch") if mode == "push" and health.get("dispatch") in DISPATCHES else None
    return RouterInfo(url, mode, dispatch, model, root, mml)


def served_name(url: str) -> str | None:
    """The model name a router serves, or None when it cannot be asked."""
    with contextlib.suppress(Exception):
        return probe_router(url).model
    return None
