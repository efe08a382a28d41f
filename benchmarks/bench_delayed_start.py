"""Starts with a delay already in place (issue 43 item 7): ``kvlens up --hosts
--mode push,pull --link p-d=5ms --link router-d=5ms`` (other links with
``--link``, repeated) started ``--tries`` times, each in a fresh kvlens home under ``--out``; per start whether it
served, its time to ready, the links' measured round trips, then 8
requests through the router (push, pull, alternating, then two drawn) and a
burst of 8 concurrent ~2000-token prompts per mode, then a stop by SIGINT,
how many warm-up tries were answered with an error (and tried again), and
what was left (namespaces, veths, processes of its group).

A start whose warm-up has not answered 60, 150 and 400 s after its router
came up is a hang in the making: each time, the Python stacks of every
vLLM and kvlens process of the stack (``py-spy dump --native``, when py-spy
is installed: it is not a kvlens dependency) and every thread's kernel
state, wait channel and kernel stack (``/proc/PID/task/TID``; ``khugepaged``'s
too) go to ``<home>/spy-<N>s/``, before ``kvlens up``'s own start timeout
stops it. UCX logs at ``info`` into the servers' logs (``UCX_LOG_LEVEL``,
passed through to every child).

    sudo .venv/bin/python benchmarks/bench_delayed_start.py --tries 5 --out /tmp/ds   # ~3-4 min a start
    .venv/bin/python benchmarks/bench_delayed_start.py --table /tmp/ds

Root only (network namespaces). Nothing is asserted; docs/links.md keeps
the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
LINKS = ("p-d=5ms", "router-d=5ms")
#: seconds after the router came up at which a still unready start's stacks are taken
DUMP_AT_S = (60, 150, 400)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="where each start's home (tryN/) and result go")
    p.add_argument("--tries", type=int, default=5)
    p.add_argument("--first", type=int, default=1, help="number of the first try (homes try<N>)")
    p.add_argument("--model", type=Path, help="model dir (default: the generated tiny model under --out)")
    p.add_argument("--give-up-s", type=float, default=1000.0, help="stop waiting for ready after this")
    p.add_argument("--table", type=Path, metavar="OUT", help="print the results found under OUT and exit")
    p.add_argument("--link", action="append", default=None, metavar="SPEC",
                   help=f"a link of the start, as kvlens up --link (repeat it; default {' '.join(LINKS)})")  # fmt: skip
    a = p.parse_args(argv)
    if a.table:
        print(table(a.table))
        return 0
    if a.out is None:
        p.error("--out is required")
    a.out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        from kvlens.model import ensure_model

        model = ensure_model(a.out / "model")
    for n in range(a.first, a.first + a.tries):
        r = one_start(a.out / f"try{n}", model, a.give_up_s, tuple(a.link or LINKS))
        print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
    print(table(a.out))
    return 0


def one_start(home: Path, model: Path, give_up_s: float, links: tuple[str, ...] = LINKS) -> dict:
    home.mkdir(parents=True, exist_ok=False)
    logs, out = home / "run", home / "up.log"
    env = {**os.environ, "KVLENS_HOME": str(home), "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "info")}
    argv = [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push,pull", "--hosts", "--insecure",
            *[x for spec in links for x in ("--link", spec)],
            "--port", "0", "--model", str(model), "--log-dir", str(logs)]  # fmt: skip
    res: dict = {"home": str(home), "argv": argv[3:]}
    t0 = time.monotonic()
    with open(out, "wb") as f:
        up = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(up, home, logs, out, res, t0, give_up_s)
        if "ready_s" in res:
            _send(json.loads((logs / "stack.json").read_text()), res)
    finally:
        said = out.read_text(errors="replace")
        res["tail"] = said[-3000:]
        # warm-up tries answered with an error (tried again after a pause, kvlens.stack.warmup)
        res["warmup_errors"] = len(re.findall(r"warm-up request[^\n]* returned HTTP", said))
        res["stop"] = _stop(up)
        res["leftovers"] = _leftovers(up.pid, _sid(logs))
        (home / "result.json").write_text(json.dumps(res, indent=1))
    return res


def _sid(logs: Path) -> str | None:
    try:
        return json.loads((logs / "stack.json").read_text())["network"]["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait_ready(up, home: Path, logs: Path, out: Path, res: dict, t0: float, give_up_s: float) -> None:
    router_at = None
    while True:
        text = out.read_text(errors="replace")
        if m := re.search(r"ready in (\d+)s", text):
            res["ready_s"] = int(m.group(1))
            return
        if up.poll() is not None:
            res["exit"] = up.returncode
            return
        try:
            pids = json.loads((logs / "stack.json").read_text()).get("pids", {})
        except (OSError, ValueError):
            pids = {}
        if router_at is None and "router" in pids:
            router_at = time.monotonic()
            res["router_started_s"] = round(router_at - t0, 1)
        for mark in DUMP_AT_S:
            if router_at is not None and time.monotonic() - router_at > mark and mark not in res.get("dumps", []):
                res.setdefault("dumps", []).append(mark)
                dump(up.pid, home / f"spy-{mark}s")
        if time.monotonic() - t0 > give_up_s:
            res["gave_up_s"] = give_up_s
            dump(up.pid, home / "spy-giveup")
            return
        time.sleep(1)


def dump(root_pid: int, d: Path) -> None:
    """Python stacks (py-spy, where installed) and kernel-side thread states of the stack's processes."""
    d.mkdir(exist_ok=True)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())[:300]
        except psutil.Error:
            continue
        if "vllm" not in cmd.lower() and "VLLM" not in p.name() and "kvlens" not in cmd:
            continue
        stacks = ""
        if spy:
            r = subprocess.run([spy, "dump", "--pid", str(p.pid), "--native"], capture_output=True, text=True,
                               timeout=60)  # fmt: skip
            stacks = r.stdout + r.stderr
        (d / f"{p.pid}.txt").write_text(f"# {p.name()} {cmd}\n{stacks}{kernel_side(p.pid)}")
    kh = [q.pid for q in psutil.process_iter(["name"]) if q.info["name"] == "khugepaged"]
    (d / "khugepaged.txt").write_text("".join(kernel_side(k) for k in kh))
    ps = subprocess.run(["ps", "-eLo", "pid,tid,cls,ni,pri,stat,pcpu,wchan:32,comm"], capture_output=True, text=True)
    (d / "threads.txt").write_text(Path("/proc/loadavg").read_text() + ps.stdout)


