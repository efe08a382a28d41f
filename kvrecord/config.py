"""kvlens configuration: where its files live and the connector's options.

* Home: ``kv_connector_extra_config["kvlens_home"]``, else ``$KVLENS_HOME``,
  else ``./.kvlens``. The trace store defaults to ``<home>/traces.db``
  (:func:`default_store`) and the generated tiny model to ``<home>/model``.
  Every kvlens component asks this module; none rebuilds the path.
* Store: ``kvlens_store`` is ``"on"`` (the default: ``<home>/traces.db``),
  ``"off"`` (spans go only to ``otlp_endpoint``), or a PostgreSQL URL
  ``postgresql://user@host:port/dbname`` (``postgres://`` too): the
  process writes that shared database instead of the local file. One key
  rather than a second one, because "where do spans go" has one answer per
  process; a malformed URL fails :meth:`Options.from_config` naming the
  problem. :attr:`Options.store` is a
  :class:`~kvrecord.location.StoreLocation`, or None when off.
* Retention: ``kvlens_retention`` (``"7d"``, ``"12h"``, seconds, or
  ``"off"``, the default): traces older than that are pruned by the writer
  (:attr:`Options.retention_s`, :class:`kvtrace.store.Retention`).
* Options: the ``kvlens_*`` / ``otlp_endpoint`` keys of
  ``kv_connector_extra_config``, checked once, where they enter, by
  :meth:`Options.from_config`, so a typo fails at engine start-up with a
  message naming the key and the option it was probably meant to be
  (strict at start, forgiving at run time); everything after that takes
  the :class:`Options`. The same dict carries vLLM's own keys
  (``kv_lease_duration``, ``push_registration_timeout``, ...): those pass
  untouched.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvrecord.durations import parse_duration
from kvrecord.keeprule import KeepRule
from kvrecord.location import StoreLocation, is_url

HOME_ENV = "KVLENS_HOME"
#: The bearer token kvlens servers check and kvlens clients send (:mod:`frontdoor.flags`; read here so the
#: exporters below the CLI layer send it too).
TOKEN_ENV = "KVLENS_TOKEN"
#: The ingest role's token (exporters -> a collector; :mod:`frontdoor.credentials`), and the
#: OTLP endpoints the operator marked as kvlens collectors (the only ones a token goes to).
INGEST_TOKEN_ENV = "KVLENS_INGEST_TOKEN"
COLLECTORS_ENV = "KVLENS_COLLECTOR_ENDPOINTS"
DEFAULT_HOME = ".kvlens"
STORE_FILE = "traces.db"

KNOWN_KEYS = frozenset(
    {
        "kvlens_home",
        "kvlens_store",
        "otlp_endpoint",
        "otlp_protocol",
        "kvlens_buffer_events",
        "kvlens_metrics",
        "kvlens_service_name",
        "kvlens_retention",
        "kvlens_span_builder",
        "kvlens_keep",
        "kvlens_keep_ratio",
        "kvlens_keep_slow",
        "open_trace_after_s",
        "kvlens_nixl_progress_thread",
    }
)

#: Default of ``open_trace_after_s``: a handoff open this long is written out as a partial trace.
DEFAULT_OPEN_TRACE_AFTER_S = 5.0

#: An unknown key is taken for a misspelled kvlens option when it starts with
#: one of these, or is this similar to a known key (difflib ratio; vLLM's own
#: keys score below 0.7 against every kvlens key).
_OUR_PREFIXES = ("kvlens", "otlp")
_TYPO_CUTOFF = 0.8
_STR_KEYS = ("kvlens_home", "otlp_endpoint", "otlp_protocol", "kvlens_service_name")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
SPAN_BUILDERS = ("sidecar", "inline")

_ON = ("on", "true")
_OFF = ("off", "false")


def home(cfg: Mapping[str, Any] | None = None) -> Path:
    """The kvlens home directory, absolute (not created)."""
    h = (cfg or {}).get("kvlens_home") or os.environ.get(HOME_ENV) or DEFAULT_HOME
    return Path(h).expanduser().resolve()


def client_token(env: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token a kvlens client sends: ``$KVLENS_TOKEN`` stripped, or None."""
    tok = env.get(TOKEN_ENV, "").strip()
    return tok or None


def ingest_token(env: Mapping[str, str] = os.environ) -> str | None:
    """The token an exporter sends with its spans: ``$KVLENS_INGEST_TOKEN``
    (the ingest role's own), else ``$KVLENS_TOKEN`` (the all-roles one), or None."""
    return env.get(INGEST_TOKEN_ENV, "").strip() or client_token(env)


