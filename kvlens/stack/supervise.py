"""Child processes of a stack: start, health-wait, stop (whole trees).

Every child runs in a process group of its own (a
:class:`~kvrecord.children.ChildProcess`) so that stopping it also stops the
EngineCore processes vLLM spawns; leftovers found through psutil are killed
as well. Each child logs to its own file; when a child dies early the tail
of its log is part of the error, and the error lines above that tail (vLLM's
EngineCore failure is logged further up than its API server's traceback).

No orphans when the supervisor dies, however it dies (SIGKILL, OOM kill,
a crash): on Linux each child runs under a small guard process
(:mod:`kvrecord.guard`) that leads the child's process group and asks the
kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``). The
server's own children (vLLM's EngineCore and workers) get no such signal (a
parent-death setting is not inherited, and vLLM sets none: its workers only
watch EngineCore through a pipe, EngineCore watches nothing), but they stay
in the group the guard leads; on its parent's death the guard stops that
whole group: SIGTERM, up to ``grace_s`` for the server to exit, then SIGKILL.

What an earlier stack left behind is found by :mod:`kvlens.stack.leftovers`.

All functions block the calling thread (polls, waits); none is for an event
loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from kvrecord.children import GUARD_GRACE_S, ChildProcess, stop_all
from kvlens.stack.errors import StackError

try:  # psutil ships with vLLM, not with kvlens: without it, no straggler sweep
    import psutil
except ImportError:  # pragma: no cover
    psutil = None  # type: ignore[assignment]

#: How often :func:`wait_healthy` polls, and how often it says who it waits for.
POLL_S = 0.5
NOTE_EVERY_S = 15.0


#: A log line that names an error: a log record at ERROR or CRITICAL (vLLM's
#: ``ERROR 12-07 02:44:12 [core.py:…]``, Python's ``ERROR:name:``), or an
#: exception's last line (``RuntimeError: …``), after an optional process prefix
#: (vLLM's ``(EngineCore_DP0 pid=123)``).
ERROR_LINE = re.compile(r"^(\(\S+ pid=\d+\)\s*)?(\S*\s*(ERROR|CRITICAL)\b|[\w.]*(Error|Exception|Exit)\b:)")
#: At most this many of the earlier error lines go into :meth:`Child.died_message`.
EARLIER_ERRORS = 12


def _log_lines(path: Path) -> list[str]:
    """The lines of a log file's last 64 KiB (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 64 * 1024))
        return f.read().decode("utf-8", "replace").splitlines()


def tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a log file (read from its last 64 KiB)."""
    try:
        return "\n".join(_log_lines(path)[-n:])
    except OSError as e:
        return f"(no log: {e})"


def earlier_errors(path: Path, n: int = 40, most: int = EARLIER_ERRORS) -> list[str]:
    """The error lines (:data:`ERROR_LINE`) of a log above its last ``n``
    lines, the last ``most`` of them. A vLLM server whose EngineCore died
    ends its log with the API server's own traceback ("Engine core
    initialization failed. See root cause above"): the cause is further up,
    in the EngineCore's lines, out of :func:`tail`'s reach."""
    try:
        lines = _log_lines(path)[:-n]
    except OSError:
        return []
    return [ln for ln in lines if ERROR_LINE.match(ln)][-most:]


@dataclass
class Child:
    """One server process of a stack, healthy when ``url + "/health"`` is 200.

    ``proc`` is its :class:`~kvrecord.children.ChildProcess`, under the
    parent-death guard on Linux (see the module docstring): its pid is the
    process group of the server and everything the server starts, and its
    return code is the server's. Stop it through its process group
    (:func:`stop_children`); a signal the supervisor sends to the guard's
    pid alone is not passed on."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: ChildProcess | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    cwd: str | None = None

    def start(self) -> None:
        """Spawn under its guard in a process group of its own (in the
        launcher's session: :mod:`kvrecord.children` says why), stdout+stderr
        appended to ``log``. FileNotFoundError when ``argv[0]`` is not found."""
        exe = self.argv[0]  # checked here: under the guard a missing one would only show as exit code 127
        if (
            shutil.which(
                os.path.join(self.cwd or ".", exe) if os.sep in exe else exe, path=self.env.get("PATH", os.defpath)
            )
            is None
        ):
            raise FileNotFoundError(f"{self.name}: command not found: {exe}")
        proc = ChildProcess(self.argv, env=self.env, cwd=self.cwd, log=self.log, group="group", guard=True)
        self.proc = proc.start()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died_message(self) -> str:
        rc = self.proc.returncode if self.proc else None
        msg = f"{self.name} exited with code {rc}; last lines of {self.log}:\n{tail(self.log)}"
        errors = earlier_errors(self.log)
        if errors:
            msg += "\nerror lines above those:\n" + "\n".join(errors)
        return msg


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


def stop_children(children: list[Child], grace_s: float = GUARD_GRACE_S) -> None:
    """SIGTERM every child's process group, wait up to ``grace_s`` seconds,
    then SIGKILL what is left (groups and any descendant that escaped its
    group). Blocks until done."""
    live = [c for c in children if c.proc is not None]
    if not live:
        return
    stragglers = []
    for c in live:
        stragglers += descendants(c.proc.pid)
    stop_all([c.proc for c in live], grace_s)
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
