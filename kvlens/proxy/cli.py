"""``kvlens proxy`` command line: flags and ``run`` (uvicorn, blocking)."""

from __future__ import annotations

import argparse
import logging

from kvlens.proxy.config import ProxyConfig

logger = logging.getLogger("kvlens.proxy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="D's base URL")
    p.add_argument("--mode", choices=["push", "pull"], required=True)
    p.add_argument("--dispatch", choices=["overlapped", "sequential"], default="overlapped",
                   help="push: send D's request at once (overlapped) or after P answers")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill-engine-id", default="p0", help="P's kv_transfer_config.engine_id (overlapped push)")
    p.add_argument("--prefill-side-host", default="127.0.0.1", help="P's NIXL side-channel host (overlapped push)")
    p.add_argument("--prefill-side-port", type=int, default=None,
                   help="P's VLLM_NIXL_SIDE_CHANNEL_PORT (required for overlapped push)")
    p.add_argument("--prefill-tp-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="read timeout towards P and D, seconds")
    p.add_argument("--no-telemetry", action="store_true", help="serve without recording spans")


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
    cfg = ProxyConfig(
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
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(cfg)
    logger.info("kvlens proxy %s/%s on %s:%d -> P %s, D %s", cfg.mode, cfg.dispatch,
                args.host, args.port, cfg.prefill_url, cfg.decode_url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
    return 0
