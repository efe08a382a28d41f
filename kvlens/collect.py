"""``kvlens collect``: an OTLP/HTTP and OTLP/gRPC trace receiver that writes the kvlens
trace store, for P, D and the router on different hosts (each host's own
``traces.db`` only sees its own processes; one collector sees them all).

Serves ``POST /v1/traces`` (protobuf or JSON, gzip), ``GET /metrics`` (its
own counters plus the phase and handoff histograms of the spans it stores,
with trace-id exemplars) and ``GET /healthz`` with uvicorn on a socket bound
here first, so a busy port is one clear line; ``TraceService/Export`` on the
gRPC port (:mod:`collector.grpc_receiver`, its own bounded thread
pool). Token and TLS: :mod:`frontdoor` (its flags, its bearer check, its
TLS), checked before anything binds.
SIGTERM / SIGINT: uvicorn stops taking requests, the lifespan hook stops the
gRPC server (in-flight calls get :data:`GRPC_GRACE_S`), flushes the queue
into the store (``Ingest.close``, bounded) and the command exits 0.
"""

from __future__ import annotations

import argparse
import socket
import sqlite3
import sys

from frontdoor import flags, samesite
from frontdoor.credentials import Security, SecurityError
from kvlens import exits
from kvrecord.argtypes import add_keep_arguments, keep_rule
from kvrecord.config import default_store
from kvrecord.location import StoreLocation

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4318
DEFAULT_GRPC_PORT = 4317
CLOSE_TIMEOUT_S = 10.0
#: Seconds in-flight gRPC calls get to finish on shutdown (new ones are refused at once).
GRPC_GRACE_S = 5.0

