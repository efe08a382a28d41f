"""``kvlens bench --link``: the grid on stacks whose roles have their own
network namespaces joined by shaped links (``kvlens up --hosts --link``,
docs/links.md), and the link each row ran on.

Every row of such a run carries ``link``: the ``--link`` specs asked and,
per shaped direction, the asked shape and what the stack's probe measured
(round trip by UDP echo, goodput by TCP) when the stack started or was last
re-shaped. A row without ``link`` (None) ran on links kvlens did not shape:
one loopback, or a ``--proxy`` router. Pure, except :func:`check_link_args`
(it looks at the user id and ``PATH``)."""

from __future__ import annotations

from typing import Any, Sequence

from kvlens.bench.grid import BenchError
from kvlens.stack.errors import StackError

#: Roles a ``kvlens bench`` stack runs in namespaces of their own (no collector process).
BENCH_ROLES = ("p", "d", "router", "client")


def check_link_args(links: Sequence[str], proxy: str | None, check_tools: bool = True) -> tuple[str, ...]:
    """The ``--link`` values checked before any stack starts: each spec
    parses (:func:`kvlens.stack.linkspec.parse_links`), names roles a bench
    stack runs, is not combined with ``--proxy``, and (``check_tools``) the
    machine can make namespaces and delay queues. BenchError naming the
    problem (exit code 2)."""
    links = tuple(links or ())
    if not links:
        return links
    if proxy:
        raise BenchError(
            "--link shapes the links of stacks kvlens bench starts; a running router's (--proxy) links are not "
            "ours to change (start it with `kvlens up --hosts --link ...` and bench it with --proxy instead)"
        )
    from kvlens.stack.linkspec import parse_links

    try:
        shapes = parse_links(links)
    except StackError as e:
        raise BenchError(str(e)) from None
    for src, dst in shapes:
        for role in (src, dst):
            if role not in BENCH_ROLES:
                raise BenchError(
                    f"--link names {role}, which a kvlens bench stack does not run in a namespace of its own "
                    f"(roles: {', '.join(BENCH_ROLES)})"
                )
    if check_tools:
        from kvlens.stack.netns import check_tools as tools

        try:
            tools(need_queue=True)
        except StackError as e:
            raise BenchError(f"--link: {e}") from None
    return links


def unshaped(specs: Sequence[str]) -> tuple[str, ...]:
    """The same directions with no delay, rate or loss (``p-d=20ms,200mbit`` -> ``p-d=0ms``): what a
    bench stack starts with, so its pairs' NIXL handshakes run before the links are shaped."""
    return tuple(s.partition("=")[0] + "=0ms" for s in specs)


def shape_links(stack: Any, specs: Sequence[str]) -> None:
    """Re-shape a started stack's links (started :func:`unshaped`) to ``specs`` and probe them."""
    for spec in specs:
        stack.reshape(spec, probe=False)
    stack.probe_links()


def link_record(specs: Sequence[str], directions: Sequence[dict]) -> dict[str, Any]:
    """A row's ``link``: the specs asked and each shaped direction's asked
    and measured figures (``directions``: ``Net.to_json()["links"]``);
    ``summary`` says it in one line. A direction not measured (yet) has
    None figures, never 0."""
    out = []
    for d in directions:
        asked, m = d.get("asked") or {}, d.get("measured") or {}
        out.append(
            {
                "src": d["src"],
                "dst": d["dst"],
                "asked_delay_s": asked.get("delay_s"),
                "asked_jitter_s": asked.get("jitter_s"),
                "asked_rate_bps": asked.get("rate_bps"),
                "asked_loss": asked.get("loss"),
                "asked_rtt_s": asked.get("rtt_s"),
                "rtt_s": m.get("rtt_s"),
                "rtt_min_s": m.get("rtt_min_s"),
                "goodput_bps": m.get("goodput_bps"),
                "echoes_lost": m.get("echoes_lost"),
            }
        )
    return {"spec": list(specs), "directions": out, "summary": summary(list(specs), out)}


def _fmt_rtt(v: float | None) -> str:
    return "round trip not measured" if v is None else f"round trip {v * 1e3:.1f} ms"


def summary(specs: Sequence[str], directions: Sequence[dict]) -> str:
    """``p-d=20ms: round trip measured 40.8 ms (asked 40); router-d=...``:
    per spec, the median of its directions' measured round trips (pairs of
    directions: each is measured there and back)."""
    from kvlens.stack.linkspec import parse_link

    parts = []
    for spec in specs:
        try:
            ends = {(s.src, s.dst) for s in parse_link(spec)}
        except StackError:
            parts.append(f"{spec}: not a link spec")
            continue
        mine = [d for d in directions if (_role(d["src"]), _role(d["dst"])) in ends]
        rtts = sorted(d["rtt_s"] for d in mine if d.get("rtt_s") is not None)
        asked = sorted(d["asked_rtt_s"] for d in mine if d.get("asked_rtt_s") is not None)
        med = rtts[len(rtts) // 2] if rtts else None
        asked_s = f" (asked {asked[len(asked) // 2] * 1e3:g})" if asked else ""
        gps = sorted(d["goodput_bps"] for d in mine if d.get("goodput_bps"))
        gp = f", goodput {gps[len(gps) // 2] / 1e6:.0f} Mbit/s" if gps else ""
        parts.append(f"{spec}: {_fmt_rtt(med)}{asked_s}{gp}")
    return "; ".join(parts) or "no shaped link"


def _role(key: str) -> str:
    """A namespace key's role: ``p0`` -> ``p``, ``d1`` -> ``d``, ``router`` -> ``router``."""
    return key[0] if key[:1] in ("p", "d") and key[1:].isdigit() else key


def stack_link(stack: Any, specs: Sequence[str]) -> dict[str, Any] | None:
    """The ``link`` record of a running stack (None: not a ``hosts`` stack)."""
    net = getattr(stack, "net", None)
    if net is None:
        return None
    return link_record(specs, net.to_json()["links"])
