"""A real, throw-away PostgreSQL server for the tests (no mock, no Docker).

:class:`PgServer` runs the Debian server binaries
(``/usr/lib/postgresql/<version>/bin``) as the ``postgres`` OS user, because
the server refuses to run as root: ``initdb`` into a temporary directory,
the postmaster started on a free loopback port with its unix socket in that
directory, as a child of the test process with a parent-death signal (so a
killed test run leaves no server), and at the end a fast shutdown (then
SIGKILL if it is still there) and the directory removed, even when a test
failed.

The cluster is tuned for tests, not durability (``fsync=off``,
``synchronous_commit=off``, ``full_page_writes=off``): a crash loses the
test's data and nothing else.

A store that needs a password (:meth:`PgServer.new_password_database`):
a database owned by the role :data:`PW_USER`, which ``pg_hba.conf`` makes
give its password over TCP, so a process that lacks it is refused.

A server in a network namespace (``kvlens up --hosts --store-command``,
the push fleet's e2e stack): ``PgServer(net="198.18.0.0/15")`` lets
:data:`PW_USER` in from that range too (with its password); the database is
made on loopback (:meth:`PgServer.new_password_database`, then
:meth:`PgServer.stop`), and :meth:`PgServer.postmaster_argv` is the command
the stack runs in its ``store`` namespace (its child: stopped, or killed,
with the stack).

Each test gets its own database (:meth:`PgServer.new_database`, a copy of
``template0``, a few tens of ms), so tests never see each other's rows. :meth:`PgServer.stop` / :meth:`PgServer.start` stop and
restart the same cluster on the same port (the "server goes away while the
collector runs" tests).

Used by the ``pg_server`` session fixture (``tests/conftest.py``) and the
``pg_url`` per-test fixture; e2e tests use the same fixtures (they are in
the top-level conftest).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from kvrecord.ports import free_port

PG_USER = "postgres"
#: A role that must give its password over TCP (scram-sha-256; every other
#: role is trusted): :meth:`PgServer.new_password_database`'s owner.
PW_USER = "kvlens_pw"


def pg_bindir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that has initdb, or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0,
    )
    return Path(found[-1]).parent if found else None


def missing_reason() -> str | None:
    """Why a real server cannot run here (binaries or the OS user missing), or None."""
    if pg_bindir() is None:
        return "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb); `make setup` installs them"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam(PG_USER)
        except KeyError:
            return f"the {PG_USER!r} OS user is missing (PostgreSQL refuses to run as root)"
    return None


class PgServer:
    """One PostgreSQL cluster in a temporary directory, on a loopback port."""

    #: ``durable=False`` (tests): a crash may lose or corrupt the cluster;
    #: ``durable=True`` (benchmarks): fsync on, only the last commits may be
    #: lost (``synchronous_commit=off``, like SQLite's WAL + synchronous=NORMAL).
    #: ``net``: a CIDR from which :data:`PW_USER` may log in too (with its password), e.g. a stack's namespaces.
    def __init__(
        self, port: int | None = None, *, durable: bool = False, shared_buffers: str = "64MB", net: str | None = None
    ) -> None:
        self.durable = durable
        self.net = net
        self.shared_buffers = shared_buffers
        bindir = pg_bindir()
        if bindir is None:
            raise RuntimeError(missing_reason())
        self.bin = bindir
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.user = PG_USER
        self.dir = Path(tempfile.mkdtemp(prefix="kvlens-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.pw_password = "pw-" + uuid.uuid4().hex  #: PW_USER's (new_password_database)
        self._pid: int | None = None
        self._proc: subprocess.Popen | None = None

    # ------------------------------------------------------------- helpers
    def _as_pg(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``argv`` as the postgres user (we may be root; the server refuses that)."""
        cmd = list(argv)
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}\n{self._log_tail()}"
            )
        return r

    def _log_tail(self) -> str:
        try:
            return "server log:\n" + self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    # ----------------------------------------------------------- lifecycle
    def init(self) -> "PgServer":
        if os.geteuid() == 0:
            shutil.chown(self.dir, self.user, self.user)
        os.chmod(self.dir, 0o700)
        self._as_pg(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            self.user,
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        )
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                "\n# kvlens tests: throw-away cluster\n"
                + ("" if self.durable else "fsync = off\nfull_page_writes = off\n")
                + "synchronous_commit = off\n"
                f"listen_addresses = '{self.host}'\nunix_socket_directories = '{self.dir}'\n"
                f"max_connections = 200\nshared_buffers = {self.shared_buffers}\n"
            )
        # the first matching line wins: PW_USER's password, then initdb's "trust" lines
        hba = self.data / "pg_hba.conf"
        nets = [f"{self.host}/32", "::1/128", *([self.net] if self.net else [])]
        hba.write_text("".join(f"host all {PW_USER} {n} scram-sha-256\n" for n in nets) + hba.read_text())
        return self

    def start(self) -> "PgServer":
        """Start (or restart after :meth:`stop`) on the same port; waits until it accepts connections.

        The postmaster runs as a direct child of this process (``setpriv``
        drops to the postgres user and execs it, no daemonising ``pg_ctl``)
        with a parent-death signal (SIGINT: PostgreSQL's fast shutdown), so a
        test run that is killed before its fixtures' teardown leaves no
        server behind."""
        cmd = self.postmaster_argv()
        log = open(self.log, "ab")
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        self._pid = self._proc.pid
        deadline = time.monotonic() + 60
        while True:
            r = self._as_pg(str(self.bin / "pg_isready"), "-h", self.host, "-p", str(self.port), "-t", "2", check=False)
            if r.returncode == 0:
                return self
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"PostgreSQL did not start on port {self.port}\n{self._log_tail()}")
            time.sleep(0.1)

    def postmaster_argv(self, port: int | None = None, listen: str | None = None) -> list[str]:
        """The postmaster in the foreground as the postgres user, with a parent-death
        signal (SIGINT: fast shutdown); on ``port`` and ``listen`` (addresses) when given,
        else this server's. No password in it."""
        cmd = [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(port or self.port)]
        cmd += ["-c", f"listen_addresses={listen}"] if listen else []
        if os.geteuid() == 0:
            user = [f"--reuid={self.user}", f"--regid={self.user}", "--init-groups"]
            return ["setpriv", *user, "--pdeathsig=SIGINT", "--", *cmd]
        return ["setpriv", "--pdeathsig=SIGINT", "--", *cmd]

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Stop fast (SIGINT: open connections are cut); SIGKILL the postmaster if that fails."""
        proc, self._proc, self._pid = getattr(self, "_proc", None), None, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ----------------------------------------------------------- databases
    def new_database(self, prefix: str = "t") -> str:
        """A new empty database; its URL."""
        import store_sql

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        store_sql.create_database(self.url("postgres"), name)
        return self.url(name)

    def new_password_database(self, prefix: str = "pw") -> tuple[str, str]:
        """A new empty database owned by :data:`PW_USER`, who must give a
        password: (its URL without the password, the password). The role is
        created on first use, with a random password (this server's)."""
        import store_sql

        password = self.pw_password
        store_sql.create_login_role(self.url("postgres"), PW_USER, password)
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        store_sql.create_database(self.url("postgres"), name)
        store_sql.give_database(self.url("postgres"), name, PW_USER)
        return f"postgresql://{PW_USER}@{self.host}:{self.port}/{name}", password

    def drop_database(self, url: str) -> None:
        """Drop the database of ``url`` (a :meth:`new_database`), cutting its connections."""
        import store_sql

        store_sql.drop_database(self.url("postgres"), url.rsplit("/", 1)[1])

    def __enter__(self) -> "PgServer":
        try:
            return self.init().start()
        except BaseException:
            self.remove()
            raise

    def __exit__(self, *exc) -> None:
        self.remove()


if __name__ == "__main__":  # manual use: a server for a shell session (Ctrl-C or SIGTERM stops and removes it)

    def _stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    with PgServer() as s:
        print(s.url(), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