DESCRIPTION = """\
Receive OpenTelemetry spans over OTLP/HTTP (port 4318) and OTLP/gRPC (port 4317)
and write them into one kvlens trace store, so traces whose router, P and D run
on different hosts are whole in one place (kvlens traces, the dashboard and the
handoff metrics read that store). Both protocols go through the same decoding,
limits, write queue and counters.

The store is a file (default $KVLENS_HOME/traces.db) or a PostgreSQL database
(--store postgresql://user@host:port/dbname) that several collectors, kvlens
traces and the dashboard share. --retention 7d prunes older traces as it writes.

Point every process at it:
  P and D   "otlp_endpoint": "http://HOST:4318" in kv_connector_extra_config
            (add "kvlens_store": "off" to send spans only here; "otlp_protocol":
            "grpc" with "http://HOST:4317" for gRPC)
  router    OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:4318 kvlens proxy ...
  OTel Collector (several kvlens collectors): its loadbalancing exporter
            speaks OTLP/gRPC to HOST:4317, no relay needed

Security: listening beyond loopback (--host 0.0.0.0) needs a bearer token, or
--insecure said out loud. The token comes from $KVLENS_TOKEN or --token-file
(never a flag value: ps shows argv); clients send "Authorization: Bearer TOKEN"
(gRPC: metadata authorization). Tokens by role: exporters need the ingest token
(--ingest-token-file, $KVLENS_INGEST_TOKEN), /metrics and /healthz's details the
read token (--read-token-file, $KVLENS_READ_TOKEN); $KVLENS_TOKEN opens both.
kvlens' own exporters (P, D, router) send $KVLENS_INGEST_TOKEN, else
$KVLENS_TOKEN, to a kvlens collector (https, or http on loopback; see
docs/security.md); other OTLP exporters take
OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20TOKEN". /healthz needs no
token and then says only {"status": "ok"}; /metrics needs the read token
(Prometheus: authorization.credentials_file). Tokens under 16 characters are
refused; a client refused 20 times in a minute gets 429 until the minute ends.
POST bodies must be OTLP's application/x-protobuf or application/json, and the
Host a loopback name, the bind address or an --allowed-host. --tls-cert
and --tls-key serve both protocols over TLS (clients trust the CA with
OTEL_EXPORTER_OTLP_CERTIFICATE); --tls-client-ca also requires client
certificates. A refused request writes nothing and is counted
(kvlens_collector_requests_rejected_total{reason="unauthenticated"}).

Bounds: a request over --max-body-mb is refused (HTTP 413; gRPC
RESOURCE_EXHAUSTED from gRPC itself as sent, INVALID_ARGUMENT once
inflated); when more than --queue-spans spans wait for the store,
requests get 429 with Retry-After (gRPC RESOURCE_EXHAUSTED with RetryInfo) and
OTLP exporters retry them. Counters on /metrics count every rejected request
and every dropped span. See docs/security.md and docs/fleet.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}; 0.0.0.0 for other hosts: needs a token or --insecure)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}, OTLP/HTTP's; 0 picks a free one and prints it)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=DEFAULT_GRPC_PORT,
        help=f"OTLP/gRPC port on the same --host (default {DEFAULT_GRPC_PORT}; 0 picks a free one and prints it)",
    )
    p.add_argument("--no-grpc", action="store_true", help="do not receive OTLP/gRPC (OTLP/HTTP only)")
    p.add_argument(
        "--store",
        default=None,
        help="trace store to write: a file, or postgresql://user@host:port/dbname (default: $KVLENS_HOME/traces.db)",
    )
    p.add_argument(
        "--retention",
        default=None,
        metavar="DURATION",
        help="keep traces this long (e.g. 7d, 12h); older ones are deleted in small batches "
        "as spans are written (default: keep all)",
    )
    add_keep_arguments(p)
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body accepted, MiB, after decompression (default 16)",
    )
    p.add_argument(
        "--queue-spans",
        type=int,
        default=100_000,
        help="spans waiting for the store before requests get 429 (default 100000)",
    )
    p.add_argument(
        "--busy-status",
        type=int,
        choices=(429, 503),
        default=429,
        help="answer when the queue is full (default 429; 503 for exporters that retry only 5xx, "
        "e.g. older opentelemetry-python OTLP/HTTP exporters; gRPC: RESOURCE_EXHAUSTED or UNAVAILABLE)",
    )
    flags.add_arguments(p, client_certs=True, roles=COLLECTOR_ROLES)
    samesite.add_arguments(p)


#: The collector's roles: exporters send the ingest token, readers of /metrics and health details the read token.
COLLECTOR_ROLES = ("ingest", "read")


def _role_of(scope: dict) -> str:
    """``POST /v1/traces``: ingest; everything else (``/metrics``): read."""
    from collector.app import TRACES_PATH

    return "ingest" if scope.get("path") == TRACES_PATH else "read"


def _store_problem(path: StoreLocation) -> tuple[str, int] | None:
    """One line saying why ``path`` (a file or a PostgreSQL URL) cannot be
    written as a trace store, with its exit code (:mod:`kvlens.exits`: 1 for
    a server that cannot be reached now or a store another writer holds
    locked, 2 for the rest), or None."""
    from kvtrace import store
    from collector.ingest import check_store
    from kvtrace.store.schema import translate

    if not path.is_postgres and path.path.is_dir():
        return f"--store {path} is a directory; give the store file (e.g. {path.path / 'traces.db'})", exits.USAGE
    try:
        check_store(path)
    except store.StoreError as e:
        return str(e), exits.store_code(e)
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            return str(translate(e, path)), exits.FAILED
        return f"cannot write the trace store {path}: {e}", exits.USAGE
    except sqlite3.Error as e:
        return str(translate(e, path)), exits.USAGE
    except OSError as e:
        return f"cannot create the trace store {path}: {e.strerror or e}", exits.USAGE
    return None


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _check_args(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port < 65536:
        return f"invalid port {args.port}"
    if not args.no_grpc and not 0 <= args.grpc_port < 65536:
        return f"invalid --grpc-port {args.grpc_port}"
    if not args.no_grpc and args.port and args.port == args.grpc_port:
        return f"--port and --grpc-port are both {args.port}; give them different ports (or --no-grpc)"
    if not args.max_body_mb > 0:
        return f"--max-body-mb must be > 0, got {args.max_body_mb}"
    if args.queue_spans <= 0:
        return f"--queue-spans must be > 0, got {args.queue_spans}"
    try:
        keep_rule(args)
    except ValueError as e:
        return str(e)
    if getattr(args, "retention", None):
        from kvrecord.durations import parse_duration

        try:
            parse_duration(args.retention)
        except ValueError as e:
            return f"--retention: {e}"
    return None


def _store_arg(args: argparse.Namespace) -> tuple[StoreLocation | None, str | None]:
    """(the store, None), or (None, why --store is unusable)."""
    if not args.store:
        return default_store(), None
    try:
        return StoreLocation.parse(args.store), None
    except ValueError as e:
        return None, f"--store: {e}"


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then flush and exit 0; 2 on a bad flag or
    store, 1 when the port cannot be had."""
    problem = _check_args(args)
    security = None
    if not problem:
        try:
            security = flags.from_args(args, args.host, warn=_warn)
        except SecurityError as e:
            problem = str(e)
    store, bad = (None, None) if problem else _store_arg(args)
    problem, code = problem or bad, exits.USAGE
    if not problem:
        problem, code = _store_problem(store) or (None, exits.OK)
    if problem:
        print(f"kvlens collect: {problem}", file=sys.stderr, flush=True)
        return code
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        print(
            f"kvlens collect: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr, flush=True
        )
        return 1
    if not args.no_grpc and args.grpc_port:
        try:  # a busy gRPC port is one clear line too (gRPC's own message is a log line)
            _listen(args.host, args.grpc_port).close()
        except OSError as e:
            sock.close()
            print(
                f"kvlens collect: cannot listen on {args.host}:{args.grpc_port} (OTLP/gRPC; --grpc-port, or --no-grpc): "
                f"{e.strerror or e}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    return _serve(args, store, sock, security)


def _warn(line: str) -> None:
    print(f"kvlens collect: {line}", file=sys.stderr, flush=True)


#: The collector's garbage collector: a young generation of 50,000 objects,
#: not 700. Every span allocates a few dozen containers (rows, dicts,
#: tuples) and the held ones survive for seconds, so at 700 the cyclic
#: collector ran every ~30 spans and kept re-scanning what the keep decision
#: still holds: a fifth of the writer thread's CPU (benchmarks/bench_collector.py).
#: Nothing the collector keeps forms reference cycles; this only makes the
#: passes rarer (memory: a few MB of young objects at most).
GC_THRESHOLDS = (50_000, 20, 20)


def _tune_gc() -> None:
    """Freeze what start-up allocated (modules, the app: never garbage, never
    scanned again) and set :data:`GC_THRESHOLDS`. This process only: the
    collector's, never vLLM's."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _start_grpc(args: argparse.Namespace, ingest, security: Security, max_body_bytes: int):
    """The OTLP/gRPC server, started, and its port; (None, None) with
    --no-grpc. RuntimeError when its port cannot be bound."""
    if args.no_grpc:
        return None, None
    from collector.grpc_receiver import add_port, grpc_server
    from frontdoor.serving import grpc_credentials

    server = grpc_server(ingest, security, max_body_bytes=max_body_bytes, busy_status=args.busy_status)
    port = add_port(server, args.host, args.grpc_port, grpc_credentials(security))
    server.start()
    return server, port


def _http_app(args, ingest, registry, security: Security, max_body: int, before_close):
    """The collector's ASGI app behind the bearer check
    (:class:`frontdoor.bearer.BearerAuth`, which passes everything when no
    token is set; a refused export is counted ``unauthenticated``, a refused
    scrape is not an export), behind the same-site guard."""
    from collector.app import TRACES_PATH, create_app
    from frontdoor.bearer import BearerAuth

    app = create_app(
        ingest,
        registry,
        max_body_bytes=max_body,
        close_timeout_s=CLOSE_TIMEOUT_S,
        busy_status=args.busy_status,
        before_close=before_close,
    )

    def refused(scope: dict) -> None:
        if scope.get("path") == TRACES_PATH:
            ingest.reject("unauthenticated")

    checked = BearerAuth(app, security, on_reject=refused, role_of=_role_of)
    # no cross-site POST, no DNS rebinding (frontdoor.samesite), outside the token check
    return samesite.SameSiteGuard(
        checked,
        bind_host=args.host,
        allowed_hosts=getattr(args, "allowed_host", None) or (),
        post_types={TRACES_PATH: samesite.OTLP_TYPES},
    )


def _announce(sock: socket.socket, grpc_port: int | None, store, security: Security, rule) -> None:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    scheme = security.scheme
    print(f"kvlens collect: receiving OTLP/HTTP on {scheme}://{shown}:{port}/v1/traces, writing {store}", flush=True)
    if grpc_port is not None:
        print(f"kvlens collect: receiving OTLP/gRPC on {scheme}://{shown}:{grpc_port}", flush=True)
    print(f"kvlens collect: {security.describe()}; {rule.describe()}", flush=True)


def _serve(args: argparse.Namespace, store: StoreLocation, sock: socket.socket, security: Security) -> int:
    # start-up cost: uvicorn, starlette, protobuf and grpc load only when it serves
    import uvicorn
    from prometheus_client import CollectorRegistry

    from collector.ingest import collector_ingest
    from frontdoor import serving
    from kvlens.signals import sigterm_as_interrupt

    registry = CollectorRegistry()
    rule = keep_rule(args)
    ingest = collector_ingest(
        store, registry, max_queue_spans=args.queue_spans, retention=getattr(args, "retention", None), keep=rule
    )
    max_body = int(args.max_body_mb * 1024 * 1024)
    try:
        grpc_server, grpc_port = _start_grpc(args, ingest, security, max_body)
    except RuntimeError as e:
        ingest.close(CLOSE_TIMEOUT_S)
        sock.close()
        print(
            f"kvlens collect: cannot serve OTLP/gRPC on {args.host}:{args.grpc_port}: {e}", file=sys.stderr, flush=True
        )
        return 1

    def stop_grpc() -> None:  # before the queue is flushed: no call may find it closed
        if grpc_server is not None:
            grpc_server.stop(GRPC_GRACE_S).wait(GRPC_GRACE_S + 1)

    app = _http_app(args, ingest, registry, security, max_body, stop_grpc)
    # TLS 1.2+ with kvlens' ciphers, and a cap on concurrent connections (frontdoor/serving.py)
    config = serving.config(
        app, security, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    _tune_gc()
    _announce(sock, grpc_port, store, security, rule)
    try:
        with sigterm_as_interrupt():
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on
                pass
    finally:
        stop_grpc()  # returns at once after the lifespan hook stopped it
        ingest.close(CLOSE_TIMEOUT_S)  # no-op after the lifespan hook closed it
        sock.close()
    c = ingest.counts()
    unkept = ingest.keeper.counts["unkept"]
    more = f", {unkept} not kept (summaries only)" if rule.sampled else ""
    print(f"kvlens collect: stopped; {c['written']} spans written, {c['dropped']} dropped{more}", flush=True)
    return 0
