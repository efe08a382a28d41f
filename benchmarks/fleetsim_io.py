"""The fleet simulation's two ends (``bench_fleetsim.py``): the ``kvlens
collect`` subprocess it measures (its counters, CPU and memory from /proc)
and the sender that replays pre-built OTLP bodies on schedule over
keep-alive connections, retrying as an OTLP exporter does."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import select
import signal
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvrecord.children import ChildProcess

PB = {"content-type": "application/x-protobuf"}
RETRYABLE = (429, 502, 503, 504)
#: OTEL_EXPORTER_OTLP_TIMEOUT's default: an export is given up this long after its first attempt.
EXPORT_TIMEOUT_S = 10.0


# ---------------------------------------------------------------- collector
class Collector:
    """A ``kvlens collect`` subprocess on a free port, writing ``location``."""

    def __init__(self, location: str, extra: list[str]) -> None:
        argv = [sys.executable, "-m", "kvlens.cli", "collect", "--port", "0", "--no-grpc", "--store", location, *extra]
        self.child = ChildProcess(argv, pipes=True, death_signal=signal.SIGTERM).start()
        line = self._first_line(60.0)
        if "/v1/traces" not in line:
            self.child.stop(5)
            raise SystemExit(f"kvlens collect did not start (exit {self.child.returncode}): {line.strip()!r}")
        self.base = line.split("http://", 1)[1].split("/v1/traces", 1)[0]
        self.base = "http://" + self.base
        self.pid = self.child.pid

    def _first_line(self, timeout_s: float) -> str:
        out, fd, deadline = b"", self.child.stdout.fileno(), time.monotonic() + timeout_s
        while not out.endswith(b"\n") and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                out += chunk
        return out.decode(errors="replace")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MiB."""
        got = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
        return int(got["VmRSS"].split()[0]) / 1024, int(got["VmHWM"].split()[0]) / 1024

    def counters(self) -> dict[str, float]:
        """The ``kvlens_collector_*`` samples of its /metrics (labels folded into the name)."""
        text = httpx.get(self.base + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("kvlens_collector_"):
                    label = ",".join(f"{v}" for v in s.labels.values())
                    out[s.name + (f"{{{label}}}" if label else "")] = s.value
        return out

    def queue(self) -> int:
        return int(httpx.get(self.base + "/healthz", timeout=30).json()["queue_spans"])

    def stop(self) -> None:
        self.child.stop(30)
        rest = os.read(self.child.stdout.fileno(), 65536) if self.child.stdout else b""
        if rest.strip():
            print("  " + rest.decode(errors="replace").strip().replace("\n", "\n  "), flush=True)


# ---------------------------------------------------------------- sender
async def _export(
    client, sem, url: str, body: bytes, n: int, due: float, counts: collections.Counter, lags: list
) -> None:
    loop = asyncio.get_running_loop()
    first, backoff, attempt = loop.time(), 1.0, 0
    while True:
        async with sem:
            if attempt == 0:
                lags.append(loop.time() - due)
            try:
                r = await client.post(url, content=body, headers=PB)
                code, retry_after = r.status_code, r.headers.get("retry-after")
            except httpx.TransportError:
                code, retry_after = None, None
        attempt += 1
        if code == 200:
            counts["ok_posts"] += 1
            return
        if code is not None and code not in RETRYABLE:
            counts[f"refused_{code}_posts"] += 1
            counts["refused_spans"] += n
            return
        counts[f"retry_{code or 'conn'}"] += 1
        wait = max(float(retry_after or 0), backoff) * random.uniform(0.8, 1.2)
        if loop.time() + wait - first > EXPORT_TIMEOUT_S:
            counts["gave_up_posts"] += 1
            counts["gave_up_spans"] += n
            return
        await asyncio.sleep(wait)
        backoff *= 2


async def send_window(url: str, bodies: list, connections: int, progress) -> dict:
    """Send every body at its time; returns counters, the send lags and the
    generator's CPU seconds while sending."""
    loop = asyncio.get_running_loop()
    counts: collections.Counter = collections.Counter()
    lags: list[float] = []
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    cpu0 = time.process_time()
    async with httpx.AsyncClient(limits=limits, timeout=EXPORT_TIMEOUT_S) as client:
        sem, tasks = asyncio.Semaphore(connections), set()
        t0, shown = loop.time(), 0.0
        for at, body, n in bodies:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_export(client, sem, url, body, n, t0 + at, counts, lags))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if at - shown >= 10:
                shown = at
                progress(
                    f"    t={at:5.0f}s  posts ok {counts['ok_posts']:,}  retries {retries(counts):,}  in flight {len(tasks)}"
                )
        if tasks:
            await asyncio.gather(*tasks)
    return {"stats": counts, "lags": lags, "cpu_s": time.process_time() - cpu0, "wall_s": loop.time() - t0}


def retries(counts) -> int:
    return sum(v for k, v in counts.items() if k.startswith("retry_"))
