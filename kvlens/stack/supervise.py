"""Child processes of a stack: start, health-wait, stop (whole trees).

Every child runs in its own session (process group) so that stopping it also
stops the EngineCore processes vLLM spawns; leftovers found through psutil
are killed as well. Each child logs to its own file; when a child dies early
the tail of its log is part of the error.

All functions block the calling thread (polls, waits); none is for an event
loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

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


@dataclass
class Child:
    """One server process of a stack, healthy when ``url + "/health"`` is 200."""

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
        """Spawn in a new session, stdout+stderr appended to ``log``."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log, "ab", buffering=0)
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                start_new_session=True,
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


def wait_healthy(children: list[Child], deadline: float, say: Callable[[str], None]) -> None:
    """Poll each child's ``/health`` until all answer 200.

    ``deadline``: ``time.monotonic()`` value. Raises StackError when a child
    dies (with its log tail) or at the deadline. ``say`` gets progress lines
    (a ready line per child, a waiting line every 15 s)."""
    import httpx  # start-up cost: ``kvlens --help`` imports this module

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    pending = list(children)
    last_note = 0.0
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
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
                raise StackError(f"timed out waiting for {names} to answer /health; "
                                 f"last lines of {pending[0].log}:\n{tail(pending[0].log)}")
            if now - last_note >= NOTE_EVERY_S:
                last_note = now
                say("waiting for " + ", ".join(f"{c.name} ({now - c.started_at:.0f}s)" for c in pending))
            time.sleep(POLL_S)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGTERM and SIGINT ignored within the block, then restored: a second
    signal while a stack stops must not leave orphans. Main thread only."""
    old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
