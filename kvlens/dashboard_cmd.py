"""``kvlens dashboard``: run the Streamlit app (``dashboard/app.py``, served
through ``dashboard/serve.py``) as a child process bound to 127.0.0.1 unless
``--host`` says otherwise, print its URL, forward SIGINT/SIGTERM to it and
exit with it.

Token and TLS (:mod:`frontdoor.flags`): a token from ``$KVLENS_TOKEN`` or
``--token-file`` makes every request need it (:class:`dashboard.gate.TokenGate`,
ASGI middleware on Streamlit's own server: a login form or ``?token=`` once
sets a session cookie; see that module for why the check is there and not
in the page). The token reaches the child in its environment, never on its
command line (``ps`` shows every process's to every user); the child takes
it out of its environment once read. ``--tls-cert/--tls-key`` become
Streamlit's ``server.sslCertFile``/``server.sslKeyFile`` (file paths, not
secrets). A host other than loopback without a token is refused (exit 2)
unless ``--insecure``.

Streamlit's own safety settings are passed as its command-line flags, which
win over every config file: ``server.address`` (127.0.0.1 by default),
``client.showErrorDetails`` (``none`` unless ``--show-error-details``: an
exception on a page does not show its traceback and source to whoever opens
the URL), the toolbar a viewer needs (``client.toolbarMode = viewer``: no
Deploy button), headless, no usage statistics, CORS and XSRF protection on. The
same settings are in the repository's ``.streamlit/config.toml`` for a bare
``streamlit run dashboard/app.py``.

Streamlit reads ``.streamlit/config.toml`` from its working directory, so the
child does not run in the caller's: it runs in the directory above the
``dashboard`` package (:func:`workdir`, the repository root of a checkout),
with ``KVLENS_HOME`` made absolute, and the store passed as an absolute path:
the same dashboard from wherever it is started. The app imports
``dashboard``/``exporters``/``kvtrace``/``kvrecord`` from the installed
package (``make setup`` installs the checkout in editable mode), so no
``PYTHONPATH`` is set.

The child runs in a process group of its own in the caller's session (a
:class:`kvrecord.children.ChildProcess`: a session of its own would leave
it a few % of the CPU next to a stack's spinning NIXL threads) so that
stopping it also stops anything Streamlit starts; a child that ignores
SIGTERM is killed after a grace period. A missing trace store is not an error: the page says so.

The store may be a PostgreSQL URL (``--store postgresql://user@host/db``):
it is checked once before the child starts, and a malformed URL or a server
that cannot be used (down, wrong user, no such database) is one line and
exit 2, not a page of errors. A password in the URL goes to the child as
``PGPASSWORD`` (libpq reads it), not on its command line, where ``ps``
would show it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import dashboard
from frontdoor import flags
from frontdoor.credentials import ROLE_ENV, Security, SecurityError
from kvlens import exits
from kvrecord.children import ChildProcess
from kvrecord.config import HOME_ENV, TOKEN_ENV, default_store, home
from kvrecord.location import StoreLocation

DEFAULT_PORT = 8501
DEFAULT_HOST = "127.0.0.1"
STOP_GRACE_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        help="trace store: a file, or postgresql://user@host:port/dbname (default: $KVLENS_HOME/traces.db)",
    )
    p.add_argument(
        "--prometheus",
        default=None,
        metavar="URL",
        help="Prometheus base URL (e.g. http://127.0.0.1:9090); live figures come from it",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}); any other needs a token (${TOKEN_ENV} or "
        "--token-file) or --insecure",
    )
    p.add_argument(
        "--show-error-details",
        action="store_true",
        help="show exceptions with their traceback in the page (default: a short message only)",
    )
    flags.add_arguments(p, roles=("read",))
    p.epilog = (
        f"The dashboard's one role is read: with a read token (--read-token-file or ${ROLE_ENV['read']}) "
        f"it takes that token, else the all-roles one (${TOKEN_ENV} or --token-file). "
        f"With a token every page needs it: a browser signs in once, "
        "with the form the dashboard shows or by opening any URL with ?token=TOKEN (the dashboard moves it "
        "into a session cookie and strips it from the URL), and scripts send Authorization: Bearer TOKEN. "
        "TLS (--tls-cert/--tls-key) is Streamlit's own (server.sslCertFile/sslKeyFile)."
    )


def app_path() -> Path:
    """The Streamlit script ``kvlens dashboard`` runs: ``dashboard/serve.py`` of
    the installed package (``dashboard/app.py`` behind the token gate)."""
    return Path(dashboard.__file__).resolve().parent / "serve.py"


def workdir() -> Path:
    """Where the Streamlit child runs: the directory above the ``dashboard``
    package (a checkout's root, with its ``.streamlit/config.toml``), never
    the caller's working directory and whatever ``.streamlit/`` it has."""
    return app_path().parent.parent


def gate_token(security: Security) -> bytes | None:
    """The one token the dashboard's gate checks: the read token when one is
    set (the dashboard only reads), else the all-roles token. The gate keeps
    one token (its session cookie is derived from it), so with both set the
    all-roles token does not open the dashboard: give it the read token."""
    return security.read_token or security.token


def child_env(store: StoreLocation | None = None, security: Security | None = None) -> dict[str, str]:
    """The child's environment: ours, with ``KVLENS_HOME`` absolute (the
    child's working directory is not ours), a store URL's password as
    ``PGPASSWORD``, and ``security``'s token (:func:`gate_token`) as
    ``$KVLENS_TOKEN`` (none inherited otherwise: the gate's token is the one
    checked here)."""
    env = {**os.environ, HOME_ENV: str(home())}
    env.pop(TOKEN_ENV, None)
    env.pop(ROLE_ENV["read"], None)
    token = gate_token(security) if security is not None else None
    if token:
        env[TOKEN_ENV] = token.decode()
    if store is not None:
        env.update(store.password_env())
    return env


def _check_store(store: StoreLocation) -> tuple[str, int] | None:
    """Why the dashboard cannot read a PostgreSQL store at all, with its exit
    code (:func:`kvlens.exits.store_code`), or None (a file that does not
    exist yet, or a database without kvlens tables, is not an error: the
    page says so)."""
    from kvtrace import store as st

    if not store.is_postgres:
        if not store.path.exists():
            print(f"kvlens dashboard: no trace store at {store} yet (the page will say so)", file=sys.stderr)
        return None
    try:
        with st.reading(store) as c:
            st.info(c)
    except st.StoreMissing as e:
        if "no kvlens tables" in str(e):
            print(f"kvlens dashboard: {e} (the page will say so)", file=sys.stderr)
            return None
        return str(e), exits.store_code(e)
    except st.StoreError as e:
        return str(e), exits.store_code(e)
    return None


def command(args: argparse.Namespace, store: StoreLocation | str | os.PathLike) -> list[str]:
    """The streamlit command line for ``args`` (``store``: a path or URL is parsed)."""
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app_path()),
        "--server.port",
        str(args.port),
        "--server.address",
        args.host,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.enableCORS",
        "true",
        "--server.enableXsrfProtection",
        "true",
        # getattr: callers that build the Namespace themselves (kvlens demo) may leave the flag out
        "--client.showErrorDetails",
        "full" if getattr(args, "show_error_details", False) else "none",
        # a viewer's toolbar: no Deploy button, no rerun / clear-cache developer entries
        "--client.toolbarMode",
        "viewer",
    ]
    if getattr(args, "tls_cert", None):  # paths, not secrets (flags.from_args checked them)
        cmd += ["--server.sslCertFile", str(Path(args.tls_cert).resolve())]
        cmd += ["--server.sslKeyFile", str(Path(args.tls_key).resolve())]
    cmd += ["--", "--store", StoreLocation.parse(store).without_password().text]
    if args.prometheus:
        cmd += ["--prometheus", args.prometheus]
    return cmd


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        print(f"kvlens dashboard: invalid port {args.port}", file=sys.stderr)
        return 2
    if args.prometheus and not args.prometheus.startswith(("http://", "https://")):
        print(f"kvlens dashboard: --prometheus must be an http(s) URL, got {args.prometheus!r}", file=sys.stderr)
        return 2
    try:
        store = StoreLocation.parse(args.store) if args.store else default_store()
    except ValueError as e:
        print(f"kvlens dashboard: --store: {e}", file=sys.stderr)
        return 2
    try:
        security = flags.from_args(args, args.host)
    except SecurityError as e:
        print(f"kvlens dashboard: {e}", file=sys.stderr)
        return 2
    problem = _check_store(store)
    if problem:
        print(f"kvlens dashboard: {problem[0]}", file=sys.stderr)
        return problem[1]
    env = child_env(store, security)
    # death_signal: a kvlens dashboard killed outright (SIGKILL) takes Streamlit with it
    child = ChildProcess(
        command(args, store), env=env, cwd=workdir(), group="group", death_signal=signal.SIGTERM
    ).start()
    shown = "localhost" if args.host in ("127.0.0.1", "0.0.0.0", "::") else args.host
    how = "; sign in with the token, or open the URL with ?token=TOKEN once" if security.token else ""
    print(
        f"kvlens dashboard: {security.scheme}://{shown}:{args.port}  ({security.describe()}{how}; store {store}; "
        "Ctrl-C to stop)",
        flush=True,
    )

    stopping: list[int] = []

    def forward(signum, _frame):
        stopping.append(signum)
        child.send(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = None
        while rc is None and not stopping:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = child.wait(0.5)
        if stopping:  # asked already (forward): SIGKILL after the grace
            child.stop(STOP_GRACE_S, first=None)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        # Anything left in the child's group (it should be empty by now).
        child.stop(0, first=None)
    if stopping:
        return 0
    return rc
