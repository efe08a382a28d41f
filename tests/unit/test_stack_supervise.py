"""Issue 12, processes: a stack's children never outlive their supervisor
(``kvlens.stack.supervise``: the guard with a parent-death signal that stops
the child's whole process group), and SIGHUP unwinds like SIGTERM
(``kvlens.signals``). Real small processes, checked through /proc; every
wait polls (generous deadlines only so that a failure cannot hang)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlens.stack.supervise import Child, stop_children

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics (/proc, prctl)")

#: A server stand-in: starts a grandchild (same process group, as vLLM's
#: EngineCore), writes "<own pid> <grandchild pid>" to argv[1], sleeps.
SERVER = (
    "import os, subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {g.pid}')\n"
    "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "time.sleep(300)\n"
)

#: A supervisor: starts one guarded SERVER (from a thread that then ends
#: when argv[2] == "thread"), writes the guard's pid, sleeps until killed;
#: with argv[2] == "signals" it runs kvlens up's shutdown path instead.
SUPERVISOR = r"""
import os, signal, sys, threading, time
from pathlib import Path
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.supervise import Child, signals_ignored, stop_children
out, how = Path(sys.argv[1]), sys.argv[2]
c = Child("server", [sys.executable, "-c", sys.argv[3], str(out / "pids")], dict(os.environ), out / "server.log",
          "http://127.0.0.1:1")
if how == "thread":
    t = threading.Thread(target=c.start)
    t.start()
    t.join()
else:
    c.start()
(out / "guard").write_text(str(c.proc.pid))
if how == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
if how in ("signals", "nohup"):
    with sigterm_as_interrupt():
        try:
            print("ready", flush=True)
            time.sleep(300)
        except KeyboardInterrupt as e:
            print("stopping on", e, flush=True)
        finally:
            with signals_ignored():
                stop_children([c], grace_s=10)
            print("stopped", flush=True)
    sys.exit(0)
time.sleep(300)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, its exit status not collected)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_until(cond, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def start_supervisor(tmp_path: Path, how: str) -> tuple[subprocess.Popen, list[int]]:
    """The supervisor process and [guard, server, grandchild] pids."""
    # SIGHUP at its default in the supervisor whatever the test run inherited
    # (a `nohup make test` ignores it, and an ignored SIGHUP stays ignored by design)
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path), how, SERVER],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    pids = tmp_path / "pids"
    wait_until(lambda: pids.exists() or sup.poll() is not None, "the server never started")
    assert sup.poll() is None, sup.stdout.read()
    wait_until(lambda: (tmp_path / "guard").exists(), "no guard pid")
    server, grandchild = map(int, pids.read_text().split())
    return sup, [int((tmp_path / "guard").read_text()), server, grandchild]


def _kill(sup: subprocess.Popen, tree: list[int]) -> None:
    for pid in [sup.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sup.wait(10)


@pytest.mark.parametrize("how", ["main", "thread"])
def test_sigkilled_supervisor_leaves_no_child_or_grandchild(tmp_path, how):
    sup, tree = start_supervisor(tmp_path, how)
    try:
        if how == "thread":  # the starting thread ended: the server must live on
            time.sleep(0.5)
            assert not any(gone(p) for p in tree), "a thread's end stopped the server"
        sup.kill()  # SIGKILL: no finally, no handler runs in the supervisor
        sup.wait(10)
        wait_until(
            lambda: all(gone(p) for p in tree),
            f"left behind: {[p for p in tree if not gone(p)]} (guard, server, grandchild)",
        )
    finally:
        _kill(sup, tree)


def test_sighup_stops_the_supervisor_cleanly(tmp_path):
    sup, tree = start_supervisor(tmp_path, "signals")
    try:
        assert sup.stdout.readline().strip() == "ready"
        sup.send_signal(signal.SIGHUP)
        out, _ = sup.communicate(timeout=60)
        assert sup.returncode == 0, out
        assert "stopping on SIGHUP" in out and "stopped" in out
        wait_until(lambda: all(gone(p) for p in tree), "stop_children left processes behind")
    finally:
        _kill(sup, tree)


def test_sighup_ignored_at_start_stays_ignored(tmp_path):
    """``nohup kvlens up``: the user asked to survive a closed terminal."""
    sup, tree = start_supervisor(tmp_path, "nohup")
    try:
        assert sup.stdout.readline().strip() == "ready"
        sup.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert sup.poll() is None and not any(gone(p) for p in tree)
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=60)
        assert sup.returncode == 0 and "stopping on SIGTERM" in out
    finally:
        _kill(sup, tree)


def _child(tmp_path: Path, code: str) -> Child:
    c = Child("c", [sys.executable, "-c", code], dict(os.environ), tmp_path / "c.log", "http://127.0.0.1:1")
    c.start()
    return c


