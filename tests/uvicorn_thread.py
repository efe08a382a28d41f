"""An ASGI app under a real uvicorn on a loopback port, in a thread: the
tests' one way to serve the router, the dashboard's gate or a bare app."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

import uvicorn


@contextlib.contextmanager
def serve(app: Any = None, *, config: uvicorn.Config | None = None, lifespan: str = "on") -> Iterator[str]:
    """Serve ``app`` (or a ready ``config``) until the block ends; yields its base URL.
    The server is told to exit and its thread joined on the way out."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        t.join(20)
        sock.close()
