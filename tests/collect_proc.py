"""A real ``kvlens collect`` subprocess on loopback for a test: its OTLP/HTTP
and OTLP/gRPC addresses as it printed them, its counters as ``/metrics``
shows them, and a SIGTERM stop that returns what it printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvrecord.config import TOKEN_ENV


class Collect:
    """``kvlens collect --port 0 --grpc-port 0 --store DB *args`` with ``env``
    added to a copy of the environment (``$KVLENS_TOKEN`` removed unless
    given). ``http``: the base URL (``http(s)://127.0.0.1:PORT``), ``grpc``:
    ``host:port`` of the gRPC side (None with ``--no-grpc``)."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None, store: Path | str | None = None):
        self.store = store or tmp_path / "collected.db"
        e = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        e.update({"KVLENS_HOME": str(tmp_path), **(env or {})})
        argv = [sys.executable, "-m", "kvlens.cli", "collect", "--port", "0", "--store", str(self.store)]
        if "--no-grpc" not in args:
            argv += ["--grpc-port", "0"]
        self.proc = subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
        self.lines: list[str] = []
        self.http = self.grpc = None
        try:
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"kvlens collect exited {self.proc.wait()}: {self.proc.stderr.read()}")
                self.lines.append(line.strip())
                if m := re.search(r"receiving OTLP/HTTP on (https?://\S+)/v1/traces", line):
                    self.http = m.group(1)
                elif m := re.search(r"receiving OTLP/gRPC on https?://(\S+)$", line.strip()):
                    self.grpc = m.group(1)
                elif "keep" in line:  # the last start-up line: "<security>; keep ..."
                    break
        except BaseException:
            self.kill()
            raise

    def metric(self, name: str, labels: dict | None = None, **client) -> float | None:
        """A sample of ``/metrics`` (``client``: httpx arguments, e.g. headers or verify)."""
        text = httpx.get(f"{self.http}/metrics", timeout=10, **client).raise_for_status().text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    return s.value
        return None

    def stop(self) -> tuple[int, str, str]:
        """SIGTERM, then (exit code, stdout after start-up, stderr)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=60)
        finally:
            self.kill()
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
