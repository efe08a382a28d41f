"""What a stack runs: the vLLM P and D instances', the kvlens router's and
vLLM's own router's (``vllm-router``) command lines, environments and
``kv_transfer_config``. Pure functions, no process started.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from frontdoor.flags import API_KEY_ENV
from kvlens.stack.errors import StackError
from kvrecord.location import StoreLocation, is_url

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 240.0
MAX_MODEL_LEN = 4096

CONNECTORS = {
    # (mode, stock) -> (connector class, module path or None)
    ("push", False): ("InstrumentedNixlPushConnector", "instrumented_connector"),
    ("pull", False): ("InstrumentedNixlPullConnector", "instrumented_connector"),
    ("push", True): ("NixlPushConnector", None),
    ("pull", True): ("NixlConnector", None),
}

#: vLLM's KV lease (P keeps blocks for D this long) defaults to 30 s and a
#: push registration waits 480 s. On a small CPU box a cold or busy engine
#: can take longer than 30 s to register, and the request then hangs until
#: the 480 s watchdog. The stacks kvlens starts (stock and instrumented alike,
#: so comparisons stay fair) use a longer lease and a shorter watchdog.
DEFAULT_KV_LEASE_S = 120
DEFAULT_PUSH_REGISTRATION_TIMEOUT_S = 150


def check_model(model: Path) -> Path:
    """The resolved model dir; StackError when it is missing or has no config.json."""
    model = Path(model).expanduser()
    if not model.exists():
        raise StackError(f"model path does not exist: {model}")
    if not (model / "config.json").is_file():
        raise StackError(f"model path has no config.json: {model}")
    return model.resolve()


def kv_transfer_config(
    mode: str,
    role: str,
    engine_id: str,
    stock: bool,
    kvlens_home: Path,
    kv_lease_s: int = DEFAULT_KV_LEASE_S,
    push_registration_timeout_s: int = DEFAULT_PUSH_REGISTRATION_TIMEOUT_S,
    otlp_endpoint: str | None = None,
    kv_load_failure_policy: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> dict:
    """vLLM's ``--kv-transfer-config`` for one side (``role`` prefill/decode).
    ``otlp_endpoint``: also send kvlens' spans there (a collector);
    ``kv_load_failure_policy``: D's (``fail``, vLLM's default, or ``recompute``);
    ``options``: more ``kvlens_*`` keys for kvlens' connector (checked by it
    at start-up; ignored for the stock one), e.g. ``{"kvlens_store": "off"}``."""
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
    if kv_load_failure_policy and role == "decode":
        cfg["kv_load_failure_policy"] = kv_load_failure_policy
    if module:
        cfg["kv_connector_module_path"] = module
        extra["kvlens_home"] = str(kvlens_home)
        if otlp_endpoint:
            extra["otlp_endpoint"] = otlp_endpoint
        extra.update(options or {})
    return cfg


def api_key_env(api_key: str | None) -> dict[str, str]:
    """The environment that gives a child the stack's API key: vLLM reads
    ``VLLM_API_KEY`` as it reads ``--api-key``, ``kvlens proxy`` reads
    ``KVLENS_API_KEY`` first (both set, so an unrelated one inherited from
    the caller cannot win). The key goes in the environment, not on the
    command line: any user of the host can read a command line (``ps``),
    only the owner a process's environment."""
    return {k: api_key for k in API_KEY_ENV} if api_key else {}


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <key>`` for the stack's own calls, when it has a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def base_env(kvlens_home: Path) -> dict[str, str]:
    """Environment of every child: ours, plus the repo on PYTHONPATH (vLLM
    loads ``instrumented_connector`` by module path), the kvlens home, offline
    Hugging Face, no usage stats, unbuffered output."""
    env = dict(os.environ)
    parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["KVLENS_HOME"] = str(kvlens_home)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def server_env(
    env: dict[str, str],
    is_p: bool,
    host: str,
    side_port: int,
    prom_dir: Path,
    extra: Mapping[str, str] | None,
    cpus: str | None = None,
) -> dict[str, str]:
    """A vLLM server's environment: its CPU (``cpus``, from
    :func:`kvlens.stack.pinning.cpu_binding`; default P on 0, D on 1 when
    there are two), its NIXL side channel, its Prometheus multiprocess dir,
    then the caller's ``extra`` on top."""
    env = dict(env)
    if cpus is None:
        cpus = "0" if is_p or (os.cpu_count() or 1) < 2 else "1"
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
        }
    )
    if extra:
        extra = dict(extra)
        path = extra.pop("PYTHONPATH", None)
        if path:  # put first, keeping the repo (vLLM loads the connector from it)
            env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.update({k: str(v) for k, v in extra.items()})
    return env


