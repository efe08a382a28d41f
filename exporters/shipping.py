"""Engine side of the span-building sidecar: :class:`ShippingRecorder`.

Why: building an OpenTelemetry SDK span, running the store/OTLP
batch processors and the span metrics costs ~43 µs per event, and in vLLM's
EngineCore and worker processes that work holds the GIL of the Python loop
that is the serving bottleneck. Options weighed:

* encode events straight to OTLP protobuf in-process: cheaper than SDK spans
  but still µs per event, and the store writes (SQLite, handoff settlement),
  the span metrics and the handoff resolver would stay in the engine;
* batch and amortise SDK spans: the per-span cost of the SDK and of the
  processors dominates; batching does not remove it;
* ship compact raw events to a process of kvlens' own and build spans and
  metrics there (chosen): the engine pays one ``pickle`` of a list of the
  event tuples :meth:`Recorder.record` already holds and one non-blocking
  pipe ``write`` per frame, ~1-2 µs per event; the sidecar
  (:mod:`exporters.sidecar`) runs today's :class:`Recorder` and
  :func:`exporters.pipeline.provider_factory` unchanged, so the store, the
  OTLP output and the metrics are exactly what the in-process path gives.

The hot path (``record``, ``record_root``, ``point``: one bounded append) is
:class:`Recorder`'s, unchanged; only the background thread differs: it takes
events off the recorder's buffer (:meth:`Recorder.take`) and writes them in
frames (:mod:`exporters.frames`, the wire format) to the sidecar's stdin.

Never blocking the engine: the pipe is non-blocking; while it is full
(sidecar slow) events stay in the bounded buffer, and ``record`` drops and
counts (``buffer_full``) once that is full. If the sidecar cannot start (or
is not ``ready`` within :data:`READY_TIMEOUT_S`), or dies while serving,
one warning, and spans are built in-process (the inline path) from then on;
the events of a frame it never read whole are counted ``export_failed``.
The one uncounted loss: a frame written whole to a sidecar SIGKILLed before
it read it.

No orphan: stdin EOF (the parent closed its recorder, exited or was killed)
ends the sidecar; ``PR_SET_PDEATHSIG`` and a parent-pid watch back that up;
it stays in the engine's process group, which ``kvlens up`` stops as a
whole. Forked children of the engine close their copies of the pipe, so
EOF still comes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from exporters import frames
from kvrecord.children import ChildProcess
from kvrecord.logutil import log_once
from kvrecord.procstats import mark_process_dead, name_native_thread, write_stats
from kvrecord.recorder import Recorder

#: The sidecar must say ``ready`` within this long, else spans are built in-process.
READY_TIMEOUT_S = 60.0
#: A sidecar being stopped gets this long after SIGTERM, then as long after SIGKILL.
SIDECAR_STOP_S = 1.0
#: With nothing buffered the shipping thread sleeps this long at most (the
#: first event wakes it sooner); it checks on the sidecar at each wake.
IDLE_WAIT_S = 1.0
#: Pipe size asked for (Linux ``F_SETPIPE_SZ``; the default is 64 KiB).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
REPO_ROOT = Path(__file__).resolve().parents[1]

_live: "set[ShippingRecorder]" = set()


def _close_inherited() -> None:
    """In a forked child: close the parent's pipe ends (the child gets its own
    recorder), so the sidecar still sees EOF when its parent goes."""
    for r in list(_live):
        r._forget_after_fork()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


class ShippingRecorder(Recorder):
    """A :class:`Recorder` whose background thread ships raw events to a
    sidecar process instead of building spans (module docstring).

    ``sidecar_spec``: ``role``, ``mode``, ``engine_id`` and the validated
    kvlens ``config`` the sidecar builds its pipeline from.
    ``pipeline_factory``: the in-process pipeline, used only when the
    sidecar cannot run. ``sidecar_argv``: the command (tests start a
    stand-in); default ``python -m exporters.sidecar``."""

    def __init__(
        self,
        *,
        sidecar_spec: Mapping[str, Any],
        sidecar_argv: list[str] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self._spec = json.dumps(dict(sidecar_spec), default=str)
        self._argv = list(sidecar_argv) if sidecar_argv else [sys.executable, "-m", "exporters.sidecar"]
        self._ready_timeout = float(ready_timeout_s)
        self._proc: ChildProcess | None = None
        self._fd = -1
        self._ship_lock = threading.Lock()
        self._pending = memoryview(b"")  # the unsent rest of the current frame
        self._pending_n = 0
        self._pending_drops: dict[str, int] = {}
        self._shipped_drops: dict[str, int] = {}
        self._inline = False
        self._flush_seq = 0
        self._close_deadline = 0.0
        self.shipped = 0  # events in frames written whole to the sidecar
        self.sidecar_pid: int | None = None
        self.thread_name = "kvlens-shipper"

    @property
    def mode_in_use(self) -> str:
        """``sidecar``, ``inline`` (fallback) or ``starting``."""
        if self._inline:
            return "inline"
        return "sidecar" if self.sidecar_pid is not None else "starting"

    # ------------------------------------------------------------- start-up
    def _build(self) -> None:
        if self._start_sidecar():
            return
        self._inline = True  # (also when closing while it started: the buffered events still become spans)
        super()._build()

    def _start_sidecar(self) -> bool:
        env = dict(os.environ)
        path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(REPO_ROOT) not in path:
            env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *path])
        # the spec in the environment, not on the command line: it may hold a
        # store URL with a password, and anyone can read a command line (ps)
        env[frames.SPEC_ENV] = self._spec
        try:
            # the engine's process group (stopped with it), unbuffered pipes (select sees every line)
            proc = ChildProcess([*self._argv, str(os.getpid())], env=env, group="caller", pipes=True).start()
        except Exception as e:
            log_once("sidecar-start", "kvlens sidecar could not start (%s); building spans in this process", e)
            return False
        if not self._await_ready(proc):
            proc.stop(SIDECAR_STOP_S, reap_s=SIDECAR_STOP_S)
            if not self._stop.is_set():
                log_once(
                    "sidecar-start",
                    "kvlens sidecar did not come up (exit code %s); building spans in this process",
                    proc.returncode,
                )
            return False
        fd = proc.stdin.fileno()
        os.set_blocking(fd, False)
        with contextlib.suppress(Exception):  # the default size works too; the buffer absorbs bursts
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        self._proc, self.sidecar_pid, self._fd = proc, proc.pid, fd
        _live.add(self)
        return True

    def _await_ready(self, proc: ChildProcess) -> bool:
        deadline = time.monotonic() + self._ready_timeout
        out = proc.stdout.fileno()
        while time.monotonic() < deadline and not self._stop.is_set():
            if select.select([out], [], [], 0.1)[0]:
                return proc.stdout.readline().strip() == b"ready"
            if proc.poll() is not None:
                return False
        return False

    # ----------------------------------------------------------- background
    def _run(self) -> None:
        name_native_thread(self.thread_name)
        self._setup()
        while not self.stopping:
            self._wait_for_events(IDLE_WAIT_S)  # idle, it sleeps until record wakes it
            if not self.stopping:
                time.sleep(self._interval)  # a batch gathers (a sleep costs half the CPU of a timed wait)
            if not self._inline and self._proc is not None and self._proc.poll() is not None:
                with self._ship_lock:
                    self._sidecar_gone()
            self.drain()
            self.periodic.run_due()
            self._maybe_write_stats()
        if self._inline:
            self.drain()
        else:
            self._finish()

    def drain(self) -> int:
        """Ship every buffered event (frames of :data:`frames.MAX_FRAME_EVENTS`)
        while the pipe takes them; inline after a fallback. Returns the
        number of events taken off the buffer."""
        if not self.ready:
            return 0
        if self._inline:
            return super().drain()
        with self._ship_lock:
            return self._ship()

    def _ship(self) -> int:
        """Holding the ship lock. Frames stay whole: a partly written frame
        is finished before the next is cut."""
        n = 0
        # a frame also goes out, empty, when only the loss totals changed
        while self._fd >= 0 and self._write_pending() and (self.buffered or self._drop_totals() != self._shipped_drops):
            batch = self.take(frames.MAX_FRAME_EVENTS)
            k, drops = len(batch), self._drop_totals()
            self._pending = memoryview(frames.encode_events(drops, batch))
            self._pending_n, self._pending_drops = k, drops
            self.recorded += k
            n += k
        if self._inline and self.buffered:  # the sidecar went while shipping: the rest is built here
            n += super().drain()
        return n

    def _write_pending(self) -> bool:
        """Write what is left of the current frame. True when it is all out."""
        while self._pending:
            try:
                w = os.write(self._fd, self._pending)
            except BlockingIOError:
                return False
            except OSError:
                self._sidecar_gone()
                return False
            self._pending = self._pending[w:]
        if self._pending_n:
            self.shipped += self._pending_n
            self._shipped_drops = self._pending_drops
            self._pending_n = 0
        return True

    def _drop_totals(self) -> dict[str, int]:
        return Recorder.unreported_drops(self)  # every loss this recorder counted

    def unreported_drops(self) -> dict[str, int]:
        """Losses not yet handed to the sidecar (which reports the rest)."""
        out = {}
        for k, v in self._drop_totals().items():
            v -= self._shipped_drops.get(k, 0)
            if v > 0:
                out[k] = v
        return out

    def _sidecar_gone(self) -> None:
        """Holding the ship lock: the sidecar exited or closed its pipe. The
        frame in flight is counted lost; spans are built here from now on."""
        if self._fd < 0:
            return
        lost = self._pending_n
        self.failed_dropped += lost
        self._pending, self._pending_n = memoryview(b""), 0
        self._fd = -1
        proc = self._proc
        _live.discard(self)
        proc.stop(SIDECAR_STOP_S, reap_s=SIDECAR_STOP_S)
        mark_process_dead(proc.pid)
        if self._stop.is_set():
            return  # closing anyway: what is left is counted at close
        log_once(
            "sidecar-gone",
            "kvlens sidecar (pid %s) exited with code %s; %d events in flight lost (counted "
            "export_failed); building spans in this process from now on",
            proc.pid,
            proc.returncode,
            lost,
        )
        self._inline = True
        super()._build()

    # ------------------------------------------------------ flush and close
    def flush(self, timeout_s: float = 5.0) -> None:
        """Ship what is buffered and wait (at most ``timeout_s``) until the
        sidecar has exported it. Tests and shutdown; not for hot paths."""
        deadline = time.monotonic() + timeout_s
        if self._thread is None:
            self._setup_if_needed()
        else:
            self.wait_ready(timeout_s)
        if self._inline or self._fd < 0:
            return super().flush(max(deadline - time.monotonic(), 0.0))
        with self._ship_lock:
            if not self._ship_all(deadline):
                return
            self._flush_seq += 1
            seq = self._flush_seq
            self._pending = memoryview(frames.encode_flush(seq))
            if self._ship_all(deadline):
                self._await_ack(seq, deadline)

    def _ship_all(self, deadline: float) -> bool:
        """Holding the ship lock: ship until the buffer and the frame in
        flight are out, waiting for the pipe until ``deadline``."""
        while self._fd >= 0:
            self._ship()
            if not self._pending and not self.buffered:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._fd < 0:
                return False
            select.select([], [self._fd], [], min(left, 0.1))
        return False

    def _await_ack(self, seq: int, deadline: float) -> None:
        out = self._proc.stdout
        while time.monotonic() < deadline:
            if not select.select([out.fileno()], [], [], max(min(deadline - time.monotonic(), 0.5), 0))[0]:
                continue
            line = out.readline()
            if not line or line.strip() == f"flushed {seq}".encode():
                return

    def _finish(self) -> None:
        """Recorder thread, at close: ship the rest, send EOF, wait for the
        sidecar to export and exit, all by the close deadline."""
        deadline = self._close_deadline or time.monotonic() + 5.0
        with self._ship_lock:
            if self._fd >= 0:
                self._ship_all(deadline)
            self.shutdown_dropped += self._pending_n
            self.drop_buffered()
            self._pending, self._pending_n = memoryview(b""), 0
            proc, self._fd, self._proc = self._proc, -1, None
            _live.discard(self)
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # EOF: the sidecar exports what it has and exits
        try:
            proc.wait(max(deadline - time.monotonic(), 0.05))
        except subprocess.TimeoutExpired:
            log_once(
                "sidecar-slow-exit",
                "kvlens sidecar (pid %s) still exporting at close; it exits on its own within its close bound",
                proc.pid,
            )
        self._maybe_write_stats(force=True)

    def close(self, timeout_s: float = 5.0) -> None:
        """Ship the rest, let the sidecar export it and exit, within about
        ``timeout_s`` (as :meth:`Recorder.close`). Idempotent; any thread."""
        self._close_deadline = time.monotonic() + timeout_s * 0.9
        if self._inline:
            return super().close(timeout_s)
        try:
            t = self._signal_stop()
            running = isinstance(t, threading.Thread)
            if running and t is not threading.current_thread():
                t.join(timeout_s)
            if self._inline:  # fell back while closing
                return super().close(max(self._close_deadline - time.monotonic(), 0.5))
            if not (running and t.is_alive()):
                self._finish()  # no thread, or it is done: a no-op after its own _finish
        except Exception:
            log_once("close", "recorder shutdown failed", exc_info=True)

    def _forget_after_fork(self) -> None:
        """In a forked child: point the inherited pipe ends at /dev/null (the
        numbers stay valid for the file objects that still hold them), so
        only the parent keeps the sidecar's stdin open."""
        proc, self._proc, self._fd = self._proc, None, -1
        if proc is None:
            return
        try:
            nul = os.open(os.devnull, os.O_RDWR)
            try:
                for f in (proc.stdin, proc.stdout):
                    os.dup2(nul, f.fileno())
            finally:
                os.close(nul)
        except (OSError, ValueError):
            pass

    def _maybe_write_stats(self, force: bool = False) -> None:
        write_stats(
            self,
            {"shipped": self.shipped, "sidecar_pid": self.sidecar_pid, "span_builder": self.mode_in_use},
            force=force,
        )
