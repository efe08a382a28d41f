"""``kvlens up`` start-up checks that fail fast, before any vLLM process starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# ------------------------------------------------------------ stack parts
def test_assign_ports_checks_then_fills():
    from kvlens.stack.errors import StackError
    from kvlens.stack.ports import assign_ports

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(StackError, match=f"router port {busy} is already in use"):
            assign_ports({"router port": busy}, "127.0.0.1", ["router port"])
    with pytest.raises(StackError, match="given twice"):
        assign_ports({"a": 23456, "b": 23456}, "127.0.0.1", [])
    got = assign_ports({"a": None, "b": 0, "c": None}, "127.0.0.1", ["a", "b"])
    assert got["c"] is None and got["a"] and got["b"] and got["a"] != got["b"]


def test_kv_transfer_config_instrumented_and_stock(tmp_path):
    from kvlens.up import kv_transfer_config

    ktc = kv_transfer_config("push", "prefill", "p0", False, tmp_path)
    assert ktc["kv_connector"] == "InstrumentedNixlPushConnector" and ktc["kv_role"] == "kv_producer"
    assert ktc["kv_connector_module_path"] == "instrumented_connector"
    assert ktc["kv_connector_extra_config"]["kvlens_home"] == str(tmp_path)
    stock = kv_transfer_config("pull", "decode", "d0", True, tmp_path, kv_lease_s=7)
    assert stock["kv_connector"] == "NixlConnector" and stock["kv_role"] == "kv_consumer"
    assert "kv_connector_module_path" not in stock
    assert stock["kv_connector_extra_config"] == {"kv_lease_duration": 7, "push_registration_timeout": 150}


def test_stop_children_stops_the_whole_process_group(tmp_path):
    from kvlens.stack.supervise import Child, stop_children

    pidfile = tmp_path / "grandchild.pid"
    c = Child("tree", ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], dict(os.environ),
              tmp_path / "tree.log", "http://127.0.0.1:1")
    c.start()
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    stop_children([c], grace_s=5)
    assert not c.alive()
    time.sleep(0.2)
    try:
        os.kill(grandchild, 0)
        gone = open(f"/proc/{grandchild}/stat").read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        gone = True
    assert gone, "the grandchild outlived its process group"


# ------------------------------------------------ issue 12: flag checks
@pytest.mark.parametrize("flag,value", [
    ("--port", "70000"), ("--port", "-1"), ("--port", "http"), ("--prefill-port", "65536"),
    ("--decode-port", "-80"), ("--prometheus-port", "0"), ("--timeout", "-5"), ("--timeout", "0"),
    ("--timeout", "inf"), ("--timeout", "nan"), ("--kv-lease", "0"), ("--kv-lease", "1.5"),
    ("--push-registration-timeout", "-1"),
])
def test_up_bad_numbers_are_usage_errors(capsys, flag, value):
    from kvlens.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["up", "--mode", "push", f"{flag}={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"kvlens up: error: argument {flag}:")


def test_up_warns_when_open_beyond_loopback(capsys, monkeypatch):
    from kvlens import up

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("KVLENS_API_KEY", raising=False)
    up._warn_if_open("127.0.0.1")
    assert capsys.readouterr().err == ""
    up._warn_if_open("0.0.0.0")
    assert "warning: --host 0.0.0.0 without VLLM_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_API_KEY", "k")
    up._warn_if_open("0.0.0.0")
    assert capsys.readouterr().err == ""


def test_port_arg_and_loopback():
    import argparse

    from kvlens.stack.ports import is_loopback, port_arg

    assert port_arg()("8000") == 8000 and port_arg(allow_zero=True)("0") == 0
    for bad in ("0", "65536", "x", "8e3"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_arg()(bad)
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))