def kernel_side(pid: int) -> str:
    """Each thread's state, CPU ticks, wait channel and kernel stack (root reads ``/proc/PID/task/TID/stack``)."""
    out = [f"\n## kernel side of {pid}"]
    task = Path(f"/proc/{pid}/task")
    for t in sorted(os.listdir(task), key=int) if task.is_dir() else []:
        base = task / t
        try:
            head, tail = (base / "stat").read_text().rsplit(")", 1)
            f = tail.split()
            wchan = (base / "wchan").read_text()
            stack = (base / "stack").read_text().strip().replace("\n", " | ")
        except OSError as e:
            out.append(f"{t}: {e}")
            continue
        out.append(f"{t} {head.split('(', 1)[1]} state={f[0]} utime={f[11]} stime={f[12]} wchan={wchan} stack={stack}")
    return "\n".join(out) + "\n"


def _send(m: dict, res: dict) -> None:
    url = m["router_url"]
    res["links_rtt_ms"] = {
        x["src"] + ">" + x["dst"]: round(x["measured"]["rtt_s"] * 1e3, 2) for x in m["network"]["links"]
    }

    def one(mode: str | None, prompt: str, max_tokens: int) -> list:
        t = time.monotonic()
        try:
            r = httpx.post(url + "/v1/completions", headers={"X-Kvlens-Mode": mode} if mode else {}, timeout=120,
                           json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})  # fmt: skip
            return [mode, r.status_code, round(time.monotonic() - t, 2)]
        except httpx.HTTPError as e:
            return [mode, type(e).__name__, round(time.monotonic() - t, 2)]

    res["requests"] = [one(mode, f"req {i} " + "tokens " * (30 + 40 * i), 8)
                       for i, mode in enumerate(["push", "pull"] * 3 + [None, None])]  # fmt: skip
    with cf.ThreadPoolExecutor(8) as ex:
        res["burst"] = list(ex.map(lambda a: one(a[0], f"burst {a[0]} {a[1]} " + "tokens " * 1900, 16),
                                   [(mode, i) for mode in ("push", "pull") for i in range(8)]))  # fmt: skip


def _stop(up: subprocess.Popen) -> str:
    if up.poll() is not None:
        return f"exited {up.returncode} by itself"
    os.kill(up.pid, signal.SIGINT)
    try:
        up.wait(180)
        return f"SIGINT: exited {up.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
        return "SIGINT did not stop it in 180 s: SIGTERM to its group"


def _leftovers(pgid: int, sid: str | None) -> dict:
    time.sleep(2)
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    procs = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                procs.append(p.pid)
        except OSError:
            pass
    return {
        "sid": sid,
        "namespaces": [x for x in ns.splitlines() if sid and sid in x],
        "veths": [x.split(":")[1].strip() for x in links.splitlines() if sid and sid in x],
        "group_processes": procs,
    }


def table(out: Path) -> str:
    rows, ready = [], []
    for f in sorted(out.glob("try*/result.json"), key=lambda f: int(f.parent.name[3:])):
        r = json.loads(f.read_text())
        sent = r.get("requests", []) + r.get("burst", [])
        ok = sum(1 for x in sent if x[1] == 200)
        served = "ready_s" in r and ok == len(sent) > 0
        ready += [r["ready_s"]] if "ready_s" in r else []
        rtts = list((r.get("links_rtt_ms") or {}).values())
        left = r.get("leftovers") or {}
        clean = not any(left.get(k) for k in ("namespaces", "veths", "group_processes", "processes"))
        rows.append(
            f"{f.parent.name:6} {'served' if served else 'FAILED':7} ready "
            f"{str(r.get('ready_s', '-')) + ' s':>6}  servers+router {r.get('router_started_s', '-')} s  "
            f"rtt {min(rtts, default=0):.1f}-{max(rtts, default=0):.1f} ms  {ok}/{len(sent)} answered  "
            f"warm-up errors {r.get('warmup_errors', '-')}  "
            f"stack dumps {r.get('dumps', [])}  {'nothing left' if clean else 'LEFT: ' + json.dumps(left)}"
        )
    served = sum(1 for x in rows if " served " in x)
    med = f"{statistics.median(ready):.0f} s" if ready else "-"
    return "\n".join(rows + [f"{served} of {len(rows)} served; time to ready median {med}"])


if __name__ == "__main__":
    sys.exit(main())
