"""Child processes kvlens starts (vLLM and the routers of a stack,
Prometheus, the dashboard's Streamlit, the span-building sidecar):
:class:`ChildProcess`, started in a process group of its own (or the
caller's), optionally under the parent-death guard (:mod:`kvrecord.guard`),
and stopped with everything in its group.

Where a child goes (``group``):

* ``"session"``: a session (and process group) of its own, detached from
  the caller's terminal;
* ``"group"``: a process group of its own in the caller's session (a
  stack's servers, Prometheus, the dashboard): with the kernel's autogroups
  (``sched_autogroup_enabled``) every session is scheduled as one entity,
  so ``SCHED_IDLE`` on a server's spinning NIXL thread only yields to
  threads of its own session, never to another session's (measured: a
  starting engine got 6 % of its CPU next to another server's ``SCHED_IDLE``
  spinner; a CPU-bound process in a session of its own 5 % of one CPU next
  to an idle mixed fleet, 93 % in the fleet's session; the dashboard's
  first page took 31-68 s instead of 4.5 s; ``kvlens.stack.spinners``);
* ``"caller"``: the caller's own group (the sidecar: it goes when its
  engine's group is stopped); signals go to its pid alone.

The ``Popen`` surface a supervisor reads (``pid``, ``poll``, ``wait``,
``returncode``) is kept, so a :class:`ChildProcess` stands where a
``Popen`` stood. Every method blocks at most as its timeout says; none is
for an event loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterable, Mapping

from kvrecord import guard as _guard_module
from kvrecord.guard import parent_death_signal
from kvrecord.logutil import log_once

GROUPS = ("session", "group", "caller")
#: Seconds a guard whose supervisor died gives the child between SIGTERM
#: and SIGKILL (as a stack's stop grace).
GUARD_GRACE_S = 15.0
#: After SIGKILL, how long :meth:`ChildProcess.stop` waits to reap.
REAP_S = 5.0


def guarded(argv: list[str], grace_s: float = GUARD_GRACE_S) -> list[str]:
    """The command line running ``argv`` under the parent-death guard
    (:mod:`kvrecord.guard`); ``argv`` unchanged on systems without
    ``prctl`` (not Linux)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", os.path.abspath(_guard_module.__file__), str(os.getpid()), str(grace_s), *argv]


class ChildProcess:
    """One child process. ``argv`` run with ``env`` (default: ours) in
    ``cwd``; stdout and stderr appended to ``log`` when given (else
    inherited); stdin from /dev/null, or with ``pipes`` stdin and stdout
    are unbuffered pipes (:attr:`stdin`, :attr:`stdout`).

    ``guard``: run under the parent-death guard, which leads the child's
    group and stops it when this process dies, however it dies (``pid`` is
    then the guard's and ``returncode`` the child's); needs a group of its
    own. ``death_signal``: the signal the child itself gets when this
    process's starting thread dies (``PR_SET_PDEATHSIG``, set between fork
    and exec)."""

    def __init__(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log: str | Path | None = None,
        group: str = "session",
        guard: bool = False,
        guard_grace_s: float = GUARD_GRACE_S,
        death_signal: int | None = None,
        pipes: bool = False,
    ) -> None:
        if group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {group!r}")
        if guard and group == "caller":
            raise ValueError("a guarded child needs a process group of its own (the guard stops that group)")
        self.argv = list(argv)
        self.env = None if env is None else dict(env)
        self.cwd = None if cwd is None else str(cwd)
        self.log = None if log is None else Path(log)
        self.group = group
        self.guard = guard
        self.guard_grace_s = float(guard_grace_s)
        self.death_signal = death_signal
        self.pipes = pipes
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ChildProcess":
        """Spawn it. OSError (FileNotFoundError, ...) when it cannot start;
        under the guard a missing command shows only as exit code 127."""
        argv = guarded(self.argv, self.guard_grace_s) if self.guard else self.argv
        death = self.death_signal
        kw: dict = {
            "env": self.env,
            "cwd": self.cwd,
            "start_new_session": self.group == "session",
            "process_group": 0 if self.group == "group" else None,
            "preexec_fn": (lambda: parent_death_signal(death)) if death and sys.platform.startswith("linux") else None,
        }
        if self.pipes:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, **kw)
            return self
        fh: IO | None = None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.log, "ab", buffering=0)
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT if fh is not None else None, **kw
            )
        finally:
            if fh is not None:
                fh.close()  # the child holds its own copy
        return self

    # ----------------------------------------------------- the Popen surface
    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    @property
    def stdin(self) -> IO[bytes] | None:
        return None if self.proc is None else self.proc.stdin

    @property
    def stdout(self) -> IO[bytes] | None:
        return None if self.proc is None else self.proc.stdout

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; ``subprocess.TimeoutExpired`` after ``timeout``."""
        return None if self.proc is None else self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------- stopping
    def send(self, sig: int) -> None:
        """``sig`` to the child's process group (even when the leader has
        exited: the group may still hold what it started), or to its pid
        alone while it runs when it shares the caller's group."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.group == "caller":
                self.proc.send_signal(sig)  # a no-op once reaped: the pid may be another's by then
            else:
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0, *, first: int | None = signal.SIGTERM, reap_s: float = REAP_S) -> int | None:
        """``first`` (SIGTERM; None: the caller has asked already) to the
        group, up to ``grace_s`` seconds for the child to exit, then SIGKILL
        to the group and up to ``reap_s`` to reap it. Idempotent; never
        raises (a failure is logged once). Returns the exit code (None: not
        started, or not reaped)."""
        stop_all([self], grace_s, first=first, reap_s=reap_s)
        return self.returncode


def stop_all(
    children: Iterable[ChildProcess], grace_s: float, *, first: int | None = signal.SIGTERM, reap_s: float = REAP_S
) -> None:
    """:meth:`ChildProcess.stop` for several children at once: all are
    signalled, then share one ``grace_s``. Blocks until done."""
    live = [c for c in children if c.proc is not None]
    try:
        for c in live:
            if first is not None:
                c.send(first)
        deadline = time.monotonic() + grace_s
        for c in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(max(0.1, deadline - time.monotonic()))
        for c in live:
            c.send(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(reap_s)
    except Exception:
        log_once("child-stop", "could not stop a child process (%s)", [c.argv[:1] for c in live], exc_info=True)
