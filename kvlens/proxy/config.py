"""The router's settings (one :class:`ProxyConfig` per app)."""

from __future__ import annotations

from dataclasses import dataclass

from instrumented_connector import config as kvconfig


@dataclass
class ProxyConfig:
    """Where P and D are, how to dispatch, and the HTTP client's limits.

    ``prefill_engine_id`` / ``prefill_side_host`` / ``prefill_side_port`` /
    ``prefill_tp_size``: P's identity as D needs it for an overlapped push
    (D's request goes out before P has answered). Timeouts in seconds.
    ``kvlens_home``: where spans go (default: the kvlens home)."""

    prefill_url: str
    decode_url: str
    mode: str = "push"
    dispatch: str = "overlapped"
    prefill_engine_id: str = "p0"
    prefill_side_host: str = "127.0.0.1"
    prefill_side_port: int | None = None
    prefill_tp_size: int = 1
    kvlens_home: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    max_connections: int = 256
    telemetry: bool = True

    def __post_init__(self) -> None:
        self.prefill_url = self.prefill_url.rstrip("/")
        self.decode_url = self.decode_url.rstrip("/")
        if self.mode not in ("push", "pull"):
            raise ValueError(f"mode must be push or pull, got {self.mode!r}")
        if self.dispatch not in ("overlapped", "sequential"):
            raise ValueError(f"dispatch must be overlapped or sequential, got {self.dispatch!r}")
        if self.kvlens_home is None:
            self.kvlens_home = str(kvconfig.home())

    @property
    def overlapped_push(self) -> bool:
        return self.mode == "push" and self.dispatch == "overlapped"

    @property
    def effective_dispatch(self) -> str:
        """``dispatch`` for push; pull is always sequential (D needs P's answer)."""
        return self.dispatch if self.mode == "push" else "sequential"
