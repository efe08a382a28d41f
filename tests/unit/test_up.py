"""``kvlens up`` start-up checks that fail fast, before any vLLM process starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import RecordingServer
from kvrecord.config import Options

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
    from kvlens.stack.pinning import parse_cpu_list

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
    from kvlens.stack.commands import kv_transfer_config

    ktc = kv_transfer_config("push", "prefill", "p0", False, tmp_path)
    assert ktc["kv_connector"] == "InstrumentedNixlPushConnector" and ktc["kv_role"] == "kv_producer"
    assert ktc["kv_connector_module_path"] == "instrumented_connector"
    assert ktc["kv_connector_extra_config"]["kvlens_home"] == str(tmp_path)
    stock = kv_transfer_config("pull", "decode", "d0", True, tmp_path, kv_lease_s=7)
    assert stock["kv_connector"] == "NixlConnector" and stock["kv_role"] == "kv_consumer"
    assert "kv_connector_module_path" not in stock
    assert stock["kv_connector_extra_config"] == {"kv_lease_duration": 7, "push_registration_timeout": 150}
    # more kvlens keys go to kvlens' connector only, which checks them at start-up
    off = {"kvlens_store": "off", "kvlens_metrics": "off"}
    bare = kv_transfer_config("push", "decode", "d0", False, tmp_path, options=off)
    assert Options.from_config(bare["kv_connector_extra_config"]).store is None
    stock_extra = kv_transfer_config("push", "decode", "d0", True, tmp_path, options=off)["kv_connector_extra_config"]
    assert not any(k.startswith("kvlens") for k in stock_extra)


def test_stop_children_stops_the_whole_process_group(tmp_path):
    from kvlens.stack.supervise import Child, stop_children

    pidfile = tmp_path / "grandchild.pid"
    c = Child(
        "tree",
        ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"],
        dict(os.environ),
        tmp_path / "tree.log",
        "http://127.0.0.1:1",
    )
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
@pytest.mark.parametrize(
    "flag,value",
    [
        ("--port", "70000"),
        ("--port", "-1"),
        ("--port", "http"),
        ("--prefill-port", "65536"),
        ("--decode-port", "-80"),
        ("--prometheus-port", "0"),
        ("--timeout", "-5"),
        ("--timeout", "0"),
        ("--timeout", "inf"),
        ("--timeout", "nan"),
        ("--kv-lease", "0"),
        ("--kv-lease", "1.5"),
        ("--push-registration-timeout", "-1"),
    ],
)
def test_up_bad_numbers_are_usage_errors(capsys, flag, value):
    from kvlens.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["up", "--mode", "push", f"{flag}={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"kvlens up: error: argument {flag}:")


def test_up_refuses_an_open_host_without_token_key_or_insecure(capsys, monkeypatch):
    from kvlens import up
    from kvlens.stack.errors import StackError

    for k in ("VLLM_API_KEY", "KVLENS_API_KEY", "KVLENS_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    up.check_open("127.0.0.1", None, False)
    with pytest.raises(StackError, match="refusing --host 0.0.0.0 .* no token and no API key.*--insecure"):
        up.check_open("0.0.0.0", None, False)
    up.check_open("0.0.0.0", "sk-flag", False)  # the router takes the API key as its clients' credential
    with pytest.raises(StackError, match="the collector asks for \\$KVLENS_TOKEN"):
        up.check_open("0.0.0.0", "sk-flag", False, separate=True, collector="process")
    up.check_open("0.0.0.0", "sk-flag", False, separate=True, collector="router")
    assert capsys.readouterr().err == ""
    up.check_open("0.0.0.0", None, True)
    assert "--insecure and no token" in capsys.readouterr().err
    monkeypatch.setenv("KVLENS_TOKEN", "tok-0123456789abcdef")
    up.check_open("0.0.0.0", None, False, separate=True, collector="process")
    monkeypatch.delenv("KVLENS_TOKEN")
    monkeypatch.setenv("VLLM_API_KEY", "k")
    up.check_open("0.0.0.0", None, False)
    assert capsys.readouterr().err == ""


def test_stack_passes_the_token_by_environment_and_insecure_by_flag(tmp_path, monkeypatch):
    """The stack's children inherit $KVLENS_TOKEN (never on a command line);
    vLLM's own OTLP exporter gets it as the standard header variable when
    spans cross to a collector; --insecure reaches the router and the
    collector; the stack's own calls and Prometheus send the router's key."""
    from exporters.prometheus_server import PrometheusServer
    from kvlens.stack import manifest

    for k in ("VLLM_API_KEY", "KVLENS_API_KEY", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KVLENS_TOKEN", "tok-stack-0123456789")
    s = _stack(tmp_path, separate_homes=True, collector="process", collector_port=18005, insecure=True)
    p, r, c = s.roles.server("prefill"), s.roles.router("overlapped", 18000), s.roles.collector()
    for child in (p, r, c):
        assert (
            "tok-stack-0123456789" not in " ".join(child.argv) and child.env["KVLENS_TOKEN"] == "tok-stack-0123456789"
        )
    assert "--insecure" in r.argv and "--insecure" in c.argv and "--insecure" not in p.argv
    assert p.env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "authorization=Bearer%20tok-stack-0123456789"
    assert s.router_key == "tok-stack-0123456789"
    s.router_url = "http://127.0.0.1:18000"  # as start() fills it
    creds = manifest.scrape_credentials(s)
    assert creds == {"kvlens-router": "tok-stack-0123456789", "kvlens-collector": "tok-stack-0123456789"}
    prom = PrometheusServer(manifest.scrape_targets(s), data_dir=tmp_path / "prom", credentials=creds)
    cfg_text = prom.write_config().read_text()
    assert "tok-stack-0123456789" not in cfg_text  # the token is in a file of its own, 0600
    jobs = {j["job_name"]: j for j in prom.config()["scrape_configs"]}
    token_file = Path(jobs["kvlens-router"]["authorization"]["credentials_file"])
    assert token_file.read_text() == "tok-stack-0123456789" and token_file.stat().st_mode & 0o777 == 0o600
    assert "authorization" not in jobs["vllm-prefill"]
    prom.stop()
    assert not token_file.exists()
    # one host, no token: nothing added
    monkeypatch.delenv("KVLENS_TOKEN")
    (tmp_path / "one").mkdir()
    s = _stack(tmp_path / "one")
    assert (
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS" not in s.roles.server("prefill").env
        and "--insecure" not in s.roles.router("overlapped", 18000).argv
    )
    assert manifest.scrape_credentials(s) == {} and s.router_key is None


def test_port_arg_and_loopback():
    import argparse

    from frontdoor.credentials import is_loopback
    from kvrecord.argtypes import port_arg

    assert port_arg()("8000") == 8000 and port_arg(allow_zero=True)("0") == 0
    for bad in ("0", "65536", "x", "8e3"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_arg()(bad)
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))


# ------------------------------------------------ issue 12: the API key
def _stack(tmp_path, **kw):
    from kvlens.stack.launch import Stack

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    base = dict(
        mode="push",
        model=model,
        kvlens_home=tmp_path / "home",
        log_dir=tmp_path / "run",
        port=18000,
        prefill_port=18001,
        decode_port=18002,
        prefill_side_port=18003,
        decode_side_port=18004,
    )
    base.update(kw)
    return Stack(**base)


def test_api_key_reaches_p_d_and_router_through_the_environment_only(tmp_path, monkeypatch):
    from frontdoor.flags import API_KEY_ENV, env_api_key
    from kvlens.stack import commands

    for k in API_KEY_ENV:
        monkeypatch.delenv(k, raising=False)
    assert commands.api_key_env(None) == {} and commands.auth_headers(None) == {}
    assert commands.api_key_env("sk") == {"KVLENS_API_KEY": "sk", "VLLM_API_KEY": "sk"}
    assert env_api_key({"VLLM_API_KEY": "v"}) == "v"
    assert env_api_key({"VLLM_API_KEY": "v", "KVLENS_API_KEY": "k"}) == "k"  # as kvlens proxy reads them
    monkeypatch.setenv("KVLENS_API_KEY", "sk-inherited")  # must not win over the stack's own key
    s = _stack(tmp_path, api_key="sk-stack")
    p, d, r = s.roles.server("prefill"), s.roles.server("decode"), s.roles.router("overlapped", 18000)
    for c in (p, d, r):
        assert "sk-stack" not in " ".join(c.argv) and "--api-key" not in c.argv  # `ps` shows command lines
        assert c.env["VLLM_API_KEY"] == "sk-stack"  # what vLLM reads as --api-key
    assert r.env["KVLENS_API_KEY"] == "sk-stack"  # what kvlens proxy reads first
    assert "sk-stack" not in repr(s)
    monkeypatch.setenv("KVLENS_API_KEY", "sk-env")
    assert _stack(tmp_path).api_key == "sk-env"  # none given: the one the children would read anyway


def test_up_api_key_flag(tmp_path, monkeypatch):
    import argparse

    from kvlens import up, upargs

    monkeypatch.delenv("KVLENS_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    p = argparse.ArgumentParser()
    upargs.add_arguments(p)
    args = p.parse_args(
        ["--mode", "pull", "--api-key", "sk-flag", "--model", str(tmp_path), "--log-dir", str(tmp_path / "run")]
    )
    assert up._stack(args).api_key == "sk-flag"
    assert up._stack(p.parse_args(["--mode", "pull", "--log-dir", str(tmp_path / "run")])).api_key is None


def test_warm_up_and_health_checks_send_the_key(tmp_path):
    from kvlens.stack.supervise import Child, wait_healthy

    srv = RecordingServer()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = _stack(tmp_path, api_key="sk-w", quiet=True)
        s.router_url = srv.url
        s.warm_up(tries=1, timeout_s=10)
        c = Child("fake", ["x"], {}, tmp_path / "x.log", srv.url, proc=sleeper)
        wait_healthy([c], time.monotonic() + 10, lambda m: None, {"Authorization": "Bearer sk-w"})
    finally:
        sleeper.kill()
        sleeper.wait()
        srv.close()
    (post, health) = srv.seen
    assert post[:2] == ("POST", "/v1/completions") and post[2]["Authorization"] == "Bearer sk-w"
    assert len(post[2]["X-Request-Id"]) == 32
    assert health[:2] == ("GET", "/health") and health[2]["Authorization"] == "Bearer sk-w"


# ------------------------------------- issue 12: a previous stack's leftovers
def _sleeper() -> subprocess.Popen:
    """A real process in its own group, as a stack's child (the guard) is;
    returned once it runs its own program (right after Popen, a busy machine
    may not have let the child exec yet: /proc still shows the parent's
    command line and group)."""
    code = "import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            if code.encode() in argv and os.getpgid(proc.pid) == proc.pid:
                break
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.01)
    return proc


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _record(runs: Path, tag: str, proc: subprocess.Popen, ports: dict, supervisor: int | None = None) -> Path:
    import json

    from kvlens.stack.leftovers import cmdline, group_record

    d = runs / tag
    d.mkdir(parents=True)
    sup = supervisor if supervisor is not None else _dead_pid()
    (d / "stack.json").write_text(
        json.dumps(
            {
                "mode": "push",
                "ports": ports,
                "pids": {"prefill": proc.pid},
                "processes": [group_record("prefill", proc.pid)],
                "supervisor": {"pid": sup, "cmdline": cmdline(sup) or ["kvlens", "up"]},
            }
        )
    )
    return d / "stack.json"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_leftovers_are_named_not_killed(tmp_path):
    import json

    from kvlens.stack.leftovers import find_leftovers, group_record

    runs = tmp_path / "runs"
    proc = _sleeper()
    try:
        rec = group_record("prefill", proc.pid)
        assert rec["pgid"] == proc.pid and rec["members"][0]["pid"] == proc.pid
        assert rec["members"][0]["cmdline"][-1] == "import time; time.sleep(120)"
        path = _record(runs, "push-old", proc, {"router": 8000, "prefill": 8001})
        (lo,) = find_leftovers(runs)
        assert (lo.manifest, lo.names, lo.pgids, lo.pids, lo.ports) == (
            path,
            ["prefill"],
            [proc.pid],
            [proc.pid],
            [8000, 8001],
        )
        line = lo.line()
        assert "its kvlens is gone" in line and f"kill -TERM -{proc.pid}" in line and str(path) in line
        assert proc.poll() is None  # named, never stopped
        # a pid now used by another program is not blamed
        m = json.loads(path.read_text())
        m["processes"][0]["members"][0]["cmdline"] = ["/usr/bin/some-other-program"]
        path.write_text(json.dumps(m))
        assert find_leftovers(runs) == []
        # a stack whose kvlens still runs: named with its kvlens to stop; this process's own: skipped
        path.unlink()
        path.parent.rmdir()
        _record(runs, "push-running", proc, {}, supervisor=os.getppid())
        (lo,) = find_leftovers(runs)
        assert lo.supervisor == os.getppid() and lo.line().endswith(f"kill -TERM {os.getppid()}")
        _record(runs, "push-mine", proc, {}, supervisor=os.getpid())
        assert [x.manifest.parent.name for x in find_leftovers(runs)] == ["push-running"]
        (runs / "broken").mkdir()
        (runs / "broken" / "stack.json").write_text("{not json")
        (runs / "odd").mkdir()
        (runs / "odd" / "stack.json").write_text('{"processes": [{"members": [{"pid": "x"}]}], "pids": 3}')
        assert len(find_leftovers(runs)) == 1
    finally:
        proc.kill()
        proc.wait()
    assert find_leftovers(runs) == []  # gone: nothing to name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_busy_port_error_names_the_leftover_stack(tmp_path, capsys):
    from kvlens.stack.errors import StackError

    proc = _sleeper()
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            busy = s.getsockname()[1]
            _record(tmp_path / "home" / "runs", "push-old", proc, {"router": busy})
            with pytest.raises(StackError) as e:
                _stack(tmp_path, port=busy).preflight()
        msg = str(e.value)
        assert f"router port {busy} is already in use" in msg
        assert "a previous stack is still running" in msg and f"kill -TERM -{proc.pid}" in msg
        out = capsys.readouterr().out
        assert "[kvlens up] warning: a previous stack is still running" in out and str(busy) in out
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_manifest_records_groups_and_never_the_key(tmp_path):
    import json

    from kvlens.stack.supervise import Child

    s = _stack(tmp_path, api_key="sk-secret")
    c = Child(
        "prefill",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        dict(os.environ),
        tmp_path / "p.log",
        "http://127.0.0.1:1",
    )
    c.start()
    try:
        Path(s.log_dir).mkdir(parents=True, exist_ok=True)
        s.children.append(c)
        deadline = time.monotonic() + 10
        while len(s.manifest()["processes"][0]["members"]) < 2:  # the guard, then the server it starts
            assert time.monotonic() < deadline
            time.sleep(0.05)
        m = s.manifest()
        (rec,) = m["processes"]
        assert rec["name"] == "prefill" and rec["pgid"] == c.proc.pid
        assert {x["pid"] for x in rec["members"]} >= {c.proc.pid}
        assert any(x["cmdline"][-1] == "import time; time.sleep(60)" for x in rec["members"])
        assert m["supervisor"]["pid"] == os.getpid() and m["api_key"] is True
        assert "sk-secret" not in json.dumps(m)
    finally:
        from kvlens.stack.supervise import stop_children

        stop_children([c], grace_s=5)


# ------------------------------------------------------------ issue 42 item 7: sudo kvlens up --hosts
def test_up_hosts_without_a_token_is_refused_unless_insecure(tmp_path):
    """``sudo`` drops $KVLENS_TOKEN: ``kvlens up --hosts`` with no token used to
    turn --insecure on silently. Now exit 2 with one line naming
    --token-file and --insecure, before anything starts (no log dir, no
    namespace)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVLENS_TOKEN", "KVLENS_API_KEY", "VLLM_API_KEY")}
    env.update(KVLENS_HOME=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    logs = tmp_path / "logs"
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push", "--hosts", "--log-dir", str(logs)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "refusing --hosts with no token" in line and "--token-file" in line and "--insecure" in line
    assert not logs.exists()


def test_up_token_file_reaches_every_child_by_environment_and_short_tokens_are_refused(tmp_path, monkeypatch):
    from kvlens import up
    from kvlens.upargs import add_arguments

    import argparse

    # use_token writes os.environ itself: setenv first, so the test's end restores what was there
    monkeypatch.setenv("KVLENS_TOKEN", "replaced-by-the-file-0123")
    monkeypatch.delenv("KVLENS_TOKEN")
    p = argparse.ArgumentParser()
    add_arguments(p)
    tok = tmp_path / "token"
    tok.write_text("file-token-0123456789\n")
    tok.chmod(0o600)
    args = p.parse_args(["--mode", "push", "--hosts", "--token-file", str(tok)])
    up.use_token(args)
    assert os.environ["KVLENS_TOKEN"] == "file-token-0123456789"
    up.check_hosts(args)  # a token: no refusal, and no --insecure for the router and the collector
    s = _stack(tmp_path, separate_homes=True, collector="process", collector_port=18005)
    r, c = s.roles.router("overlapped", 18000), s.roles.collector()
    for child in (r, c):
        assert "--insecure" not in child.argv and "file-token-0123456789" not in " ".join(child.argv)
        assert child.env["KVLENS_TOKEN"] == "file-token-0123456789"
    # the router exports to the collector kvlens configured: marked, and vLLM's header for it set
    assert r.env["KVLENS_COLLECTOR_ENDPOINTS"] == r.env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    tok.write_text("short\n")
    from frontdoor.credentials import SecurityError

    with pytest.raises(SecurityError, match="5 characters, under the minimum of 16"):
        up.use_token(args)
    monkeypatch.delenv("KVLENS_TOKEN")
    with pytest.raises(Exception, match="refusing --hosts with no token"):
        up.check_hosts(p.parse_args(["--mode", "push", "--hosts"]))
    up.check_hosts(p.parse_args(["--mode", "push", "--hosts", "--insecure"]))  # said out loud: allowed
