"""Fault injection on a real P/D stack, and the clocks that time detection.

- :func:`freeze` / :func:`resume`: SIGSTOP / SIGCONT every process of a stack
  child's process group (the guard, vLLM's API server, EngineCore, workers)
  and any descendant that left the group; :func:`frozen` resumes on the way
  out whatever happens (a stopped process ignores SIGTERM, so a test that
  fails while D is frozen must not leave the teardown waiting on it).
- :func:`kill` ends a child's whole group with SIGKILL and reaps it.
- :func:`scrape` reads an instance's ``/metrics`` into
  ``{(name, frozenset(labels)): value}``; :func:`value` / :func:`total` pick
  samples out of it.
- :class:`Detect` records, per fault, when it was injected and when each
  signal (a gauge, an alert) was first seen: figures to report, never to
  assert (the box is shared and noisy).

Blocking calls on the caller's thread; tests call them from a thread when an
event loop must keep a request in flight.
"""

from __future__ import annotations

import contextlib
import math
import re
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

try:
    import psutil
except ImportError:  # pragma: no cover - vLLM ships it
    psutil = None  # type: ignore[assignment]


def group_pids(child) -> list[int]:
    """Every pid of ``child``'s process group plus its escaped descendants."""
    pgid = child.proc.pid
    pids = {pgid}
    if psutil is not None:
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.info["pid"]) == pgid:
                    pids.add(p.info["pid"])
            except (ProcessLookupError, PermissionError, OSError):
                pass
        try:
            pids.update(d.pid for d in psutil.Process(pgid).children(recursive=True))
        except Exception:
            pass
    return sorted(pids)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def is_engine_worker(pid: int) -> bool:
    """Whether ``pid`` is a vLLM engine worker (process title ``VLLM::Worker...``)."""
    if psutil is None:
        return False
    try:
        p = psutil.Process(pid)
        return "::Worker" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Worker")
    except psutil.Error:
        return False


def freeze(child, only: Callable[[int], bool] | None = None) -> list[int]:
    """SIGSTOP ``child``'s process tree (or those of its pids ``only`` picks:
    e.g. :func:`is_engine_worker`, so the API server still answers and
    scrapes); returns the pids stopped (for :func:`resume`)."""
    pids = group_pids(child)
    if only is not None:
        pids = [p for p in pids if only(p)]
        if not pids:
            raise RuntimeError(f"no process of {child.name} matches {only.__name__}")
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGSTOP)
    _signal_all(pids, signal.SIGSTOP)
    return pids


def resume(child, pids: list[int] | None = None, whole: bool = True) -> None:
    """SIGCONT ``pids`` from :func:`freeze` (and ``child``'s whole group unless ``whole`` is False)."""
    if whole:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGCONT)
    _signal_all(pids or [], signal.SIGCONT)


@contextlib.contextmanager
def frozen(child, only: Callable[[int], bool] | None = None) -> Iterator[list[int]]:
    """``with frozen(d): ...``: D (or the part ``only`` picks) stopped inside
    the block, resumed after it, always."""
    pids = freeze(child, only)
    try:
        yield pids
    finally:
        resume(child, pids)


def kill(child, timeout: float = 30.0) -> None:
    """SIGKILL ``child``'s whole process group (and escaped descendants); wait for it."""
    pids = group_pids(child)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, signal.SIGKILL)
    _signal_all(pids, signal.SIGKILL)
    child.proc.wait(timeout)


def alive_pids(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not zombies)."""
    out = []
    for pid in pids:
        if psutil is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                out.append(pid)
            continue
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


Samples = dict[tuple[str, frozenset], float]


def scrape(url: str, timeout: float = 5.0, headers: Mapping[str, str] | None = None) -> Samples:
    """``url``'s ``/metrics`` as ``{(sample name, frozenset(label items)): value}``."""
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout, headers=dict(headers or {}))
    r.raise_for_status()
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def select(samples: Samples, name: str, **labels: str) -> list[tuple[dict, float]]:
    """Samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [(dict(lab), v) for (n, lab), v in samples.items() if n == name and want <= set(lab)]


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of the matching samples (NaN ones skipped); None when no sample matches."""
    found = select(samples, name, **labels)
    if not found:
        return None
    return sum(v for _, v in found if not math.isnan(v))


