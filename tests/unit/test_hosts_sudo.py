"""``sudo kvlens up --hosts`` (issue 42, item 7): only the namespace plumbing
needs root. Under ``$SUDO_UID`` the servers run as that user. Real network
namespaces and the real ``kvlens collect`` and ``kvlens proxy`` in them (no
vLLM: P's and D's command lines go through the same ``_child``, checked
below as built); the uid read from ``/proc``; the collector writes spans
into a home handed to the user."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kvlens.stack.errors import StackError
from kvrecord.config import TOKEN_ENV
from kvrecord.ports import free_port
from test_collector import pb_body, record_spans, stored, trace_ids

NOBODY = 65534
TOKEN = "sudo-stack-" + "t" * 20


def _need_root_and_nobody() -> None:
    from kvlens.stack import netns

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    try:
        netns.check_tools(need_queue=False)
        pwd.getpwuid(NOBODY)
    except (StackError, KeyError) as e:
        pytest.skip(str(e))


def _server_uid(guard_pid: int, needle: str) -> tuple[int, int]:
    """(real uid, pid) of the process under ``guard_pid`` whose command line holds ``needle``."""
    for p in psutil.Process(guard_pid).children(recursive=True):
        with_cmd = " ".join(p.cmdline())
        if needle in with_cmd and "setpriv" not in with_cmd and "netns" not in with_cmd:
            return p.uids().real, p.pid
    raise AssertionError(f"no {needle} under {guard_pid}")


def test_under_sudo_the_servers_of_a_hosts_stack_run_as_the_invoking_user(tmp_path, monkeypatch, request):
    from kvlens.stack import netclean
    from kvlens.stack.launch import Stack
    from kvlens.stack.supervise import wait_healthy

    _need_root_and_nobody()
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    monkeypatch.setenv("SUDO_GID", str(NOBODY))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    # pytest's tmp_path sits under /tmp/pytest-of-root (0700): the user could not reach a home there,
    # as it reaches the kvlens home of its own checkout under sudo. A directory it can traverse:
    base = Path(tempfile.mkdtemp(prefix="kvlens-sudo-"))
    base.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    home = base / "home"
    s = Stack(
        "push", hosts=True, separate_homes=True, collector="process", kvlens_home=home, log_dir=tmp_path / "logs",
        collector_port=free_port(), port=free_port(), prefill_port=free_port(), decode_port=free_port(),
        prefill_side_port=free_port(), decode_side_port=free_port(), model=str(base / "model"), quiet=True,
    )  # fmt: skip
    spans = record_spans(1)
    s.network.check_tools()
    try:
        s.network.start(time.monotonic() + 60)
        # the keeper stays root: it removes the namespaces
        assert psutil.Process(s.children[0].proc.pid).uids().real == 0
        c = s.supervised.spawn(s.roles.collector())
        wait_healthy([c], time.monotonic() + 60, lambda m: None)
        uid, _ = _server_uid(c.proc.pid, "kvlens.cli collect")
        assert uid == NOBODY
        r = httpx.post(
            f"{c.url}/v1/traces", content=pb_body(spans), timeout=20, trust_env=False,
            headers={"content-type": "application/x-protobuf", "authorization": f"Bearer {TOKEN}"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        router = s.supervised.spawn(s.roles.router("overlapped", int(s.port)))
        deadline = time.monotonic() + 60
        while True:  # no P or D behind it: /health answers 503, but it answers
            assert router.alive() and time.monotonic() < deadline, router.died_message()
            try:
                httpx.get(router.url + "/health", timeout=15, trust_env=False)  # P and D: 5 s connect timeouts
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert _server_uid(router.proc.pid, "kvlens.cli proxy")[0] == NOBODY
        # P and D go through the same door (built, not started: no vLLM here)
        p = s.roles.server("prefill")
        i = p.argv.index("setpriv")
        assert p.argv[:3] == ["ip", "netns", "exec"] and p.argv[i + 1 : i + 3] == [
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
        ]
        assert p.env["HOME"] == pwd.getpwuid(NOBODY).pw_dir
        assert (home / "hosts" / "prefill").stat().st_uid == NOBODY
    finally:
        s.stop()
    assert netclean.objects(s.net.sid) == {"namespaces": [], "veths": [], "pids": []}
    db = home / "hosts" / "collector" / "traces.db"
    assert db.stat().st_uid == NOBODY  # written by the collector as the user
    assert sum(map(len, stored(db, trace_ids(spans)).values())) == len(spans)


def test_without_sudo_nothing_changes(tmp_path, monkeypatch):
    """No ``$SUDO_UID`` (or 0): every child as before, no ``setpriv``."""
    from kvlens.stack import sudo

    for v in (None, "0", "x"):
        if v is None:
            monkeypatch.delenv("SUDO_UID", raising=False)
        else:
            monkeypatch.setenv("SUDO_UID", v)
        assert sudo.sudo_user() is None
    if os.geteuid() == 0:
        monkeypatch.setenv("SUDO_UID", "4000000")  # no such user
        with pytest.raises(StackError, match="SUDO_UID 4000000 names no user"):
            sudo.sudo_user()
