"""``kvlens up --sched-trace``: the kernel's scheduler events, recorded
while a stack serves, for :mod:`kvtrace.schedtrace` to walk each phase's
critical path through (docs/phases.md, "The kernel's record").

The kernel records them itself, into a tracefs instance of its own
(``instances/kvlens-<pid>-<n>``): ``sched_switch``, ``sched_wakeup`` and
``sched_wakeup_new`` on every CPU, on CLOCK_MONOTONIC, with each event's
process id and interrupt context, and where the kernel has them the TCP
tracepoints that say when data reached a socket and when a thread read it
(``tcp_probe`` with data, ``tcp_rcv_space_adjust``: the transfer's CPU wait,
:meth:`kvtrace.schedtrace.Timeline.starved_ns`; ``sched.net`` says they were on) and the
threads' TCP sends (``sock_send_length``: a reply a thread owed), in a ring buffer per CPU
(:func:`buffer_kb`: 128 MiB in all by default, ``--sched-buffer-mb``) that keeps the
newest events (the memory it takes is bounded; a long run keeps its last
stretch). No process of ours copies events out while the stack serves: a first version ran ``perf record``, and on this 2-core host
under CPU load the perf process was migrated between the CPUs for a minute
without once getting one (runnable, 0 ms of CPU; ``/proc/<pid>/sched``),
so its start timed out. At :meth:`SchedRecording.stop` the instance's
buffer is written to ``<folder>/sched.trace`` (text) and the instance
removed; while it runs, :func:`kvtrace.schedtrace.load` reads the live
buffer.

A small holder process (``sh`` under ``unshare --mount``) owns the
instance: where tracefs is not mounted it mounts it in its own mount
namespace, so the host is left as it was; it runs under the parent-death
guard (:mod:`kvrecord.guard`), and on SIGTERM or SIGINT (a stop, or its
parent's death through the guard) it writes the buffer out, turns the
events off and removes the instance. It runs at real-time priority
(:data:`HOLDER_FIFO`), so that work never waits behind busy threads; one
killed past the stop's grace has its instance removed by kvlens
(:data:`REMOVE`). Root only; anything missing is a
:class:`~kvlens.stack.errors.StackError` naming it. Beside the record,
``sched.json``: the offset from CLOCK_MONOTONIC to the wall clock the spans
use (read when recording began and when it ended), the stack's processes (a
wake-up in a softirq is followed only into those) and the instance.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

from kvrecord.children import ChildProcess
from kvlens.stack.errors import StackError
from kvtrace.schedtrace import META, NET, READY, TEXT, TRACEFS

logger = logging.getLogger("kvlens.up")

#: Kernel memory the record may take, KiB, shared out per CPU (:func:`buffer_kb`); the newest events kept. A
#: serving 1P1D pair on this 2-core host made ~6,000 context switches a second plus as many wake-ups
#: (benchmarks/bench_schedrec.py): 64 MiB a CPU holds about three minutes of it; a mixed fleet (two pairs,
#: the delayers) twice that rate, about 100 s (benchmarks/bench_links.py takes 512 MiB).
TOTAL_KB = 131072
#: Each CPU's share is at least this (a many-core host keeps a shorter stretch, never more memory than asked).
MIN_CPU_KB = 1024


def buffer_kb(cpus: int | None = None, total_kb: int = TOTAL_KB) -> int:
    """The ring buffer per CPU, KiB: ``total_kb`` shared out, at least :data:`MIN_CPU_KB`."""
    n = cpus or os.cpu_count() or 1
    return max(MIN_CPU_KB, total_kb // n)


#: Seconds for the holder to set the instance up.
START_TIMEOUT_S = 60.0
#: Seconds the holder gets to write the buffer out when stopped (then it is killed and kvlens removes the
#: instance, :data:`REMOVE`; where kvlens itself died, the next recording's holder removes an instance whose
#: owner is gone).
STOP_GRACE_S = 120.0
#: The holder's real-time priority (SCHED_FIFO, the lowest): its few moments of work (freeze, write out,
#: remove) must not wait for a CPU. Measured on this 2-core host, a 1P1D pair idle (NIXL's progress threads
#: spinning at the normal class, one per core): a plain ``cat`` of a 5 MB record took 0.1 s in 12 of 12 tries
#: free to move between the cores, but 0.1-75 s bound to one core (4 of 6 over 20 s: runnable, a few ms of
#: CPU); the stop of a record in ``--hosts`` stacks took 22-36 s for 5 MB, and twice ran past
#: :data:`STOP_GRACE_S` (killed, no record). At SCHED_FIFO 1: 0.1 s in 3 of 3. Writing 128 MiB of buffer
#: (~360 MB of text) takes ~4 s of one CPU here, during which that CPU runs nothing else of the normal class.
HOLDER_FIFO = 1
#: The instance's name prefix (``<prefix><pid>-<n>``).
PREFIX = "kvlens-"
_seq = itertools.count()

#: The holder (sh): $1 instance name, $2 buffer KiB, $3 folder (the record and its ready file go there).
HOLDER = r"""
T=/sys/kernel/tracing
mountpoint -q "$T" || mount -t tracefs nodev "$T" || { echo "cannot mount tracefs at $T" >&2; exit 3; }
I="$T/instances/$1"
F="$3"
for d in "$T"/instances/kvlens-*; do  # an instance whose holder was killed before it could remove it
  [ -d "$d" ] || continue
  owner=${d##*/kvlens-}; owner=${owner%%-*}
  kill -0 "$owner" 2>/dev/null || { echo 0 > "$d/events/enable"; rmdir "$d"; }
done
mkdir "$I" || { echo "cannot create the tracefs instance $I" >&2; exit 4; }
stop() {
  echo 0 > "$I/tracing_on"
  cat "$I/trace" > "$F/sched.trace.part" && mv "$F/sched.trace.part" "$F/sched.trace"
  echo 0 > "$I/events/enable"
  rmdir "$I"
  exit 0
}
discard() {  # the record is not wanted (a benchmark that read it live): no minutes of text
  echo 0 > "$I/tracing_on"
  echo 0 > "$I/events/enable"
  rmdir "$I"
  exit 0
}
trap stop TERM INT HUP
trap discard USR1
trap 'echo 0 > "$I/tracing_on"' USR2  # freeze: the record ends here; written out at the stop
echo mono > "$I/trace_clock" && echo "$2" > "$I/buffer_size_kb" && echo 1 > "$I/options/record-tgid" \
  && echo 1 > "$I/events/sched/sched_switch/enable" && echo 1 > "$I/events/sched/sched_wakeup/enable" \
  && echo 1 > "$I/events/sched/sched_wakeup_new/enable" && echo 1 > "$I/tracing_on" \
  || { echo "cannot set up the tracefs instance $I" >&2; echo 0 > "$I/events/enable"; rmdir "$I"; exit 5; }
# the transfer's sockets, where the kernel has the tracepoints: a segment that brought data (tcp_probe, in the
# receiving softirq) and a read from a socket (tcp_rcv_space_adjust, by the reading thread); kvtrace.schedtrace
E="$I/events/tcp"
if [ -d "$E/tcp_probe" ] && [ -d "$E/tcp_rcv_space_adjust" ] && echo 'data_len > 0' > "$E/tcp_probe/filter" \
  && echo 1 > "$E/tcp_probe/enable" && echo 1 > "$E/tcp_rcv_space_adjust/enable"; then
  echo 1 > "$F/sched.net"  # kvtrace.schedtrace.NET
  # and a thread's sends over TCP/IPv4 (sock_send_length: its socket's address), where the kernel has it: a
  # thread that read from a socket and owes its peer a reply on it (kvtrace.schedtrace.Timeline.turns)
  S="$I/events/sock/sock_send_length"
  [ -d "$S" ] && echo 'family == 2 && protocol == 6' > "$S/filter" && echo 1 > "$S/enable"
fi
echo "$$" > "$F/sched.ready"
while :; do sleep 3600 & wait $!; done
"""


#: Removes instance $1 where its holder could not (killed past the grace): events off, then the directory.
REMOVE = r"""
T=/sys/kernel/tracing
mountpoint -q "$T" || mount -t tracefs nodev "$T" || exit 3
I="$T/instances/$1"
[ -d "$I" ] || exit 0
echo 0 > "$I/tracing_on"; echo 0 > "$I/events/enable"; rmdir "$I"
"""


def check() -> None:
    """StackError naming what is missing where the kernel's record cannot be kept here."""
    if os.geteuid() != 0:
        raise StackError("--sched-trace needs root (the kernel's scheduler tracepoints, through tracefs)")
    for tool in ("unshare", "sh", "mountpoint"):
        if shutil.which(tool) is None:
            raise StackError(f"--sched-trace needs {tool} (util-linux)")
    if not os.path.isdir(TRACEFS):
        raise StackError(f"--sched-trace needs tracefs at {TRACEFS} (a kernel with CONFIG_TRACING)")


def _tree(pids: Iterable[int]) -> list[int]:
    """``pids`` and every process under them."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil ships with vLLM
        return sorted(set(pids))
    out = set()
    for pid in pids:
        try:
            out.add(pid)
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return sorted(out)


def _realtime(pid: int) -> bool:
    """``pid`` (the holder) at SCHED_FIFO :data:`HOLDER_FIFO`, inherited by what it runs; False (one warning)
    where the kernel refuses: the record still works, its write-out may then wait for a CPU."""
    try:
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(HOLDER_FIFO))
        return True
    except (OSError, AttributeError) as e:
        logger.warning("the kernel's scheduler record: its holder keeps the normal class (%s): writing the record "
                       "out may wait for a CPU on a busy host", e)  # fmt: skip
        return False


def _remove(instance: str) -> None:
    """Remove ``instance`` where its holder did not (:data:`REMOVE`); a failure is logged, never raised."""
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", REMOVE, "sh", instance]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            logger.warning("could not remove the tracefs instance %s: %s", instance, r.stderr.strip()[-200:])
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not remove the tracefs instance %s: %s", instance, e)


def _offset_ns() -> int:
    """Wall clock minus CLOCK_MONOTONIC, ns (the middle of two bracketing reads)."""
    a = time.time_ns()
    m = time.monotonic_ns()
    b = time.time_ns()
    return (a + b) // 2 - m


class SchedRecording:
    """The kernel's scheduler record of a running stack, kept in ``folder``.
    ``start()`` returns once the kernel records; ``stop()`` writes the
    record out and removes the instance. A context manager too."""

    def __init__(self, folder: Path | str, pids: Iterable[int], say=logger.info, total_kb: int = TOTAL_KB) -> None:
        self.folder = Path(folder)
        self.pids = list(pids)
        self.say = say
        self.proc: ChildProcess | None = None
        self.meta: dict = {}
        self.instance = f"{PREFIX}{os.getpid()}-{next(_seq)}"
        self.buffer_kb = buffer_kb(total_kb=total_kb)

    def start(self) -> "SchedRecording":
        check()
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in (TEXT, READY, META, NET):
            (self.folder / old).unlink(missing_ok=True)
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", HOLDER, "sh"]
        argv += [self.instance, str(self.buffer_kb), str(self.folder)]
        self.proc = ChildProcess(argv, log=self.folder / "holder.log", guard=True, guard_grace_s=STOP_GRACE_S)
        self.proc.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.folder / READY).exists():
            if not self.proc.alive() or time.monotonic() > deadline:
                log = (self.folder / "holder.log").read_text(errors="replace").strip()[-300:]
                self.stop()
                raise StackError(f"the kernel's scheduler record did not start: {log or 'no output'}")
            time.sleep(0.05)
        self.meta = {
            "offset_ns": _offset_ns(),
            "pids": _tree(self.pids),
            "started": time.time(),
            "instance": self.instance,
            "holder_pid": int((self.folder / READY).read_text().strip() or 0),
            "buffer_kb": self.buffer_kb,
            # the TCP tracepoints were on: the transfer's CPU wait can be read (kvtrace.schedtrace.Timeline.net)
            "net": (self.folder / NET).exists(),
        }
        self.meta["holder_fifo"] = _realtime(self.meta["holder_pid"])
        self._write_meta()
        self.say(
            f"kernel scheduler record: {self.folder} (tracefs instance {self.instance}, {self.buffer_kb} KiB a CPU)"
        )
        return self

    def _write_meta(self) -> None:
        (self.folder / META).write_text(json.dumps(self.meta, indent=1))

    def _signal_holder(self, sig: int) -> bool:
        holder = self.meta.get("holder_pid")
        if self.proc is None or not holder:
            return False
        try:
            os.kill(int(holder), sig)
        except OSError:
            return False
        return True

    def freeze(self) -> None:
        """End the record now (the kernel stops writing to it) without writing it out yet: a stack stops its
        record first, then its children, so the text is written with the CPUs free (:meth:`stop`)."""
        if self._signal_holder(signal.SIGUSR2):
            self.meta["offset_ns_end"] = _offset_ns()

    def stop(self, keep: bool = True) -> None:
        """Write the record out (``sched.trace``; with ``keep`` False, not: the instance is dropped at once)
        and remove the instance; idempotent. Writing takes about a second per MiB of a full buffer here."""
        if self.proc is None:
            return
        if not keep and self._signal_holder(signal.SIGUSR1):
            self.proc.wait(STOP_GRACE_S)
        proc, self.proc = self.proc, None
        code = proc.stop(grace_s=STOP_GRACE_S, first=signal.SIGTERM)
        (self.folder / READY).unlink(missing_ok=True)
        if code != 0:  # killed past the grace (or failed): the instance may be left, with its kernel memory
            _remove(self.instance)
            if keep and self.meta and not (self.folder / TEXT).exists():  # it had started
                logger.warning(
                    "the kernel's scheduler record in %s was not written out within %.0f s (holder exit %s): "
                    "no record; the tracefs instance %s is removed",
                    self.folder,
                    STOP_GRACE_S,
                    code,
                    self.instance,
                )
        if self.meta:
            self.meta.setdefault("offset_ns_end", _offset_ns())
            self.meta["stopped"] = time.time()
            self.meta.pop("holder_pid", None)  # the record is the file now
            self._write_meta()

    def __enter__(self) -> "SchedRecording":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
