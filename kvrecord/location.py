"""How a trace store is named, in one place: where the user's text enters.

A store is named by a **path** (an SQLite file, the default for one host) or
a **URL** ``postgresql://user[:password]@host[:port]/dbname`` (also
``postgres://``; libpq query parameters such as ``?sslmode=require`` pass
through): a PostgreSQL database the whole fleet shares. :func:`location`
turns what a user typed into one of the two, and every caller uses it
instead of ``Path(...)`` (which would mangle ``postgresql://u@h/db`` into
``postgresql:/u@h/db``); :func:`display` names either in messages, a URL's
password hidden.

Pure Python (no driver, no SQL), so options can be checked in the bottom
layer; the store (:mod:`kvtrace.store`) re-exports these names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

URL_SCHEMES = ("postgresql", "postgres")


class StoreError(Exception):
    """The store cannot be used: not a kvlens store, corrupt, locked, too new.
    Its kinds are in :mod:`kvtrace.store.errors`."""


class StoreUrlError(StoreError, ValueError):
    """A malformed store URL (``postgresql://user@host:port/dbname`` expected).
    Also a ``ValueError``, for argument checks that catch that."""


def is_url(name: Any) -> bool:
    """Whether ``name`` names a PostgreSQL store (``postgresql://`` / ``postgres://``)."""
    if not isinstance(name, str):
        return False
    head = name.strip().split("://", 1)[0].lower() if "://" in name else ""
    return head in URL_SCHEMES


def check_url(url: str) -> str:
    """``url`` when it is a usable PostgreSQL URL; :class:`StoreUrlError`
    (a ``ValueError``) naming the problem otherwise (a typo'd scheme, no
    host, no database, a bad port)."""
    text = url.strip()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme not in URL_SCHEMES:
        raise StoreUrlError(f"not a PostgreSQL URL: {redact(text)!r} (use postgresql://user@host:port/dbname)")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise StoreUrlError(f"bad port in {redact(text)!r} (use postgresql://user@host:port/dbname)") from None
    del port
    host = parts.hostname or ""
    if not host and "host=" not in parts.query:
        raise StoreUrlError(f"no host in {redact(text)!r} (use postgresql://user@host:port/dbname)")
    if not unquote(parts.path.lstrip("/")) and "dbname=" not in parts.query:
        raise StoreUrlError(f"no database name in {redact(text)!r} (use postgresql://user@host:port/dbname)")
    try:
        from psycopg.conninfo import conninfo_to_dict

        conninfo_to_dict(text)
    except ImportError:  # the driver is checked when a connection is opened
        pass
    except Exception as e:  # psycopg.ProgrammingError: libpq could not parse it
        raise StoreUrlError(f"bad PostgreSQL URL {redact(text)!r}: {e}") from None
    return text


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{netloc[1]}").geturl()


def endpoint(url: str) -> tuple[str, int, str, str]:
    """(host, port, database, user) of a URL, with libpq's defaults filled in."""
    parts = urlsplit(url)
    from urllib.parse import parse_qs

    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    host = parts.hostname or q.get("host") or "localhost"
    port = parts.port or int(q.get("port") or 5432)
    db = unquote(parts.path.lstrip("/")) or q.get("dbname") or ""
    user = unquote(parts.username or "") or q.get("user") or os.environ.get("PGUSER") or ""
    return host, port, db, user


def location(name: str | os.PathLike) -> str | Path:
    """What a user typed for ``--store`` (or a config value) as a store name:
    a checked PostgreSQL URL (str), else an absolute :class:`Path` (``~``
    expanded). :class:`StoreUrlError` (a ``ValueError``) for a malformed URL."""
    if isinstance(name, str) and is_url(name):
        return check_url(name)
    if isinstance(name, str) and "://" in name:
        scheme = name.split("://", 1)[0]
        raise StoreUrlError(
            f"unknown store URL scheme {scheme!r} in {redact(name)!r}: a store is a file path "
            "or postgresql://user@host:port/dbname"
        )
    return Path(name).expanduser().resolve()


def display(name: str | os.PathLike) -> str:
    """A store's name for messages (a URL's password redacted)."""
    return redact(name) if is_url(name) else str(name)
