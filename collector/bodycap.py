"""A request body read under a size cap (:func:`read_capped`): the
collector's ``POST /v1/traces`` and the kvlens router's requests. Pure
asyncio over the ASGI server's body chunks; no framework import."""

from __future__ import annotations

from typing import AsyncIterator, Callable, Mapping


async def read_capped(
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    cap: int,
    too_large: Callable[[int | None], Exception],
    bad_length: Callable[[str], Exception] | None = None,
) -> bytes:
    """The body, refused as soon as it is known to pass ``cap`` bytes: from
    ``Content-Length`` before reading anything, else while reading (nothing
    past ``cap`` plus one chunk is kept). Raises ``too_large(n)``, ``n`` the
    declared length, or None when the body itself passed the cap. A
    ``Content-Length`` that is not a number raises ``bad_length(value)``,
    or without ``bad_length`` is ignored (the cap still holds while reading)."""
    declared = headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            if bad_length is not None:
                raise bad_length(declared) from None
            n = None
        if n is not None and n > cap:
            raise too_large(n)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > cap:
            raise too_large(None)
    return bytes(buf)
