"""The one Prometheus HTTP API client of kvlens (``/api/v1/...`` over httpx).

Used by :mod:`exporters.prometheus_server` (the local server wrapper: readiness,
queries, exemplars, target health) and by the dashboard (``dashboard/prom.py``:
PromQL for the Overview page).

Contract: every call is a blocking HTTP GET on the caller's thread, bounded by
``timeout_s`` (seconds); pass ``client=`` (an ``httpx.Client``) to reuse one
connection over many queries, else each call opens and closes its own. Any
failure (unreachable, timeout, not JSON, ``status != "success"``, HTTP status
other than 200) raises :class:`PrometheusError` with the URL, the API path and
Prometheus' own ``errorType: error``; nothing else escapes.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import httpx

#: Default per-request timeout (seconds).
DEFAULT_TIMEOUT_S = 10.0

#: One instant-query result item: ``{"metric": {label: value}, "value": [t, "v"]}``.
Sample = dict[str, Any]


class PrometheusError(RuntimeError):
    """Prometheus could not start, is unreachable, or a query failed."""


def client(timeout_s: float = DEFAULT_TIMEOUT_S) -> httpx.Client:
    """A connection to reuse over several calls (``client=``); close it, or use ``with``."""
    return httpx.Client(timeout=timeout_s)


def get(
    url: str,
    path: str,
    params: Mapping[str, Any] | None = None,
    *,
    client: httpx.Client | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """GET ``url + path`` and return the response's ``data`` member."""
    base = url.rstrip("/")
    own = client is None
    c = client or httpx.Client(timeout=timeout_s)
    try:
        r = c.get(base + path, params=dict(params or {}))
    except httpx.HTTPError as e:
        raise PrometheusError(f"Prometheus at {base} unreachable: {type(e).__name__}: {e}") from e
    finally:
        if own:
            c.close()
    try:
        body = r.json()
    except ValueError:
        raise PrometheusError(f"{base}{path}: HTTP {r.status_code}: {r.text[:200]}") from None
    if r.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
        err = body if isinstance(body, dict) else {}
        raise PrometheusError(
            f"{base}{path} {dict(params or {})}: HTTP {r.status_code} "
            f"{err.get('errorType', '')}: {err.get('error', '')}"
        )
    return body.get("data")


def ready(url: str, *, client: httpx.Client | None = None, timeout_s: float = 1.0) -> bool:
    """True when ``/-/ready`` answers 200; False when it does not (yet), or is unreachable."""
    own = client is None
    c = client or httpx.Client(timeout=timeout_s)
    try:
        return c.get(url.rstrip("/") + "/-/ready").status_code == 200
    except httpx.HTTPError:
        return False
    finally:
        if own:
            c.close()


def query(
    url: str,
    promql: str,
    *,
    time_s: float | None = None,
    client: httpx.Client | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Sample]:
    """Instant query: the ``data.result`` list. A scalar or string result comes
    back as one item with empty labels, so callers see one shape."""
    params: dict[str, Any] = {"query": promql}
    if time_s is not None:
        params["time"] = time_s
    data = get(url, "/api/v1/query", params, client=client, timeout_s=timeout_s) or {}
    res = data.get("result")
    if data.get("resultType") in ("scalar", "string"):
        return [{"metric": {}, "value": res}]
    return list(res or [])


def values(result: list[Sample]) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of each sample of a :func:`query` result; samples that
    are NaN, infinite or malformed are dropped."""
    out = []
    for item in result:
        try:
            v = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(v):
            out.append((item.get("metric") or {}, v))
    return out


def query_exemplars(
    url: str,
    promql: str,
    start_s: float,
    end_s: float,
    *,
    client: httpx.Client | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Exemplars of the series selected by ``promql`` in [start_s, end_s] (Unix seconds)."""
    params = {"query": promql, "start": start_s, "end": end_s}
    return get(url, "/api/v1/query_exemplars", params, client=client, timeout_s=timeout_s) or []


def targets_health(
    url: str, *, client: httpx.Client | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Active scrape targets, each with ``labels``, ``health`` and ``lastError``."""
    data = get(url, "/api/v1/targets", {"state": "active"}, client=client, timeout_s=timeout_s) or {}
    return data.get("activeTargets") or []


def rule_groups(
    url: str, *, client: httpx.Client | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Loaded rule groups (``/api/v1/rules``): ``name``, ``file``, ``rules`` (recording and alerting;
    an alerting rule carries ``state`` and its ``alerts``, each with ``labels`` and ``annotations``)."""
    data = get(url, "/api/v1/rules", client=client, timeout_s=timeout_s) or {}
    return data.get("groups") or []
