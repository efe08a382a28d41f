"""The cleanup side of ``kvlens up --hosts``'s network (:mod:`kvlens.stack.netns`,
docs/links.md): what of a stack id exists now, its removal, the sweep of
stacks whose owner is gone, and the keeper (``python -m kvlens.stack.netclean
keep ID``) that removes a stack's network when the stack stops or its
supervisor dies.

Every object name carries the stack's id (6 hex digits), so cleanup only ever
removes kvlens' own objects. The namespaces hold the veths, qdiscs and
iptables rules, so :func:`teardown` deletes the namespaces and the root veth.
A stack records its owner in ``/run/kvlens-netns/ID.json``;
:func:`remove_leftovers` removes the objects of every id whose owner is gone.

Blocking subprocess calls on the calling thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from kvlens.stack.errors import StackError
from kvlens.stack.leftovers import cmdline

STATE_DIR = Path("/run/kvlens-netns")
_ID = re.compile(r"^kvl-([0-9a-f]{6})-")
_ROOT_VETH = re.compile(r"^kvl([0-9a-f]{6})h$")
#: How long the keeper waits for the processes in its namespaces to exit before it kills them
#: (below the guard's grace, kvrecord.children.GUARD_GRACE_S).
KEEP_WAIT_S = 10.0


def run(argv: list[str], check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` (in namespace ``ns``, by ``ip netns exec``); StackError on failure if ``check``."""
    if ns is not None:
        argv = ["ip", "netns", "exec", ns, *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise StackError(f"--hosts: `{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def _owner_alive(rec: dict) -> bool:
    pid = rec.get("pid")
    return bool(pid) and cmdline(pid) == rec.get("cmdline")


def stack_ids() -> set[str]:
    """Ids of every stack whose namespaces or root veth exist now."""
    ids = set()
    r = run(["ip", "netns", "list"], check=False)
    for line in r.stdout.splitlines():
        if m := _ID.match(line.split()[0] if line.split() else ""):
            ids.add(m.group(1))
    r = run(["ip", "-o", "link", "show"], check=False)
    for line in r.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if m := _ROOT_VETH.match(name):
            ids.add(m.group(1))
    ids |= {p.stem for p in STATE_DIR.glob("*.json")} if STATE_DIR.is_dir() else set()
    return ids


def objects(sid: str) -> dict[str, list[str]]:
    """What of stack ``sid`` exists now: namespaces, root veths, processes in its namespaces."""
    r = run(["ip", "netns", "list"], check=False)
    ns = [ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith(f"kvl-{sid}-")]
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    veths = [f"kvl{sid}h"] if f" kvl{sid}h" in links or f" kvl{sid}h@" in links else []
    pids = []
    for n in ns:
        pids += run(["ip", "netns", "pids", n], check=False).stdout.split()
    return {"namespaces": ns, "veths": veths, "pids": pids}


def teardown(sid: str, kill: bool = False) -> None:
    """Remove stack ``sid``'s namespaces, root veth and owner record
    (``kill``: SIGKILL processes still inside its namespaces first: a
    crashed stack's delayers). Idempotent; never touches another id."""
    if not re.fullmatch(r"[0-9a-f]{6}", sid):
        raise ValueError(f"not a kvlens stack id: {sid!r}")
    obj = objects(sid)
    if kill:
        for pid in obj["pids"]:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for n in obj["namespaces"]:
        run(["ip", "netns", "del", n], check=False)
    for v in obj["veths"]:
        run(["ip", "link", "del", v], check=False)
    with contextlib.suppress(OSError):
        (STATE_DIR / f"{sid}.json").unlink()


def remove_leftovers(say: Callable[[str], None] = print) -> list[str]:
    """Tear down every stack id whose owner process is gone (a crash the
    guard could not clean up after); returns the ids removed."""
    gone = []
    for sid in sorted(stack_ids()):
        try:
            rec = json.loads((STATE_DIR / f"{sid}.json").read_text())
        except (OSError, ValueError):
            rec = {}
        if _owner_alive(rec):
            continue
        say(f"removing the network namespaces of an earlier --hosts stack {sid} (its kvlens is gone)")
        teardown(sid, kill=True)
        gone.append(sid)
    return gone


def keep(sid: str) -> int:
    """``python -m kvlens.stack.netclean keep ID``: wait for SIGTERM / SIGINT /
    SIGHUP (the stack's stop, or the guard after the supervisor died), then
    :func:`teardown` the stack's network. Runs as the stack's first child."""
    sigs = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    print(f"netns keeper of stack {sid} (pid {os.getpid()})", flush=True)
    signal.sigwait(sigs)
    end = time.monotonic() + KEEP_WAIT_S  # the stack's servers stop meanwhile: let them exit cleanly first
    while objects(sid)["pids"] and time.monotonic() < end:
        time.sleep(0.2)
    teardown(sid, kill=True)
    print(f"removed the network of stack {sid}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["keep"]:
        sys.exit(keep(sys.argv[2]))
    if sys.argv[1:2] == ["cleanup"]:
        print(remove_leftovers())
        sys.exit(0)
    sys.exit("usage: python -m kvlens.stack.netclean keep ID | cleanup")
