"""kvlens' logger and the log-once helper every hook and exporter uses.

Telemetry never breaks its host: a failure inside kvlens is logged once per
kind (``key``) and then skipped silently, so a broken exporter cannot flood
vLLM's log at request rate.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("kvlens")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
    """Log ``msg`` at WARNING the first time ``key`` is seen in this process.

    Any thread; never raises (logging itself must not break the host)."""
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    try:
        logger.warning("kvlens: " + msg, *args, exc_info=exc_info)
    except Exception:
        pass
