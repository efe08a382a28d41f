"""Child processes of a stack: start, health-wait, stop (whole trees).

Every child runs in its own session (process group) so that stopping it also
stops the EngineCore processes vLLM spawns; leftovers found through psutil
are killed as well. Each child logs to its own file; when a child dies early
the tail of its log is part of the error.

No orphans when the supervisor dies, however it dies (SIGKILL, OOM kill,
a crash): on Linux each child runs under a small guard process (``_GUARD``)
that leads the child's process group and asks the kernel for a signal when
its parent dies (``prctl(PR_SET_PDEATHSIG)``). The server's own children
(vLLM's EngineCore and workers) get no such signal (a parent-death setting
is not inherited, and vLLM sets none: its workers only watch EngineCore
through a pipe, EngineCore watches nothing), but they stay in the group the
guard leads; on its parent's death the guard stops that whole group:
SIGTERM, up to ``grace_s`` for the server to exit, then SIGKILL.

What an earlier stack left behind is found by :mod:`kvlens.stack.leftovers`.

All functions block the calling thread (polls, waits); none is for an event
loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from kvlens.stack.errors import StackError

try:  # psutil ships with vLLM, not with kvlens: without it, no straggler sweep
    import psutil
except ImportError:  # pragma: no cover
    psutil = None  # type: ignore[assignment]

#: How often :func:`wait_healthy` polls, and how often it says who it waits for.
POLL_S = 0.5
NOTE_EVERY_S = 15.0


def tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log file (read from its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError as e:
        return f"(no log: {e})"


#: The guard a child runs under (``python -I -S -c <_BOOT> <supervisor pid>
#: <grace s> <argv...>``, its code in the environment so that ``ps`` shows a
#: short line): stdlib only, no kvlens import, so it starts in milliseconds.
#: It forks and execs ``argv`` in its own process group, then
#: waits with every signal it handles blocked (``sigwaitinfo``, no handler
#: races):
#:
#: * the child exits: the guard exits the same way (same code, or killed by
#:   the same signal), so ``Popen.returncode`` is the server's;
#: * its parent died (``getppid()`` changed; the kernel's parent-death signal
#:   SIGUSR2 is what usually says so): SIGTERM to the group, up to ``grace``
#:   seconds for the child, then SIGKILL to the group (the guard included);
#: * SIGUSR2 while the parent lives: the thread that started the guard ended
#:   (the kernel sends the parent-death signal per thread); ignored;
#: * SIGTERM / SIGINT / SIGHUP from the supervisor: ignored, the supervisor
#:   signals whole process groups (:func:`stop_children`), so the server got
#:   the same signal (sending it twice could interrupt vLLM's clean-up);
#:   from anyone else: passed on to the server.
_GUARD = r"""
import ctypes, os, signal, sys, time
ppid, grace, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
DEATH, STOP = signal.SIGUSR2, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WATCH = {*STOP, DEATH, signal.SIGCHLD}
old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCH)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(DEATH))  # PR_SET_PDEATHSIG
except Exception:
    pass

def sweep(pid):
    try:
        os.killpg(0, signal.SIGTERM)  # blocked here: only the others get it
    except OSError:
        pass
    end = time.monotonic() + grace
    while pid and time.monotonic() < end:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)

if os.getppid() != ppid:  # the supervisor died before prctl took effect
    sweep(0)
pid = os.fork()
if pid == 0:
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, ("kvlens: cannot run %r: %s\n" % (argv[0], e)).encode())
    os._exit(127)
while True:
    info = signal.sigwaitinfo(WATCH)
    if info.si_signo == signal.SIGCHLD:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
    elif os.getppid() != ppid:
        sweep(pid)
    elif info.si_signo in STOP and info.si_pid != ppid:
        try:
            os.kill(pid, info.si_signo)
        except OSError:
            pass
code = os.waitstatus_to_exitcode(status)
if code < 0:  # die of the same signal
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
    os.kill(os.getpid(), -code)
    code = 128 - code  # a signal whose default is not to terminate
