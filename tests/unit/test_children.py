"""kvrecord.children: one child-process type for every process kvlens starts.
Real small processes, checked through /proc; every wait polls (generous
deadlines only so that a failure cannot hang)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrecord.children import ChildProcess, guarded, stop_all
from test_stack_supervise import SERVER, gone, wait_until

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics (/proc, prctl)")

#: A stand-in that ignores SIGTERM (its grandchild inherits that): only SIGKILL stops it.
STUBBORN = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SERVER


def pgid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


def _tree(tmp_path: Path, how: str = "polite", **kw) -> tuple[ChildProcess, list[int]]:
    pids = tmp_path / f"pids-{how}"
    code = STUBBORN if how == "stubborn" else SERVER
    c = ChildProcess([sys.executable, "-c", code, str(pids)], log=tmp_path / f"{how}.log", **kw).start()
    wait_until(lambda: pids.exists() or not c.alive(), "the child never started")
    assert c.alive(), (tmp_path / f"{how}.log").read_text()
    return c, [int(p) for p in pids.read_text().split()]


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass


@pytest.mark.parametrize("group", ["session", "group"])
def test_stop_takes_the_whole_group_grandchild_included(tmp_path, group):
    c, tree = _tree(tmp_path, group=group)
    try:
        assert pgid(tree[1]) == c.pid  # the grandchild is in the child's group
        assert (os.getsid(c.pid) == c.pid) == (group == "session")
        t0 = time.monotonic()
        assert c.stop(grace_s=20) == -signal.SIGTERM
        assert time.monotonic() - t0 < 15  # it went at SIGTERM, not at the end of the grace
        wait_until(lambda: all(gone(p) for p in tree), f"left behind: {[p for p in tree if not gone(p)]}")
        assert not c.alive() and c.returncode == -signal.SIGTERM
        assert c.stop() == -signal.SIGTERM  # idempotent
    finally:
        _kill(tree)


def test_sigkill_after_the_grace_for_a_child_ignoring_sigterm(tmp_path):
    c, tree = _tree(tmp_path, "stubborn", group="group")
    try:
        t0 = time.monotonic()
        assert c.stop(grace_s=1.0) == -signal.SIGKILL
        assert 0.9 <= time.monotonic() - t0 < 10
        wait_until(lambda: all(gone(p) for p in tree), f"left behind: {[p for p in tree if not gone(p)]}")
    finally:
        _kill(tree)


def test_stop_all_shares_one_grace(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, ta = _tree(tmp_path / "a", "stubborn", group="group")
    b, tb = _tree(tmp_path / "b", "stubborn", group="group")
    try:
        t0 = time.monotonic()
        stop_all([a, b], grace_s=1.0)
        assert time.monotonic() - t0 < 1.9  # not 1 s each
        assert a.returncode == b.returncode == -signal.SIGKILL
    finally:
        _kill(ta + tb)


def test_a_child_in_the_callers_group_is_signalled_alone(tmp_path):
    c = ChildProcess([sys.executable, "-c", "import time; time.sleep(300)"], group="caller", pipes=True).start()
    try:
        assert pgid(c.pid) == os.getpgrp()
        assert c.stop(grace_s=5) == -signal.SIGTERM  # and this test process is still here
        assert c.stdin is not None and c.stdout is not None
        c.stop()  # reaped: nothing is sent to a pid that may be another's by now
    finally:
        _kill([c.pid])
    with pytest.raises(ValueError, match="process group of its own"):
        ChildProcess(["true"], group="caller", guard=True)
    with pytest.raises(ValueError, match="group must be"):
        ChildProcess(["true"], group="none")


def test_not_started_is_harmless():
    c = ChildProcess(["true"])
    assert c.pid is None and c.poll() is None and c.returncode is None and not c.alive()
    assert c.stop(grace_s=0) is None


#: A parent: starts one child (argv[2]: "guard" under the guard, "signal"
#: with a parent-death signal), writes "<child pid> <grandchild pid>" to
#: argv[1] via the child, then sleeps until killed.
PARENT = r"""
import signal, sys, time
from kvrecord.children import ChildProcess
out, how, server = sys.argv[1], sys.argv[2], sys.argv[3]
kw = {"guard": True, "group": "group"} if how == "guard" else {"death_signal": signal.SIGTERM}
c = ChildProcess([sys.executable, "-c", server, out], **kw).start()
open(out + ".guard", "w").write(str(c.pid))
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["guard", "signal"])
def test_a_sigkilled_parent_takes_its_child_along(tmp_path, how):
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pids), how, SERVER], cwd=REPO)
    tree: list[int] = []
    try:
        started = Path(f"{pids}.guard")
        wait_until(lambda: (pids.exists() and started.exists()) or parent.poll() is not None, "no child started")
        assert parent.poll() is None
        top = int(started.read_text())  # the guard, or the child itself
        tree = list(dict.fromkeys([top, *map(int, pids.read_text().split())]))
        parent.kill()  # SIGKILL: nothing runs in the parent
        parent.wait(10)
        # under the guard the whole group goes (grandchild too); a parent-death
        # signal reaches the child alone, whose own children are its business
        wanted = tree if how == "guard" else tree[:1]
        wait_until(lambda: all(gone(p) for p in wanted), f"left behind: {[p for p in wanted if not gone(p)]}")
    finally:
        parent.kill()
        parent.wait(10)
        _kill(tree)


def test_guard_command_line_and_parent_death_signal():
    argv = guarded(["vllm", "serve"], 3.0)
    assert argv[1:3] == ["-I", "-S"] and argv[3].endswith("kvrecord/guard.py")
    assert argv[4:] == [str(os.getpid()), "3.0", "vllm", "serve"]
    out = subprocess.run(
        [sys.executable, "-c", "from kvrecord.guard import parent_death_signal as p; print(p(15))"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "True", out.stderr
