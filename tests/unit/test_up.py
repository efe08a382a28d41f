"""``kvlens up`` start-up checks that fail fast, before any vLLM process starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ------------------------------------------------------------ fail fast
def test_up_bad_model_path_fails_fast(tmp_path):
    missing = tmp_path / "no-such-model"
    t0 = time.monotonic()
    r = _cli("up", "--mode", "push", "--model", str(missing), "--port", "0")
    assert r.returncode != 0
    assert str(missing) in r.stderr
    assert time.monotonic() - t0 < 60


def test_up_model_without_config_fails_fast(tmp_path):
    r = _cli("up", "--mode", "pull", "--model", str(tmp_path), "--port", "0")
    assert r.returncode != 0
    assert "config.json" in r.stderr and str(tmp_path) in r.stderr


def test_up_busy_port_fails_fast(tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli("up", "--mode", "push", "--model", str(tiny_model), "--port", str(port))
    assert r.returncode != 0
    assert f"{port} is already in use" in r.stderr


def test_parse_cpu_list():
    from kvlens.up import parse_cpu_list

    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    for spec in ("auto", "nobind", "0|1", "", None, "a-b"):
        assert parse_cpu_list(spec) is None, spec
