"""The real links of a ``hosts`` :class:`~kvlens.stack.launch.Stack` (its
:class:`StackNetwork`, docs/links.md): the roles' network namespaces
(:mod:`kvlens.stack.netns`), the keeper that removes them
(:mod:`kvlens.stack.netclean`), a delayer per shaped direction
(:mod:`kvlens.stack.delayer`) and the link probe; re-shaping at run time and
what the delayers cost; and the store's own namespace (``--store-command``).
Blocking.

The store's namespace: with ``store_command`` (``kvlens up --hosts
--store-command CMD``) the collector's PostgreSQL runs on a "host" of its
own too. The stack adds a ``store`` namespace (address ``198.18.N.3``),
runs CMD there as its child (after the network, before the collector: so
stopped after the collector, and removed with the namespaces, stop or
SIGKILL alike) and waits until the database answers. The subnet is picked
at start, so ``--collector-store`` names the host ``store``
(``postgresql://USER@store:5432/DB``) and the stack puts the namespace's
address there (:func:`place_store`): in the collector's URL, ``stack.json``
and :attr:`Stack.store`. CMD is the database server in the foreground,
listening on its namespace's address (``listen_addresses='*'`` is safe: the
namespace has no other network); SIGTERM stops it.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlsplit

from kvlens.stack.children import DELAYER_PREFIX
from kvlens.stack.commands import REPO_ROOT, base_env
from kvlens.stack.errors import StackError
from kvlens.stack.linkspec import parse_link
from kvlens.stack.sudo import as_user, hand_over, sudo_user, user_env
from kvlens.stack.supervise import Child
from kvrecord.location import StoreLocation, redact_text

logger = logging.getLogger("kvlens.up")
#: ``--collector-store``'s host that stands for the store's namespace (``--store-command``)
STORE_HOST = "store"


def store_argv(command: str | Sequence[str]) -> list[str]:
    """``--store-command``'s argv (a string is split as a shell would, without one)."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise StackError("--store-command is empty")
    return argv


