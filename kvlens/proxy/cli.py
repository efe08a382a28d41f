"""``kvlens proxy`` command line: flags and ``run`` (uvicorn, blocking).

Several P and D: ``--prefill`` and ``--decode`` repeat; the per-P flags
(``--prefill-engine-id``, ``--prefill-side-port``, ...) repeat too and pair
with ``--prefill`` by position (:func:`instances`).

Who may use the router (:func:`security`): a token from ``$KVLENS_TOKEN``
or ``--token-file`` (:mod:`kvlens.auth`), else the API key P and D require
(``--api-key``, ``$KVLENS_API_KEY``, ``$VLLM_API_KEY``), is required on
every route but ``/health``. A host other than loopback with neither is
refused (exit 2) unless ``--insecure``. ``--tls-cert/--tls-key``: uvicorn
serves HTTPS.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import urllib.parse

from kvlens import auth
from kvlens.argtypes import add_keep_arguments, keep_rule, positive
from kvlens.proxy.config import DEFAULT_MAX_BODY_BYTES, Decode, Prefill, ProxyConfig
from kvlens.stack.ports import is_loopback, port_arg

logger = logging.getLogger("kvlens.proxy")

#: Environment variables the API key is read from when --api-key is not
#: given (the first set wins); VLLM_API_KEY is what vLLM itself reads.
API_KEY_ENV = ("KVLENS_API_KEY", "VLLM_API_KEY")
MIB = 1024 * 1024


def base_url(text: str) -> str:
    """argparse ``type=``: an ``http(s)://host[:port]`` base URL (a path is
    kept, a trailing slash dropped); anything else is a usage error."""
    try:
        u = urllib.parse.urlsplit(text.strip())
        port = u.port  # ValueError when out of range or not a number
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an http(s)://host:port URL: {text!r}") from None
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or port == 0:
        raise argparse.ArgumentTypeError(f"not an http(s)://host:port URL: {text!r}")
    return text.strip().rstrip("/")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        type=base_url,
        metavar="URL",
        help="a P's base URL, e.g. http://127.0.0.1:8100; repeat for several P (round robin)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        type=base_url,
        metavar="URL",
        help="a D's base URL; repeat for several D (round robin, independent of P's)",
    )
    p.add_argument("--mode", choices=["push", "pull"], required=True)
    p.add_argument(
        "--dispatch",
        choices=["overlapped", "sequential"],
        default="overlapped",
        help="push: send D's request at once (overlapped) or after P answers",
    )
    p.add_argument("--port", type=port_arg(), default=8000)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"bind address (default loopback; any other needs a token (${auth.TOKEN_ENV} or --token-file), "
        "an API key, or --insecure)",
    )
    _add_instance_arguments(p)
    _add_serving_arguments(p)


def _add_instance_arguments(p: argparse.ArgumentParser) -> None:
    """What the router must know of each P and D besides its URL."""
    p.add_argument(
        "--prefill-engine-id",
        action="append",
        default=None,
        metavar="ID",
        help="P's kv_transfer_config.engine_id, once per --prefill in the same order "
        "(default p0, p1, ... as `kvlens up` names them)",
    )
    p.add_argument(
        "--prefill-side-host",
        action="append",
        default=None,
        metavar="HOST",
        help="P's NIXL side-channel host (overlapped push): once for all P, or once per --prefill (default 127.0.0.1)",
    )
    p.add_argument(
        "--prefill-side-port",
        action="append",
        type=port_arg(),
        default=None,
        metavar="PORT",
        help="P's VLLM_NIXL_SIDE_CHANNEL_PORT, once per --prefill in the same order (required for overlapped push)",
    )
    p.add_argument(
        "--prefill-tp-size",
        action="append",
        type=positive(int),
        default=None,
        metavar="N",
        help="P's tensor-parallel size: once for all P, or once per --prefill (default 1)",
    )
    p.add_argument(
        "--decode-engine-id",
        action="append",
        default=None,
        metavar="ID",
        help="D's engine id, once per --decode in the same order (default d0, d1, ...; names D "
        "on root spans and in /health)",
    )


def _add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """Limits, auth and telemetry of the router itself."""
    p.add_argument("--timeout", type=positive(float), default=600.0, help="read timeout towards P and D, seconds")
    p.add_argument(
        "--max-body-mb",
        type=positive(float),
        default=DEFAULT_MAX_BODY_BYTES / MIB,
        metavar="MB",
        help=f"largest request body accepted, MiB (default {DEFAULT_MAX_BODY_BYTES // MIB}); "
        "larger ones get 413 without being read",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the API key P and D require (vLLM's --api-key): sent to them; without a token, also what "
        f"clients must send (default: ${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]}, else none; "
        "a flag shows in ps, the variables do not)",
    )
    p.add_argument("--no-telemetry", action="store_true", help="serve without recording spans")
    p.add_argument(
        "--collect",
        action="store_true",
        help="also receive OTLP/HTTP spans at POST /v1/traces (as `kvlens collect` does) into the "
        "router's trace store, so P and D on other hosts can send theirs here (their "
        "otlp_endpoint: http://ROUTER/v1/traces) and the router's handoff metric sees both ends; "
        f"with a token they must send it (${auth.TOKEN_ENV} in their environment)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="write spans to this PostgreSQL store (postgresql://user@host:port/dbname) instead of "
        "$KVLENS_HOME/traces.db: the router's own and, with --collect, those P and D send",
    )
    p.add_argument(
        "--retention",
        default=None,
        metavar="DURATION",
        help="keep traces this long (e.g. 7d); older ones are deleted in small batches as spans "
        "are written (default: keep all)",
    )
    add_keep_arguments(p)
    auth.add_arguments(p)
    p.epilog = (
        f"With a token (${auth.TOKEN_ENV} or --token-file), or else an API key, every route but /health "
        "needs 'Authorization: Bearer ...': /v1/*, /metrics (Prometheus: authorization: {credentials_file: "
        "PATH} in the scrape job) and, with --collect, POST /v1/traces. The token is never sent to P or D."
    )


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first of :data:`API_KEY_ENV` that is set, else None."""
    if args.api_key:
        return args.api_key
    return next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


