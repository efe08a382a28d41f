"""``kvlens proxy`` command line: flags and ``run`` (uvicorn, blocking)."""

from __future__ import annotations

import argparse
import logging
import os

from kvlens.argtypes import positive
from kvlens.proxy.config import DEFAULT_MAX_BODY_BYTES, ProxyConfig
from kvlens.stack.ports import is_loopback, port_arg

logger = logging.getLogger("kvlens.proxy")

#: Environment variables the API key is read from when --api-key is not
#: given (the first set wins); VLLM_API_KEY is what vLLM itself reads.
API_KEY_ENV = ("KVLENS_API_KEY", "VLLM_API_KEY")
MIB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="D's base URL")
    p.add_argument("--mode", choices=["push", "pull"], required=True)
    p.add_argument("--dispatch", choices=["overlapped", "sequential"], default="overlapped",
                   help="push: send D's request at once (overlapped) or after P answers")
    p.add_argument("--port", type=port_arg(), default=8000)
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; any other needs --api-key, or it is open to all)")
    p.add_argument("--prefill-engine-id", default="p0", help="P's kv_transfer_config.engine_id (overlapped push)")
    p.add_argument("--prefill-side-host", default="127.0.0.1", help="P's NIXL side-channel host (overlapped push)")
    p.add_argument("--prefill-side-port", type=port_arg(), default=None,
                   help="P's VLLM_NIXL_SIDE_CHANNEL_PORT (required for overlapped push)")
    p.add_argument("--prefill-tp-size", type=positive(int), default=1)
    p.add_argument("--timeout", type=positive(float), default=600.0, help="read timeout towards P and D, seconds")
    p.add_argument("--max-body-mb", type=positive(float), default=DEFAULT_MAX_BODY_BYTES / MIB, metavar="MB",
                   help=f"largest request body accepted, MiB (default {DEFAULT_MAX_BODY_BYTES // MIB}); "
                        "larger ones get 413 without being read")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and send it to P and D "
                        f"(default: ${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]}, else none; "
                        "a flag shows in ps, the variables do not)")
    p.add_argument("--no-telemetry", action="store_true", help="serve without recording spans")
    p.add_argument("--collect", action="store_true",
                   help="also receive OTLP/HTTP spans at POST /v1/traces (as `kvlens collect` does) into the "
                        "router's trace store, so P and D on other hosts can send theirs here (their "
                        "otlp_endpoint: http://ROUTER/v1/traces) and the router's handoff metric sees both ends")
    p.add_argument("--store", default=None, metavar="URL",
                   help="write spans to this PostgreSQL store (postgresql://user@host:port/dbname) instead of "
                        "$KVLENS_HOME/traces.db: the router's own and, with --collect, those P and D send")
    p.add_argument("--retention", default=None, metavar="DURATION",
                   help="keep traces this long (e.g. 7d); older ones are deleted in small batches as spans "
                        "are written (default: keep all)")


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first of :data:`API_KEY_ENV` that is set, else None."""
    if args.api_key:
        return args.api_key
    return next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


def config(args: argparse.Namespace) -> ProxyConfig:
    """The router's settings from its flags (ValueError on a bad mix)."""
    return ProxyConfig(
        prefill_url=args.prefill,
        decode_url=args.decode,
        mode=args.mode,
        dispatch=args.dispatch,
        prefill_engine_id=args.prefill_engine_id,
        prefill_side_host=args.prefill_side_host,
        prefill_side_port=args.prefill_side_port,
        prefill_tp_size=args.prefill_tp_size,
        read_timeout_s=args.timeout,
        telemetry=not args.no_telemetry,
        api_key=api_key(args),
        max_body_bytes=max(1, int(args.max_body_mb * MIB)),
        collect=args.collect,
        store=getattr(args, "store", None),
        retention=getattr(args, "retention", None),
    )


def warn_if_open(host: str, key: str | None) -> bool:
    """Log one warning when binding beyond loopback without an API key;
    True when it warned."""
    if key or is_loopback(host):
        return False
    logger.warning("kvlens proxy: listening on %s without an API key: anyone who can reach this host can "
                   "send requests through the router (pass --api-key or set %s)", host, API_KEY_ENV[0])
    return True


def run(args: argparse.Namespace) -> int:
    """Serve the router until interrupted (uvicorn). 2 on a bad flag mix."""
    # start-up cost: uvicorn, fastapi and httpx load only when the router
    # really runs, not for ``kvlens --help`` (which imports this module)
    import uvicorn

    from kvlens.proxy.app import create_app

    if args.mode == "push" and args.dispatch == "overlapped" and not args.prefill_side_port:
        print("kvlens proxy: error: overlapped push needs --prefill-side-port "
              "(P's VLLM_NIXL_SIDE_CHANNEL_PORT)", flush=True)
        return 2
    try:
        cfg = config(args)
    except ValueError as e:
        print(f"kvlens proxy: error: {e}", flush=True)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    warn_if_open(args.host, cfg.api_key)
    app = create_app(cfg)
    logger.info("kvlens proxy %s/%s on %s:%d -> P %s, D %s", cfg.mode, cfg.dispatch,
                args.host, args.port, cfg.prefill_url, cfg.decode_url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
    return 0
