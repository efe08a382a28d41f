"""Test-only: shift this interpreter's wall clock by ``KVLENS_TEST_CLOCK_SHIFT_S``.

Put this directory first on a process's ``PYTHONPATH`` and every Python
interpreter it starts (vLLM's API server, EngineCore, workers) imports it at
start-up. Only ``time.time`` and ``time.time_ns`` move: the monotonic clock,
``time.sleep`` and timed waits are untouched, so the process runs normally
with its wall clock off, as on a host whose clock disagrees with its peers'.
(libfaketime is not used: with Debian's 0.9.10 timed waits hang or fail.)
"""

import os
import time

_shift_s = float(os.environ.get("KVLENS_TEST_CLOCK_SHIFT_S") or 0.0)
if _shift_s:
    _shift_ns = round(_shift_s * 1e9)
    _time, _time_ns = time.time, time.time_ns

    def _shifted_time() -> float:
        return _time() + _shift_s

    def _shifted_time_ns() -> int:
        return _time_ns() + _shift_ns

    time.time = _shifted_time
    time.time_ns = _shifted_time_ns
