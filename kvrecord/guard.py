"""The parent-death guard a supervised child runs under, and the one place
that asks the kernel for a parent-death signal (:func:`parent_death_signal`).

Run as ``python -I -S <this file> <supervisor pid> <grace s> <argv...>``
(:func:`kvrecord.children.guarded`): by its file, stdlib only, isolated from
the child's ``PYTHONPATH`` and site, so it starts in milliseconds and is the
copy that sits beside the :mod:`kvrecord.children` that started it (a
``-m kvrecord.guard`` would import whichever ``kvrecord`` the environment
finds first). It forks and execs ``argv`` in the guard's process group
(the guard leads it), then waits with every signal it handles blocked
(``sigwaitinfo``, no handler races):

* the child exits: the guard exits the same way (same code, or killed by
  the same signal), so the supervisor's ``returncode`` is the server's;
* its parent died (``getppid()`` changed; the kernel's parent-death signal
  SIGUSR2 is what usually says so): SIGTERM to the group, up to ``grace``
  seconds for the child, then SIGKILL to the group (the guard included);
* SIGUSR2 while the parent lives: the thread that started the guard ended
  (the kernel sends the parent-death signal per thread); ignored;
* SIGTERM / SIGINT / SIGHUP from the supervisor: ignored, the supervisor
  signals whole process groups, so the server got the same signal (sending
  it twice could interrupt vLLM's clean-up); from anyone else: passed on to
  the server.

Why a guard rather than the server's own parent-death signal (or
``setpriv --pdeathsig``): the signal would reach only the server, not the
processes it starts (vLLM's EngineCore and workers set none), and it fires
when the supervisor's *thread* that started the server ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1
#: ``prctl`` option: no transparent huge pages for the caller and, inherited, its children
PR_SET_THP_DISABLE = 41


def prctl(option: int, arg: int) -> bool:
    """Linux ``prctl(option, arg)`` for the calling process; False where it
    fails or cannot run (not Linux, no libc). Safe between fork and exec."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, int(arg), 0, 0, 0) == 0
    except Exception:
        return False


def parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send the calling process ``sig`` when its parent
    (the parent's thread that started it) dies (Linux ``PR_SET_PDEATHSIG``).
    Safe between fork and exec. False where it cannot (not Linux, no libc)."""
    return prctl(_PR_SET_PDEATHSIG, sig)


def _sweep(pid: int, grace: float) -> None:
    """The parent is gone: SIGTERM to the group, ``grace`` seconds for the
    child ``pid`` (0: none started), then SIGKILL to the group, this guard too."""
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


def _exit_like(status: int) -> None:
    """Exit as the child did: the same code, or killed by the same signal."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to terminate
    sys.exit(code)


def main(args: list[str]) -> None:
    ppid, grace, argv = int(args[0]), float(args[1]), args[2:]
    death, stop = signal.SIGUSR2, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    watch = {*stop, death, signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watch)
    parent_death_signal(death)
    if os.getppid() != ppid:  # the supervisor died before the parent-death signal was set
        _sweep(0, grace)
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(2, f"kvlens: cannot run {argv[0]!r}: {e}\n".encode())
        os._exit(127)
    while True:
        info = signal.sigwaitinfo(watch)
        if info.si_signo == signal.SIGCHLD:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
        elif os.getppid() != ppid:
            _sweep(pid, grace)
        elif info.si_signo in stop and info.si_pid != ppid:
            try:
                os.kill(pid, info.si_signo)
            except OSError:
                pass
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