def _per_instance(values: list | None, n: int, flag: str, of: str, default, one_for_all: bool = False) -> list:
    """``values`` of a per-instance flag spread over ``n`` instances: none
    (``default(i)`` each), exactly ``n``, or (``one_for_all``) one for all;
    any other count is a ValueError naming both flags."""
    if not values:
        return [default(i) for i in range(n)]
    if len(values) == n:
        return list(values)
    if one_for_all and len(values) == 1:
        return list(values) * n
    want = f"1 or {n}" if one_for_all else str(n)
    raise ValueError(f"{flag} given {len(values)} times for {n} {of} (give it {want} times, in the order of {of})")


def instances(args: argparse.Namespace) -> tuple[list[Prefill], list[Decode]]:
    """The P and D instances from the repeated flags (ValueError on a count
    mismatch, naming the flags)."""
    urls_p, urls_d = list(args.prefill), list(args.decode)
    n = len(urls_p)
    of = "--prefill"
    ids_p = _per_instance(args.prefill_engine_id, n, "--prefill-engine-id", of, lambda i: f"p{i}")
    hosts = _per_instance(args.prefill_side_host, n, "--prefill-side-host", of, lambda i: "127.0.0.1", True)
    ports = _per_instance(args.prefill_side_port, n, "--prefill-side-port", of, lambda i: None)
    tps = _per_instance(args.prefill_tp_size, n, "--prefill-tp-size", of, lambda i: 1, True)
    ids_d = _per_instance(
        getattr(args, "decode_engine_id", None), len(urls_d), "--decode-engine-id", "--decode", lambda i: f"d{i}"
    )
    return ([Prefill(*x) for x in zip(urls_p, ids_p, hosts, ports, tps)], [Decode(u, e) for u, e in zip(urls_d, ids_d)])