def default_store(home_dir: Path | None = None) -> StoreLocation:
    """The home's SQLite store, ``<home>/traces.db`` (default: :func:`home`)."""
    return StoreLocation.sqlite((home() if home_dir is None else home_dir) / STORE_FILE)


def model_dir(cfg: Mapping[str, Any] | None = None) -> Path:
    """Default generated tiny model: ``<home>/model``."""
    return home(cfg) / "model"


def _positive_int(key: str, v: Any) -> int:
    """A positive integer option: an int, or a string of one (JSON from the
    command line); a bool or a fractional number is an error, not 1.
    ValueError naming ``key`` otherwise."""
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


def _retention(v: Any) -> float | None:
    """``kvlens_retention`` in seconds, or None (keep everything). ValueError on a bad value."""
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


def _seconds_or_off(key: str, v: Any) -> float:
    """A number of seconds >= 0 (0: off), or a string of one; ValueError naming ``key`` otherwise."""
    n = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        n = float(v)
    elif isinstance(v, str):
        try:
            n = float(v.strip())
        except ValueError:
            n = None
    if n is None or not n >= 0 or n == float("inf"):
        raise ValueError(f"{key} must be a number of seconds >= 0 (0: off), got {v!r}")
    return n


def _on_off(key: str, v: Any) -> bool:
    """A switch: a bool, or ``on``/``true``/``off``/``false``; ValueError naming ``key`` otherwise."""
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text not in _ON + _OFF:
        raise ValueError(f"{key} must be 'on' or 'off', got {v!r}")
    return text in _ON


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


def _store(v: Any) -> StoreLocation | bool:
    """``kvlens_store``: its PostgreSQL location, else whether the home's file is on."""
    if is_url(v):
        try:
            return StoreLocation.parse(v)
        except ValueError as e:
            raise ValueError(f"kvlens_store: {e}") from None
    text = str(v).strip().lower()
    if text not in _ON + _OFF:
        raise ValueError(f"kvlens_store must be 'on', 'off' or a postgresql://user@host:port/dbname URL, got {v!r}")
    return text in _ON


