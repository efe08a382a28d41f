"""Measure a link of ``kvlens up --hosts`` (docs/links.md): a UDP echo
round trip and a short TCP goodput, between two network namespaces.

``python -m kvlens.stack.linkprobe serve HOST PORT`` answers UDP echoes and
sinks one TCP transfer on ``PORT``, then reports that transfer's goodput on
the same connection and exits; ``python -m kvlens.stack.linkprobe client
HOST PORT`` sends the echoes and the transfer and prints one JSON line:
``rtt_s`` (median of the echoes), ``rtt_min_s``, ``goodput_bps`` (the
receiver's bytes over time, after the first quarter of the transfer: TCP's
slow start is not the link's rate), ``bytes``, and what TCP did to get
them through a lossy link: ``retrans_segs`` / ``out_segs`` (the sending
namespace's TCP counters over the transfer, :func:`tcp_counters`). Also the
parsers of the counters a stack records per link (:func:`tcp_counters`,
:func:`drop_counters`). Blocking, stdlib only.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import threading
import time

ECHOES = 15
ECHO_GAP_S = 0.02
TCP_SECONDS = 1.2
CHUNK = 64 * 1024
#: The kernel's TCP counters kept per namespace (``/proc/net/snmp``'s ``Tcp:``, ``/proc/net/netstat``'s ``TcpExt:``)
TCP_COUNTERS = {
    "out_segs": ("Tcp", "OutSegs"),
    "retrans_segs": ("Tcp", "RetransSegs"),
    "fast_retrans": ("TcpExt", "TCPFastRetrans"),
    "timeouts": ("TcpExt", "TCPTimeouts"),
    "loss_probes": ("TcpExt", "TCPLossProbes"),
}


def tcp_counters(text: str) -> dict[str, int]:
    """:data:`TCP_COUNTERS` from the text of ``/proc/net/snmp`` and ``/proc/net/netstat``
    (a header line of names, then a line of values, per group). Counts segments
    of one namespace since it was made; a counter the kernel lacks is left out."""
    rows: dict[str, list[str]] = {}
    got: dict[tuple[str, str], int] = {}
    for line in text.splitlines():
        group, _, rest = line.partition(":")
        if group in rows:
            got.update({(group, n): int(v) for n, v in zip(rows.pop(group), rest.split()) if v.lstrip("-").isdigit()})
        else:
            rows[group] = rest.split()
    return {k: got[g] for k, g in TCP_COUNTERS.items() if g in got}


def drop_counters(listing: str, src: str, dst: str) -> tuple[int, int] | None:
    """Packets and bytes dropped by the loss rule (a ``statistic`` DROP) from ``src`` to
    ``dst`` in an ``iptables -L CHAIN -v -x -n`` listing (None: no such rule). A rule
    that matches any source (``0.0.0.0/0``: toward the client, in the sender's OUTPUT) counts."""
    for line in listing.splitlines():
        f = line.split()
        if len(f) >= 9 and f[2] == "DROP" and "statistic" in line and f[8] == dst and f[7] in (src, "0.0.0.0/0"):
            return int(f[0]), int(f[1])
    return None


def _own_tcp() -> dict[str, int]:
    try:
        with open("/proc/net/snmp") as a, open("/proc/net/netstat") as b:
            return tcp_counters(a.read() + b.read())
    except OSError:
        return {}


def serve(host: str, port: int, timeout_s: float = 60.0) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((host, port))
    tcp.listen(1)
    tcp.settimeout(timeout_s)

    def echo() -> None:
        while True:
            data, addr = udp.recvfrom(2048)
            try:
                udp.sendto(data, addr)
            except OSError:  # a local error on the way out: the echo is lost, the next one is answered
                continue

    threading.Thread(target=echo, daemon=True).start()
    print("ready", flush=True)
    conn, _ = tcp.accept()
    marks: list[tuple[float, int]] = []
    total = 0
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        total += len(data)
        marks.append((time.monotonic(), total))
    start_t = marks[0][0] + (marks[-1][0] - marks[0][0]) / 4 if marks else 0.0
    base = next(((t, b) for t, b in marks if t >= start_t), (0.0, 0))
    span = marks[-1][0] - base[0] if marks else 0.0
    rate = (total - base[1]) * 8 / span if span > 0 else None
    conn.sendall(json.dumps({"bytes": total, "goodput_bps": rate}).encode())
    conn.close()


def client(host: str, port: int) -> dict:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.settimeout(5.0)
    rtts = []
    for i in range(ECHOES):
        t0 = time.monotonic()
        udp.sendto(struct.pack("!Id", i, t0), (host, port))
        try:
            while True:
                data, _ = udp.recvfrom(2048)
                if struct.unpack("!Id", data)[0] == i:
                    break
        except socket.timeout:
            continue  # a lost echo: loss on the link
        rtts.append(time.monotonic() - t0)
        time.sleep(ECHO_GAP_S)
    before = _own_tcp()
    s = socket.create_connection((host, port), timeout=30)
    payload = b"\0" * CHUNK
    end = time.monotonic() + TCP_SECONDS
    while time.monotonic() < end:
        s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    got = json.loads(reply)
    after = _own_tcp()
    return {
        "rtt_s": statistics.median(rtts) if rtts else None,
        "rtt_min_s": min(rtts) if rtts else None,
        "echoes_lost": ECHOES - len(rtts),
        "goodput_bps": got["goodput_bps"],
        "bytes": got["bytes"],
        # the namespace's counters: the probe's connection, and whatever else sent meanwhile (a stack idle)
        **{k: after[k] - before[k] for k in ("retrans_segs", "out_segs") if k in after and k in before},
    }


def main(argv: list[str]) -> int:
    what, host, port = argv[0], argv[1], int(argv[2])
    if what == "serve":
        serve(host, port)
    else:
        print(json.dumps(client(host, port)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