def test_guard_passes_on_the_exit_status(tmp_path):
    c = _child(tmp_path, "import sys; print('bye'); sys.exit(3)")
    assert c.proc.wait(30) == 3 and "bye" in c.log.read_text()
    c = _child(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert c.proc.wait(30) == -signal.SIGKILL
    with pytest.raises(FileNotFoundError, match="no-such-binary"):
        Child("x", ["no-such-binary-kvlens"], dict(os.environ), tmp_path / "x.log", "http://127.0.0.1:1").start()


def test_guard_forwards_signals_from_others_not_from_its_supervisor(tmp_path):
    ready = tmp_path / "ready"
    c = _child(tmp_path, f"import time; open({str(ready)!r}, 'w').close(); time.sleep(300)")
    try:
        wait_until(ready.exists, "child did not start")
        os.kill(c.proc.pid, signal.SIGTERM)  # from the supervisor: it signals groups, not the guard alone
        time.sleep(0.3)
        assert c.alive()
        subprocess.run(["kill", "-TERM", str(c.proc.pid)], check=True)  # from someone else: passed on
        assert c.proc.wait(30) == -signal.SIGTERM
    finally:
        stop_children([c], grace_s=2)


# ------------------------------- issue 12: the dashboard safe however started
def test_streamlit_config_at_the_repo_root_is_safe():
    import tomllib

    cfg = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "127.0.0.1" and cfg["server"]["headless"] is True
    assert cfg["client"]["showErrorDetails"] == "none" and cfg["browser"]["gatherUsageStats"] is False
    from streamlit.config import ShowErrorDetailsConfigOptions as Allowed  # the values Streamlit accepts

    assert cfg["client"]["showErrorDetails"] in {v.value for v in Allowed}


def _streamlit_config(cwd: Path, *flags: str) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "streamlit", "config", "show", *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(cwd)},
    )
    assert out.returncode == 0, out.stderr
    keys = ("address", "headless", "showErrorDetails", "gatherUsageStats")
    return {
        k: v.strip()
        for line in out.stdout.splitlines()
        if " = " in line
        for k, v in [line.split(" = ", 1)]
        if k in keys
    }


def test_streamlit_reads_the_file_from_the_repo_root_and_flags_win(tmp_path):
    got = _streamlit_config(REPO)
    assert got == {
        "address": '"127.0.0.1"',
        "headless": "true",
        "showErrorDetails": '"none"',
        "gatherUsageStats": "false",
    }
    assert "address" not in _streamlit_config(tmp_path)  # elsewhere: Streamlit's defaults (every interface)
    assert _streamlit_config(REPO, "--server.address", "0.0.0.0", "--client.showErrorDetails", "full") == {
        **got,
        "address": '"0.0.0.0"',
        "showErrorDetails": '"full"',
    }


def test_kvlens_dashboard_does_not_depend_on_the_callers_directory(tmp_path, monkeypatch):
    import argparse

    from kvlens import dashboard_cmd

    assert (dashboard_cmd.workdir() / ".streamlit" / "config.toml").is_file()
    assert dashboard_cmd.workdir() == REPO
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVLENS_HOME", "relative-home")
    assert dashboard_cmd.child_env()["KVLENS_HOME"] == str(tmp_path / "relative-home")
    p = argparse.ArgumentParser()
    dashboard_cmd.add_arguments(p)
    cmd = dashboard_cmd.command(p.parse_args(["--host", "0.0.0.0"]), tmp_path / "t.db")
    for flag, val in (
        ("--server.address", "0.0.0.0"),
        ("--client.showErrorDetails", "none"),
        ("--server.headless", "true"),
        ("--browser.gatherUsageStats", "false"),
        ("--server.enableCORS", "true"),
        ("--server.enableXsrfProtection", "true"),
    ):
        assert cmd[cmd.index(flag) + 1] == val


#: A vLLM server whose EngineCore died, as its log reads (shortened): the
#: EngineCore's error and its exception, then the API server's own traceback,
#: longer than the tail, ending in "See root cause above".
DEAD_ENGINE = r"""
import sys
print("(APIServer pid=10) INFO 12-07 02:44:01 [api_server.py:1] vLLM API server version 0.0")
print("(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1] EngineCore failed to start.")
print("(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1] Traceback (most recent call last):")
print('(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1]   File "core.py", line 1, in run')
print("(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1] ValueError: the root cause")
print("(APIServer pid=10) Traceback (most recent call last):")
for i in range(60):
    print(f'(APIServer pid=10)   File "frame{i}.py", line {i}, in f{i}')
print("(APIServer pid=10) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
sys.exit(1)
"""


def test_a_dead_childs_message_has_the_root_cause_above_its_tail(tmp_path):
    """The tail is the API server's traceback; the EngineCore's error, above
    it, is in the message too, and the lines that are not errors are not."""
    c = _child(tmp_path, DEAD_ENGINE)
    assert c.proc.wait(30) == 1
    msg = c.died_message()
    assert "exited with code 1" in msg and "See root cause above" in msg
    head, above = msg.split("\nerror lines above those:\n")
    assert "ValueError: the root cause" not in head
    assert above.splitlines() == [
        "(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1] EngineCore failed to start.",
        "(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1] Traceback (most recent call last):",
        '(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1]   File "core.py", line 1, in run',
        "(EngineCore_DP0 pid=11) ERROR 12-07 02:44:12 [core.py:1] ValueError: the root cause",
    ]


def test_a_short_log_adds_no_error_lines(tmp_path):
    """A log within the tail: the message is the tail alone."""
    c = _child(tmp_path, "import sys; print('RuntimeError: boom'); sys.exit(2)")
    assert c.proc.wait(30) == 2
    msg = c.died_message()
    assert "RuntimeError: boom" in msg and "error lines above" not in msg
