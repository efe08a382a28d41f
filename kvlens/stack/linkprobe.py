"""Measure a link of ``kvlens up --hosts`` (docs/links.md): a UDP echo
round trip and a short TCP goodput, between two network namespaces.

``python -m kvlens.stack.linkprobe serve HOST PORT`` answers UDP echoes and
sinks one TCP transfer on ``PORT``, then reports that transfer's goodput on
the same connection and exits; ``python -m kvlens.stack.linkprobe client
HOST PORT`` sends the echoes and the transfer and prints one JSON line:
``rtt_s`` (median of the echoes), ``rtt_min_s``, ``goodput_bps`` (the
receiver's bytes over time, after the first quarter of the transfer: TCP's
slow start is not the link's rate) and ``bytes``. Blocking, stdlib only.
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
            udp.sendto(data, addr)

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
    return {
        "rtt_s": statistics.median(rtts) if rtts else None,
        "rtt_min_s": min(rtts) if rtts else None,
        "echoes_lost": ECHOES - len(rtts),
        "goodput_bps": got["goodput_bps"],
        "bytes": got["bytes"],
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