def vllm_argv(model: Path, host: str, port: int, ktc: dict, vllm_args: list[str]) -> list[str]:
    """Command line of one vLLM OpenAI server (P or D), float32, eager, CPU-friendly."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", host,
        "--port", str(port),
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-transfer-config", json.dumps(ktc),
        *vllm_args,
    ]  # fmt: skip


def collector_argv(host: str, port: int, store: StoreLocation) -> list[str]:
    """Command line of one ``kvlens collect`` (OTLP/HTTP receiver -> ``store``, a file or a database; its
    stack's P, D and router speak OTLP/HTTP, so no gRPC port: two stacks on one host would both want 4317).
    A URL's password is not in it: the child gets it from :meth:`StoreLocation.password_env`."""
    public = store.without_password().text
    return [sys.executable, "-m", "kvlens.cli", "collect", "--host", host, "--port", str(port), "--no-grpc",
            "--store", public]  # fmt: skip


def without_store_password(options: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(connector ``options`` with a ``kvlens_store`` URL's password taken
    out, the environment that gives it to the engine: ``PGPASSWORD``). vLLM
    logs its ``--kv-transfer-config`` and ``ps`` shows it, so a password
    must not be in it. A malformed URL passes as it is: the connector names
    the problem at start-up."""
    if not options or not is_url(options.get("kvlens_store")):
        return (dict(options) if options else None), {}
    try:
        loc = StoreLocation.parse(options["kvlens_store"])
    except ValueError:
        return dict(options), {}
    return {**options, "kvlens_store": loc.without_password().text}, loc.password_env()


def router_argv(
    prefills: Sequence[tuple],
    decodes: Sequence[tuple[str, str]],
    mode: str,
    dispatch: str,
    host: str,
    port: int,
    modes: tuple[Sequence[str], Sequence[str]] | None = None,
    split: float | None = None,
    side_hosts: Sequence[str] | None = None,
) -> list[str]:
    """Command line of one ``kvlens proxy`` in front of ``prefills`` ((URL,
    engine id, side-channel port[, TP size]) each, on ``host``) and
    ``decodes`` ((URL, engine id) each); the per-P flags pair with
    ``--prefill`` by position; ``side_hosts``: each P's side-channel host
    (default ``host`` for all). ``--prefill-tp-size`` goes to every P once any
    P runs more than one rank: overlapped push tells D each P's TP size.
    ``modes``: a mixed fleet's mode of each P and each D (every URL tagged
    ``push=`` / ``pull=``, no ``--mode``); ``split``: its push weight (None:
    the router's default)."""
    tag_p = list(modes[0]) if modes else [""] * len(prefills)
    tag_d = list(modes[1]) if modes else [""] * len(decodes)
    argv = [
        sys.executable,
        "-m",
        "kvlens.cli",
        "proxy",
        *([] if modes else ["--mode", mode]),
        *(["--split", f"push={split:g}"] if modes and split is not None else []),
        "--dispatch",
        dispatch,
        "--host",
        host,
        "--port",
        str(port),
    ]
    hosts = list(side_hosts) if side_hosts and len(set(side_hosts)) > 1 else [side_hosts[0] if side_hosts else host]
    for h in hosts:
        argv += ["--prefill-side-host", h]
    any_tp = any(len(p) > 3 and p[3] > 1 for p in prefills)
    for (url, engine_id, side_port, *tp), tag in zip(prefills, tag_p):
        url = f"{tag}={url}" if tag else url
        argv += ["--prefill", url, "--prefill-engine-id", engine_id, "--prefill-side-port", str(side_port)]
        if any_tp:
            argv += ["--prefill-tp-size", str(tp[0] if tp else 1)]
    for (url, engine_id), tag in zip(decodes, tag_d):
        argv += ["--decode", f"{tag}={url}" if tag else url, "--decode-engine-id", engine_id]
    return argv


#: The ``vllm-router`` release whose behaviour kvlens was checked against
#: (pyproject's ``dev`` extra installs it).
VLLM_ROUTER_PACKAGE = "vllm-router>=0.1.17"


def find_vllm_router() -> str:
    """Path of the ``vllm-router`` program: next to this Python (the
    venv's, where ``pip install vllm-router`` puts it), else on PATH;
    StackError when it is not installed."""
    here = Path(sys.executable).parent / "vllm-router"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("vllm-router")
    if found:
        return found
    raise StackError(
        f"--router vllm-router needs vLLM's router: pip install '{VLLM_ROUTER_PACKAGE}' (make setup installs it)"
    )


def vllm_router_argv(
    program: str, prefill_urls: Sequence[str], decode_urls: Sequence[str], host: str, port: int, metrics_port: int
) -> list[str]:
    """Command line of vLLM's own router in front of P and D: disaggregated
    (P then D, NIXL pull: it hands D the ``kv_transfer_params`` P returns),
    round robin over each list. ``metrics_port``: its Prometheus exporter,
    which otherwise binds 29000 (two stacks, or a user's own router, would
    collide there)."""
    argv = [program, "--vllm-pd-disaggregation"]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    return argv + [
        "--policy",
        "round_robin",
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
    ]
