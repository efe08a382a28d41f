"""``kvlens proxy`` command line: flags and ``run`` (uvicorn, blocking).

Several P and D: ``--prefill`` and ``--decode`` repeat; the per-P flags
(``--prefill-engine-id``, ``--prefill-side-port``, ...) repeat too and pair
with ``--prefill`` by position (:func:`instances`).

A mixed fleet (a canary): each URL tagged with its mode, ``--prefill
push=URL --prefill pull=URL --decode push=URL --decode pull=URL``, and
``--split push=W`` (default 0.5): each request's mode is drawn with that
push weight. An untagged URL takes ``--mode`` (the one-mode syntax).

Who may use the router (:func:`security`): a token from ``$KVLENS_TOKEN``
or ``--token-file`` (:mod:`frontdoor.flags`), the role tokens (``--ingest-``,
``--read-``, ``--admin-token-file`` or their variables) and the API key P
and D require (``--api-key-file``, ``$KVLENS_API_KEY``, ``$VLLM_API_KEY``;
``--api-key`` with a warning), each route taking its role's
(:func:`~proxy.intake.client_auth`). A host other than loopback with
neither a token nor an API key is refused (exit 2) unless ``--insecure``.
``--allowed-host``: names clients use besides loopback ones
(:mod:`frontdoor.samesite`). ``--tls-cert/--tls-key``: uvicorn serves HTTPS
(:mod:`frontdoor.serving`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import urllib.parse

from frontdoor import flags, samesite
from frontdoor.credentials import ROLES, Security, SecurityError, is_loopback
from frontdoor.flags import API_KEY_ENV, add_api_key_arguments, api_key_arg, env_api_key
from kvrecord.argtypes import add_keep_arguments, keep_rule, port_arg, positive
from proxy.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_SPLIT, MODES, Decode, Prefill, ProxyConfig
from proxy.split import parse_split
from kvrecord.config import TOKEN_ENV

logger = logging.getLogger("kvlens.proxy")

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


def tagged_url(text: str) -> tuple[str | None, str]:
    """argparse ``type=``: ``[push=|pull=]URL`` as (mode or None, base URL)."""
    head, sep, rest = text.strip().partition("=")
    if sep and head.strip().lower() in MODES:
        return head.strip().lower(), base_url(rest)
    if sep and "://" not in head:
        raise argparse.ArgumentTypeError(f"a URL's mode must be push= or pull=, got {head!r} in {text!r}")
    return None, base_url(text)


def split_arg(text: str) -> float:
    """argparse ``type=`` of ``--split``: the push weight."""
    try:
        return parse_split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        type=tagged_url,
        metavar="[MODE=]URL",
        help="a P's base URL, e.g. http://127.0.0.1:8100; repeat for several P (round robin); "
        "push=URL / pull=URL tags its mode (a mixed fleet: both modes behind one router)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        type=tagged_url,
        metavar="[MODE=]URL",
        help="a D's base URL; repeat for several D (round robin within its mode, independent of P's); "
        "push=URL / pull=URL tags its mode",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="the mode of every untagged --prefill / --decode (required unless every URL is tagged)",
    )
    p.add_argument(
        "--split",
        type=split_arg,
        default=None,
        metavar="push=W",
        help=f"a mixed fleet: draw each request's mode at random, push with weight W (pull=W: pull's "
        f"weight; default push={DEFAULT_SPLIT}); the root span records the mode and the weight "
        '(kvlens.split). Live: POST /admin/split {"push": W}',
    )
    p.add_argument(
        "--split-seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the split's draws (a reproducible sequence, for tests; default random)",
    )
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
        help=f"bind address (default loopback; any other needs a token (${TOKEN_ENV} or --token-file), "
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
    add_api_key_arguments(
        p,
        "the API key P and D require (vLLM's --api-key): sent to them; also what clients must send on "
        "/v1/* and may send on /metrics (never /admin/* or /v1/traces)",
    )
    p.add_argument("--no-telemetry", action="store_true", help="serve without recording spans")
    p.add_argument(
        "--collect",
        action="store_true",
        help="also receive OTLP/HTTP spans at POST /v1/traces (as `kvlens collect` does) into the "
        "router's trace store, so P and D on other hosts can send theirs here (their "
        "otlp_endpoint: http://ROUTER/v1/traces) and the router's handoff metric sees both ends; "
        f"with a token they must send it (${TOKEN_ENV} in their environment)",
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
    flags.add_arguments(p, roles=ROLES)
    samesite.add_arguments(p)
    p.epilog = (
        f"Credentials by role: /v1/* takes the token (${TOKEN_ENV} or --token-file) or the API key; "
        "/metrics and /health's details the read token, the token or the API key (Prometheus: "
        "authorization: {credentials_file: PATH} in the scrape job); POST /admin/split the admin token or "
        "the token; with --collect, POST /v1/traces the ingest token or the token (never the API key). "
        "/health without one says only ok. No token is ever sent to P or D. POST bodies must be "
        "application/json (OTLP's application/x-protobuf on /v1/traces), and the Host a loopback name, "
        "the bind address or an --allowed-host."
    )


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key-file``, else ``--api-key`` (one warning), else the first of
    :data:`API_KEY_ENV` that is set, else None; read once per ``args``.
    ValueError on a bad file (:func:`frontdoor.flags.api_key_arg`)."""
    if not hasattr(args, "_api_key"):
        key = api_key_arg(args, lambda line: print(f"kvlens proxy: {line}", file=sys.stderr, flush=True))
        args._api_key = key or env_api_key()
    return args._api_key


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
    urls_p, urls_d = [_url(x) for x in args.prefill], [_url(x) for x in args.decode]
    modes_p, modes_d = [_mode(x, args) for x in args.prefill], [_mode(x, args) for x in args.decode]
    n = len(urls_p)
    of = "--prefill"
    ids_p = _per_instance(args.prefill_engine_id, n, "--prefill-engine-id", of, lambda i: f"p{i}")
    hosts = _per_instance(args.prefill_side_host, n, "--prefill-side-host", of, lambda i: "127.0.0.1", True)
    ports = _per_instance(args.prefill_side_port, n, "--prefill-side-port", of, lambda i: None)
    tps = _per_instance(args.prefill_tp_size, n, "--prefill-tp-size", of, lambda i: 1, True)
    ids_d = _per_instance(
        getattr(args, "decode_engine_id", None), len(urls_d), "--decode-engine-id", "--decode", lambda i: f"d{i}"
    )
    return (
        [Prefill(*x) for x in zip(urls_p, ids_p, hosts, ports, tps, modes_p)],
        [Decode(*x) for x in zip(urls_d, ids_d, modes_d)],
    )


