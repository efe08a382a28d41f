"""``kvlens up --hosts`` links (docs/links.md): the ``--link`` parser, the
delayer's FIFO, and, as root (here and in CI), real namespaces: an nfqueue
delay measured by UDP echo, a tbf rate by TCP goodput, and cleanup on
teardown, on SIGKILL of the supervisor (the keeper under its guard) and at
the next start (leftovers)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvlens.stack.delayer import Delayer
from kvlens.stack.errors import StackError
from kvlens.stack.linkspec import Shape, parse_link, parse_links, parse_shape, release_time
from kvrecord.guard import parent_death_signal

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ parser
def test_shape_units_told_apart():
    assert parse_shape("20ms") == Shape(0.02)
    assert parse_shape("2ms,10gbit") == Shape(0.002, 0.0, 10e9)
    assert parse_shape("20ms,1gbit,0.1%") == Shape(0.02, 0.0, 1e9, 0.001)
    assert parse_shape("5ms,1ms,200mbit") == Shape(0.005, 0.001, 200e6)
    assert parse_shape("500us") == Shape(0.0005)
    assert parse_shape("0ms") == Shape()


@pytest.mark.parametrize(
    "text,word",
    [
        ("", "empty"),
        ("20ms,", "empty"),
        ("20", "not a time"),
        ("20ms,1ms,2ms", "more than two times"),
        ("1ms,2ms", "exceeds the delay"),
        ("1ms,10mbit,20mbit", "two rates"),
        ("1ms,100%", "below 100%"),
        ("1ms,1bit", "outside"),
        ("11s", "at most"),
        ("1ms,2%,3%", "two losses"),
    ],
)
def test_bad_shapes_name_the_problem(text, word):
    with pytest.raises(StackError, match=word):
        parse_shape(text)


def test_link_directions():
    both = parse_link("p-d=20ms,200mbit")
    assert [(x.src, x.dst) for x in both] == [("p", "d"), ("d", "p")]
    assert both[0].shape == both[1].shape == Shape(0.02, 0.0, 200e6)
    assert [(x.src, x.dst) for x in parse_link("router>d=5ms")] == [("router", "d")]
    with pytest.raises(StackError, match="ends must be"):
        parse_link("p-x=1ms")
    with pytest.raises(StackError, match="want A-B=SHAPE"):
        parse_link("p-d")
    with pytest.raises(StackError, match="two different roles"):
        parse_link("p-p=1ms")
    with pytest.raises(StackError, match="given twice"):
        parse_links(["p-d=1ms", "p>d=2ms"])


def test_no_loss_toward_the_client():
    with pytest.raises(StackError, match="no loss toward the client"):
        parse_link("router-client=1ms,1%")
    with pytest.raises(StackError, match="no loss toward the client"):
        parse_link("router>client=1%")
    assert parse_link("client>router=1%")[0].shape.loss == 0.01  # away from it: the router's INPUT drops
    assert parse_link("router-client=1ms")  # a delay is fine


_SNMP = """Tcp: RtoAlgorithm RtoMin OutSegs RetransSegs InErrs
Tcp: 1 200 1000 17 0
TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes TCPFastRetrans
TcpExt: 0 3 4 12
IpExt: InNoRoutes
IpExt: 0
"""


def test_counter_parsers():
    from kvlens.stack.linkprobe import drop_counters, tcp_counters

    assert tcp_counters(_SNMP) == {"out_segs": 1000, "retrans_segs": 17, "fast_retrans": 12, "timeouts": 3,
                                   "loss_probes": 4}  # fmt: skip
    listing = """Chain INPUT (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination
      12   700000 DROP       all  --  kvl0   *       198.18.7.10          198.18.7.40          statistic mode random probability 0.05000000000 /* kvl-abc123 */
     900  9000000 NFQUEUE    all  --  kvl0   *       198.18.7.10          198.18.7.40          NFQUEUE num 1 bypass
"""  # fmt: skip
    assert drop_counters(listing, "198.18.7.10", "198.18.7.40") == (12, 700000)
    assert drop_counters(listing, "198.18.7.1", "198.18.7.40") is None


def test_link_needs_hosts():
    from kvlens.stack.launch import Stack

    with pytest.raises(StackError, match="--link needs --hosts"):
        Stack("push", links=["p-d=1ms"])
    with pytest.raises(StackError, match="not a time"):
        Stack("push", hosts=True, links=["p-d=fast"])


def test_cli_bad_link_exits_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push", "--hosts", "--link", "p-d=20xs"],
        capture_output=True,
        text=True,
        env={**os.environ, "KVLENS_HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 2 and "not a time" in r.stderr, r.stderr


# ------------------------------------------------------------------ FIFO
def test_jitter_never_reorders():
    import random

    rng = random.Random(7)
    last, out = 0.0, []
    # a dense burst (packets closer than the jitter: the FIFO holds them back), then sparse ones
    arrivals = sorted([rng.uniform(0, 1) for _ in range(1000)] + [rng.uniform(2, 200) for _ in range(1000)])
    for a in arrivals:
        last = release_time(a, last, 0.02, 0.019, rng.random())
        out.append(last)
    assert out == sorted(out)  # never backwards: the FIFO keeps order
    assert all(r >= a + 0.02 - 0.019 for a, r in zip(arrivals, out))
    spread = [r - a for a, r in zip(arrivals, out)]
    assert max(spread) > 0.03 and min(spread) < 0.01  # the jitter is there


def test_delayer_releases_in_order_after_the_delay(tmp_path):
    control = tmp_path / "c.json"
    control.write_text(json.dumps({"delay_s": 0.05, "jitter_s": 0.04}))
    got: list[tuple[int, float]] = []
    d = Delayer(str(control), accept=lambda pkt: got.append((pkt, time.monotonic())), seed=3)
    stop = threading.Event()
    t = threading.Thread(target=d.run_releaser, args=(stop,), daemon=True)
    t.start()
    sent = {}
    for i in range(200):
        sent[i] = time.monotonic()
        d.push(i, sent[i])
    deadline = time.monotonic() + 30
    while len(got) < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    assert [i for i, _ in got] == list(range(200))
    assert all(at >= sent[i] + 0.05 - 0.04 for i, at in got)  # causal floor: never early
    # a new delay is picked up from the control file
    control.write_text(json.dumps({"delay_s": 0.2, "jitter_s": 0.0}))
    os.utime(control, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    d._reload()
    assert d.delay_s == 0.2


# ------------------------------------------------------------------ real namespaces (root)
def _need_root():
    from kvlens.stack import netns

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    try:
        return netns.check_tools(need_queue=True)
    except StackError as e:
        pytest.skip(str(e))


def _delayer(net, d, log: Path, procs: list) -> None:
    """The delayer of ``d``, in ``procs`` at once (torn down even if its wait is cut short) and
    with a parent-death signal: a test process killed or interrupted leaves none behind (a
    clean-clone run interrupted here did), as the stack's own guard does for its delayers."""
    p = subprocess.Popen(
        net.delayer_argv(d),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: parent_death_signal(signal.SIGTERM),  # `ip netns exec` execs: it stays set
    )
    procs.append(p)
    deadline = time.monotonic() + 30
    while not net.queue_bound(d):
        assert p.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "delayer did not bind its queue"
        time.sleep(0.1)


@contextlib.contextmanager
def _shaped_net(tmp_path, specs: list[str]):
    """A real P0/D0 network with ``specs`` shaped (a delayer per direction); torn down
    after, and checked that nothing of it is left."""
    from kvlens.stack import netclean, netns

    ipt = _need_root()
    net = netns.Net.create(["p0", "d0"], ipt, tmp_path)
    procs = []
    try:
        for (src, dst), shape in netns.expand(parse_links(specs), net.keys).items():
            _delayer(net, net.add_direction(src, dst, shape), tmp_path / f"{src}.log", procs)
        yield net, ipt
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        netclean.teardown(net.sid)
    assert netclean.objects(net.sid) == {"namespaces": [], "veths": [], "pids": []}


def test_real_delay_and_rate_between_namespaces(tmp_path):
    with _shaped_net(tmp_path, ["p>d=20ms,200mbit", "d>p=5ms"]) as (net, ipt):
        pd = net.probe(net.directions[("p0", "d0")])
        # the round trip crosses both directions: 20 + 5 ms asked; a delay is a floor, never undercut
        assert pd["rtt_min_s"] >= 0.025 and pd["echoes_lost"] == 0
        assert pd["rtt_s"] < 0.025 + 0.1, pd  # far above would mean the delay is not what was asked
        assert pd["goodput_bps"] <= 200e6 * 1.02, pd  # tbf: never above the rate
        dp = net.probe(net.directions[("d0", "p0")])
        assert dp["goodput_bps"] > 200e6, dp  # the reverse direction is not rate limited
        # only the kvlens rules, in the namespaces they shape
        rules = subprocess.run(["ip", "netns", "exec", net.ns("d0"), ipt, "-S"], capture_output=True, text=True)
        assert "NFQUEUE" in rules.stdout and f"kvl-{net.sid}" in rules.stdout
        # the link is re-shaped at run time: the delayer re-reads its control file
        net.reshape("p0", "d0", Shape(0.04))
        again = net.probe(net.directions[("p0", "d0")])
        assert again["rtt_min_s"] >= 0.045, again
    assert f"kvl{net.sid}h" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_real_loss_is_seen_by_tcp(tmp_path):
    """The loss rule drops where packets arrive: the sender's TCP retransmits
    (a drop on its way out would be an error its socket sees, sent again at
    once), and the drops are counted across a re-shape."""
    with _shaped_net(tmp_path, ["p-d=1ms,5%"]) as (net, _ipt):
        pd = net.probe(net.directions[("p0", "d0")])
        c = net.counters()
        assert pd["retrans_segs"] > 0 and c["tcp"]["p0"]["retrans_segs"] >= pd["retrans_segs"], (pd, c)
        dropped = c["links"]["p0>d0"]["dropped_packets"]
        assert dropped > 0 and c["links"]["p0>d0"]["dropped_bytes"] > 0, c
        net.reshape("p0", "d0", Shape(0.001))  # no loss: the old rule's drops are kept, none added
        net.probe(net.directions[("p0", "d0")])
        assert net.counters()["links"]["p0>d0"]["dropped_packets"] == dropped
        assert net.to_json()["counters"]["links"]["p0>d0"]["dropped_packets"] == dropped


_SUPERVISOR = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvlens.stack import netns
    from kvlens.stack.linkspec import parse_links
    from kvrecord.children import ChildProcess
    ipt = netns.check_tools(True)
    net = netns.Net.create(["p0", "d0"], ipt, Path(sys.argv[1]))
    if sys.argv[2] == "keeper":
        ChildProcess([sys.executable, "-m", "kvlens.stack.netclean", "keep", net.sid], group="group", guard=True,
                     log=Path(sys.argv[1]) / "keeper.log").start()
    d = net.add_direction("p0", "d0", parse_links(["p>d=10ms"])[("p", "d")])
    ChildProcess(net.delayer_argv(d), group="group", guard=True, log=Path(sys.argv[1]) / "delayer.log").start()
    while not net.queue_bound(d):
        time.sleep(0.1)
    print(net.sid, flush=True)
    time.sleep(600)
    """
)


def _delayers(word: str) -> list[str]:
    """Live delayers whose arguments contain ``word`` (``/proc``, what ``ps`` reads)."""
    from kvlens.stack.leftovers import cmdline

    argvs = [cmdline(int(d)) for d in os.listdir("/proc") if d.isdigit()]
    return [" ".join(a) for a in argvs if a and "kvlens.stack.delayer" in a and any(word in x for x in a)]


def _gone(sid: str, log_dir: Path, timeout: float = 40.0) -> dict:
    from kvlens.stack import netclean

    deadline = time.monotonic() + timeout
    while True:
        obj = netclean.objects(sid)
        delayers = _delayers(str(log_dir))
        if (not any(obj.values()) and not delayers) or time.monotonic() > deadline:
            return {**obj, "delayers": delayers}
        time.sleep(0.3)


@pytest.mark.parametrize("how", ["keeper", "leftover"])
def test_sigkill_leaves_nothing(tmp_path, how):
    """SIGKILL of the supervisor: its keeper's guard removes the network
    (``keeper``); without a keeper the next start's sweep does (``leftover``)."""
    from kvlens.stack import netclean

    _need_root()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    sup = subprocess.Popen(
        [sys.executable, "-c", _SUPERVISOR, str(tmp_path), how], stdout=subprocess.PIPE, text=True, env=env
    )
    sid = sup.stdout.readline().strip()
    assert len(sid) == 6, sid
    assert netclean.objects(sid)["namespaces"] and _delayers(str(tmp_path))
    sup.kill()
    sup.wait()
    if how == "leftover":
        time.sleep(1)  # the delayer's guard stops it; the namespaces stay
        assert netclean.objects(sid)["namespaces"]
        assert sid in netclean.remove_leftovers(lambda m: None)
    left = _gone(sid, tmp_path)
    assert left == {"namespaces": [], "veths": [], "pids": [], "delayers": []}, left
    assert not (netclean.STATE_DIR / f"{sid}.json").exists()


def test_missing_tools_named(monkeypatch):
    """Not root, no ip/tc, no iptables-legacy, no fnfqueue: each a clear StackError (``kvlens up`` exits 2)."""
    from kvlens.stack import netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(StackError, match="needs root"):
        netns.check_tools(need_queue=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = netns.shutil.which
    for tool, word in (("tc", "apt-get install iproute2"), ("iptables-legacy", "apt-get install iptables")):
        monkeypatch.setattr(netns.shutil, "which", lambda t, path=None, _t=tool: None if t == _t else real_which(t))
        with pytest.raises(StackError, match=word):
            netns.check_tools(need_queue=False)
    monkeypatch.setattr(netns.shutil, "which", lambda t, path=None: "/usr/sbin/" + t)
    monkeypatch.setitem(sys.modules, "fnfqueue", None)  # import fails
    with pytest.raises(StackError, match="fnfqueue"):
        netns.check_tools(need_queue=True)
