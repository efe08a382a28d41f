"""PostgreSQL's errors as the store's (:mod:`kvtrace.store.errors`): what
psycopg and its pool raise, translated into one printable kind (the server
down, a wrong password, no such database ...), the password never shown."""

from __future__ import annotations

from kvrecord.location import endpoint, redact
from kvtrace.store.errors import StoreAccessDenied, StoreError, StoreMissing, StoreUnavailable

#: Connections per pool (per URL per process): the writer, the handoff
#: resolver, a retention pass and a few dashboard/CLI readers. Defined here,
#: where a full pool is reported, and used by :mod:`kvtrace.store.pg`.
POOL_MAX = 8


def translate(e: BaseException, url: str) -> StoreError:
    """A psycopg / pool error as a :class:`StoreError` kind a person can act on."""
    if isinstance(e, StoreError):
        return e
    host, port, db, user = endpoint(url)
    where = f"{host}:{port}"
    msg = _reason(e)
    state = getattr(e, "sqlstate", None) or ""
    low = msg.lower()
    try:
        from psycopg_pool import PoolTimeout
    except ImportError:  # pragma: no cover
        PoolTimeout = ()  # type: ignore[assignment]
    if isinstance(e, PoolTimeout):
        return StoreUnavailable(
            f"trace store {redact(url)}: no free connection within the timeout "
            f"({POOL_MAX} in use, or the server at {where} is not reachable)"
        )
    if state == "3D000" or ("database" in low and "does not exist" in low):
        return StoreMissing(
            f"trace store {redact(url)}: database {db!r} does not exist on the PostgreSQL "
            f"server at {where}: create it (createdb -h {host} -p {port} {db}) or fix the URL"
        )
    if (
        state in ("28P01", "28000")
        or "password authentication failed" in low
        or "pg_hba.conf" in low
        or ("role" in low and "does not exist" in low)
        or "no password supplied" in low
    ):
        return StoreAccessDenied(
            f"trace store {redact(url)}: the PostgreSQL server at {where} refused user {user!r} ({msg})"
        )
    if state == "42501":
        return StoreAccessDenied(f"trace store {redact(url)}: user {user!r} lacks a privilege the store needs ({msg})")
    if state.startswith(("08", "57P")) or state == "53300" or _connection_failure(low):
        return StoreUnavailable(
            f"trace store {redact(url)}: the PostgreSQL server at {where} is not reachable "
            f"({msg}); is it running, and is the URL right?"
        )
    return StoreError(f"trace store {redact(url)}: {msg}")


def _reason(e: BaseException) -> str:
    """libpq's reason in one line: ``connection to server at "h", port p
    failed: Connection refused`` -> ``Connection refused`` (host and port
    are in our own message)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if "failed: " in first:
        first = first.rsplit("failed: ", 1)[1]
    return " ".join(first.split()) or type(e).__name__


def _connection_failure(low: str) -> bool:
    return any(
        s in low
        for s in (
            "connection refused",
            "could not connect",
            "connection failed",
            "timeout expired",
            "no route to host",
            "could not translate host name",
            "name or service not known",
            "server closed the connection",
            "connection is closed",
            "the connection is lost",
            "terminating connection",
            "consuming input failed",
            "connection not open",
            "the database system is",
            "sending query failed",
            "connection timed out",
            "network is unreachable",
        )
    )


def is_backend_error(e: BaseException) -> bool:
    """A psycopg / pool exception (to be translated before it leaves the store)."""
    return (type(e).__module__ or "").startswith(("psycopg", "psycopg_pool"))
