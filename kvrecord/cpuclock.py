"""Per-thread CPU accounting at phase boundaries: CPU work, waiting for a
CPU, and the rest (off-CPU), from the kernel's own counters.

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
* :meth:`CpuClock.window` turns two readings into ``(on_s, wait_s)`` for one
  thread over ``[start, end]``: the last reading at or before each end (a
  sleeping thread's counters do not move, so a reading taken before it went
  to sleep stands for the start; ``gap_s`` says how far before it was).
  :meth:`CpuClock.spinner_window` interpolates a spinning thread's counters
  (they grow with the wall clock) at any instant.
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
from typing import Any, Iterable, NamedTuple

from kvrecord import semconv as sc
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
#: Readings a lookback examines at most (a burst of hooks can put hundreds within a millisecond).
LOOKBACK_SCAN = 16
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


class Window(NamedTuple):
    """One thread's counters over an interval, seconds."""

    on_s: float  # on a CPU
    wait_s: float  # runnable, waiting for a CPU
    gap_s: float  # how long before the interval's start the start reading was taken


def parse_schedstat(raw: bytes) -> tuple[int, int]:
    """(on-CPU ns, run-queue wait ns) of one schedstat reading."""
    a, b, _ = raw.split(None, 2)
    return int(a), int(b)


def _wait(raw: bytes) -> int:
    return int(raw.split(None, 2)[1])