def oldest(samples: Samples, name: str, **labels: str) -> float | None:
    """Smallest non-NaN matching sample (an oldest start timestamp); None when none."""
    vals = [v for _, v in select(samples, name, **labels) if not math.isnan(v)]
    return min(vals) if vals else None


def poll(pred: Callable[[], object], timeout: float, every: float = 0.25) -> object:
    """``pred()``'s first truthy value within ``timeout`` seconds, else None.
    Exceptions from ``pred`` (a frozen or dead peer) count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except Exception:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            return None
        time.sleep(every)


@dataclass
class Detect:
    """When a fault began and when each of its signals was first seen (wall clock)."""

    fault: str
    start: float = field(default_factory=time.time)
    seen: dict[str, float] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)

    def mark(self, signal_name: str, at: float | None = None) -> float:
        """Record ``signal_name`` seen now (or at ``at``); seconds since the fault."""
        t = time.time() if at is None else at
        self.seen.setdefault(signal_name, t)
        return self.seen[signal_name] - self.start

    def after(self, signal_name: str) -> float | None:
        t = self.seen.get(signal_name)
        return None if t is None else t - self.start

    def row(self) -> dict:
        return {
            "fault": self.fault,
            **{k: round(v - self.start, 2) for k, v in sorted(self.seen.items(), key=lambda kv: kv[1])},
            **self.notes,
        }


# ------------------------------------------------------------ requests in flight
class InFlight:
    """One HTTP request sent on a thread of its own, so the caller can freeze,
    kill and scrape while it waits; :meth:`cancel` is the client giving up
    (the connection closes, as when a user's client times out)."""

    def __init__(self, url: str, body: dict, request_id: str, timeout: float = 600.0) -> None:
        import asyncio
        import threading

        self.result: object = None
        self.elapsed_s: float | None = None
        self._loop = asyncio.new_event_loop()
        self._task = None
        self._started = time.monotonic()

        async def go():
            try:
                async with httpx.AsyncClient(timeout=timeout) as c:
                    r = await c.post(url, json=body, headers={"X-Request-Id": request_id})
                    return r.status_code
            except asyncio.CancelledError:
                return "cancelled"
            except httpx.HTTPError as e:
                return type(e).__name__

        def run():
            self._task = self._loop.create_task(go())
            self.result = self._loop.run_until_complete(self._task)
            self.elapsed_s = time.monotonic() - self._started

        self._thread = threading.Thread(target=run, daemon=True, name=f"inflight-{request_id[:8]}")
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        if self._task is not None and not self.done():
            self._loop.call_soon_threadsafe(self._task.cancel)

    def wait(self, timeout: float) -> object:
        self._thread.join(timeout)
        return self.result


# ------------------------------------------------------------ health signals
#: the outcome and event counters whose increase a fault test looks at
COUNTERS = {
    "expired": ("kvlens_handoff_outcomes_total", {"outcome": "expired"}),
    "failed": ("kvlens_handoff_outcomes_total", {"outcome": "failed"}),
    "timeout": ("kvlens_handoff_outcomes_total", {"outcome": "timeout"}),
    "stale_outcome": ("kvlens_handoff_outcomes_total", {"outcome": "stale"}),
    "ok": ("kvlens_handoff_outcomes_total", {"outcome": "ok"}),
    "attempts": ("kvlens_handoff_attempts_total", {}),
    "stale": ("kvlens_kv_stale_total", {}),
    "registration_timeouts": ("kvlens_registration_timeouts_total", {}),
}
PINNED_STATES = ("awaiting_read", "unregistered_prefill", "unmatched_registration")


def signals(samples: Samples, mode: str) -> dict[str, float | None]:
    """The health figures of one instance's scrape: open handoffs, the oldest
    open start, pinned requests per state, and the counters of :data:`COUNTERS`
    (None where the metric is absent: it must then not count as 0)."""
    out: dict[str, float | None] = {
        "open": total(samples, "kvlens_handoffs_open", mode=mode),
        "oldest_open_start": oldest(samples, "kvlens_handoff_oldest_open_start_timestamp_seconds", mode=mode),
    }
    for st in PINNED_STATES:
        out[f"pinned:{st}"] = total(samples, "kvlens_kv_pinned_requests", mode=mode, state=st)
    for k, (name, labels) in COUNTERS.items():
        out[k] = total(samples, name, mode=mode, **labels)
    return out


def open_phases(samples: Samples, mode: str) -> list[str]:
    """``role/phase`` of every non-zero open-handoff gauge (what the table names)."""
    return sorted(
        f"{lab.get('role')}/{lab.get('phase')}"
        for lab, v in select(samples, "kvlens_handoffs_open", mode=mode)
        if v and not math.isnan(v)
    )


def firing_alerts(prom_url: str) -> list[dict]:
    """Prometheus' firing alerts (``/api/v1/alerts``), each with ``labels``."""
    from exporters import promapi

    data = promapi.get(prom_url, "/api/v1/alerts", timeout_s=5.0) or {}
    return [a for a in data.get("alerts") or [] if a.get("state") == "firing"]


def _active_at(alert: dict) -> float:
    """An alert's ``activeAt`` (RFC 3339) as a Unix time; +inf when unreadable."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(alert.get("activeAt")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return math.inf


def _older_than(alert: dict, since_fault_s: float) -> bool:
    """A stuck-handoff alert whose value (the open handoff's age, s) says it
    began before the fault: Prometheus started with the test, so ``activeAt``
    alone cannot tell an earlier fault's leftover."""
    if alert["labels"].get("alertname") != "KvlensHandoffStuck":
        return False
    try:
        return float(alert.get("value")) > since_fault_s + 2.0
    except (TypeError, ValueError):
        return False


class Watcher:
    """Scrapes every instance's ``/metrics`` (and Prometheus' alerts) on a
    thread, from construction to :meth:`stop`, and records into ``detect``
    when each signal first shows: ``<role>:open`` (a handoff open),
    ``<role>:pinned:<state>``, ``<role>:<counter>`` (the counter rose over its
    value at the start), ``alert:<name>`` (firing, and active since the
    fault: an alert an earlier fault left firing is kept apart in
    ``before``). Gauges count from their value at the start. ``peak`` keeps each
    figure's largest value, ``phases`` the open handoffs' role/phase seen.
    A frozen or dead instance's failed scrapes are skipped."""

    def __init__(
        self,
        detect: Detect,
        targets: Mapping[str, str],
        mode: str,
        prom_url: str | None = None,
        every_s: float = 0.5,
        settle_s: float = 15.0,
    ) -> None:
        import threading

        self.detect, self.targets, self.mode, self.prom_url = detect, dict(targets), mode, prom_url
        self.base: dict[str, dict] = self._settled(settle_s)
        self.last: dict[str, dict] = dict(self.base)
        self.peak: dict[str, float] = {}
        self.phases: set[str] = set()
        self.alerts: dict[str, dict] = {}
        self.before: dict[str, dict] = {}  #: alerts already active before the fault
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-watcher")
        self._thread.start()

    def _settled(self, settle_s: float) -> dict[str, dict]:
        """Every instance's signals once two scrapes 1.2 s apart agree (the
        gauges are published once a second: a handoff that ended just before
        may still show), or the last ones after ``settle_s``."""
        deadline = time.monotonic() + settle_s
        prev = None
        while True:
            cur = {r: signals(scrape(u), self.mode) for r, u in self.targets.items()}
            if cur == prev or time.monotonic() > deadline:
                return cur
            prev = cur
            time.sleep(1.2)

    def delta(self, role: str, counter: str) -> float | None:
        """How much ``counter`` on ``role`` rose since the start (None: metric absent)."""
        a, b = self.base[role].get(counter), self.last[role].get(counter)
        return None if a is None or b is None else b - a

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            for role, url in self.targets.items():
                try:
                    s = scrape(url, timeout=2.0)
                except Exception:
                    continue
                sig = signals(s, self.mode)
                self.last[role] = sig
                for ph in open_phases(s, self.mode):
                    self.phases.add(f"{role}:{ph}")
                for k, v in sig.items():
                    if v is None or k == "oldest_open_start":
                        continue
                    self.peak[f"{role}:{k}"] = max(self.peak.get(f"{role}:{k}", v), v)
                base = self.base[role]
                # above what was there before the fault (an earlier fault may leave state behind)
                if (sig["open"] or 0) > (base["open"] or 0):
                    self.detect.mark(f"{role}:open")
                o = sig["oldest_open_start"]
                starts = select(s, "kvlens_handoff_oldest_open_start_timestamp_seconds", mode=self.mode)
                if any(not math.isnan(v) and v >= self.detect.start - 1.0 for _, v in starts):
                    self.detect.mark(f"{role}:oldest_open")  # a series whose oldest began with this fault
                if o is not None:
                    self.peak[f"{role}:oldest_open_age_s"] = max(
                        self.peak.get(f"{role}:oldest_open_age_s", 0.0), time.time() - o
                    )
                for st in PINNED_STATES:
                    if (sig[f"pinned:{st}"] or 0) > (base[f"pinned:{st}"] or 0):
                        self.detect.mark(f"{role}:pinned:{st}")
                for k in COUNTERS:
                    d = self.delta(role, k)
                    if d:
                        self.detect.mark(f"{role}:{k}")
            if self.prom_url and n % 2 == 0:
                try:
                    for a in firing_alerts(self.prom_url):
                        lab = a["labels"]
                        name = lab.get("alertname", "?")
                        if _active_at(a) < self.detect.start - 1.0 or _older_than(a, time.time() - self.detect.start):
                            self.before.setdefault(name, lab)  # pending before this fault: not its alert
                            continue
                        self.alerts.setdefault(name, lab)
                        self.detect.mark(f"alert:{name}")
                        self.detect.mark(
                            f"alert:{name}@{lab.get('job', '?')}/{lab.get('phase', lab.get('outcome', ''))}"
                        )
                except Exception:
                    pass
            n += 1
            self._stop.wait(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------ Prometheus with the alert rules
def alert_rules_for_test(src, dst, max_for_s: int = 5) -> list[str]:
    """Copy the alert rules ``src`` to ``dst`` with every ``for:`` longer than
    ``max_for_s`` cut to it (a test cannot wait a minute per fault); the
    expressions and bounds stay as shipped. Returns what was shortened."""
    import yaml

    doc = yaml.safe_load(open(src))
    changed = []
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for g in doc.get("groups", []):
        for r in g.get("rules", []):
            f = r.get("for")
            if "alert" not in r or not f:
                continue

            m = re.fullmatch(r"([0-9]+)(ms|s|m|h)", str(f))
            if m and int(m.group(1)) * units[m.group(2)] > max_for_s:
                r["for"] = f"{max_for_s}s"
                changed.append(f"{r['alert']}: for {f} -> {max_for_s}s")
    with open(dst, "w") as out:
        yaml.safe_dump(doc, out, sort_keys=False)
    return changed


def start_prometheus(targets: Mapping[str, list[str]], data_dir, alert_rules, max_for_s: int = 5):
    """A real Prometheus (1 s scrape and evaluation) scraping ``targets`` with
    kvlens' recording rules and a test copy of ``alert_rules``
    (:func:`alert_rules_for_test`). Returns ``(server, shortened)``."""
    from pathlib import Path

    from exporters.prometheus_server import PrometheusServer

    name = "alert_rules.yml"
    shortened: list[str] = []

    class _WithAlerts(PrometheusServer):
        def config(self):
            cfg = super().config()
            files = cfg.setdefault("rule_files", [])
            if name not in files:
                files.append(name)
            return cfg

        def write_config(self):
            super().write_config()
            shortened[:] = alert_rules_for_test(alert_rules, Path(self.data_dir) / name, max_for_s)
            self.config_path.write_text(__import__("json").dumps(self.config(), indent=2) + "\n")
            return self.config_path

    server = _WithAlerts(targets, port=0, data_dir=data_dir, scrape_interval="1s")
    server.start(timeout=60)
    return server, shortened


def listed_open(store_text: str, tid: str) -> bool:
    """Whether ``kvlens traces --open`` lists ``tid`` now (False when it fails)."""
    try:
        return tid in traces_open(store_text)
    except Exception:
        return False


def traces_open(store_text: str, timeout: float = 60.0) -> str:
    """``kvlens traces --open --store STORE`` run as a user runs it; its stdout
    (raises on a non-zero exit, with stderr)."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "traces", "--open", "--store", store_text],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if p.returncode != 0:
        raise RuntimeError(f"kvlens traces --open exited {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout


# ------------------------------------------------------------ traces
#: the contract's span and attribute names (issue 37; kvrecord.semconv)
SPAN_OPEN = "handoff.open"
ATTR_OPEN = "kvlens.open"
ATTR_STALE = "kvlens.kv.stale"
ATTR_REG_TIMEOUT = "kvlens.registration_timeout"


def spans_of(store_loc, tid: str) -> list[dict]:
    """The trace's stored spans ([] while the store does not exist yet)."""
    from kvtrace import store
    from kvtrace.store.errors import StoreMissing

    try:
        conn = store.connect(store_loc, readonly=True)
    except StoreMissing:
        return []
    try:
        return store.spans_for(conn, [tid]).get(tid, [])
    finally:
        conn.close()


def trace_row(store_loc, tid: str) -> dict | None:
    from kvtrace import store
    from kvtrace.store.errors import StoreMissing

    try:
        conn = store.connect(store_loc, readonly=True)
    except StoreMissing:
        return None
    try:
        rows = store.slowest(conn, 1, trace_ids=[tid])
        return dict(rows[0]) if rows else None
    finally:
        conn.close()


def summary(spans: list[dict]) -> list[str]:
    """``role:name=outcome`` per span, in start order (for messages and the table)."""
    return [f"{s['role']}:{s['name']}={s['outcome']}" for s in sorted(spans, key=lambda s: s["start_ns"])]


def flags(spans: list[dict]) -> dict[str, list[str]]:
    """What marks a trace as unhealthy, by kind: spans that are partial
    (``handoff.open``; ``open_shown``: those a reader still shows), stale,
    registration timeouts, and non-ok outcomes."""
    out: dict[str, list[str]] = {"open": [], "stale": [], "registration_timeout": [], "not_ok": [], "open_shown": []}
    try:  # what a reader still shows as open (kvtrace.stuck hides the partials of a side that ended)
        from kvtrace import stuck

        out["open_shown"] = [f"{s['role']}:{s['name']}" for s in stuck.visible_spans(spans) if s["name"] == SPAN_OPEN]
    except ImportError:
        out["open_shown"] = ["(kvtrace.stuck missing)"]
    for s in spans:
        a = s.get("attributes") or {}
        tag = f"{s['role']}:{s['name']}"
        if s["name"] == SPAN_OPEN or a.get(ATTR_OPEN):
            out["open"].append(tag)
        if a.get(ATTR_STALE):
            out["stale"].append(tag)
        if a.get(ATTR_REG_TIMEOUT):
            out["registration_timeout"].append(tag)
        if s.get("outcome") not in (None, "ok"):
            out["not_ok"].append(f"{tag}={s['outcome']}")
    return out


def mark_trace(
    det: "Detect", spans: list[dict], names: tuple[str, ...] = ("prefill.finished", "registration.stage")
) -> None:
    """Record in ``det`` when the trace says the handoff began on each side
    (``trace:<role>:<name>``), so a gauge's delay reads against it."""
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        if s["name"] in names:
            det.mark(f"trace:{s['role']}:{s['name']}", at=s["start_ns"] / 1e9)


def wait_trace(store_loc, tid: str, pred: Callable[[list[dict]], object], timeout: float) -> list[dict]:
    """The trace's spans once ``pred(spans)`` holds (within ``timeout``), else what is there."""
    got = poll(lambda: (lambda s: s if pred(s) else None)(spans_of(store_loc, tid)), timeout, every=0.5)
    return got if got else spans_of(store_loc, tid)


def healthy(url: str, n: int, tag: str) -> list[str]:
    """``n`` ordinary completions through the router (each must answer 200); their trace ids."""
    from e2e_client import send_completions

    return send_completions(url, n, tag=tag)


def false_flags(store_loc, tids: list[str], timeout: float = 60.0) -> dict[str, dict]:
    """Healthy requests that kvlens flagged anyway: trace id -> its flags
    (empty when none). Waits for each trace to be complete first."""
    out = {}
    for tid in tids:
        row = poll(lambda t=tid: trace_row(store_loc, t), timeout)
        fl = {k: v for k, v in flags(spans_of(store_loc, tid)).items() if v}
        if row is None or row.get("outcome") != "ok":
            fl["row"] = [str(row and row.get("outcome"))]
        if fl:
            out[tid] = fl
    return out


class Checks:
    """Every check of a fault test evaluated, then failed together: one run
    tells which of a fault's signals kvlens shows and which it misses."""

    def __init__(self) -> None:
        self.results: dict[str, bool] = {}
        self.details: dict[str, object] = {}

    def that(self, name: str, ok: object, detail: object = None) -> bool:
        self.results[name] = bool(ok)
        if not ok:
            self.details[name] = detail
        return bool(ok)

    def failed(self) -> list[str]:
        return [k for k, v in self.results.items() if not v]

    def done(self) -> None:
        bad = self.failed()
        assert not bad, "failed checks:\n" + "\n".join(f"- {k}: {self.details.get(k)!r}"[:1500] for k in bad)
