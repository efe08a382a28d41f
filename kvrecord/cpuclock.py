"""Per-thread CPU readings at phase boundaries, from the kernel's own
counters: what CPU work, waiting for a CPU, and the rest (off-CPU) are
computed from (:mod:`kvrecord.cpufigures`).

``/proc/<pid>/task/<tid>/schedstat`` (``CONFIG_SCHED_INFO``) holds three
numbers per thread: ns spent on a CPU, ns spent runnable but waiting on a
run queue, and the number of times it ran. Both times only grow, and a
sleeping (blocked) thread moves neither: so between two readings of one
thread, ``wall - on - wait`` is the time it was blocked (the wire, the peer,
a lock, an idle queue). ``/proc/pressure/cpu``'s ``some total`` (PSI, µs)
is the host's time with at least one runnable task waiting.

One catch, measured here: the kernel updates a *running* thread's on-CPU
figure in schedstat only at its scheduler ticks (every 4 ms at HZ 250), so
two readings 31 µs apart differed by 6.4 ms. On-CPU time is therefore read
from the thread's CPU-time clock (``clock_gettime`` of
``CLOCK_THREAD_CPUTIME_ID`` / the per-thread clock id: the kernel brings it up
to date on every read), and only the run-queue wait from schedstat: a
thread's wait is added when it gets a CPU, so a thread reading its own is
exact; a reading of another thread (a spinner) misses only the wait it is in.

How kvlens reads them (docs/phases.md, "CPU or wire"):

* :meth:`CpuClock.now` is the hooks' clock: the wall-clock ns the hooks
  already take, plus the calling thread's CPU-time clock and a ``pread`` of
  its schedstat, appended raw (no parsing) to a small per-thread ring
  (benchmarks/bench_cpuclock.py; the files stay open).
  :meth:`CpuClock.sample`, once per engine step, reads the same and also
  each watched spinning thread (NIXL's UCX progress thread) and PSI.
* The readings stay in :attr:`CpuClock.rings` (one ring per thread, keyed
  by thread id; another process's main thread under ``-pid``) and
  :attr:`CpuClock.psi`; :mod:`kvrecord.cpufigures` turns them into each
  phase's figures (a thread's window between two readings, its lookback,
  where another thread's wait landed, a spinner's interpolated counters).
  A ring's entry is ``(t_ns, on-CPU ns, raw schedstat)``; another process's
  thread's also carries its wait, parsed (``(..., wait ns)``); a PSI entry
  is ``(t_ns, raw PSI)``.
* Where a file is missing or unreadable (another kernel, a container without
  ``/proc``), :attr:`CpuClock.unknown` holds the reason, every figure is
  absent (never 0) and the hooks' clock is the plain wall clock: one warning,
  serving unaffected.

Nothing here raises into its caller.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Iterable

from kvrecord.logutil import log_once

SCHEDSTAT = "/proc/self/task/{tid}/schedstat"
PSI_CPU = "/proc/pressure/cpu"
#: Readings kept per thread: at one per engine step (a few ms) a ring spans
#: seconds, longer than any phase's start lies back.
RING = 1024
#: Threads watched per process at most (fds held open): far above vLLM's.
MAX_THREADS = 64
#: A thread is a spinner when it was runnable (on a CPU or waiting for one)
#: this share of the wall clock while its engine was idle: NIXL's UCX progress
#: thread polls with timeout 0 (runnable ~100 %); a sleeping one is ~0 %.
SPIN_SHARE = 0.5
#: ``0`` turns the readings off (the cost benchmark's baseline); figures are then unknown with this reason.
ENV = "KVLENS_CPU_ACCOUNTING"

_get_tid = threading.get_native_id
_time_ns = time.time_ns
#: A reading is kept only when it ended within this long of its timestamp: a
#: thread preempted (or made to wait for the GIL) between the two would carry
#: its wait into a window it does not belong to (measured here before this
#: check: a 32 µs phase with 1.2 ms on-CPU + wait).
SMEAR_NS = 50_000


def _gil_pread():
    """``pread`` called with the GIL held (``ctypes.PyDLL``): os.pread releases
    it, and taking it back can wait for another thread's 5 ms switch interval
    between a reading and its check. Returns ``f(fd, buf) -> bytes``."""
    import ctypes

    libc = ctypes.PyDLL(None)
    fn = libc.pread
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long]
    fn.restype = ctypes.c_ssize_t
    bufs: dict[int, Any] = {}

    def pread(fd: int, n: int, _off: int = 0) -> bytes:
        buf = bufs.get(fd)
        if buf is None:
            buf = bufs[fd] = ctypes.create_string_buffer(256)
        got = fn(fd, buf, n, 0)
        if got <= 0:
            raise OSError(f"pread of fd {fd} returned {got}")
        return buf.raw[:got]

    return pread


try:
    _pread = _gil_pread()
except Exception:  # no libc through ctypes: the plain call (readings smeared by GIL waits are dropped)
    _pread = os.pread
_thread_ns = time.thread_time_ns
_clock_ns = time.clock_gettime_ns


def thread_clock_id(tid: int) -> int:
    """The CPU-time clock id of thread ``tid`` (the kernel's
    ``MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)``): what ``pthread_getcpuclockid`` returns."""
    return ((~tid) << 3) | 6


def parse_schedstat(raw: bytes) -> tuple[int, int]:
    """(on-CPU ns, run-queue wait ns) of one schedstat reading."""
    a, b, _ = raw.split(None, 2)
    return int(a), int(b)


def wait_ns(raw: bytes) -> int:
    """schedstat's second figure: the run-queue wait, ns, of one reading."""
    return int(raw.split(None, 2)[1])


