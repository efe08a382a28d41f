"""A real Prometheus server for kvlens: writes its config, the kvlens
recording rules and alert rules, runs ``/usr/bin/prometheus`` (Debian package ``prometheus``,
2.42) with exemplar storage, and queries it over the HTTP API (through
:mod:`exporters.promapi`, the one client).

Used by ``kvlens up`` / the demo and by the tests. Scrape jobs are named by the
caller (``kvlens-router``, ``vllm-prefill``, ``vllm-decode``); ``instance`` is
the scraped ``host:port``, so fleet figures come from aggregating over
``instance`` - kvlens adds no host labels of its own.

Lifecycle: :meth:`PrometheusServer.start` blocks until ``/-/ready``;
:meth:`stop` sends SIGTERM, waits, then SIGKILL. The child
(:class:`kvrecord.children.ChildProcess`) is its own session and gets
SIGTERM if the parent dies (Linux ``PR_SET_PDEATHSIG``), so a killed test
run leaves no orphan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from exporters import promapi
from exporters.promapi import PrometheusError
from kvrecord.children import ChildProcess
from kvrecord.ports import free_port, port_in_use

__all__ = ["PrometheusError", "PrometheusServer", "alert_rules_path", "rules_path"]

DEFAULT_BINARY = "/usr/bin/prometheus"
RULES_FILE = "recording_rules.yml"
ALERTS_FILE = "alert_rules.yml"
#: What ``rules=True`` loads, in this order (files under ``exporters/assets``).
RULE_FILES = (RULES_FILE, ALERTS_FILE)
_JOB_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_DURATION_RE = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
_API_TIMEOUT_S = 10.0
_INSTALL_HINT = "install Debian package prometheus: apt-get install prometheus (make setup does it)"


def rules_path() -> Path:
    """The packaged recording rules (``exporters/assets/recording_rules.yml``)."""
    return Path(str(resources.files("exporters") / "assets" / RULES_FILE))


def alert_rules_path() -> Path:
    """The packaged alert rules (``exporters/assets/alert_rules.yml``; docs/handoff-health.md)."""
    return Path(str(resources.files("exporters") / "assets" / ALERTS_FILE))


def _check_target(job: str, target: str) -> None:
    if not isinstance(target, str) or target.count(":") < 1 or "/" in target:
        raise ValueError(f"target {target!r} of job {job!r} must be 'host:port'")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {target!r} of job {job!r} must be 'host:port' with a port in 1..65535")


def _write_secret(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its owner only, never through a
    link: written to a new file beside it (``O_CREAT | O_EXCL | O_NOFOLLOW``,
    mode ``0600``, so neither a file nor a link planted there is opened)
    that then replaces ``path`` (a rename replaces a link itself, not what it
    points to). A symlink at ``path`` made by another user of a shared
    directory therefore cannot make kvlens write the token elsewhere."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class PrometheusServer:
    """One local Prometheus process scraping ``targets`` (job -> ``host:port`` list).

    ``port=0`` picks a free port. ``rules=True`` loads the kvlens recording
    rules and alert rules (:data:`RULE_FILES`, evaluated every
    ``scrape_interval``; alerts show on ``/api/v1/alerts``, no Alertmanager). Strict at construction:
    bad ports, empty targets or intervals raise ``ValueError``.
    """

    def __init__(
        self,
        targets: Mapping[str, Sequence[str]],
        port: int = 9090,
        data_dir: str | Path = Path(".kvlens/prometheus"),
        rules: bool = True,
        scrape_interval: str = "2s",
        *,
        binary: str | Path = DEFAULT_BINARY,
        retention: str = "1d",
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ValueError(f"port must be an integer in 0..65535 (0: pick a free one), got {port!r}")
        if not targets:
            raise ValueError("targets is empty: give at least one job -> ['host:port', ...]")
        clean: dict[str, list[str]] = {}
        for job, tl in targets.items():
            if not isinstance(job, str) or not _JOB_RE.match(job):
                raise ValueError(f"invalid job name {job!r} (letters, digits, '_', '-', '.')")
            if isinstance(tl, str) or not tl:
                raise ValueError(f"job {job!r} needs a non-empty list of 'host:port' targets, got {tl!r}")
            for t in tl:
                _check_target(job, t)
            clean[job] = list(tl)
        if not _DURATION_RE.match(str(scrape_interval)):
            raise ValueError(f"scrape_interval must look like 2s / 500ms / 1m, got {scrape_interval!r}")
        if not _DURATION_RE.match(str(retention)):
            raise ValueError(f"retention must look like 1d / 12h, got {retention!r}")
        self.targets = clean
        self.port = port
        self.data_dir = Path(data_dir).resolve()
        self.rules = rules
        self.scrape_interval = str(scrape_interval)
        self.binary = Path(binary)
        self.retention = retention
        unknown = set(credentials or {}) - set(clean)
        if unknown:
            raise ValueError(f"credentials for jobs that are not scraped: {sorted(unknown)}")
        #: job -> bearer token its targets ask for on /metrics (never in repr or in prometheus.yml)
        self._credentials = dict(credentials or {})
        self.proc: ChildProcess | None = None

    # ------------------------------------------------------------- config
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "prometheus.yml"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "prometheus.log"

    def credentials_path(self, job: str) -> Path:
        """Where a job's bearer token is kept while Prometheus runs (mode 0600)."""
        return self.data_dir / f"{job}.token"

    def _scrape_config(self, job: str, targets: list[str]) -> dict[str, Any]:
        sc: dict[str, Any] = {"job_name": job, "metrics_path": "/metrics", "static_configs": [{"targets": targets}]}
        if job in self._credentials:  # the file, not the token: prometheus.yml stays free of secrets
            sc["authorization"] = {"type": "Bearer", "credentials_file": str(self.credentials_path(job))}
        return sc

    def config(self) -> dict[str, Any]:
        """The ``prometheus.yml`` content (a dict; written as JSON, which is YAML)."""
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [self._scrape_config(job, tl) for job, tl in self.targets.items()],
        }
        if self.rules:
            cfg["rule_files"] = list(RULE_FILES)
        return cfg

    def write_config(self) -> Path:
        """``prometheus.yml`` (and the rules); each job's token in its own file
        only the owner can read (Prometheus has no other way to take one
        than a file or the config itself; removed by :meth:`stop`)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for job, token in self._credentials.items():
            _write_secret(self.credentials_path(job), token)
        if self.rules:
            for name in RULE_FILES:
                shutil.copyfile(rules_path().parent / name, self.data_dir / name)
        self.config_path.write_text(json.dumps(self.config(), indent=2) + "\n")
        return self.config_path

    # ----------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> "PrometheusServer":
        """Write config, start Prometheus, wait for ``/-/ready``; raise PrometheusError otherwise."""
        if self.running():
            return self
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise PrometheusError(f"Prometheus binary not found at {self.binary}: {_INSTALL_HINT}")
        if self.port == 0:
            self.port = free_port()
        elif port_in_use(self.port):
            raise PrometheusError(
                f"port {self.port} on 127.0.0.1 is busy (another Prometheus?): stop it or pass another port (0: any free)"
            )
        self.write_config()
        argv = [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir / 'data'}",
            f"--storage.tsdb.retention.time={self.retention}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--enable-feature=exemplar-storage",
        ]
        self.proc = ChildProcess(argv, log=self.log_path, group="group", death_signal=signal.SIGTERM).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                self.stop()
                raise PrometheusError(f"prometheus exited with code {self.proc.returncode}:\n{tail}")
            if promapi.ready(self.url, timeout_s=1.0):
                return self
            time.sleep(0.1)
        tail = self._tail()
        self.stop()
        raise PrometheusError(f"prometheus not ready on {self.url} after {timeout:.0f}s:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait ``timeout``, SIGKILL; the token files removed. Idempotent."""
        if self.proc is not None:
            self.proc.stop(timeout)
        for job in self._credentials:
            self.credentials_path(job).unlink(missing_ok=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # --------------------------------------------------------------- API
    # Blocking HTTP calls on the caller's thread (10 s timeout); failures raise PrometheusError.
    def query(self, promql: str, time_s: float | None = None) -> list[dict[str, Any]]:
        """Instant query: the ``data.result`` list (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        return promapi.query(self.url, promql, time_s=time_s, timeout_s=_API_TIMEOUT_S)

    def query_exemplars(self, promql: str, start_s: float, end_s: float) -> list[dict[str, Any]]:
        """Exemplars of the series selected by ``promql`` in [start, end]."""
        return promapi.query_exemplars(self.url, promql, start_s, end_s, timeout_s=_API_TIMEOUT_S)

    def rule_groups(self) -> list[dict[str, Any]]:
        """Loaded rule groups (``/api/v1/rules``): each with ``name``, ``file`` and ``rules``
        (an alert rule with its ``state``: inactive, pending or firing, and its ``alerts``)."""
        return promapi.rule_groups(self.url, timeout_s=_API_TIMEOUT_S)

    def targets_health(self) -> list[dict[str, Any]]:
        """Active targets with ``labels``, ``health`` and ``lastError``."""
        return promapi.targets_health(self.url, timeout_s=_API_TIMEOUT_S)
