"""A real Prometheus scraping the router's token-protected ``/metrics``
(issue 33, item 2): the job with the token in a ``credentials_file`` (what
``kvlens up --prometheus`` writes when the router has a key) is up; the same
target without it is down with 401. The router is the real ``kvlens proxy``
in front of the fake P and D of ``tests/fakes.py``."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from exporters.prometheus_server import PrometheusServer
from fakes import FakeVllm, d_answers, p_ok
from kvrecord.guard import parent_death_signal
from kvrecord.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = Path("/usr/bin/prometheus")
TOKEN = "prom-" + secrets.token_hex(16)
#: issue 42: the read role opens /metrics, the admin role does not
READ = "read-" + secrets.token_hex(16)
ADMIN = "admin-" + secrets.token_hex(16)


def _dies_with_us() -> None:
    """In the child: SIGTERM when this test process dies, so an interrupted run leaves no server behind."""
    parent_death_signal(signal.SIGTERM)


@pytest.mark.skipif(not PROMETHEUS.exists(), reason="install Debian package prometheus: apt-get install prometheus")
def test_prometheus_scrapes_the_router_with_its_token_file(tmp_path):
    p, d = FakeVllm(p_ok), FakeVllm(d_answers)
    port = free_port()
    env = {**os.environ, "KVLENS_HOME": str(tmp_path / "home"), "KVLENS_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    env.update(KVLENS_READ_TOKEN=READ, KVLENS_ADMIN_TOKEN=ADMIN)
    for k in ("KVLENS_API_KEY", "VLLM_API_KEY", "KVLENS_INGEST_TOKEN"):
        env.pop(k, None)
    router = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "proxy", "--mode", "pull", "--prefill", p.url, "--decode", d.url,
         "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_dies_with_us,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    target = f"127.0.0.1:{port}"
    prom = PrometheusServer(
        {"kvlens-router": [target], "without-token": [target], "read-token": [target], "admin-token": [target]},
        port=0,
        data_dir=tmp_path / "prom",
        rules=False,
        scrape_interval="1s",
        credentials={"kvlens-router": TOKEN, "read-token": READ, "admin-token": ADMIN},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None and time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        prom.start(timeout=60)
        token_file = prom.credentials_path("kvlens-router")
        assert token_file.stat().st_mode & 0o777 == 0o600 and TOKEN not in prom.config_path.read_text()
        deadline = time.monotonic() + 60
        while True:
            health = {t["labels"]["job"]: t for t in prom.targets_health()}
            if len(health) == 4 and all(t["health"] != "unknown" for t in health.values()):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert health["kvlens-router"]["health"] == "up", health
        assert health["without-token"]["health"] == "down" and "401" in health["without-token"]["lastError"]
        assert health["read-token"]["health"] == "up", health  # the read token opens /metrics ...
        assert (
            health["admin-token"]["health"] == "down" and "401" in health["admin-token"]["lastError"]
        )  # ... admin's not
        up = prom.query('up{job="kvlens-router"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        prom.stop()
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        p.close()
        d.close()
    assert not prom.credentials_path("kvlens-router").exists()  # removed with Prometheus
