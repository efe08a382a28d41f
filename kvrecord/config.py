"""kvlens configuration: where its files live and the connector's options.

* Home: ``kv_connector_extra_config["kvlens_home"]``, else ``$KVLENS_HOME``,
  else ``./.kvlens``. The trace store defaults to ``<home>/traces.db`` and
  the generated tiny model to ``<home>/model``. Every kvlens component asks
  this module; none rebuilds the path.
* Store: ``kvlens_store`` is ``"on"`` (the default: ``<home>/traces.db``),
  ``"off"`` (spans go only to ``otlp_endpoint``), or a PostgreSQL URL
  ``postgresql://user@host:port/dbname`` (``postgres://`` too): the
  process writes that shared database instead of the local file. One key
  rather than a second one, because "where do spans go" has one answer per
  process; a malformed URL fails :func:`validate_config` naming the problem.
  :func:`store_path` returns the file's :class:`Path` or the URL (str).
* Retention: ``kvlens_retention`` (``"7d"``, ``"12h"``, seconds, or
  ``"off"``, the default): traces older than that are pruned by the writer
  (:func:`retention_s`, :class:`kvtrace.store.Retention`).
* Options: the ``kvlens_*`` / ``otlp_endpoint`` keys of
  ``kv_connector_extra_config``, checked up front by :func:`validate_config`
  so a typo fails at engine start-up with a message naming the key and the
  option it was probably meant to be (strict at start, forgiving at run
  time). The same dict carries vLLM's own keys (``kv_lease_duration``,
  ``push_registration_timeout``, ...): those pass untouched.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Mapping

from kvrecord.durations import parse_duration
from kvrecord.location import check_url, is_url

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
        "kvlens_retention",
        "kvlens_span_builder",
    }
)

#: An unknown key is taken for a misspelled kvlens option when it starts with
#: one of these, or is this similar to a known key (difflib ratio; vLLM's own
#: keys score below 0.7 against every kvlens key).
_OUR_PREFIXES = ("kvlens", "otlp")
_TYPO_CUTOFF = 0.8
_STR_KEYS = ("kvlens_home", "otlp_endpoint", "kvlens_service_name")

_ON = ("on", "true")
_OFF = ("off", "false")


def home(cfg: Mapping[str, Any] | None = None) -> Path:
    """The kvlens home directory, absolute (not created)."""
    h = (cfg or {}).get("kvlens_home") or os.environ.get(HOME_ENV) or DEFAULT_HOME
    return Path(h).expanduser().resolve()


def store_path(cfg: Mapping[str, Any] | None = None) -> Path | str:
    """The trace store: ``kvlens_store``'s PostgreSQL URL when it is one, else
    ``<home>/traces.db``. A URL is a ``str``: pass it on as it is (``Path()``
    would mangle it); :func:`kvtrace.store.location` names both."""
    v = (cfg or {}).get("kvlens_store")
    if is_url(v):
        return v.strip()
    return home(cfg) / STORE_FILE


def retention_s(cfg: Mapping[str, Any] | None = None) -> float | None:
    """``kvlens_retention`` in seconds, or None (keep everything). ValueError on a bad value."""
    v = (cfg or {}).get("kvlens_retention")
    if v is None or isinstance(v, bool):
        if v is True:
            raise ValueError("kvlens_retention must be a duration such as '7d' or 'off', got True")
        return None
    if isinstance(v, (int, float)):
        if not v > 0:
            raise ValueError(f"kvlens_retention must be > 0 seconds, got {v!r}")
        return float(v)
    text = str(v).strip().lower()
    if text in _OFF + ("none", ""):
        return None
    try:
        return parse_duration(text)
    except ValueError as e:
        raise ValueError(f"kvlens_retention: {e}") from None


def model_dir(cfg: Mapping[str, Any] | None = None) -> Path:
    """Default generated tiny model: ``<home>/model``."""
    return home(cfg) / "model"


def enabled(cfg: Mapping[str, Any], key: str, default: bool = True) -> bool:
    """An on/off option (``on``/``off``/``true``/``false``, any case, or a bool)."""
    v = cfg.get(key)
    if v is None:
        return default
    return str(v).strip().lower() not in _OFF


def _unknown_key_error(key: str) -> ValueError | None:
    """The error for ``key`` when it looks like a misspelled kvlens option, else None."""
    k = key.strip().lower()
    near = difflib.get_close_matches(k, KNOWN_KEYS, n=1, cutoff=_TYPO_CUTOFF)
    if not near and not k.startswith(_OUR_PREFIXES):
        return None  # someone else's key (vLLM's, another connector's)
    near = near or difflib.get_close_matches(k, KNOWN_KEYS, n=1, cutoff=0.0)
    return ValueError(
        f"unknown kvlens option {key!r} in kv_connector_extra_config: did you mean {near[0]!r}? "
        f"(known: {', '.join(sorted(KNOWN_KEYS))})"
    )


def _positive_int(key: str, v: Any) -> int:
    """A positive integer option: an int, or a string of one (JSON from the
    command line); a bool or a fractional number is an error, not 1."""
    n = None
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, float) and v.is_integer():
        n = int(v)
    elif isinstance(v, str) and v.strip().isdigit():
        n = int(v.strip())
    if n is None or n <= 0:
        raise ValueError(f"{key} must be a positive integer, got {v!r}")
    return n


def validate_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The kvlens keys of ``kv_connector_extra_config``, checked.

    Raises ValueError naming the bad key or value: an unknown key that looks
    like a kvlens option (starts with ``kvlens``/``otlp``, or is a near miss
    of a known key: ``otlp_endpiont``) names the option it was probably meant
    to be. Other (vLLM) keys pass through untouched and are not returned."""
    for k in cfg:
        if k not in KNOWN_KEYS and isinstance(k, str):
            err = _unknown_key_error(k)
            if err is not None:
                raise err
    out = {k: v for k, v in cfg.items() if k in KNOWN_KEYS}
    if "kvlens_buffer_events" in out:
        _positive_int("kvlens_buffer_events", out["kvlens_buffer_events"])
    if "kvlens_metrics" in out and str(out["kvlens_metrics"]).strip().lower() not in _ON + _OFF:
        raise ValueError(f"kvlens_metrics must be 'on' or 'off', got {out['kvlens_metrics']!r}")
    if "kvlens_store" in out:
        v = out["kvlens_store"]
        if is_url(v):
            try:
                check_url(v)
            except ValueError as e:
                raise ValueError(f"kvlens_store: {e}") from None
        elif str(v).strip().lower() not in _ON + _OFF:
            raise ValueError(f"kvlens_store must be 'on', 'off' or a postgresql://user@host:port/dbname URL, got {v!r}")
    if "kvlens_retention" in out:
        retention_s(out)
    if "kvlens_span_builder" in out and str(out["kvlens_span_builder"]).strip().lower() not in ("sidecar", "inline"):
        raise ValueError(f"kvlens_span_builder must be 'sidecar' or 'inline', got {out['kvlens_span_builder']!r}")
    for key in _STR_KEYS:
        if key in out and out[key] is not None and not isinstance(out[key], (str, os.PathLike)):
            raise ValueError(f"{key} must be a string, got {out[key]!r}")
    ep = out.get("otlp_endpoint")
    if ep is not None and not str(ep).startswith(("http://", "https://")):
        raise ValueError(f"otlp_endpoint must be an http(s) URL, got {ep!r}")
    return out
