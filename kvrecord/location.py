"""How a trace store is named, in one place: where the user's text enters.

A store is named by a **path** (an SQLite file, the default for one host) or
a **URL** ``postgresql://user[:password]@host[:port]/dbname`` (also
``postgres://``; libpq query parameters such as ``?sslmode=require`` pass
through): a PostgreSQL database the whole fleet shares.
:meth:`StoreLocation.parse` turns what a user typed into one of the two,
once, and everything after it passes the :class:`StoreLocation` on instead
of the text (``Path(...)`` would mangle ``postgresql://u@h/db`` into
``postgresql:/u@h/db``); ``str()`` of one names it in messages, a URL's
password hidden.

Pure Python (no driver, no SQL), so options can be checked in the bottom
layer; the store (:mod:`kvtrace.store`) re-exports these names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

URL_SCHEMES = ("postgresql", "postgres")
SQLITE = "sqlite"
POSTGRESQL = "postgresql"
_USE = "(use postgresql://user@host:port/dbname)"


class StoreError(Exception):
    """The store cannot be used: not a kvlens store, corrupt, locked, too new.
    Its kinds are in :mod:`kvtrace.store.errors`."""


class StoreUrlError(StoreError, ValueError):
    """A malformed store URL (``postgresql://user@host:port/dbname`` expected).
    Also a ``ValueError``, for argument checks that catch that."""


@dataclass(frozen=True)
class StoreLocation:
    """Where a trace store is: ``kind`` ``"sqlite"`` with an absolute
    ``path``, or ``"postgresql"`` with a checked ``url``. Immutable and
    hashable; ``str()`` is :attr:`display` (a URL's password hidden), so a
    location can go into any message or log line. :attr:`text` is the whole
    name, password included: only for what must reach the store itself (a
    child's command line, a config value).

    Build one with :meth:`parse` (what a user typed) or :meth:`sqlite` (a
    file path kvlens made itself, such as ``<home>/traces.db``)."""

    kind: str
    path: Path | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.kind, self.path is None, self.url is None) not in ((SQLITE, False, True), (POSTGRESQL, True, False)):
            raise ValueError("a store location is kind 'sqlite' with a path, or 'postgresql' with a url")

    @classmethod
    def parse(cls, name: "str | os.PathLike | StoreLocation") -> "StoreLocation":
        """What a user typed for ``--store`` (or a config value) as a
        location: a checked PostgreSQL URL, else an absolute file path
        (``~`` expanded). A location passes through as it is.
        :class:`StoreUrlError` (a ``ValueError``) naming the problem for a
        malformed URL or a scheme that is not PostgreSQL's."""
        if isinstance(name, StoreLocation):
            return name
        if isinstance(name, str) and is_url(name):
            return cls(POSTGRESQL, url=check_url(name))
        if isinstance(name, str) and "://" in name:
            scheme = name.split("://", 1)[0]
            raise StoreUrlError(
                f"unknown store URL scheme {scheme!r} in {redact(name)!r}: a store is a file path "
                "or postgresql://user@host:port/dbname"
            )
        return cls(SQLITE, path=Path(name).expanduser().resolve())

    @classmethod
    def sqlite(cls, path: "str | os.PathLike") -> "StoreLocation":
        """An SQLite file kvlens names itself (not user text: taken as it is)."""
        return cls(SQLITE, path=Path(path))

    @property
    def is_postgres(self) -> bool:
        return self.kind == POSTGRESQL

    @property
    def name(self) -> "str | Path":
        """What the backend connects to: the URL (str) or the file (Path)."""
        return self.url if self.url is not None else self.path  # type: ignore[return-value]

    @property
    def text(self) -> str:
        """The whole name as text, a URL's password included (never for messages)."""
        return str(self.name)

    @property
    def display(self) -> str:
        """The name for messages and logs: a URL's password as ``***``."""
        return redact(self.url) if self.url is not None else str(self.path)

    def __str__(self) -> str:
        return self.display

    def __repr__(self) -> str:
        return f"StoreLocation({self.display!r})"


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
        raise StoreUrlError(f"not a PostgreSQL URL: {redact(text)!r} {_USE}")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise StoreUrlError(f"bad port in {redact(text)!r} {_USE}") from None
    del port
    host = parts.hostname or ""
    if not host and "host=" not in parts.query:
        raise StoreUrlError(f"no host in {redact(text)!r} {_USE}")
    if not unquote(parts.path.lstrip("/")) and "dbname=" not in parts.query:
        raise StoreUrlError(f"no database name in {redact(text)!r} {_USE}")
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
