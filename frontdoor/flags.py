"""Where a server's credentials come from: its security flags, token files
and variables (:func:`add_arguments`, :func:`from_args`), and the API key P
and D require (:func:`add_api_key_arguments`, :func:`api_key_arg`).

A token comes from the environment (``$KVLENS_TOKEN``, ``$KVLENS_<ROLE>_TOKEN``)
or from a file (``--token-file``, ``--<role>-token-file``), never from a
flag value: ``ps`` shows every process's argv to every user of the host. A
server bound beyond loopback must have a token, or be told ``--insecure``
explicitly (:func:`from_args` refuses otherwise), so "listening on 0.0.0.0
for anyone" is never a default.

Decisions, and why:

* ``--token-file`` wins over ``$KVLENS_TOKEN`` when both are set. The
  variable is also what kvlens *clients* send
  (:func:`frontdoor.credentials.client_headers`: the router exporting its
  spans, a benchmark), so it may be present for the client side of a process
  that listens with its own token; an explicit flag names the intent.
  ``--help`` says so.
* A token file that others (group or world) can read is a warning, not a
  refusal: Kubernetes and Docker mount secrets 0644 by default, inside a
  directory only the pod reads, and refusing would break that common
  deployment. The warning names the file and the ``chmod`` that silences it.
* Leading and trailing whitespace of the token (a file's newline) is
  stripped; a token with whitespace or control characters inside is refused
  (it could not travel in an HTTP header or gRPC metadata), and so is one
  under :data:`MIN_TOKEN_CHARS` characters (guessable).
* The API key is vLLM's (what P and D require, what every OpenAI client
  sends): kvlens takes it as it is, one line of printable characters, from
  ``--api-key-file`` or :data:`API_KEY_ENV`; ``--api-key`` still works, with
  a warning that ``ps`` shows it.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from frontdoor.credentials import ROLE_ENV, ROLE_HELP, ROLES, Security, SecurityError, is_loopback

# TOKEN_ENV ($KVLENS_TOKEN): the bearer token, from the environment (servers: when no --token-file;
# clients: what they send). Defined in the bottom layer, which the OTLP exporters read too.
from kvrecord.config import TOKEN_ENV

#: Shorter tokens are refused: 16 random characters are out of reach of guessing over HTTP.
MIN_TOKEN_CHARS = 16
#: Environment variables the API key is read from when no flag gives it (the
#: first set wins); ``VLLM_API_KEY`` is what vLLM itself reads.
API_KEY_ENV = ("KVLENS_API_KEY", "VLLM_API_KEY")


def add_arguments(p: argparse.ArgumentParser, *, client_certs: bool = False, roles: Iterable[str] = ()) -> None:
    """Add ``--token-file``, ``--tls-cert``, ``--tls-key``, ``--insecure`` (and
    ``--tls-client-ca`` when ``client_certs``; ``--<role>-token-file`` for
    each of ``roles``) to ``p``, in a group of their own."""
    g = p.add_argument_group(
        "security",
        f"A bearer token from ${TOKEN_ENV} or --token-file (never a flag value: ps shows\n"
        "argv), and TLS. Listening beyond loopback needs a token or --insecure.",
    )
    g.add_argument(
        "--token-file",
        metavar="PATH",
        default=None,
        help=f"file holding the bearer token clients must send (Authorization: Bearer TOKEN); "
        f"wins over ${TOKEN_ENV} when both are set (default: ${TOKEN_ENV}, else no token); "
        f"it opens every role below. At least {MIN_TOKEN_CHARS} characters",
    )
    for role in roles:
        g.add_argument(
            f"--{role}-token-file",
            metavar="PATH",
            default=None,
            help=f"file holding the {role} token: {ROLE_HELP[role]} (default: ${ROLE_ENV[role]}; "
            f"the --token-file / ${TOKEN_ENV} token opens it too)",
        )
    g.add_argument(
        "--tls-cert", metavar="PATH", default=None, help="serve TLS with this certificate (PEM; with --tls-key)"
    )
    g.add_argument("--tls-key", metavar="PATH", default=None, help="private key of --tls-cert (PEM)")
    if client_certs:
        g.add_argument(
            "--tls-client-ca",
            metavar="PATH",
            default=None,
            help="require client certificates signed by this CA (PEM; needs --tls-cert)",
        )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding an address other than loopback with no token (anyone who reaches it may use it)",
    )


def _check_token(raw: bytes, where: str) -> bytes:
    tok = raw.strip()
    if not tok:
        raise SecurityError(f"{where} is empty; put the bearer token in it")
    if any(b <= 0x20 or b >= 0x7F for b in tok):
        raise SecurityError(f"{where}: the token must be printable ASCII with no spaces (it travels in a header)")
    if len(tok) < MIN_TOKEN_CHARS:
        raise SecurityError(
            f"{where}: the token is {len(tok)} characters, under the minimum of {MIN_TOKEN_CHARS} "
            "(guessable); make one with: openssl rand -hex 32"
        )
    return tok


def _read_token_file(path: str, warn: Callable[[str], None], flag: str = "--token-file") -> bytes:
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise SecurityError(f"{flag} {path} is a directory; give the file holding the token")
        raw = Path(path).read_bytes()
    except SecurityError:
        raise
    except OSError as e:
        raise SecurityError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    tok = _check_token(raw, f"{flag} {path}")
    if st.st_mode & 0o077:
        warn(f"warning: {flag} {path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 {path}")
    return tok


def _token_from(
    file: str | None, env: Mapping[str, str], var: str, flag: str, warn: Callable[[str], None]
) -> bytes | None:
    """The token in ``file`` (``flag``'s value; it wins), else in ``$var``, else None."""
    if file:
        return _read_token_file(file, warn, flag)
    if env.get(var, "") != "":
        return _check_token(env[var].encode("utf-8", "replace"), f"${var}")
    return None


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise SecurityError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def _stderr(line: str) -> None:
    print(f"kvlens: {line}", file=sys.stderr, flush=True)


def from_args(
    args: argparse.Namespace, host: str, *, env: Mapping[str, str] = os.environ, warn: Callable[[str], None] = _stderr
) -> Security:
    """The :class:`~frontdoor.credentials.Security` that ``args`` (from
    :func:`add_arguments`) and ``env`` ask for, for a server about to bind
    ``host``. Raises :class:`~frontdoor.credentials.SecurityError` (one line)
    on a bad combination; ``warn`` gets the warnings (default: stderr)."""
    token_file = getattr(args, "token_file", None)
    cert = getattr(args, "tls_cert", None)
    key = getattr(args, "tls_key", None)
    ca = getattr(args, "tls_client_ca", None)
    insecure = bool(getattr(args, "insecure", False))

    token = _token_from(token_file, env, TOKEN_ENV, "--token-file", warn)
    roles = {
        f"{r}_token": _token_from(getattr(args, f"{r}_token_file", None), env, ROLE_ENV[r], f"--{r}-token-file", warn)
        for r in roles_of(args)
    }

    if bool(cert) != bool(key):
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise SecurityError(f"{given} needs {missing} as well")
    if ca and not cert:
        raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key (client certificates need TLS)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", ca)):
        if path:
            _readable(flag, path)

    sec = Security(token=token, tls_cert=cert, tls_key=key, tls_client_ca=ca, insecure=insecure, **roles)
    for r in roles_of(args):
        if sec.any_token and not sec.credentials(r):
            warn(
                f"warning: no {r} token (--{r}-token-file, ${ROLE_ENV[r]} or ${TOKEN_ENV}): "
                f"every request that needs it is refused ({ROLE_HELP[r]})"
            )
    if not sec.any_token and not insecure and not is_loopback(host):
        raise SecurityError(
            f"refusing to listen on {host} (beyond loopback) without a token: set ${TOKEN_ENV} or --token-file, "
            "or pass --insecure to let anyone who reaches it in"
        )
    return sec


def roles_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The roles ``args`` has a ``--<role>-token-file`` flag for (:func:`add_arguments`)."""
    return tuple(r for r in ROLES if hasattr(args, f"{r}_token_file"))


def add_api_key_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--api-key-file`` and ``--api-key`` (kept, with a warning: ps shows it),
    for ``kvlens proxy``, ``up`` and ``bench``. ``what``: who requires it."""
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"file holding the API key: {what} (default: ${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]}, else none)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="the API key as a flag value: ps shows it to every user of the host (a warning says so); "
        f"prefer --api-key-file or ${API_KEY_ENV[0]}",
    )


def api_key_arg(args: argparse.Namespace, warn) -> str | None:
    """The API key the flags give: ``--api-key-file``'s content, else
    ``--api-key`` (``warn`` gets one line naming the risk), else None (the
    caller falls back to :data:`API_KEY_ENV`). ValueError naming the
    problem: both flags, an unreadable or empty file, a key with spaces."""
    path, flag = getattr(args, "api_key_file", None), getattr(args, "api_key", None)
    if path and flag:
        raise ValueError("give the API key once: --api-key-file or --api-key, not both")
    if path:
        try:
            with open(path, "rb") as f:
                key = f.read().decode("utf-8", "replace").strip()
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file {path}: {e.strerror or e}") from None
        if not key or any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError(f"--api-key-file {path}: the key must be one line of printable characters, no spaces")
        return key
    if flag:
        warn(
            "warning: --api-key puts the key on the command line, where ps shows it to every user of "
            f"this host; use --api-key-file PATH or ${API_KEY_ENV[0]} instead"
        )
    return flag or None


def env_api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The first of :data:`API_KEY_ENV` set in ``environ`` (default: ours), else None."""
    env = os.environ if environ is None else environ
    return next((env[k] for k in API_KEY_ENV if env.get(k)), None)