def runs(raw: bytes) -> int:
    """schedstat's third figure: how many times the thread was put on a CPU (each after a wait, maybe 0)."""
    return int(raw.split(None, 2)[2])


def parse_psi_some_us(raw: bytes) -> int:
    """PSI ``some total`` (µs) of one ``/proc/pressure/cpu`` reading."""
    first = raw.split(b"\n", 1)[0]
    return int(first.rsplit(b"total=", 1)[1])


def probe() -> tuple[str | None, str | None]:
    """Why per-thread schedstat, and why PSI, cannot be read here (None: they can)."""
    sched = psi = None
    try:
        with open(SCHEDSTAT.format(tid=_get_tid()), "rb") as f:
            parse_schedstat(f.read())
    except Exception as e:
        sched = f"per-thread schedstat unreadable ({SCHEDSTAT.format(tid='<tid>')}: {e}); needs CONFIG_SCHED_INFO"
    try:
        with open(PSI_CPU, "rb") as f:
            parse_psi_some_us(f.read())
    except Exception as e:
        psi = f"CPU pressure unreadable ({PSI_CPU}: {e}); needs CONFIG_PSI"
    return sched, psi


class CpuClock:
    """The hooks' clock with per-thread CPU readings (module docstring).

    One per process (:data:`CLOCK`). Every method may be called from any
    thread; rings are ``deque``s (appends are atomic under the GIL)."""

    def __init__(self, ring: int = RING) -> None:
        self._ring = ring
        self._fds: dict[int, int] = {}  # tid -> fd (-1: unreadable)
        self.rings: dict[int, collections.deque] = {}  # tid -> (t_ns, on-CPU ns, raw schedstat)
        self.psi: collections.deque = collections.deque(maxlen=ring * 2)  # (t_ns, raw PSI)
        self._spin: tuple[tuple[int, int, int], ...] = ()  # (tid, fd, CPU clock id) of watched spinners
        self.spinners: frozenset[int] = frozenset()
        self._up: tuple[int, int] | None = None  # (ring key, fd) of the upstream thread (watch_upstream)
        self.upstream: int | None = None
        self._front: tuple[int, int] | None = None  # (ring key, fd) of the API server's main thread (watch_frontend)
        self.frontend: int | None = None  # its ring's key (the upstream's where that is the API server)
        self._psi_fd = -1
        self.smeared = 0  # readings dropped: they ended more than SMEAR_NS after their timestamp
        if os.environ.get(ENV, "1").strip() == "0":
            self.unknown = self.psi_unknown = f"turned off ({ENV}=0)"
        else:
            self.unknown, self.psi_unknown = probe()
        if self.unknown:
            log_once("cpuclock", "kvlens: %s; phases carry no CPU figures (shown as unknown)", self.unknown)
        if self.psi_unknown is None:
            try:
                self._psi_fd = os.open(PSI_CPU, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                self.psi_unknown = f"CPU pressure unreadable ({PSI_CPU}: {e})"
        self.enabled = self.unknown is None

    # ------------------------------------------------------------ hot path
    def now(self) -> int:
        """Wall-clock ns, and a reading of this thread stamped with it (the
        returned time is the kept reading's stamp)."""
        if not self.enabled:
            return _time_ns()
        try:
            return self._read(_get_tid())
        except Exception:
            self._failed()
            return _time_ns()

    def sample(self) -> None:
        """Once per engine step: a reading of the calling thread, of the
        spinners, of the upstream thread and of PSI (their figures are to
        within a step)."""
        try:
            self._read(_get_tid())
            if self._up is not None and not self._other(self._up):  # it exited: stop reading it
                self._up = self.upstream = None
            if self._front is not None and not self._other(self._front):
                self._front = self.frontend = None
            for stid, sfd, cid in self._spin:  # each stamped on its own (interpolated between readings)
                try:
                    for _ in range(2):
                        ts = _time_ns()
                        r = (ts, _clock_ns(cid), _pread(sfd, 96, 0))
                        if _time_ns() - ts < SMEAR_NS:
                            self.rings[stid].append(r)
                            break
                except OSError:  # the thread exited: stop reading it
                    self._spin = tuple(x for x in self._spin if x[0] != stid)
                    self.spinners = frozenset(t for t, *_ in self._spin)
            if self._psi_fd >= 0:
                ts = _time_ns()
                r = (ts, _pread(self._psi_fd, 160, 0))
                if _time_ns() - ts < SMEAR_NS:
                    self.psi.append(r)
        except Exception:
            self._failed()

    def _other(self, up: tuple[int, int]) -> bool:
        """A reading of another process's thread (``(ring key, fd)``): its wait
        from schedstat (on-CPU: schedstat's, coarse); False where it exited."""
        try:
            ts = _time_ns()
            raw = _pread(up[1], 96, 0)
            if _time_ns() - ts < SMEAR_NS:
                on, wait, _ = raw.split(None, 2)  # the wait parsed once here: cpufigures.landings scans many
                self.rings[up[0]].append((ts, int(on), raw, int(wait)))
            return True
        except OSError:
            return False

    def _read(self, tid: int) -> int:
        """This thread's reading, stamped; kept only if it ended within
        :data:`SMEAR_NS` of its stamp (else the thread was preempted in
        between: tried again, up to 3 times, then dropped and counted)."""
        fd = self._fds.get(tid)
        if fd is None:
            fd = self._open(tid)
        t = _time_ns()
        if fd >= 0:
            ring = self.rings[tid]
            for _ in range(3):
                try:
                    raw = _pread(fd, 96, 0)
                except OSError:  # a file opened for a thread that exited, its tid now this one's: open anew once
                    fd = self._reopen(tid)
                    if fd < 0:
                        return t
                    continue
                r = (t, _thread_ns(), raw)
                t1 = _time_ns()
                if t1 - t < SMEAR_NS:
                    ring.append(r)
                    return t
                t = t1
            self.smeared += 1
        return t

    def _reopen(self, tid: int) -> int:
        try:
            os.close(self._fds.get(tid, -1))
        except OSError:
            pass
        try:
            fd = os.open(SCHEDSTAT.format(tid=tid), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
        self._fds[tid] = fd
        self.rings[tid] = collections.deque(maxlen=self._ring)
        return fd

    def _after_fork(self) -> None:
        """In a forked child: the parent's threads' files are not this process's."""
        for fd in {*self._fds.values(), *(f for _, f, _ in self._spin)} - {-1}:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self.rings.clear()
        self._spin, self.spinners = (), frozenset()
        self._up = self.upstream = None
        self._front = self.frontend = None

    def _open(self, tid: int) -> int:
        fd = -1
        if len(self._fds) < MAX_THREADS:
            try:
                fd = os.open(SCHEDSTAT.format(tid=tid), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = -1
            self.rings[tid] = collections.deque(maxlen=self._ring)
        self._fds[tid] = fd
        return fd

    def _failed(self) -> None:
        log_once("cpuclock-read", "kvlens: reading schedstat failed; CPU figures off in this process", exc_info=True)
        self.enabled = False
        self.unknown = "schedstat read failed in this process (see its log)"

    # ------------------------------------------------------------ upstream
    def watch_upstream(self, pid: int) -> int | None:
        """Read the main thread of process ``pid`` at every step: the thread
        this process's engine waits on, blocked, while it waits for a CPU
        (a vLLM worker's EngineCore; an EngineCore's API server). Its ring's
        key is returned (``-pid``: never a thread id); None where it cannot
        be read."""
        if self._up is not None and self._up[0] == -pid:
            return self.upstream
        try:
            fd = os.open(f"/proc/{pid}/task/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        key = -pid
        self.rings[key] = collections.deque(maxlen=self._ring)
        self._up = (key, fd)
        self.upstream = key
        if self._front is not None and self._front[0] == key:  # read once, as the upstream
            self._front = None
        return key

    def watch_frontend(self, pid: int) -> int | None:
        """Also read the main thread of process ``pid``, the engine's API
        server, at every step (where it is this process's upstream, that
        ring serves): where its CPU wait landed
        (:func:`kvrecord.cpufigures.landings`) places it in the derived
        phases that end in it. Its ring's key; None where it cannot be read."""
        key = -pid
        if self.upstream == key:
            self._front, self.frontend = None, key
            return key
        if self._front is not None and self._front[0] == key:
            return key
        try:
            fd = os.open(f"/proc/{pid}/task/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        self.rings[key] = collections.deque(maxlen=self._ring)
        self._front, self.frontend = (key, fd), key
        return key

    # ------------------------------------------------------------ spinners
    def watch_spinners(self, tids: Iterable[int]) -> None:
        """Read these threads (NIXL's progress threads) at every sample."""
        spin = []
        for tid in tids:
            fd = self._fds.get(tid)
            if fd is None:
                fd = self._open(tid)
            if fd >= 0:
                spin.append((tid, fd, thread_clock_id(tid)))
        self._spin = tuple(spin)
        self.spinners = frozenset(t for t, *_ in spin)


def thread_ids(pid: int | str = "self") -> set[int]:
    """The thread ids of a process (empty where /proc cannot be read)."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


def find_spinners(candidates: Iterable[int], sample_s: float = 0.5) -> set[int]:
    """Among ``candidates`` (threads of this process), those runnable at
    least :data:`SPIN_SHARE` of ``sample_s`` (on a CPU or waiting for one):
    threads that poll instead of sleeping. Blocks ``sample_s``; call it off
    the engine's threads."""

    def read(tid: int) -> int | None:
        try:
            with open(SCHEDSTAT.format(tid=tid), "rb") as f:
                wait = wait_ns(f.read())
            return _clock_ns(thread_clock_id(tid)) + wait
        except Exception:
            return None

    before = {t: v for t in candidates if (v := read(t)) is not None}
    t0 = time.monotonic()
    time.sleep(sample_s)
    dt = time.monotonic() - t0
    out = set()
    for t, v0 in before.items():
        v1 = read(t)
        if v1 is not None and (v1 - v0) / 1e9 >= SPIN_SHARE * dt:
            out.add(t)
    return out


#: The process's clock (the hooks' ``now``).
CLOCK = CpuClock()
os.register_at_fork(after_in_child=CLOCK._after_fork)