def _checked(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The kvlens keys of ``cfg``, each checked (and the store, buffer and
    retention parsed); ValueError for a misspelled key or a bad value."""
    for k in cfg:
        if k not in KNOWN_KEYS and isinstance(k, str):
            err = _unknown_key_error(k)
            if err is not None:
                raise err
    out = {k: v for k, v in cfg.items() if k in KNOWN_KEYS}
    if "kvlens_buffer_events" in out:
        out["kvlens_buffer_events"] = _positive_int("kvlens_buffer_events", out["kvlens_buffer_events"])
    if "kvlens_metrics" in out and str(out["kvlens_metrics"]).strip().lower() not in _ON + _OFF:
        raise ValueError(f"kvlens_metrics must be 'on' or 'off', got {out['kvlens_metrics']!r}")
    out["kvlens_store"] = _store(out["kvlens_store"]) if "kvlens_store" in out else True
    out["kvlens_retention"] = _retention(out.get("kvlens_retention"))
    out["kvlens_keep"] = KeepRule.parse(
        out.get("kvlens_keep"), out.get("kvlens_keep_ratio"), out.get("kvlens_keep_slow"), prefix="kvlens_keep"
    )
    if "open_trace_after_s" in out:
        out["open_trace_after_s"] = _seconds_or_off("open_trace_after_s", out["open_trace_after_s"])
    if "kvlens_nixl_progress_thread" in out:
        out["kvlens_nixl_progress_thread"] = _on_off("kvlens_nixl_progress_thread", out["kvlens_nixl_progress_thread"])
    builder = out.get("kvlens_span_builder")
    if "kvlens_span_builder" in out and str(builder).strip().lower() not in SPAN_BUILDERS:
        raise ValueError(f"kvlens_span_builder must be 'sidecar' or 'inline', got {builder!r}")
    for key in _STR_KEYS:
        if key in out and out[key] is not None and not isinstance(out[key], (str, os.PathLike)):
            raise ValueError(f"{key} must be a string, got {out[key]!r}")
    ep = out.get("otlp_endpoint")
    if ep is not None and not str(ep).startswith(("http://", "https://")):
        raise ValueError(f"otlp_endpoint must be an http(s) URL, got {ep!r}")
    proto = out.get("otlp_protocol")
    if proto is not None and str(proto).strip().lower() not in OTLP_PROTOCOLS:
        raise ValueError(f"otlp_protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {proto!r}")
    return out


@dataclass(frozen=True)
class Options:
    """One process's kvlens options, checked: what the telemetry pipeline
    (:mod:`exporters.pipeline`), the sidecar and the connector take.

    ``home``: the kvlens home (absolute). ``store``: where spans are
    written, None when ``kvlens_store`` is off. ``metrics``: span-derived
    Prometheus metrics. ``retention_s``: prune traces older than this (None:
    keep all). ``buffer_events``: the recorder's buffer (None: the
    recorder's default). ``span_builder``: ``"sidecar"`` / ``"inline"``, or
    None when not set (``$KVLENS_SPAN_BUILDER`` or the default decide).
    ``service_name``: the spans' ``service.name`` (None: ``kvlens-<role>``).
    ``otlp_endpoint``: an OTLP collector (None: the OTel environment).
    ``otlp_protocol``: ``http/protobuf`` or ``grpc`` (None: the OTel
    environment, else OTLP/HTTP). The bearer token a collector wants is never
    an option (vLLM's argv shows them): ``$KVLENS_TOKEN`` or the standard
    ``$OTEL_EXPORTER_OTLP_HEADERS`` (:func:`exporters.pipeline.otlp_headers`)."""

    home: Path
    store: StoreLocation | None
    metrics: bool = True
    retention_s: float | None = None
    buffer_events: int | None = None
    span_builder: str | None = None
    service_name: str | None = None
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    #: which requests keep their spans in the store (``kvlens_keep``, ``kvlens_keep_ratio``, ``kvlens_keep_slow``)
    keep: KeepRule = KeepRule()
    #: a handoff open this long (s) is written out as a ``handoff.open`` partial trace; 0: never (docs/handoff-health.md)
    open_trace_after_s: float = DEFAULT_OPEN_TRACE_AFTER_S
    #: ``kvlens_nixl_progress_thread``: False creates the worker's NIXL agent without its UCX progress
    #: thread (an experiment for small hosts, :mod:`instrumented_connector.nixlagent`, docs/links.md)
    nixl_progress_thread: bool = True

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None) -> "Options":
        """The options in ``kv_connector_extra_config`` (or a dict built from
        command-line flags), all checked here, once.

        Raises ValueError naming the bad key or value: an unknown key that
        looks like a kvlens option (starts with ``kvlens``/``otlp``, or is a
        near miss of a known key: ``otlp_endpiont``) names the option it was
        probably meant to be. Other (vLLM) keys are ignored."""
        out = _checked(cfg or {})
        home_dir = home(out)
        store = out["kvlens_store"]  # a PostgreSQL location, or whether the home's file is on
        if isinstance(store, bool):
            store = default_store(home_dir) if store else None
        builder = out.get("kvlens_span_builder")
        return cls(
            home=home_dir,
            store=store,
            metrics=str(out.get("kvlens_metrics", "on")).strip().lower() not in _OFF,
            retention_s=out["kvlens_retention"],
            buffer_events=out.get("kvlens_buffer_events"),
            span_builder=None if builder is None else str(builder).strip().lower(),
            service_name=str(out["kvlens_service_name"]) if out.get("kvlens_service_name") else None,
            otlp_endpoint=str(out["otlp_endpoint"]) if out.get("otlp_endpoint") else None,
            otlp_protocol=str(out["otlp_protocol"]).strip().lower() if out.get("otlp_protocol") else None,
            keep=out["kvlens_keep"],
            open_trace_after_s=out.get("open_trace_after_s", DEFAULT_OPEN_TRACE_AFTER_S),
            nixl_progress_thread=out.get("kvlens_nixl_progress_thread", True),
        )

    def to_config(self) -> dict[str, Any]:
        """The kvlens keys :meth:`from_config` rebuilds these options from
        (JSON-safe: what crosses to the sidecar process). A URL's password
        is in it. ValueError for a file store other than ``<home>/traces.db``,
        which the connector's options cannot name."""
        if self.store is not None and not self.store.is_postgres and self.store != default_store(self.home):
            raise ValueError(f"kvlens_store names only <home>/{STORE_FILE} or a PostgreSQL URL, not {self.store}")
        out: dict[str, Any] = {
            "kvlens_home": str(self.home),
            "kvlens_metrics": "on" if self.metrics else "off",
            "kvlens_store": "off" if self.store is None else (self.store.url or "on"),
        }
        optional = {
            "kvlens_retention": self.retention_s,
            "kvlens_buffer_events": self.buffer_events,
            "kvlens_span_builder": self.span_builder,
            "kvlens_service_name": self.service_name,
            "otlp_endpoint": self.otlp_endpoint,
            "otlp_protocol": self.otlp_protocol,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.open_trace_after_s != DEFAULT_OPEN_TRACE_AFTER_S:
            out["open_trace_after_s"] = self.open_trace_after_s
        if self.keep.sampled:
            out.update(self.keep.to_config())
        if not self.nixl_progress_thread:
            out["kvlens_nixl_progress_thread"] = "off"
        return out