def _url(x: tuple[str | None, str] | str) -> str:
    return x[1] if isinstance(x, tuple) else x


def _mode(x: tuple[str | None, str] | str, args: argparse.Namespace) -> str:
    """A URL's mode: its tag, else ``--mode`` (ValueError when neither)."""
    tag = x[0] if isinstance(x, tuple) else None
    mode = tag or getattr(args, "mode", None)
    if mode is None:
        raise ValueError(
            f"{_url(x)} has no mode: tag it (push={_url(x)} or pull={_url(x)}) or give --mode for untagged URLs"
        )
    return mode


def _router_mode(args: argparse.Namespace, prefills: list[Prefill]) -> str:
    """The router's own mode: ``--mode``, else its first P's."""
    return getattr(args, "mode", None) or prefills[0].mode


def security(args: argparse.Namespace, key: str | None) -> Security:
    """TLS and the token for binding ``args.host`` (:func:`frontdoor.flags.from_args`);
    the API key ``key`` counts as the clients' credential when no token is
    set (it is what an OpenAI client sends). SecurityError naming the
    problem: a host beyond loopback with neither and no ``--insecure``."""
    sec = flags.from_args(args, "127.0.0.1")  # files and token checked; the bind check below knows the API key
    if sec.token is None and not key and not sec.insecure and not is_loopback(args.host):  # the API is open
        raise SecurityError(
            f"refusing to listen on {args.host} (beyond loopback) with no token and no API key: set "
            f"${TOKEN_ENV} or --token-file (or ${API_KEY_ENV[0]}), or pass --insecure to let anyone "
            "who reaches it in"
        )
    return sec


def _role_tokens(sec: Security | None) -> dict[str, str | None]:
    def s(t: bytes | None) -> str | None:
        return t.decode() if t else None

    if sec is None:
        return {}
    return {"ingest_token": s(sec.ingest_token), "read_token": s(sec.read_token), "admin_token": s(sec.admin_token)}


def config(args: argparse.Namespace, token: bytes | None = None, sec: Security | None = None) -> ProxyConfig:
    """The router's settings from its flags (ValueError on a bad mix);
    ``token``: the clients' bearer token, ``sec``: the role tokens too (:func:`security`)."""
    prefills, decodes = instances(args)
    split = getattr(args, "split", None)
    cfg = ProxyConfig.of(
        prefills,
        decodes,
        mode=_router_mode(args, prefills),
        split=DEFAULT_SPLIT if split is None else split,
        split_seed=getattr(args, "split_seed", None),
        dispatch=args.dispatch,
        read_timeout_s=args.timeout,
        telemetry=not args.no_telemetry,
        api_key=api_key(args),
        token=token.decode() if token else None,
        **_role_tokens(sec),
        bind_host=getattr(args, "host", "127.0.0.1"),
        allowed_hosts=tuple(getattr(args, "allowed_host", None) or ()),
        max_body_bytes=max(1, int(args.max_body_mb * MIB)),
        collect=args.collect,
        store=getattr(args, "store", None),
        retention=getattr(args, "retention", None),
        keep=keep_rule(args).to_config(),
    )
    if split is not None and not cfg.mixed:
        raise ValueError(
            f"--split needs instances of both modes; every instance here is {cfg.modes[0]} "
            "(tag the other mode's URLs: --prefill push=URL --decode push=URL, or pull=)"
        )
    return cfg


def check(cfg: ProxyConfig) -> None:
    """What the flags can only be checked for together (ValueError):
    overlapped push needs every P's side-channel port."""
    if cfg.overlapped_push and any(p.side_port is None for p in cfg.prefills if p.mode == "push"):
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
    from frontdoor import serving
    from proxy.app import create_app

    try:
        sec = security(args, api_key(args))
        cfg = config(args, sec.token, sec)
        check(cfg)
    except ValueError as e:  # SecurityError included
        print(f"kvlens proxy: error: {e}", file=sys.stderr, flush=True)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    warn_if_open(args.host, cfg.client_key, cfg.collect)
    app = create_app(cfg)
    logger.info(
        "kvlens proxy %s/%s on %s://%s:%d (%s) -> P %s, D %s (round robin%s)",
        ",".join(cfg.modes),
        cfg.dispatch,
        sec.scheme,
        args.host,
        args.port,
        "token required" if cfg.token else "API key required" if cfg.api_key else "no token",
        ", ".join(f"{p.engine_id}={p.mode}:{p.url}" for p in cfg.prefills),
        ", ".join(f"{d.engine_id}={d.mode}:{d.url}" for d in cfg.decodes),
        f" within each mode; split push={cfg.split:g}" if cfg.mixed else "",
    )
    # TLS 1.2+ with kvlens' ciphers, and a cap on concurrent connections (frontdoor/serving.py)
    return serving.serve(
        serving.config(
            app, sec, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
    )
