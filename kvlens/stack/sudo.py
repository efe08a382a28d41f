"""``sudo kvlens up --hosts``: the network namespaces need root, the servers
do not (issue 42, item 7).

Under ``sudo`` (this process root, ``$SUDO_UID`` naming the user who ran
it), a ``--hosts`` stack runs vLLM (every P and D), the router and the
collector as that user: ``ip netns exec NS setpriv --reuid=UID --regid=GID
--init-groups -- COMMAND``. The namespace is entered as root (``setns``
needs it), then ``setpriv`` (util-linux) drops to the user and execs the
server in place, so its pid is the one the stack supervises. The parent-death
guard above it stays root and still stops it. What stays root: the
namespaces' keeper, the delayers (nfqueue needs ``CAP_NET_ADMIN``), the
store command (it runs as given) and ``kvlens up`` itself.

What the servers write is handed to the user first (:func:`hand_over`):
their kvlens homes (trace stores) and P's and D's Prometheus directories.
Their logs are opened by ``kvlens up`` and passed to them. ``HOME``, ``USER``
and ``LOGNAME`` become the user's (vLLM's and torch's caches go there, not
under ``/root``).
"""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvlens.stack.errors import StackError


@dataclass(frozen=True)
class SudoUser:
    """The user ``sudo`` ran for: ids, name and home directory."""

    uid: int
    gid: int
    name: str
    home: str


def sudo_user(environ: Mapping[str, str] | None = None) -> SudoUser | None:
    """The invoking user when this process is root under ``sudo``
    (``$SUDO_UID`` set and not 0), else None. StackError when ``$SUDO_UID``
    names no user of this host."""
    env = os.environ if environ is None else environ
    raw = env.get("SUDO_UID", "").strip()
    if os.geteuid() != 0 or not raw.isdigit() or int(raw) == 0:
        return None
    try:
        pw = pwd.getpwuid(int(raw))
    except KeyError:
        raise StackError(f"$SUDO_UID {raw} names no user of this host; unset it to run the servers as root") from None
    gid = env.get("SUDO_GID", "").strip()
    return SudoUser(pw.pw_uid, int(gid) if gid.isdigit() else pw.pw_gid, pw.pw_name, pw.pw_dir)


def check_setpriv(user: SudoUser | None) -> None:
    """StackError when the servers must drop to ``user`` and ``setpriv`` is missing."""
    if user is not None and shutil.which("setpriv") is None:
        raise StackError(
            f"running the servers as {user.name} (SUDO_UID {user.uid}) needs setpriv (Debian package util-linux)"
        )


def as_user(user: SudoUser, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` (exec'd in place by ``setpriv``)."""
    return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--", *argv]


def user_env(user: SudoUser, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the user's ``HOME``, ``USER`` and ``LOGNAME``."""
    return {**env, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}


def hand_over(user: SudoUser, *paths: Path) -> None:
    """Create each directory in ``paths`` and give it, and everything under
    it, to ``user`` (symbolic links are not followed)."""
    for path in paths:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        os.lchown(path, user.uid, user.gid)
        for root, dirs, files in os.walk(path):
            for name in [*dirs, *files]:
                os.lchown(os.path.join(root, name), user.uid, user.gid)