def place_store(loc: StoreLocation, addr: str) -> StoreLocation:
    """``loc`` (a ``postgresql://...@store[:PORT]/DB`` URL) with its host ``store`` replaced by ``addr``."""
    parts = urlsplit(loc.url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    port = f":{parts.port}" if parts.port else ""
    return StoreLocation.parse(parts._replace(netloc=f"{userinfo}{at}{addr}{port}").geturl())


def check_store(store_command, hosts: bool, separate_homes: bool, collector: str, collector_store) -> None:
    """``--store-command``'s conditions (StackError naming what is missing): ``--hosts``, a
    collector process and a PostgreSQL ``--collector-store`` on the host ``store``."""
    if not store_command:
        return
    store_argv(store_command)
    if not hosts:
        raise StackError("--store-command needs --hosts (the store runs in a network namespace of its own)")
    if not (separate_homes and collector == "process" and collector_store):
        raise StackError(
            "--store-command needs --separate-homes, --collector process and --collector-store "
            f"postgresql://USER@{STORE_HOST}:PORT/DB (the database the collector writes)"
        )
    loc = StoreLocation.parse(collector_store)
    if not loc.is_postgres or urlsplit(loc.url).hostname != STORE_HOST:
        raise StackError(
            f"--store-command: --collector-store must be postgresql://USER@{STORE_HOST}[:PORT]/DB (the host "
            f"`{STORE_HOST}` stands for the store's namespace, whose address is picked at start), got {loc}"
        )


def store_answers(loc: StoreLocation) -> str | None:
    """None when PostgreSQL at ``loc`` takes a connection (as the collector will make it), else why not."""
    try:
        import psycopg

        psycopg.connect(loc.text, connect_timeout=2).close()
        return None
    except Exception as e:  # refused, starting up, auth: the caller retries until its deadline
        return redact_text(str(e).strip()) or type(e).__name__


class StackNetwork:
    """The network of a :class:`~kvlens.stack.launch.Stack`: none (``net``
    None: every role on ``spec.host``) until :meth:`start` makes a ``hosts``
    stack's. Given the stack's :class:`~kvlens.stack.spec.StackSpec`, how it
    says things (``say``), starts and records a child (``spawn``), finds a
    dead one (``dead_child``) and writes ``stack.json`` (``record``)."""

    def __init__(
        self,
        spec,
        say: Callable[[str], None],
        spawn: Callable[[Child], Child],
        dead_child: Callable[..., Child | None],
        record: Callable[[], None],
    ) -> None:
        self.spec = spec
        self.say = say
        self.spawn = spawn
        self.dead_child = dead_child
        self.record = record
        self.net = None  #: the :class:`~kvlens.stack.netns.Net` of a ``hosts`` stack, once started
        self.delayers: list[Child] = []  #: a delayer per shaped direction, as started
        self.dead_delayers: set[str] = set()  #: the names of the delayers that died (said once each)

    def role_host(self, role: str, index: int = 0) -> str:
        """The address ``role`` (prefill, decode, router, collector) binds
        and is reached at: its namespace's on a ``hosts`` stack, else ``host``."""
        if self.net is None:
            return self.spec.host
        from kvlens.stack.netns import role_key

        return self.net.addr(role_key(role, index))

    def child(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        url: str,
        key: str | None = None,
        writes: tuple[Path, ...] | None = None,
    ) -> Child:
        """A child logging to ``<log_dir>/<name>.log``, run from the repository
        root; on a ``hosts`` stack in the network namespace of ``key`` (``p0``,
        ``router``, ...: ``ip netns exec`` execs the command in place, so the
        pid and its process group stay the child's). ``writes``: a server's
        directories; given, under ``sudo`` the server runs as the invoking
        user, who is handed them first (:mod:`kvlens.stack.sudo`)."""
        if key is not None and self.net is not None:
            user = sudo_user() if writes is not None else None
            if user is not None:
                hand_over(user, *writes)
                argv, env = as_user(user, argv), user_env(user, env)
            argv = ["ip", "netns", "exec", self.net.ns(key), *argv]
        return Child(name, argv, env, Path(self.spec.log_dir) / f"{name}.log", url, cwd=str(REPO_ROOT))

    def ucx_env(self) -> dict[str, str]:
        """On a ``hosts`` stack: UCX (NIXL's transport) over TCP on the
        namespace's veth only. Left to itself UCX picks shared memory or
        CMA between processes of one machine, and the link would be bypassed."""
        if self.net is None:
            return {}
        from kvlens.stack.netns import IFACE

        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": IFACE}

    def check_tools(self) -> None:
        """A ``hosts`` stack's tools (:func:`kvlens.stack.netns.check_tools`), before minutes of
        model generation or start-up."""
        spec = self.spec
        if spec.hosts:
            from kvlens.stack.netns import check_tools
            from kvlens.stack.sudo import check_setpriv

            check_tools(need_queue=bool(spec.link_shapes))
            check_setpriv(sudo_user())  # the servers run as sudo's user
        if spec.store_command and shutil.which(store_argv(spec.store_command)[0]) is None:
            raise StackError(f"--store-command: command not found: {store_argv(spec.store_command)[0]}")

    def start(self, deadline: float) -> None:
        """Namespaces, the keeper that removes them (:func:`kvlens.stack.netclean.keep`,
        the first child: stopped last, and run by its guard when this process is
        killed), a delayer per shaped direction, then the link probe."""
        from kvlens.stack import netclean, netns

        spec = self.spec
        say = (lambda m: logger.warning(m)) if spec.quiet else self.say
        ipt = netns.check_tools(need_queue=bool(spec.link_shapes))
        netclean.remove_leftovers(say)
        keys = ["router"]
        if spec.separate_homes and spec.collector == "process":
            keys.append("collector")
        keys += ["store"] if spec.store_command else []
        keys += [f"p{i}" for i in range(spec.prefill_instances)] + [f"d{i}" for i in range(spec.decode_instances)]
        self.net = netns.Net.create(keys, ipt, Path(spec.log_dir))
        keeper = [sys.executable, "-m", "kvlens.stack.netclean", "keep", self.net.sid]
        self.spawn(self.child("netns", keeper, base_env(Path(spec.kvlens_home)), ""))
        for (src, dst), shape in netns.expand(spec.link_shapes, keys).items():
            d = self.net.add_direction(src, dst, shape)
            name = f"{DELAYER_PREFIX}{src}-{dst}"
            self.delayers.append(
                self.spawn(self.child(name, self.net.delayer_argv(d), base_env(Path(spec.kvlens_home)), ""))
            )
        for d in self.net.directions.values():
            while not self.net.queue_bound(d):
                dead = self.dead_child(delayers=True)
                if dead is not None:
                    raise StackError(dead.died_message())
                if time.monotonic() > deadline:
                    raise StackError(f"the delayer of {d.src}>{d.dst} did not bind nfqueue {d.queue}")
                time.sleep(0.1)
        self.say(f"network {self.net.sid}: {len(keys)} namespaces on 198.18.{self.net.third}.0/24")
        self.probe_links()
        if spec.store_command:
            self._start_store(deadline)

    def collector_store(self) -> StoreLocation | str | None:
        """``collector_store``, on a stack with ``store_command`` and its network made: at the store's address."""
        spec = self.spec
        if not (spec.store_command and self.net is not None and spec.collector_store):
            return spec.collector_store
        return place_store(StoreLocation.parse(spec.collector_store), self.net.addr("store"))

    def _start_store(self, deadline: float) -> None:
        """``store_command`` in the ``store`` namespace (module docstring), waited for until the
        collector's store takes a connection; StackError (with its log) when it exits or the deadline passes.
        The collector's store is the stack's (:attr:`Stack.store`): ``--store-command`` needs ``--collector-store``."""
        spec = self.spec
        env = {**base_env(Path(spec.kvlens_home)), **spec.env("store")}
        c = self.spawn(self.child("store", store_argv(spec.store_command), env, "", "store"))
        loc = StoreLocation.parse(self.collector_store())
        while (why := store_answers(loc)) is not None:
            if not c.alive():
                raise StackError(f"--store-command: {c.died_message()}")
            if time.monotonic() > deadline:
                raise StackError(f"--store-command: {loc} did not answer ({why}); log {c.log}")
            time.sleep(0.2)
        self.say(f"store ready at {loc} (namespace {self.net.ns('store')}, log {c.log})")

    def probe_links(self, only=None) -> list[dict]:
        """Measure every shaped direction (:meth:`kvlens.stack.netns.Net.probe`), or those
        ``only`` names ((src, dst) keys such as ``("p0", "d0")``; the rest keep what
        they had, None after a reshape), and record them in ``stack.json``."""
        for d in self.net.directions.values():
            if only is not None and (d.src, d.dst) not in only:
                continue
            m = self.net.probe(d)
            gp = m.get("goodput_bps")
            self.say(
                f"link {d.src}>{d.dst}: asked {d.shape.delay_s * 1e3:g} ms"
                f"{f', {d.shape.rate_bps / 1e6:g} Mbit/s' if d.shape.rate_bps else ''}; measured round trip "
                f"{m['rtt_s'] * 1e3:.2f} ms, goodput {gp / 1e6 if gp else float('nan'):.0f} Mbit/s"
            )
        self.record()
        return self.net.to_json()["links"]

    def reshape(self, spec: str, probe: bool = True) -> list[dict]:
        """Change shaped directions of a running ``hosts`` stack (``p-d=20ms,200mbit``;
        only directions it started with), then (``probe``) measure them all again."""
        from kvlens.stack import netns

        if self.net is None:
            raise StackError("reshape needs a --hosts stack")
        for sp in parse_link(spec):
            for src, dst in netns.expand({(sp.src, sp.dst): sp.shape}, self.net.keys):
                if (src, dst) not in self.net.directions:
                    raise StackError(f"reshape: {src}>{dst} was not shaped when the stack started")
                self.net.reshape(src, dst, sp.shape)
        return self.probe_links() if probe else self.net.to_json()["links"]

    def delayer_cpu_s(self) -> dict[str, float | None]:
        """CPU seconds (user + system) each delayer used so far (None: gone)."""
        out = {}
        for c in self.delayers:
            if c.proc is None:
                continue
            try:
                import psutil

                procs = [psutil.Process(c.proc.pid), *psutil.Process(c.proc.pid).children(recursive=True)]
                out[c.name] = sum(sum(p.cpu_times()[:2]) for p in procs)
            except Exception:
                out[c.name] = None
        return out

    def delayer_died(self, c: Child) -> None:
        """Say a delayer's death loudly, once, and record it in ``stack.json``
        (its packets now pass undelayed: ``--queue-bypass``)."""
        if c.name not in self.dead_delayers:
            self.dead_delayers.add(c.name)
            logger.error("%s", self.delayer_death(c))
            if not self.spec.quiet:
                print(f"kvlens up: WARNING: {self.delayer_death(c)}", flush=True)
            self.record()

    def delayer_death(self, c: Child) -> str:
        return (
            f"link delayer {c.name} died (exit {c.proc.returncode}): its packets now pass UNDELAYED, the link "
            f"is no longer what was asked; log {c.log}"
        )

    def record_before_stop(self) -> None:
        """Write ``stack.json`` once more before the children stop: the delayers' CPU, while they run."""
        if self.net is not None:
            with contextlib.suppress(Exception):
                self.record()

    def stop(self) -> None:
        """Forget the delayers (stopped with the stack's children) and remove the
        namespaces (the keeper did it; a second time costs nothing)."""
        self.delayers = []
        if self.net is not None:
            from kvlens.stack import netclean

            netclean.teardown(self.net.sid, kill=True)
