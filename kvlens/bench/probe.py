"""What a running router says about itself: mode and dispatch on
``/health``, served model and its max length on ``/v1/models``; and what D
says about its own time per output token on ``/metrics`` (the TPOT
cross-check). Blocking HTTP (10 s timeout per call)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from kvlens.bench.grid import DISPATCHES, MODES, BenchError
from kvlens.stack.commands import auth_headers


@dataclass
class RouterInfo:
    url: str
    mode: str | None  # None: the router does not report it
    dispatch: str | None
    model: str | None  # served model name
    root: str | None  # served model's directory
    max_model_len: int | None


#: D's per-request TPOT histogram, (last token - first token) / (tokens - 1)
#: per finished request, the client's definition: its vLLM 0.32/0.33 name,
#: then the name older vLLM releases used.
DECODE_TPOT_METRICS = ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds")


def _get_json(url: str, timeout: float = 10.0, api_key: str | None = None) -> tuple[int, Any]:
    import httpx  # here for start-up cost: `kvlens --help` imports this module

    with httpx.Client(timeout=timeout, trust_env=False) as c:
        r = c.get(url, headers=auth_headers(api_key))
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def _served_model(url: str, api_key: str | None = None) -> tuple[str | None, str | None, int | None]:
    """(model id, root, max_model_len) from ``/v1/models``; Nones when unknown."""
    import httpx  # here for start-up cost

    try:
        status, models = _get_json(url + "/v1/models", api_key=api_key)
    except httpx.HTTPError:
        return None, None, None
    if status == 200 and isinstance(models, dict) and models.get("data"):
        m0 = models["data"][0]
        mml = m0.get("max_model_len")
        return m0.get("id"), m0.get("root"), int(mml) if mml else None
    return None, None, None


def read_token() -> str | None:
    """What opens a router's ``/health`` details besides its API key:
    ``$KVLENS_READ_TOKEN``, else ``$KVLENS_TOKEN``."""
    import os

    from kvrecord.config import client_token

    return os.environ.get("KVLENS_READ_TOKEN", "").strip() or client_token()


def probe_router(url: str, api_key: str | None = None) -> RouterInfo:
    """``/health`` and ``/v1/models`` (with ``api_key``) of a router;
    BenchError when it is not reachable or not healthy."""
    import httpx  # here for start-up cost

    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--proxy must be an http(s) URL, got {url!r}")
    try:
        status, health = _get_json(url + "/health", api_key=api_key or read_token())  # the mode: a detail
    except httpx.HTTPError as e:
        raise BenchError(f"router at {url} is unreachable ({type(e).__name__}: {e})") from None
    if status != 200:
        raise BenchError(
            f"router at {url} is not healthy: HTTP {status} {json.dumps(health) if health else ''}".strip()
        )
    health = health if isinstance(health, dict) else {}
    model, root, mml = _served_model(url, api_key)
    mode = health.get("mode") if health.get("mode") in MODES else None
    dispatch = health.get("dispatch") if mode == "push" and health.get("dispatch") in DISPATCHES else None
    return RouterInfo(url, mode, dispatch, model, root, mml)


def served_name(url: str, api_key: str | None = None) -> str | None:
    """The model name a router serves, or None when it cannot be asked."""
    with contextlib.suppress(Exception):
        return probe_router(url, api_key).model
    return None


def parse_tpot(text: str) -> tuple[float, float] | None:
    """``(sum, count)`` of D's TPOT histogram (:data:`DECODE_TPOT_METRICS`,
    the first name present, summed over its label sets) in a Prometheus text
    exposition; None when neither name is there."""
    from prometheus_client.parser import text_string_to_metric_families  # start-up cost

    found: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            for base in DECODE_TPOT_METRICS:
                if smp.name in (base + "_sum", base + "_count"):
                    acc = found.setdefault(base, [0.0, 0.0])
                    acc[smp.name.endswith("_count")] += smp.value
    for base in DECODE_TPOT_METRICS:
        if base in found:
            return found[base][0], found[base][1]
    return None


def decode_tpot(decode_url: str | None) -> tuple[tuple[float, float] | None, str | None]:
    """D's TPOT histogram now: ``((sum, count), None)``, or ``(None, why
    not)`` (no URL, unreachable, not exposed). Never raises."""
    import httpx  # here for start-up cost

    if not decode_url:
        return None, "D's URL is not known (kvlens bench --decode-url URL): not cross-checked"
    url = decode_url.rstrip("/") + "/metrics"
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as c:
            r = c.get(url)
    except httpx.HTTPError as e:
        return None, f"D's {url} unreachable ({type(e).__name__})"
    if r.status_code != 200:
        return None, f"D's {url} answered HTTP {r.status_code}"
    try:
        got = parse_tpot(r.text)
    except Exception as e:  # not a Prometheus exposition
        return None, f"D's {url} could not be parsed ({type(e).__name__})"
    if got is None:
        return None, f"D's {url} has no {DECODE_TPOT_METRICS[0]}"
    return got, None
