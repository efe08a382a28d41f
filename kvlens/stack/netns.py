"""The network of ``kvlens up --hosts`` (docs/links.md): one network
namespace per role, veths on a bridge, 198.18.0.0/15 addresses (RFC 2544,
benchmarking), no route out, and the shaped directions of ``--link``.

Layout of a stack with id ``ID`` (6 hex digits, every name carries it, so
cleanup only ever removes this module's own objects):

* namespace ``kvl-ID-br`` holds the bridge ``br`` and one veth end per role
  (the host's root namespace gets no bridge);
* namespace ``kvl-ID-<role>`` per role (``router``, ``collector``, ``store``,
  ``p0``, ``d0``, ...), with its veth end renamed ``kvl0`` and one address in
  ``198.18.N.0/24`` (``N`` picked per stack), and no default route;
* one veth ``kvlIDh`` in the root namespace (the client's end: the stack's
  health checks, tests and ``kvlens bench`` reach the router there; its route
  covers the /24 only);
* per delayed direction an ``iptables-legacy`` NFQUEUE rule in the sending
  namespace and a delayer process (:mod:`kvlens.stack.delayer`), per rate an
  htb class with a ``tbf`` leaf and a u32 filter on the destination, per
  loss a ``statistic`` DROP rule beside the NFQUEUE one (the receiver's INPUT).

Everything lives in namespaces except the root veth, so
:func:`~kvlens.stack.netclean.teardown` deletes the namespaces and that veth
(iptables rules and qdiscs go with their namespace); delayers are stopped by
their supervisor (or their guard). A stack records its owner in
``/run/kvlens-netns/ID.json``; :func:`~kvlens.stack.netclean.remove_leftovers`
removes the objects of every id whose owner is gone (:mod:`kvlens.stack.netclean`).

Blocking subprocess calls on the calling thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvlens.stack.errors import StackError
from kvlens.stack.leftovers import cmdline
from kvlens.stack.linkspec import Shape
from kvlens.stack.netclean import STATE_DIR, run, teardown

IFACE = "kvl0"  #: a role's interface, in its own namespace
HOST_OCTET = 254
ROLE_OCTETS = {"router": 1, "collector": 2, "store": 3}
FIRST_P, FIRST_D = 10, 40


def role_key(role: str, index: int = 0) -> str:
    """``p0``, ``d1``, ``router``, ``collector`` for a role (prefill/decode take an index)."""
    return {"prefill": f"p{index}", "decode": f"d{index}"}.get(role, role)


def octet(key: str) -> int:
    if key in ROLE_OCTETS:
        return ROLE_OCTETS[key]
    if key == "client":
        return HOST_OCTET
    return (FIRST_P if key[0] == "p" else FIRST_D) + int(key[1:])


def iptables_cmd() -> str | None:
    """``iptables-legacy`` when installed (its NFQUEUE target is what this kernel has), else None."""
    return shutil.which("iptables-legacy") or shutil.which("iptables-legacy", path="/usr/sbin:/sbin")


def check_tools(need_queue: bool) -> str:
    """Root, ``ip``, ``tc``, ``iptables-legacy`` and (with delayed links)
    ``fnfqueue``; returns the iptables program. StackError naming what is missing."""
    if os.geteuid() != 0:
        raise StackError("--hosts needs root (network namespaces, veths, qdiscs and iptables rules)")
    path = os.environ.get("PATH", os.defpath) + ":/usr/sbin:/sbin"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool, path=path) is None:
            raise StackError(f"--hosts needs `{tool}`: apt-get install {pkg} (make setup does it)")
    ipt = iptables_cmd()
    if ipt is None:
        raise StackError("--hosts needs `iptables-legacy`: apt-get install iptables (make setup does it)")
    if need_queue:
        try:
            import fnfqueue  # noqa: F401
        except ImportError:
            raise StackError("--link with a delay needs the Python package fnfqueue: pip install 'kvlens[links]'")
    return ipt


def expand(links: dict, keys: list[str]) -> dict[tuple[str, str], Shape]:
    """``--link`` directions between roles (``p``, ``d``, ...) as directions
    between this stack's namespaces (``p0``, ``d1``, ...): ``p`` is every P.
    StackError for a role the stack does not run (``collector`` without one)."""

    def ends(role: str) -> list[str]:
        if role in ("p", "d"):
            return [k for k in keys if re.fullmatch(role + r"\d+", k)]
        if role == "client" or role in keys:
            return [role]
        raise StackError(f"--link names {role}, which this stack does not run in a namespace of its own")

    return {(a, b): shape for (src, dst), shape in links.items() for a in ends(src) for b in ends(dst)}


def _subnet_free(third: int) -> bool:
    out = run(["ip", "-4", "route", "show"], check=False).stdout
    return f"198.18.{third}." not in out


@dataclass
class Direction:
    """One shaped direction from namespace of ``src`` to the address of ``dst``."""

    src: str  #: role key (p0, router, client, ...)
    dst: str
    shape: Shape
    queue: int
    control: Path
    classid: int
    measured: dict | None = None
    #: packets and bytes dropped by loss rules this direction had before its current one (re-shaping resets them)
    dropped_before: tuple[int, int] = (0, 0)


@dataclass
class Net:
    """The namespaces of one stack (module docstring). :meth:`create` then
    :meth:`shape` per direction; :func:`~kvlens.stack.netclean.teardown` removes them."""

    sid: str
    keys: list[str]  #: role keys with a namespace of their own
    third: int  #: 198.18.<third>.0/24
    ipt: str = "iptables-legacy"
    state: Path = STATE_DIR
    directions: dict[tuple[str, str], Direction] = field(default_factory=dict)
    _htb: set = field(default_factory=set)

    @classmethod
    def create(cls, keys: list[str], ipt: str, workdir: Path) -> "Net":
        """Make the namespaces, bridge, veths and addresses (module docstring)."""
        sid = secrets.token_hex(3)
        third = next((t for t in (secrets.randbelow(250) + 2 for _ in range(50)) if _subnet_free(t)), None)
        if third is None:
            raise StackError("--hosts: found no free 198.18.x.0/24 for the stack's namespaces")
        net = cls(sid, list(keys), third, ipt)
        net.workdir = Path(workdir)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{sid}.json").write_text(
            json.dumps({"pid": os.getpid(), "cmdline": cmdline(os.getpid()), "keys": keys})
        )
        try:
            net._build()
        except BaseException:
            teardown(sid, kill=True)
            raise
        return net

    def ns(self, key: str) -> str:
        return f"kvl-{self.sid}-{'br' if key == 'bridge' else key}"

    def addr(self, key: str) -> str:
        return f"198.18.{self.third}.{octet(key)}"

    @property
    def host_veth(self) -> str:
        return f"kvl{self.sid}h"

    def _build(self) -> None:
        br = self.ns("bridge")
        run(["ip", "netns", "add", br])
        run(["ip", "-n", br, "link", "add", "name", "kvlbr", "type", "bridge"])
        run(["ip", "-n", br, "link", "set", "kvlbr", "up"])
        for key in self.keys:
            ns = self.ns(key)
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", br, "link", "add", "name", key, "type", "veth", "peer", "name", IFACE, "netns", ns])
            run(["ip", "-n", br, "link", "set", key, "master", "kvlbr", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.addr(key)}/24", "dev", IFACE])
            run(["ip", "-n", ns, "link", "set", IFACE, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # a link's rate is what a long-lived connection (UCX keeps one per peer) gets: no return to
            # slow start after each idle gap between two requests' transfers
            run(["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"], ns=ns)
        # the client's end in the root namespace: a route to the /24 only, nothing forwarded
        run(
            [
                "ip",
                "-n",
                br,
                "link",
                "add",
                "name",
                "client",
                "type",
                "veth",
                "peer",
                "name",
                self.host_veth,
                "netns",
                "1",
            ]
        )
        run(["ip", "-n", br, "link", "set", "client", "master", "kvlbr", "up"])
        run(["ip", "addr", "add", f"{self.addr('client')}/24", "dev", self.host_veth])
        run(["ip", "link", "set", self.host_veth, "up"])

    # ------------------------------------------------------------ shaping
    def src_ns(self, key: str) -> str | None:
        """The namespace a direction from ``key`` is shaped in (None: the root's, the client's)."""
        return None if key == "client" else self.ns(key)

    def _dev(self, key: str) -> str:
        return self.host_veth if key == "client" else IFACE

    def add_direction(self, src: str, dst: str, shape: Shape) -> Direction:
        """Install the rules of one direction (delay queue, rate, loss). The
        delayer itself is the caller's child (:meth:`delayer_argv`)."""
        n = len(self.directions) + 1
        d = Direction(src, dst, shape, n, Path(self.workdir) / f"link-{src}-{dst}.json", 10 + n)
        self.directions[(src, dst)] = d
        d.control.write_text(json.dumps({"delay_s": shape.delay_s, "jitter_s": shape.jitter_s}))
        # the delay where the packet arrives: a packet held on the sender's side still counts against its
        # socket (TCP small queues), which then sends 2 packets per delay: 2 Mbit/s at 20 ms (measured)
        qns, qmatch = self.queue_ns(d), self._queue_match(d)
        # loss first, and there too: a dropped packet never waits in the delayer, and a drop on the sender's
        # way out is an error its socket sees (TCP sends the packet again at once), not a lost packet
        run([self.ipt, "-w", "-I", qmatch[0], "1", *self._loss_rule(d, shape.loss)], ns=qns)
        run([self.ipt, "-w", "-A", qmatch[0], *qmatch[1:], "-j", "NFQUEUE", "--queue-num", str(d.queue),
              "--queue-bypass", "-m", "comment", "--comment", f"kvl-{self.sid}"], ns=qns)  # fmt: skip
        self._rate(d)
        return d

    def queue_ns(self, d: Direction) -> str | None:
        """Where ``d``'s delayer runs: the receiving namespace (INPUT), except
        toward the client, whose root namespace kvlens leaves alone (then the
        sender's OUTPUT, where TCP small queues slow a long transfer)."""
        return self.src_ns(d.src) if d.dst == "client" else self.ns(d.dst)

    def _queue_match(self, d: Direction) -> list[str]:
        if d.dst == "client":
            return ["OUTPUT", "-o", self._dev(d.src), "-d", self.addr(d.dst)]
        return ["INPUT", "-i", IFACE, "-s", self.addr(d.src), "-d", self.addr(d.dst)]

    def _rate(self, d: Direction) -> None:
        ns, dev = self.src_ns(d.src), self._dev(d.src)
        nsarg = ["-n", ns] if ns else []
        rate = d.shape.rate_bps
        if rate is None and (ns, dev) not in self._htb:
            return
        if (ns, dev) not in self._htb:
            run(["tc", *nsarg, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
            run(["tc", *nsarg, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                  "rate", "100gbit"])  # fmt: skip
            self._htb.add((ns, dev))
        cls = f"1:{d.classid}"
        if not getattr(d, "_filtered", False):
            run(["tc", *nsarg, "class", "replace", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate",
                  "100gbit"])  # fmt: skip
            run(["tc", *nsarg, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                  "match", "ip", "dst", f"{self.addr(d.dst)}/32", "flowid", cls])  # fmt: skip
            d._filtered = True  # type: ignore[attr-defined]
        leaf = ["tc", *nsarg, "qdisc", "replace", "dev", dev, "parent", cls, "handle", f"{d.classid}:"]
        if rate is None:  # the class's default leaf again (htb's own, at 100gbit)
            run(["tc", *nsarg, "qdisc", "del", "dev", dev, "parent", cls], check=False)
        else:
            run([*leaf, "tbf", "rate", f"{int(rate)}bit", "burst", "64kb", "latency", "200ms"])

    def reshape(self, src: str, dst: str, shape: Shape) -> None:
        """Change a direction installed by :meth:`add_direction`: the
        delayer re-reads its control file, tbf and the loss rule are replaced."""
        d = self.directions[(src, dst)]
        old = d.shape
        d.shape, d.measured = shape, None
        tmp = d.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"delay_s": shape.delay_s, "jitter_s": shape.jitter_s}))
        tmp.replace(d.control)
        qns, chain = self.queue_ns(d), self._queue_match(d)[0]
        d.dropped_before = self.dropped(d) or d.dropped_before
        run([self.ipt, "-w", "-D", chain, *self._loss_rule(d, old.loss)], ns=qns)
        run([self.ipt, "-w", "-I", chain, "1", *self._loss_rule(d, shape.loss)], ns=qns)
        self._rate(d)
        time.sleep(0.5)  # the delayer polls its control file every 0.2 s

    def _loss_rule(self, d: Direction, loss: float) -> list[str]:
        return [*self._queue_match(d)[1:], "-m", "statistic", "--mode", "random",
                "--probability", f"{loss:.6f}", "-j", "DROP", "-m", "comment", "--comment", f"kvl-{self.sid}"]  # fmt: skip

    def dropped(self, d: Direction) -> tuple[int, int] | None:
        """Packets and bytes ``d``'s loss rules dropped since it was installed
        (iptables' counters; None: its namespace is gone, or the rule)."""
        from kvlens.stack.linkprobe import drop_counters

        r = run([self.ipt, "-w", "-L", self._queue_match(d)[0], "-v", "-x", "-n"], check=False, ns=self.queue_ns(d))
        now = drop_counters(r.stdout, self.addr(d.src), self.addr(d.dst)) if r.returncode == 0 else None
        return None if now is None else (d.dropped_before[0] + now[0], d.dropped_before[1] + now[1])

    def counters(self) -> dict:
        """What the links did so far: per shaped direction (``p0>d0``) the packets its loss
        rule dropped, and per namespace its TCP segment counters
        (:func:`kvlens.stack.linkprobe.tcp_counters`: sent, retransmitted, ...) since it was made."""
        from kvlens.stack.linkprobe import tcp_counters

        drops = {}
        for d in self.directions.values():
            got = self.dropped(d)
            drops[f"{d.src}>{d.dst}"] = got and {"dropped_packets": got[0], "dropped_bytes": got[1]}
        tcp = {}
        for key in self.keys:
            r = run(["cat", "/proc/net/snmp", "/proc/net/netstat"], check=False, ns=self.ns(key))
            tcp[key] = tcp_counters(r.stdout) if r.returncode == 0 else None
        return {"links": drops, "tcp": tcp}

    def delayer_argv(self, d: Direction) -> list[str]:
        argv = [sys.executable, "-m", "kvlens.stack.delayer", "--queue", str(d.queue), "--control", str(d.control)]
        ns = self.queue_ns(d)
        return ["ip", "netns", "exec", ns, *argv] if ns else argv

    def queue_bound(self, d: Direction) -> bool:
        """Whether a process reads ``d``'s nfqueue now (/proc/net/netfilter/nfnetlink_queue of its namespace)."""
        r = run(["cat", "/proc/net/netfilter/nfnetlink_queue"], check=False, ns=self.queue_ns(d))
        return any(line.split()[:1] == [str(d.queue)] for line in r.stdout.splitlines())

    # ------------------------------------------------------------ probing
    def probe(self, d: Direction, port: int = 47999) -> dict:
        """Round trip (UDP echo) and goodput (TCP) from ``d.src`` to ``d.dst``."""
        mod = [sys.executable, "-m", "kvlens.stack.linkprobe"]
        dst_ns = self.src_ns(d.dst)
        serve = ["ip", "netns", "exec", dst_ns, *mod] if dst_ns else mod
        env = dict(os.environ)
        srv = subprocess.Popen([*serve, "serve", self.addr(d.dst), str(port)], stdout=subprocess.PIPE, text=True,
                               env=env)  # fmt: skip
        try:
            if srv.stdout.readline().strip() != "ready":
                raise StackError(f"--hosts: the link probe's server in {dst_ns} did not start")
            src_ns = self.src_ns(d.src)
            cli = ["ip", "netns", "exec", src_ns, *mod] if src_ns else mod
            r = subprocess.run([*cli, "client", self.addr(d.dst), str(port)], capture_output=True, text=True,
                               timeout=60, env=env)  # fmt: skip
            if r.returncode != 0:
                raise StackError(f"--hosts: the link probe {d.src}>{d.dst} failed: {r.stderr.strip()[-500:]}")
            d.measured = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                srv.wait(10)
            if srv.poll() is None:
                srv.kill()
                srv.wait()
        return d.measured

    def to_json(self) -> dict:
        """``stack.json``'s ``network``: names, addresses, asked and measured links."""
        links = []
        for d in self.directions.values():
            back = self.directions.get((d.dst, d.src))
            asked_rtt = d.shape.delay_s + (back.shape.delay_s if back else 0.0)
            links.append(
                {
                    "src": d.src,
                    "dst": d.dst,
                    "asked": {**d.shape.to_json(), "rtt_s": asked_rtt},
                    "measured": d.measured,
                    "nfqueue": d.queue,
                }
            )
        return {
            "id": self.sid,
            "subnet": f"198.18.{self.third}.0/24",
            "bridge_namespace": self.ns("bridge"),
            "namespaces": {k: self.ns(k) for k in self.keys},
            "addresses": {k: self.addr(k) for k in [*self.keys, "client"]},
            "client_veth": self.host_veth,
            "links": links,
            # unknown (None) where the namespaces are gone already
            "counters": self.counters() if self.directions else None,
        }