def security(args: argparse.Namespace, key: str | None) -> auth.Security:
    """TLS and the token for binding ``args.host`` (:func:`kvlens.auth.from_args`);
    the API key ``key`` counts as the clients' credential when no token is
    set (it is what an OpenAI client sends). SecurityError naming the
    problem: a host beyond loopback with neither and no ``--insecure``."""
    sec = auth.from_args(args, "127.0.0.1")  # files and token checked; the bind check below knows the API key
    if sec.token is None and not key and not sec.insecure and not auth.is_loopback(args.host):
        raise auth.SecurityError(
            f"refusing to listen on {args.host} (beyond loopback) with no token and no API key: set "
            f"${auth.TOKEN_ENV} or --token-file (or ${API_KEY_ENV[0]}), or pass --insecure to let anyone "
            "who reaches it in"
        )
    return sec


def config(args: argparse.Namespace, token: bytes | None = None) -> ProxyConfig:
    """The router's settings from its flags (ValueError on a bad mix);
    ``token``: the clients' bearer token (:func:`security`)."""
    prefills, decodes = instances(args)
    return ProxyConfig.of(
        prefills,
        decodes,
        mode=args.mode,
        dispatch=args.dispatch,
        read_timeout_s=args.timeout,
        telemetry=not args.no_telemetry,
        api_key=api_key(args),
        token=token.decode() if token else None,
        max_body_bytes=max(1, int(args.max_body_mb * MIB)),
        collect=args.collect,
        store=getattr(args, "store", None),
        retention=getattr(args, "retention", None),
        keep=keep_rule(args).to_config(),
    )


def check(cfg: ProxyConfig) -> None:
    """What the flags can only be checked for together (ValueError):
    overlapped push needs every P's side-channel port."""
    if cfg.overlapped_push and any(p.side_port is None for p in cfg.prefills):
        raise ValueError(
            "overlapped push needs --prefill-side-port (P's VLLM_NIXL_SIDE_CHANNEL_PORT), once per --prefill"
        )


def warn_if_open(host: str, key: str | None, collect: bool = False) -> bool:
    """Log one warning when binding beyond loopback with no key (``--insecure``);
    True when it warned."""
    if key or is_loopback(host):
        return False
    logger.warning(
        "kvlens proxy: listening on %s with no token (--insecure): anyone who can reach this host can "
        "send requests through the router and read /metrics%s",
        host,
        ", and write spans into its trace store (--collect)" if collect else "",
    )
    return True


def run(args: argparse.Namespace) -> int:
    """Serve the router until interrupted (uvicorn). 2 on a bad flag mix."""
    # start-up cost: uvicorn, fastapi and httpx load only when the router
    # really runs, not for ``kvlens --help`` (which imports this module)
    import uvicorn

    from kvlens.proxy.app import create_app

    try:
        sec = security(args, api_key(args))
        cfg = config(args, sec.token)
        check(cfg)
    except ValueError as e:  # auth.SecurityError included
        print(f"kvlens proxy: error: {e}", file=sys.stderr, flush=True)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    warn_if_open(args.host, cfg.client_key, cfg.collect)
    app = create_app(cfg)
    logger.info(
        "kvlens proxy %s/%s on %s://%s:%d (%s) -> P %s, D %s (round robin)",
        cfg.mode,
        cfg.dispatch,
        sec.scheme,
        args.host,
        args.port,
        "token required" if cfg.token else "API key required" if cfg.api_key else "no token",
        ", ".join(f"{p.engine_id}={p.url}" for p in cfg.prefills),
        ", ".join(f"{d.engine_id}={d.url}" for d in cfg.decodes),
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        **auth.uvicorn_ssl_kwargs(sec),
    )
    return 0
