"""kvlens configuration: where its files live and the connector's options.

* Home: ``kv_connector_extra_config["kvlens_home"]``, else ``$KVLENS_HOME``,
  else ``./.kvlens``. The trace store defaults to ``<home>/traces.db`` and
  the generated tiny model to ``<home>/model``. Every kvlens component asks
  this module; none rebuilds the path.
* Options: the ``kvlens_*`` / ``otlp_endpoint`` keys of
  ``kv_connector_extra_config``, checked up front by :func:`validate_config`
  so a typo fails at engine start-up with a message naming the key (strict
  at start, forgiving at run time).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

HOME_ENV = "KVLENS_HOME"
DEFAULT_HOME = ".kvlens"
STORE_FILE = "traces.db"

KNOWN_KEYS = frozenset(
    {
        "kvlens_home",
        "kvlens_store",
        "otlp_endpoint",
        "kvlens_buffer_events",
        "kvlens_metrics",
        "kvlens_service_name",
    }
)

_ON = ("on", "true")
_OFF = ("off", "false")


def home(cfg: Mapping[str, Any] | None = None) -> Path:
    """The kvlens home directory, absolute (not created)."""
    h = (cfg or {}).get("kvlens_home") or os.environ.get(HOME_ENV) or DEFAULT_HOME
    return Path(h).expanduser().resolve()


def store_path(cfg: Mapping[str, Any] | None = None) -> Path:
    """Default trace store: ``<home>/traces.db``."""
    return home(cfg) / STORE_FILE


def model_dir(cfg: Mapping[str, Any] | None = None) -> Path:
    """Default generated tiny model: ``<home>/model``."""
    return home(cfg) / "model"


def enabled(cfg: Mapping[str, Any], key: str, default: bool = True) -> bool:
    """An on/off option (``on``/``off``/``true``/``false``, any case, or a bool)."""
    v = cfg.get(key)
    if v is None:
        return default
    return str(v).strip().lower() not in _OFF


def validate_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The kvlens keys of ``kv_connector_extra_config``, checked.

    Raises ValueError naming the bad key or value; other (vLLM) keys pass
    through untouched and are not returned."""
    for k in cfg:
        if k.startswith("kvlens") and k not in KNOWN_KEYS:
            raise ValueError(f"unknown kvlens option {k!r} in kv_connector_extra_config (known: {sorted(KNOWN_KEYS)})")
    out = {k: v for k, v in cfg.items() if k in KNOWN_KEYS}
    if "kvlens_buffer_events" in out:
        try:
            n = int(out["kvlens_buffer_events"])
        except (TypeError, ValueError):
            n = 0
        if n <= 0:
            raise ValueError(f"kvlens_buffer_events must be a positive integer, got {out['kvlens_buffer_events']!r}")
    for key in ("kvlens_store", "kvlens_metrics"):
        if key in out and str(out[key]).strip().lower() not in _ON + _OFF:
            raise ValueError(f"{key} must be 'on' or 'off', got {out[key]!r}")
    ep = out.get("otlp_endpoint")
    if ep is not None and not str(ep).startswith(("http://", "https://")):
        raise ValueError(f"otlp_endpoint must be an http(s) URL, got {ep!r}")
    return out
