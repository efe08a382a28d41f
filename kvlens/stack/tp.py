"""Tensor parallelism of a stack's instances: the TP size of every P and D,
checked, and what follows from it (vLLM's argument, the start-up deadline).
Pure; the CPU binding of each rank is :func:`kvlens.stack.pinning.cpu_binding`.

A role's TP size is one number for all its instances (``2``) or one per
instance (``(2, 1)``: d0 at TP 2, d1 at TP 1), so one stack can hold a
P TP 2 -> D TP 2 and a P TP 2 -> D TP 1 pair. vLLM's CPU backend needs one
CPU list per rank in ``VLLM_CPU_OMP_THREADS_BIND`` (docs/tensor-parallel.md),
which is why the TP size is a stack field and not one more ``vllm_args``
entry: the binding must be built from it.
"""

from __future__ import annotations

from typing import Sequence

from kvlens.stack.commands import DEFAULT_TIMEOUT_S
from kvlens.stack.errors import StackError

#: Largest TP size a stack starts (one 8-GPU node's worth of ranks).
MAX_TP = 8
#: vLLM's own spellings of the TP size, refused in ``vllm_args`` (the stack
#: sets it per role, together with the per-rank CPU binding).
_TP_FLAGS = ("--tensor-parallel-size", "-tp")
#: Start-up seconds allowed per engine process beyond a pair's two: each
#: rank is a spawned process that imports torch and vLLM again (~10 s of CPU
#: each here) and a TP 2 pair took up to 150 s on a quiet 2-core host, minutes
#: when other engines shared the cores (docs/tensor-parallel.md).
STARTUP_S_PER_EXTRA_PROCESS = 120.0


def check_tp(what: str, value: int | Sequence[int], n: int) -> tuple[int, ...]:
    """The TP size of each of ``n`` instances from ``value`` (one int for
    all, or one per instance); StackError naming ``what`` (the flag) when a
    size is outside 1..:data:`MAX_TP` or the count is neither 1 nor ``n``."""
    sizes = [value] if isinstance(value, int) or isinstance(value, str) else list(value)
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= MAX_TP:
            raise StackError(f"{what} must be 1..{MAX_TP} (a tensor-parallel size per instance), got {value!r}")
    if len(sizes) == 1:
        return tuple(sizes) * n
    if len(sizes) != n:
        raise StackError(
            f"{what} gives {len(sizes)} sizes for {n} instance(s): give one for all, or one per "
            f"instance in engine-id order"
        )
    return tuple(sizes)


def per_mode_tp(value: int | Sequence[int], n: int, k: int) -> int | tuple[int, ...]:
    """A mixed fleet's TP sizes: one for all as it is; one per instance of
    a mode (``n`` of them) repeated for each of the ``k`` modes; else as given
    (``check_tp`` then names a wrong count)."""
    if isinstance(value, int) or isinstance(value, str):
        return value
    sizes = tuple(value)
    return sizes * k if len(sizes) == n and n > 1 else sizes


def parse_tp(text: str) -> tuple[int, ...]:
    """``"2"`` or ``"2,1"`` (per instance) as ints; ValueError otherwise
    (the CLI's argparse type; :func:`check_tp` checks the range and count)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"not a tensor-parallel size or comma-separated sizes: {text!r}")
    sizes = tuple(int(p) for p in parts)
    if not all(1 <= s <= MAX_TP for s in sizes):
        raise ValueError(f"tensor-parallel sizes must be 1..{MAX_TP}, got {text!r}")
    return sizes


def check_vllm_args(vllm_args: Sequence[str]) -> None:
    """StackError when ``vllm_args`` set the TP size themselves."""
    for a in vllm_args:
        if a in _TP_FLAGS or any(a.startswith(f + "=") for f in _TP_FLAGS):
            raise StackError(
                "set the tensor-parallel size with --tp / --prefill-tp / --decode-tp (Stack "
                "prefill_tp / decode_tp), not in the vLLM arguments: each rank needs its own CPU "
                "list in VLLM_CPU_OMP_THREADS_BIND, which the stack builds from it"
            )


def tp_args(tp: int) -> list[str]:
    """vLLM's argument for a server at TP ``tp`` (none at 1, vLLM's default)."""
    return ["--tensor-parallel-size", str(tp)] if tp > 1 else []


def tp_note(prefill_tp: Sequence[int], decode_tp: Sequence[int]) -> str:
    """`` (TP P 2, D 2,1)`` when any instance runs more than one rank, else ``""``."""
    if max(*prefill_tp, *decode_tp) == 1:
        return ""
    return " (TP P {}, D {})".format(*(",".join(map(str, t)) for t in (prefill_tp, decode_tp)))


def engine_processes(prefill_tp: Sequence[int], decode_tp: Sequence[int]) -> int:
    """Processes that load the model: one per rank of every instance."""
    return sum(prefill_tp) + sum(decode_tp)


def startup_timeout_s(processes: int) -> float:
    """The default start-up deadline for a stack whose instances run
    ``processes`` engine processes (:func:`engine_processes`):
    :data:`~kvlens.stack.commands.DEFAULT_TIMEOUT_S` for a one-rank pair (2),
    plus :data:`STARTUP_S_PER_EXTRA_PROCESS` per process beyond it (they
    start at once and share the CPUs). A 2P2D stack gets 480 s, P TP 2 with
    D TP 2 and D TP 1 600 s."""
    return DEFAULT_TIMEOUT_S + STARTUP_S_PER_EXTRA_PROCESS * max(0, processes - 2)


def start_waves(sizes: Sequence[tuple[str, int]]) -> list[list[str]]:
    """Names (``sizes``: (name, TP size) per instance) grouped into start-up
    waves, largest TP first; one wave when every size is the same.

    On a 2-core host a TP 1 instance started beside TP 2 ones answered
    ``/health`` first, and its idle worker then spun on CPU 1 (vLLM's
    shared-memory queue busy-loops for 1 s after each message) while the TP 2
    engines' rank 1, still importing torch on CPU 1, got ~1 % of it: they
    never started (docs/tensor-parallel.md, "A TP 1 D in the same stack").
    Bringing the multi-rank engines up first, each wave once healthy, keeps
    a started engine off a core a rank still needs for its import."""
    waves: dict[int, list[str]] = {}
    for name, tp in sizes:
        waves.setdefault(tp, []).append(name)
    return [waves[tp] for tp in sorted(waves, reverse=True)]
