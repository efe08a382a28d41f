"""What an earlier ``kvlens up`` left running, found from its ``stack.json``.

A stack records, for each child, its process group and every member's pid
and command line (:func:`group_record`, written by
:class:`~kvlens.stack.launch.Stack`). :func:`find_leftovers` reads the
records under a home's ``runs/`` and names the processes still alive with
the same command line (a pid reused by an unrelated process is not blamed):
a supervisor that died in a way its children's guards could not see (a
kvlens older than the guard, a guard itself killed with SIGKILL, a host
without ``prctl``), or one still running elsewhere. Nothing here stops a
process; :meth:`Leftover.line` says how to (``kill -TERM -<pgid>``).

Linux ``/proc`` only: elsewhere nothing is found. Blocking file reads on the
calling thread.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from kvrecord.location import redact_text


def cmdline(pid: int) -> list[str] | None:
    """A live process's command line (``/proc``), any PostgreSQL URL's
    password in it as ``***`` (it is written to ``stack.json``, and compared
    in that form); None when it is gone, a zombie or unreadable (not Linux)."""
    try:
        raw = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return [redact_text(a) for a in raw.rstrip(b"\0").decode("utf-8", "replace").split("\0")] if raw else None


def process_groups() -> dict[int, list[int]]:
    """Process group id -> pids of its members, from one ``/proc`` scan ({} off Linux)."""
    out: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{d}/stat").read_text()
                pgrp = int(stat.rsplit(")", 1)[1].split()[2])  # after "pid (comm)": state ppid pgrp
                out.setdefault(pgrp, []).append(int(d))
    return out


def group_record(name: str, pgid: int, groups: Mapping[int, list[int]] | None = None) -> dict:
    """What ``stack.json`` keeps of one child: its group and each member's
    pid and command line (so a later check can tell a survivor from a
    reused pid). ``groups``: a :func:`process_groups` scan to reuse."""
    pids = sorted((process_groups() if groups is None else groups).get(pgid, []))
    members = [{"pid": p, "cmdline": c} for p in pids if (c := cmdline(p))]
    return {"name": name, "pgid": pgid, "members": members}


def processes_record(children) -> dict:
    """``stack.json``'s ``processes`` (:func:`group_record` of each started
    child: anything with ``name`` and a ``proc`` whose pid leads its group)
    and ``supervisor`` (this process, pid and command line)."""
    groups = process_groups()
    return {
        "processes": [group_record(c.name, c.proc.pid, groups) for c in children if c.proc is not None],
        "supervisor": {"pid": os.getpid(), "cmdline": cmdline(os.getpid())},
    }


@dataclass
class Leftover:
    """A stack recorded in ``manifest`` with processes still alive."""

    manifest: Path
    names: list[str]
    pgids: list[int]
    pids: list[int]
    ports: list[int] = field(default_factory=list)
    supervisor: int | None = None  # the kvlens that started it, when it still runs

    def line(self) -> str:
        if self.supervisor:  # stopping its kvlens stops the whole stack
            who, stop = f"run by kvlens pid {self.supervisor}", str(self.supervisor)
        else:
            who, stop = "its kvlens is gone: left behind", " ".join(f"-{g}" for g in self.pgids)
        return (
            f"a previous stack is still running ({who}): {', '.join(self.names)}, pids "
            f"{', '.join(map(str, self.pids))}, ports {', '.join(map(str, self.ports)) or '?'}, "
            f"recorded in {self.manifest}; stop it with: kill -TERM {stop}"
        )


def _alive(member: Mapping) -> bool:
    """The recorded process still runs with the recorded command line."""
    now = cmdline(member.get("pid", 0))
    want = member.get("cmdline")
    if want is None:  # a record from before command lines were kept: a kvlens or vLLM process
        return now is not None and any("kvlens" in a or "vllm" in a for a in now)
    return now == want


def _leftover(path: Path, m: Mapping, me: int) -> Leftover | None:
    sup = m.get("supervisor") or {}
    if me and sup.get("pid") == me:
        return None  # one of this process's own stacks
    records = m.get("processes") or [
        {"name": n, "pgid": p, "members": [{"pid": p}]} for n, p in (m.get("pids") or {}).items()
    ]
    names, pgids, pids = [], [], []
    for rec in records:
        live = [x["pid"] for x in rec.get("members", []) if _alive(x)]
        if live:
            names.append(rec["name"])
            pgids.append(rec["pgid"])
            pids += live
    if not pids:
        return None
    ports = sorted(p for p in (m.get("ports") or {}).values() if isinstance(p, int))
    return Leftover(path, names, pgids, pids, ports, sup.get("pid") if sup and _alive(sup) else None)


def find_leftovers(runs_dir: Path, me: int | None = None) -> list[Leftover]:
    """Stacks recorded under ``runs_dir`` (``*/stack.json``) with processes
    still alive, except those started by process ``me`` (default: this one;
    0: none excepted). Reads only; stops nothing."""
    me = os.getpid() if me is None else me
    out = []
    for path in sorted(Path(runs_dir).glob("*/stack.json")):
        try:
            m = json.loads(path.read_text())
            found = _leftover(path, m, me) if isinstance(m, dict) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable or not ours: skip
            continue
        if found is not None:
            out.append(found)
    return out


def busy_hint(message: str, left: list[Leftover]) -> str:
    """A busy-port error ``message`` with the stacks still running appended
    (their ports among what is busy, most likely)."""
    return f"{message} ({'; '.join(lo.line() for lo in left)})" if left else message
