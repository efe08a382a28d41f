"""``kvlens up``: start a real prefill (P) and decode (D) vLLM pair plus the
kvlens router, wait until all three answer ``/health``, print the endpoints,
and stop everything on Ctrl-C / SIGTERM.

:class:`Stack` is the reusable part: tests and the benchmark start a stack
in-process with it (``with Stack("push") as s: ... s.router_url``).

Every child runs in its own session (process group) so that stopping it also
stops the EngineCore processes vLLM spawns; leftovers found through psutil
are killed as well. Each child logs to its own file under the log dir; when a
child dies early the tail of its log is part of the error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvlens import home as kvhome

logger = logging.getLogger("kvlens.up")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 240.0
DEFAULT_HOST = "127.0.0.1"
MAX_MODEL_LEN = 4096

CONNECTORS = {
    # (mode, stock) -> (connector class, module path or None)
    ("push", False): ("InstrumentedNixlPushConnector", "instrumented_connector"),
    ("pull", False): ("InstrumentedNixlPullConnector", "instrumented_connector"),
    ("push", True): ("NixlPushConnector", None),
    ("pull", True): ("NixlConnector", None),
}


class StackError(RuntimeError):
    """A stack could not start (bad input, busy port, a child died, timeout)."""


# ----------------------------------------------------------------- helpers
def port_in_use(port: int, host: str = DEFAULT_HOST) -> bool:
    """True when something already listens on ``host:port`` (bind test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except Exception:
        return 32768, 60999


def free_port(host: str = DEFAULT_HOST, avoid: set[int] | None = None) -> int:
    """A currently free TCP port (not in ``avoid``), chosen outside the
    kernel's ephemeral range: a port handed out by ``bind(0)`` is free now,
    but vLLM's ZMQ, NIXL and UCX sockets draw from that same range while the
    pair starts, and one of them took a router port before it could bind."""
    import random

    lo, hi = _ephemeral_range()
    pool = [(a, b) for a, b in ((20000, min(lo, 32768) - 1), (hi + 1, 65535)) if b - a > 100]
    for _ in range(200):
        if not pool:
            break
        a, b = random.choice(pool)
        p = random.randint(a, b)
        if (not avoid or p not in avoid) and not port_in_use(p, host):
            return p
    for _ in range(50):  # fall back to the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if not avoid or p not in avoid:
            return p
    raise StackError("could not find a free port")


def tail(path: Path, n: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError as e:
        return f"(no log: {e})"


def check_model(model: Path) -> Path:
    model = Path(model).expanduser()
    if not model.exists():
        raise StackError(f"model path does not exist: {model}")
    if not (model / "config.json").is_file():
        raise StackError(f"model path has no config.json: {model}")
    return model.resolve()


#: vLLM's KV lease (P keeps blocks for D this long) defaults to 30 s and a
#: push registration waits 480 s. On a small CPU box a cold or busy engine
#: can take longer than 30 s to register, and the request then hangs until
#: the 480 s watchdog. The stacks kvlens starts (stock and instrumented alike,
#: so comparisons stay fair) use a longer lease and a shorter watchdog.
DEFAULT_KV_LEASE_S = 120
DEFAULT_PUSH_REGISTRATION_TIMEOUT_S = 150


def kv_transfer_config(
    mode: str,
    role: str,
    engine_id: str,
    stock: bool,
    kvlens_home: Path,
    kv_lease_s: int = DEFAULT_KV_LEASE_S,
    push_registration_timeout_s: int = DEFAULT_PUSH_REGISTRATION_TIMEOUT_S,
) -> dict:
    name, module = CONNECTORS[(mode, stock)]
    extra: dict[str, Any] = {
        "kv_lease_duration": int(kv_lease_s),
        "push_registration_timeout": int(push_registration_timeout_s),
    }
    cfg: dict[str, Any] = {
        "kv_connector": name,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }
    if module:
        cfg["kv_connector_module_path"] = module
        extra["kvlens_home"] = str(kvlens_home)
    return cfg


def _pythonpath(extra: str | None) -> str:
    parts = [str(REPO_ROOT)]
    if extra:
        parts += [p for p in extra.split(os.pathsep) if p and p != str(REPO_ROOT)]
    return os.pathsep.join(parts)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_at: float | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log, "ab", buffering=0)
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
                start_new_session=True,
            )
        finally:
            fh.close()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died_message(self) -> str:
        rc = self.proc.returncode if self.proc else None
        return f"{self.name} exited with code {rc}; last lines of {self.log}:\n{tail(self.log)}"


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _stop_children(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM every child's process group, wait, then SIGKILL what is left
    (groups and any descendant that escaped its group)."""
    live = [c for c in children if c.proc is not None]
    if not live:
        return
    try:
        import psutil
    except Exception:  # pragma: no cover - psutil ships with vLLM
        psutil = None  # type: ignore[assignment]
    stragglers = []
    for c in live:
        stragglers += _descendants(c.proc.pid)
    for c in live:
        # even when the leader has exited: its group may still hold EngineCore
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in live:
        left = max(0.1, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=left)
    for c in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=5)
    if psutil is not None:
        alive = []
        for p in stragglers:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    alive.append(p)
            except Exception:
                pass
        if alive:
            psutil.wait_procs(alive, timeout=5)


def parse_cpu_list(spec: str | None) -> set[int] | None:
    """CPU ids of a one-rank ``VLLM_CPU_OMP_THREADS_BIND`` value ("1",
    "0-3,6"); None for "auto", "nobind", a multi-rank "a|b" or anything else
    this launcher did not choose itself. (vLLM's own parser,
    ``vllm.utils.cpu_resource_utils.parse_id_list``, would import the vllm
    package into the launcher, which otherwise never imports it.)"""
    if not spec or "|" in spec:
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
    except ValueError:
        return None
    return cpus or None


def repin_worker_threads(server_pid: int, cpus: set[int]) -> tuple[int, int]:
    """Pin every thread of the vLLM worker processes under ``server_pid`` to
    ``cpus``; returns (worker processes found, threads whose CPU set changed).

    Why: on a CPU-only host vLLM's NIXL worker calls
    ``os.sched_setaffinity(0, [last core of each NUMA node])`` on the worker's
    main thread (the thread that also runs the model), meant to keep KV
    transfer off the forward pass. With P and D on one host that puts both
    instances' main threads, their push writer threads, and D's spinning NIXL
    progress thread on the same core, away from the core each instance was
    given (``VLLM_CPU_OMP_THREADS_BIND``). Measured on a 2-core box: requests
    stalled 10-85 s in every phase (prefill, registration, WRITE, decode);
    with each worker's threads back on its own core, 260 requests at 4-8 in
    flight finished in at most 1.5 s. Threads created later inherit the
    main thread's set, so doing this once after start-up is enough.
    """
    import psutil

    workers, moved = 0, 0
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if not proc.name().startswith("VLLM::Worker"):
                continue
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        workers += 1
        for tid in tids:
            try:
                if set(os.sched_getaffinity(tid)) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return workers, moved


# ------------------------------------------------------------------- stack
@dataclass
class Stack:
    """One P/D pair plus router. ``start()`` blocks until all are healthy."""

    mode: str = "push"
    dispatch: str = "overlapped"
    model: Path | str | None = None
    port: int | None = 8000
    prefill_port: int | None = None
    decode_port: int | None = None
    stock: bool = False
    log_dir: Path | str | None = None
    env_extra: Mapping[str, str] | None = None
    host: str = DEFAULT_HOST
    kvlens_home: Path | str | None = None
    prefill_side_port: int | None = None
    decode_side_port: int | None = None
    vllm_args: list[str] = field(default_factory=list)
    quiet: bool = False
    warmup: bool = True
    kv_lease_s: int = DEFAULT_KV_LEASE_S
    push_registration_timeout_s: int = DEFAULT_PUSH_REGISTRATION_TIMEOUT_S
    prometheus: bool = False
    prometheus_port: int = 9090
    prometheus_server: Any = None

    # filled by start()
    router_url: str = ""
    prefill_url: str = ""
    decode_url: str = ""
    children: list[Child] = field(default_factory=list)
    startup_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("push", "pull"):
            raise StackError(f"mode must be push or pull, got {self.mode!r}")
        if self.dispatch not in ("overlapped", "sequential"):
            raise StackError(f"dispatch must be overlapped or sequential, got {self.dispatch!r}")
        self.kvlens_home = Path(self.kvlens_home).resolve() if self.kvlens_home else kvhome.home()
        if self.log_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            tag = f"{self.mode}{'-stock' if self.stock else ''}-{stamp}-{os.getpid()}"
            self.log_dir = Path(self.kvlens_home) / "runs" / tag
        self.log_dir = Path(self.log_dir).resolve()

    # ------------------------------------------------------------ public
    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _say(self, msg: str) -> None:
        if self.quiet:
            logger.info(msg)
        else:
            print(f"[kvlens up] {msg}", flush=True)

    def preflight(self) -> None:
        """Checks that need no child: model dir and ports. Raises StackError."""
        if self.model is None:
            from kvlens.model import ensure_model

            self.model = ensure_model(Path(self.kvlens_home) / "model")
        self.model = check_model(Path(self.model))
        used: set[int] = set()
        named = {
            "router port": self.port,
            "prefill port": self.prefill_port,
            "decode port": self.decode_port,
            "prefill side-channel port": self.prefill_side_port,
            "decode side-channel port": self.decode_side_port,
        }
        if self.prometheus:
            named["prometheus port"] = self.prometheus_port
            if shutil.which("prometheus") is None and not Path("/usr/bin/prometheus").exists():
                raise StackError("--prometheus needs the prometheus binary: apt-get install prometheus (make setup does it)")
        for what, p in named.items():
            if p is None or p == 0:
                continue
            if p in used:
                raise StackError(f"{what} {p} is given twice")
            if port_in_use(p, self.host):
                raise StackError(f"{what} {p} is already in use on {self.host}")
            used.add(p)
        if not self.port:
            self.port = free_port(self.host, used)
            used.add(self.port)
        for attr in ("prefill_port", "decode_port", "prefill_side_port", "decode_side_port"):
            if not getattr(self, attr):
                p = free_port(self.host, used)
                setattr(self, attr, p)
                used.add(p)

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = _pythonpath(env.get("PYTHONPATH"))
        env["KVLENS_HOME"] = str(self.kvlens_home)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _server(self, role: str) -> Child:
        is_p = role == "prefill"
        port = self.prefill_port if is_p else self.decode_port
        side = self.prefill_side_port if is_p else self.decode_side_port
        engine_id = "p0" if is_p else "d0"
        prom = Path(self.log_dir) / f"prometheus-{role}"
        shutil.rmtree(prom, ignore_errors=True)
        prom.mkdir(parents=True)
        env = self._base_env()
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_CPU_OMP_THREADS_BIND": "0" if is_p else "1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "PROMETHEUS_MULTIPROC_DIR": str(prom),
            }
        )
        if (os.cpu_count() or 1) < 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        if self.env_extra:
            env.update({k: str(v) for k, v in self.env_extra.items()})
        ktc = kv_transfer_config(self.mode, role, engine_id, self.stock, Path(self.kvlens_home),
                                 self.kv_lease_s, self.push_registration_timeout_s)
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.host,
            "--port", str(port),
            "--dtype", "float32",
            "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-transfer-config", json.dumps(ktc),
            *self.vllm_args,
        ]  # fmt: skip
        return Child(role, argv, env, Path(self.log_dir) / f"{role}.log", f"http://{self.host}:{port}")

    def _router(self, dispatch: str, port: int, name: str = "router") -> Child:
        argv = [
            sys.executable, "-m", "kvlens.cli", "proxy",
            "--prefill", self.prefill_url,
            "--decode", self.decode_url,
            "--mode", self.mode,
            "--dispatch", dispatch,
            "--host", self.host,
            "--port", str(port),
            "--prefill-engine-id", "p0",
            "--prefill-side-host", self.host,
            "--prefill-side-port", str(self.prefill_side_port),
        ]  # fmt: skip
        return Child(name, argv, self._base_env(), Path(self.log_dir) / f"{name}.log", f"http://{self.host}:{port}")

    def start(self, timeout: float = DEFAULT_TIMEOUT_S) -> "Stack":
        t0 = time.monotonic()
        self.preflight()
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        Path(self.kvlens_home).mkdir(parents=True, exist_ok=True)
        try:
            p, d = self._server("prefill"), self._server("decode")
            self.prefill_url, self.decode_url = p.url, d.url
            self._say(
                f"starting {self.mode} pair ({'stock' if self.stock else 'instrumented'} connector) "
                f"model={self.model} logs={self.log_dir}"
            )
            for c in (p, d):
                c.start()
                self.children.append(c)
            self._wait([p, d], t0 + timeout)
            self._repin(p)
            self._repin(d)
            r = self._router(self.dispatch, int(self.port))
            r.start()
            self.children.append(r)
            self.router_url = r.url
            self._wait([r], t0 + timeout)
            if self.warmup:
                self._warm_up()
            if self.prometheus:
                self.start_prometheus(self.prometheus_port)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self._write_manifest()
        self._say(f"ready in {self.startup_s:.0f}s")
        return self

    def _repin(self, c: Child) -> None:
        """Undo vLLM's CPU NIXL worker pinning (see ``repin_worker_threads``);
        the stack still serves without it (with long stalls), so a failure is
        a warning."""
        cpus = parse_cpu_list(c.env.get("VLLM_CPU_OMP_THREADS_BIND"))
        if cpus is None or c.proc is None or not hasattr(os, "sched_setaffinity"):
            return
        try:
            workers, moved = repin_worker_threads(c.proc.pid, cpus)
        except Exception as e:  # noqa: BLE001 - never fail a start-up over this
            self._say(f"warning: could not pin {c.name}'s worker threads to CPU {sorted(cpus)}: {e}")
            return
        if workers == 0:
            self._say(f"warning: no vLLM worker process found under {c.name}; CPU pinning left as vLLM set it")
        elif moved:
            self._say(f"{c.name}: {moved} worker threads moved back to CPU {sorted(cpus)} "
                      "(vLLM's CPU NIXL worker pins P's and D's main threads to one shared core)")

    def _warm_up(self, tries: int = 3, timeout_s: float = 90.0) -> None:
        """One tiny request end to end before reporting ready.

        The first request to a new P/D pair pays for kernel warm-up and the
        first-contact NIXL handshakes; vLLM gives a handshake reply 5 s, and
        on a loaded machine a cold engine can miss that, which strands that
        request until vLLM's registration timeout. Paying it here keeps it
        out of the user's (and the tests') first measured request. A failed
        handshake is retried by vLLM on the next request, hence the retries.
        """
        import httpx

        for i in range(1, tries + 1):
            try:
                r = httpx.post(
                    self.router_url + "/v1/completions",
                    json={"prompt": "kvlens warm-up", "max_tokens": 2, "temperature": 0},
                    timeout=timeout_s,
                    headers={"X-Request-Id": "0" * 31 + str(i)},
                )
                if r.status_code == 200:
                    self._say(f"warm-up request ok ({i}/{tries})")
                    return
                self._say(f"warm-up request returned HTTP {r.status_code} ({i}/{tries})")
            except httpx.HTTPError as e:
                self._say(f"warm-up request failed: {type(e).__name__} ({i}/{tries})")
            dead = self.dead_child()
            if dead is not None:
                raise StackError(dead.died_message())
        self._say("warning: warm-up never succeeded; the stack is up but may be unhealthy")

    def add_router(self, dispatch: str, port: int | None = None, timeout: float = 60.0) -> str:
        """Start one more router on the same P/D (e.g. sequential next to
        overlapped); stopped with the stack. Returns its URL."""
        port = port or free_port(self.host)
        name = f"router-{dispatch}-{port}"
        c = self._router(dispatch, port, name)
        c.start()
        self.children.append(c)
        self._wait([c], time.monotonic() + timeout)
        return c.url

    def router_for(self, dispatch: str) -> str:
        """URL of a router with this dispatch on this P/D pair, started on
        first use (tests and the bench share one pair per mode)."""
        if dispatch == self.dispatch and self.router_url:
            return self.router_url
        extra = self.__dict__.setdefault("_extra_routers", {})
        if dispatch not in extra:
            extra[dispatch] = self.add_router(dispatch)
        return extra[dispatch]

    @property
    def sequential_router_url(self) -> str:
        return self.router_for("sequential")

    @property
    def store_path(self) -> Path:
        """The trace store every process of this stack writes to."""
        return Path(self.kvlens_home) / "traces.db"

    def dead_child(self) -> Child | None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    def start_prometheus(self, port: int = 9090, timeout: float = 60.0):
        """Start a real Prometheus scraping this stack's router, P and D
        (data and config under the log dir). Returns the server; its URL is
        ``self.prometheus_server.url``. Stopped with the stack."""
        from exporters.prometheus_server import PrometheusServer

        if self.prometheus_server is not None:
            return self.prometheus_server
        routers = [self.router_url] + list(self.__dict__.get("_extra_routers", {}).values())
        hostport = lambda u: u.split("://", 1)[-1].rstrip("/")  # noqa: E731
        server = PrometheusServer(
            {
                "kvlens-router": [hostport(u) for u in routers],
                "vllm-prefill": [hostport(self.prefill_url)],
                "vllm-decode": [hostport(self.decode_url)],
            },
            port=port,
            data_dir=Path(self.log_dir) / "prometheus",
        )
        server.start(timeout=timeout)
        self.prometheus_server = server
        self._say(f"prometheus ready at {server.url}")
        return server

    def stop(self) -> None:
        if self.prometheus_server is not None:
            try:
                self.prometheus_server.stop()
            finally:
                self.prometheus_server = None
        if self.children:
            _stop_children(list(reversed(self.children)))
            self._say("stopped")
        self.children = []

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None]

    # ----------------------------------------------------------- internal
    def _wait(self, children: list[Child], deadline: float) -> None:
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise

        pending = list(children)
        last_note = 0.0
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for c in list(pending):
                    if not c.alive():
                        raise StackError(c.died_message())
                    try:
                        if client.get(c.url + "/health").status_code == 200:
                            c.ready_at = time.monotonic()
                            pending.remove(c)
                            self._say(f"{c.name} ready at {c.url} ({c.ready_at - c.started_at:.0f}s)")
                    except httpx.HTTPError:
                        pass
                if not pending:
                    break
                now = time.monotonic()
                if now > deadline:
                    names = ", ".join(f"{c.name} (log {c.log})" for c in pending)
                    last = pending[0]
                    raise StackError(
                        f"timed out waiting for {names} to answer /health; "
                        f"last lines of {last.log}:\n{tail(last.log)}"
                    )
                if now - last_note >= 15:
                    last_note = now
                    self._say(
                        "waiting for "
                        + ", ".join(f"{c.name} ({now - c.started_at:.0f}s)" for c in pending)
                    )
                time.sleep(0.5)

    def manifest(self) -> dict:
        return {
            "mode": self.mode,
            "dispatch": self.dispatch,
            "stock": self.stock,
            "connector": CONNECTORS[(self.mode, self.stock)][0],
            "model": str(self.model),
            "kvlens_home": str(self.kvlens_home),
            "log_dir": str(self.log_dir),
            "router_url": self.router_url,
            "prefill_url": self.prefill_url,
            "decode_url": self.decode_url,
            "ports": {
                "router": self.port,
                "prefill": self.prefill_port,
                "decode": self.decode_port,
                "prefill_side_channel": self.prefill_side_port,
                "decode_side_channel": self.decode_side_port,
            },
            "engine_ids": {"prefill": "p0", "decode": "d0"},
            "pids": {c.name: c.proc.pid for c in self.children if c.proc is not None},
            "logs": {c.name: str(c.log) for c in self.children},
            "startup_s": self.startup_s,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _write_manifest(self) -> None:
        p = Path(self.log_dir) / "stack.json"
        p.write_text(json.dumps(self.manifest(), indent=2) + "\n")


# --------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["push", "pull"], required=True, help="KV handoff protocol")
    p.add_argument(
        "--dispatch",
        choices=["overlapped", "sequential"],
        default="overlapped",
        help="push only: send D its request at once (overlapped) or after P answers (sequential)",
    )
    p.add_argument("--model", type=Path, default=None, help="model dir (default: generated tiny model in $KVLENS_HOME/model)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--prefill-port", type=int, default=None, help="P's HTTP port (default: a free one)")
    p.add_argument("--decode-port", type=int, default=None, help="D's HTTP port (default: a free one)")
    p.add_argument("--host", default=DEFAULT_HOST, help="bind address for all three servers")
    p.add_argument("--stock", action="store_true", help="use vLLM's own NIXL connectors (no kvlens telemetry)")
    p.add_argument("--log-dir", type=Path, default=None, help="where child logs and stack.json go")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for readiness")
    p.add_argument("--prometheus", action="store_true",
                   help="also start a Prometheus server (Debian package prometheus) scraping router, P and D, "
                        "with the kvlens recording rules and exemplar storage; data under the log dir")
    p.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus port (default 9090)")
    p.add_argument("--kv-lease", type=int, default=DEFAULT_KV_LEASE_S, metavar="S",
                   help=f"vLLM kv_lease_duration: how long P keeps a request's KV for D (default {DEFAULT_KV_LEASE_S}; vLLM's own default is 30)")
    p.add_argument("--push-registration-timeout", type=int, default=DEFAULT_PUSH_REGISTRATION_TIMEOUT_S, metavar="S",
                   help=f"vLLM push_registration_timeout on D (default {DEFAULT_PUSH_REGISTRATION_TIMEOUT_S}; vLLM's own default is 480)")


class _Terminate(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    def _on_term(signum, frame):  # SIGTERM -> unwind like Ctrl-C
        raise _Terminate()

    old = signal.signal(signal.SIGTERM, _on_term)
    stack: Stack | None = None
    try:
        stack = Stack(
            mode=args.mode,
            dispatch=args.dispatch,
            model=args.model,
            port=args.port,
            prefill_port=args.prefill_port,
            decode_port=args.decode_port,
            stock=args.stock,
            log_dir=args.log_dir,
            host=args.host,
            kv_lease_s=args.kv_lease,
            push_registration_timeout_s=args.push_registration_timeout,
            prometheus=args.prometheus,
            prometheus_port=args.prometheus_port,
        )
        stack.start(timeout=args.timeout)
        print(
            "\nkvlens stack is up "
            f"({args.mode}{', ' + args.dispatch if args.mode == 'push' else ''}, "
            f"{'stock' if args.stock else 'instrumented'} connector)\n"
            f"  router  (OpenAI API): {stack.router_url}/v1\n"
            f"  prefill (P):          {stack.prefill_url}\n"
            f"  decode  (D):          {stack.decode_url}\n"
            f"  model:                {stack.model}\n"
            f"  logs:                 {stack.log_dir}\n"
            "Ctrl-C to stop.",
            flush=True,
        )
        while True:
            dead = stack.dead_child()
            if dead is not None:
                print(f"kvlens up: {dead.died_message()}", file=sys.stderr, flush=True)
                return 1
            time.sleep(1.0)
    except StackError as e:
        print(f"kvlens up: error: {e}", file=sys.stderr, flush=True)
        return 2
    except (KeyboardInterrupt, _Terminate):
        print("kvlens up: stopping", flush=True)
        return 0
    finally:
        # A second signal while stopping must not leave orphans: ignore it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if stack is not None:
                stack.stop()
        finally:
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGINT, old_int)