def _runs(raw: bytes) -> int:
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
                on, wait, _ = raw.split(None, 2)  # the wait parsed once here: landings() scans many
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
        ring serves): where its CPU wait landed (:meth:`landings`) places it
        in the derived phases that end in it. Its ring's key; None where it
        cannot be read."""
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

    # ------------------------------------------------------------ reading
    def window(self, tid: int, start_ns: int, end_ns: int) -> Window | None:
        """``tid``'s on-CPU and run-queue wait over ``[start_ns, end_ns]``:
        the last readings at or before each end; None without one."""
        ring = self.rings.get(tid)
        if not ring:
            return None
        r1 = r0 = None
        for r in reversed(ring):
            if r1 is None:
                if r[0] <= end_ns:
                    r1 = r
                else:
                    continue
            if r[0] <= start_ns:
                r0 = r
                break
        if r0 is None or r1 is None:
            return None
        return Window((r1[1] - r0[1]) / 1e9, (_wait(r1[2]) - _wait(r0[2])) / 1e9, (start_ns - r0[0]) / 1e9)

    def lookback(self, tid: int, at_ns: int, n: int = 8, max_age_ns: int = 2_000_000_000, min_step_ns: int = 500_000):
        """``tid``'s counters before ``at_ns``: for up to ``n`` earlier readings
        (one per burst: the oldest of those within ``min_step_ns`` of the
        burst's youngest; at most ``max_age_ns`` back), their age
        and the on-CPU, CPU wait and times put on a CPU (schedstat's run count)
        from each up to the last reading at or before ``at_ns``: four lists,
        youngest first (empty: none); seconds, the runs a count, -1 where that
        last reading is not ``at_ns``'s own (a run count then says nothing of
        ``at_ns``). A derived phase that ends where this thread's event starts
        takes its figures from here (:mod:`kvtrace.cpusplit`)."""
        ring = self.rings.get(tid)
        ages: list[float] = []
        ons: list[float] = []
        waits: list[float] = []
        runs: list[int] = []
        if not ring:
            return ages, ons, waits, runs
        ref = None
        anchor = None  # the youngest reading of the current burst (readings within min_step_ns of it)
        oldest = None  # the burst's oldest reading so far: it stands for the burst (parsed once, when it closes)
        for k, (t, on, raw) in enumerate(reversed(ring)):
            if k >= LOOKBACK_SCAN:
                break
            if ref is None:
                if t <= at_ns:
                    ref = (t, on, _wait(raw), _runs(raw) if t == at_ns else None)
                    anchor = t
                continue
            if at_ns - t > max_age_ns:
                break
            if anchor - t < min_step_ns:
                # within a burst the oldest reading stands for it: a phase that began at the burst's first
                # reading (an event stamped just before a step's reading) finds its start
                if oldest is not None:
                    oldest = (t, on, raw)
                continue
            if oldest is not None:
                _entry(ref, oldest, at_ns, ages, ons, waits, runs)
            if len(ages) >= n:
                oldest = None
                break
            oldest = (t, on, raw)
            anchor = t
        if oldest is not None:
            _entry(ref, oldest, at_ns, ages, ons, waits, runs)
        return ages, ons, waits, runs

    def before_attrs(self, at_ns: int, attrs: dict) -> dict:
        """``attrs`` with the calling thread's :meth:`lookback` before ``at_ns``
        as span attributes (``kvlens.cpu.before.*``), where there is one."""
        if self.enabled:
            tid = _get_tid()
            ages, ons, waits, runs = self.lookback(tid, at_ns)
            if ages:
                attrs[sc.ATTR_CPU_BEFORE_AGE_S] = ages
                attrs[sc.ATTR_CPU_BEFORE_ON_S] = ons
                attrs[sc.ATTR_CPU_BEFORE_WAIT_S] = waits
                attrs[sc.ATTR_CPU_BEFORE_RUNS] = runs
                attrs[sc.ATTR_CPU_BEFORE_TID] = tid
        return attrs

    def landings(self, key: int, at_ns: int, max_age_ns: int = 2_000_000_000, n: int = 48, scan: int = 768):
        """Where ring ``key``'s CPU wait grew before ``at_ns`` (another
        thread's, read once per step: :meth:`watch_upstream`): for each pair
        of consecutive readings between which it grew, youngest first, the
        older's and the newer's age and the growth, seconds (three lists), and
        the newest reading's age (None: no reading): a wait still running then
        has not landed, so a phase after it is not covered.
        Another thread's wait lands when it gets a CPU, so each growth is
        waiting that ended between the two readings; :mod:`kvtrace.cpusplit`
        places it inside a phase from these bounds. At most ``n`` pairs,
        ``scan`` readings and ``max_age_ns`` back."""
        ring = self.rings.get(key)
        lo: list[float] = []
        hi: list[float] = []
        grew: list[float] = []
        newest = None
        if not ring:
            return lo, hi, grew, newest
        newer = None
        for k, r in enumerate(reversed(ring)):
            t = r[0]
            if k >= scan or at_ns - t > max_age_ns:
                break
            if t > at_ns:
                continue
            if newest is None:
                newest = (at_ns - t) / 1e9
            w = r[3] if len(r) > 3 else _wait(r[2])
            if newer is not None and newer[1] > w:
                lo.append((at_ns - t) / 1e9)
                hi.append((at_ns - newer[0]) / 1e9)
                grew.append((newer[1] - w) / 1e9)
                if len(lo) >= n:
                    break
            newer = (t, w)
        return lo, hi, grew, newest

    def spinner_window(self, tid: int, start_ns: int, end_ns: int) -> Window | None:
        """A spinning thread's counters over ``[start_ns, end_ns]``, each end
        interpolated between the readings around it (a spinner is always
        runnable: its counters grow with the wall clock); None where the
        ring does not hold both ends."""
        ring = self.rings.get(tid)
        if not ring:
            return None
        a = _interp(ring, start_ns)
        b = _interp(ring, end_ns)
        if a is None or b is None:
            return None
        # another thread's schedstat wait grows only when that thread gets a CPU (the whole stretch at once):
        # a stretch that began before the window can land in it, so the figures are bounded by the wall
        wall = (end_ns - start_ns) / 1e9
        on = min(max(b[0] - a[0], 0.0) / 1e9, wall)
        return Window(on, min(max(b[1] - a[1], 0.0) / 1e9, wall - on), 0.0)

    def psi_some_s(self, start_ns: int, end_ns: int) -> float | None:
        """The host's PSI ``some`` time over ``[start_ns, end_ns]`` (last readings at or before each end)."""
        r1 = r0 = None
        for t, raw in reversed(self.psi):
            if r1 is None:
                if t <= end_ns:
                    r1 = raw
                else:
                    continue
            if t <= start_ns:
                r0 = raw
                break
        if r0 is None or r1 is None:
            return None
        return (parse_psi_some_us(r1) - parse_psi_some_us(r0)) / 1e6


def _entry(ref, r, at_ns: int, ages: list, ons: list, waits: list, runs: list) -> None:
    """One :meth:`CpuClock.lookback` entry: reading ``r``'s age before ``at_ns`` and the counters from it up to ``ref``."""
    t, on, raw = r
    ages.append((at_ns - t) / 1e9)
    ons.append((ref[1] - on) / 1e9)
    waits.append((ref[2] - _wait(raw)) / 1e9)
    runs.append(-1 if ref[3] is None else ref[3] - _runs(raw))


def _interp(ring, t_ns: int) -> tuple[float, float] | None:
    """Counters (on, wait) at ``t_ns``, linear between the readings around it;
    None where no reading lies on one side of it."""
    after = None
    for t, on0, raw in reversed(ring):
        if t <= t_ns:
            w0 = _wait(raw)
            if t == t_ns:
                return float(on0), float(w0)
            if after is None:
                return None
            t1, on1, w1 = after
            f = (t_ns - t) / (t1 - t)
            return on0 + f * (on1 - on0), w0 + f * (w1 - w0)
        after = (t, on0, _wait(raw))
    return None


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
                wait = _wait(f.read())
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