sys.exit(code)
"""

_GUARD_ENV = "KVLENS_GUARD_CODE"
#: Reads the guard's code and removes it from the environment the server inherits.
_BOOT = f"import os; exec(os.environ.pop({_GUARD_ENV!r}))  # kvlens guard"

#: Seconds a guard whose supervisor died gives the server between SIGTERM
#: and SIGKILL (as :func:`stop_children`'s default grace).
GUARD_GRACE_S = 15.0


def guarded(argv: list[str], env: dict[str, str], grace_s: float = GUARD_GRACE_S) -> tuple[list[str], dict[str, str]]:
    """(command line, environment) running ``argv`` with ``env`` under the
    guard (module docstring); the same unchanged on systems without
    ``prctl`` (not Linux)."""
    if not sys.platform.startswith("linux"):
        return list(argv), env
    return (
        [sys.executable, "-I", "-S", "-c", _BOOT, str(os.getpid()), str(grace_s), *argv],
        {**env, _GUARD_ENV: _GUARD},
    )


@dataclass
class Child:
    """One server process of a stack, healthy when ``url + "/health"`` is 200.

    ``proc`` is the child's guard on Linux (see the module docstring): its
    pid is the process group of the server and everything the server
    starts, and its return code is the server's. Stop it through its process
    group (``os.killpg(proc.pid, ...)``, :func:`stop_children`); a signal the
    supervisor sends to the guard's pid alone is not passed on."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    cwd: str | None = None

    def start(self) -> None:
        """Spawn under its guard in a new session, stdout+stderr appended to
        ``log``. FileNotFoundError when ``argv[0]`` is not found."""
        exe = self.argv[0]  # checked here: under the guard a missing one would only show as exit code 127
        if (
            shutil.which(
                os.path.join(self.cwd or ".", exe) if os.sep in exe else exe, path=self.env.get("PATH", os.defpath)
            )
            is None
        ):
            raise FileNotFoundError(f"{self.name}: command not found: {exe}")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv, env = guarded(self.argv, self.env)
        fh = open(self.log, "ab", buffering=0)
        try:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                # a process group of its own (stopped as one: os.killpg), but the launcher's
                # session: with the kernel's autogroups (sched_autogroup_enabled) every session
                # is scheduled as one entity, so SCHED_IDLE on a server's spinning NIXL thread
                # would only yield to that server's own threads, never to another server's
                # (measured: a starting engine got 6 % of its CPU next to another server's
                # SCHED_IDLE spinner; kvlens.stack.spinners)
                process_group=0,
            )
        finally:
            fh.close()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died_message(self) -> str:
        rc = self.proc.returncode if self.proc else None
        return f"{self.name} exited with code {rc}; last lines of {self.log}:\n{tail(self.log)}"


def descendants(pid: int) -> list:
    """psutil processes below ``pid`` (recursive); [] when unknown."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _kill_stragglers(procs: list) -> None:
    if psutil is None:
        return
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                alive.append(p)
        except Exception:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=5)


def stop_children(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM every child's process group, wait up to ``grace_s`` seconds,
    then SIGKILL what is left (groups and any descendant that escaped its
    group). Blocks until done."""
    live = [c for c in children if c.proc is not None]
    if not live:
        return
    stragglers = []
    for c in live:
        stragglers += descendants(c.proc.pid)
    for c in live:
        # even when the leader has exited: its group may still hold EngineCore
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in live:
        left = max(0.1, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=left)
    for c in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=5)
    _kill_stragglers(stragglers)


def wait_healthy(
    children: list[Child],
    deadline: float,
    say: Callable[[str], None],
    headers: Mapping[str, str] | None = None,
    each_poll: Callable[[Child], None] | None = None,
) -> None:
    """Poll each child's ``/health`` (sending ``headers``, e.g. the stack's
    API key) until all answer 200. ``each_poll``: called for every child,
    ready or not, once per poll round (the stack re-pins vLLM's workers
    there while the others still start).

    ``deadline``: ``time.monotonic()`` value. Raises StackError when a child
    dies (with its log tail) or at the deadline. ``say`` gets progress lines
    (a ready line per child, a waiting line every 15 s)."""
    import httpx  # start-up cost: ``kvlens --help`` imports this module

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    pending = list(children)
    last_note = 0.0
    with httpx.Client(timeout=2.0, trust_env=False, headers=dict(headers or {})) as client:
        while pending:
            for c in children if each_poll is not None else ():
                each_poll(c)
            for c in list(pending):
                if not c.alive():
                    raise StackError(c.died_message())
                try:
                    if client.get(c.url + "/health").status_code == 200:
                        c.ready_at = time.monotonic()
                        pending.remove(c)
                        say(f"{c.name} ready at {c.url} ({c.ready_at - c.started_at:.0f}s)")
                except httpx.HTTPError:
                    pass
            if not pending:
                break
            now = time.monotonic()
            if now > deadline:
                names = ", ".join(f"{c.name} (log {c.log})" for c in pending)
                raise StackError(
                    f"timed out waiting for {names} to answer /health; "
                    f"last lines of {pending[0].log}:\n{tail(pending[0].log)}"
                )
            if now - last_note >= NOTE_EVERY_S:
                last_note = now
                say("waiting for " + ", ".join(f"{c.name} ({now - c.started_at:.0f}s)" for c in pending))
            time.sleep(POLL_S)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP ignored within the block, then restored: a
    second signal while a stack stops must not leave orphans. Main thread only."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
