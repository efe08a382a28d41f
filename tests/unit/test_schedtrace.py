"""The kernel's scheduler record (kvtrace.schedtrace): its lines parsed into
each thread's runs, runnable waits and wake-ups, and a phase's critical path
walked back through them (cpusplit's source where ``kvlens up
--sched-trace`` kept one). The recording itself runs on real stacks in
tests/e2e/test_e2e_cpu.py and test_e2e_links.py."""

from __future__ import annotations

import json
import os

import pytest

from kvrecord import semconv as sc
from kvtrace import cpusplit, schedtrace
from test_cpusplit import KV, MS, PF, _span, _trace

US = 1_000
A, B, C, OUTSIDE = 10, 20, 30, 99  # threads: A and B of the stack's process 10 (B in process 20), C of 30
A2 = 11  # a second thread of A's process


def _lines(events):
    """``(kind, t_us, a, b, c)`` -> the kernel's trace text (``record-tgid``): S (prev, prev_state, next) with
    prev_state 0 / 0x100 for R / R+ (left runnable) and 1 for S; W (woken, waker, context flags); P (socket
    cookie, data bytes, the thread the softirq interrupted): data reached a socket; R (cookie, reader, -): a read;
    X (cookie, bytes, sender): a send on the socket (its address: the cookie's, as P prints it)."""
    tgid = {A: 10, A2: 10, B: 20, C: 30, OUTSIDE: 99, 0: 0}
    out = ["# tracer: nop", "#"]
    for kind, t, x, y, z in events:
        stamp = f"{t // 1_000_000}.{t % 1_000_000:06d}"
        if kind == "S":
            state = {0: "R", 0x100: "R+"}.get(y, "S")
            cur, body = x, f"sched_switch: prev_comm=t{x} prev_pid={x} prev_prio=120 prev_state={state} ==> " \
                f"next_comm=t{z} next_pid={z} next_prio=120"  # fmt: skip
            flags = "d..2."
        elif kind == "P":
            cur, flags = z, "..s2."
            body = (f"tcp_probe: family=AF_INET src=127.0.0.1:1 dest=127.0.0.1:2 mark=0x0 data_len={y} "
                    f"sock_cookie={x:x} skbaddr=00000000deadbeef skaddr={x + 0xA000:016x}")  # fmt: skip
        elif kind == "X":
            cur, flags = z, "....."
            body = (f"sock_send_length: sk address = {x + 0xA000:016x}, family = AF_INET protocol = IPPROTO_TCP, "
                    f"length = {y}, error = 0, flags = 0x0")  # fmt: skip
        elif kind == "R":
            cur, flags = y, "....."
            body = f"tcp_rcv_space_adjust: family=AF_INET sport=2 dport=1 saddr=127.0.0.1 sock_cookie={x:x}"
        else:
            ctx = "h" if z & schedtrace.FLAG_HARDIRQ else "s" if z & schedtrace.FLAG_SOFTIRQ else "."
            cur, body, flags = y, f"sched_wakeup: comm=t{x} pid={x} prio=120 target_cpu=000", f"d.{ctx}3."
        out.append(f"   t{cur}-{cur}   ({tgid.get(cur, 0):>7}) [000] {flags} {stamp}: {body}")
    out.append("CPU:1 [LOST 3 EVENTS]")
    return out


def _timeline(events, own=(10, 20, 30), net=False):
    return schedtrace.parse(_lines(events), 0, frozenset(own), net)


#: B runs 0-30, is preempted (R, 0) and waits 30-50, runs 50-120 and wakes A at 100 (process context, flags
#: 1); A waits 100-150, runs 150-200 and stamps the phase's end at 180.
CHAIN = [
    ("S", 0, 0, 1, B),
    ("S", 30, B, 0, C),
    ("S", 50, C, 1, B),
    ("W", 100, A, B, 1),
    ("S", 120, B, 1, 0),
    ("S", 150, 0, 1, A),
    ("S", 200, A, 1, 0),
]


def test_walk_follows_preemption_and_wakeups_back_to_the_start():
    tl = _timeline(CHAIN)
    assert tl.lost == 3 and tl.tgid[B] == 20
    w = tl.walk(A, 20 * US, 180 * US)
    # A: on 150-180, waited 100-150; woken by B: B on 50-100, waited 30-50 (preempted), on 20-30
    assert (w.on_ns, w.wait_ns) == (30 * US + 50 * US + 10 * US, 50 * US + 20 * US)
    assert w.tids == (A, B) and w.stop_ns == 20 * US
    assert w.on_ns + w.wait_ns == 160 * US  # nothing off-CPU: the path ran or waited throughout
    late = schedtrace.parse(_lines(CHAIN), 0, frozenset((10, 20, 30)), since_ns=100 * US)  # the newest stretch
    assert late.first_ns == 100 * US and not late.covers(20 * US, 180 * US) and late.waits[A] == [(100 * US, 150 * US)]


def test_an_interrupts_wakeup_ends_the_walk_what_lies_before_is_off_cpu():
    hard = [e if e[0] != "W" else ("W", 100, A, B, schedtrace.FLAG_HARDIRQ | 1) for e in CHAIN]
    w = _timeline(hard).walk(A, 20 * US, 180 * US)
    assert (w.on_ns, w.wait_ns, w.stop_ns, w.tids) == (30 * US, 50 * US, 100 * US, (A,))


def test_a_softirq_wakeup_is_followed_only_into_the_stacks_threads():
    soft = [e if e[0] != "W" else ("W", 100, A, B, schedtrace.FLAG_SOFTIRQ | 1) for e in CHAIN]
    assert _timeline(soft).walk(A, 20 * US, 180 * US).tids == (A, B)  # B's own send on a local socket
    assert _timeline(soft, own=(10, 30)).walk(A, 20 * US, 180 * US).tids == (A,)  # B only interrupted


def test_preempted_in_kernel_counts_as_runnable_and_coverage():
    tl = _timeline([("S", 0, 0, 1, B), ("S", 10, B, 0x100, C), ("S", 25, C, 1, B), ("S", 40, B, 1, 0)])
    assert tl.waits[B] == [(10 * US, 25 * US)]
    assert tl.covers(5 * US, 35 * US) and not tl.covers(5 * US, 45 * US)
    w = tl.walk(B, 0, 30 * US)
    assert (w.on_ns, w.wait_ns) == (5 * US + 10 * US, 15 * US)


def test_a_switch_in_missing_from_the_record_counts_no_wait_across_it():
    """Seen under a SCHED_FIFO hog: A preempted on one CPU, its switch-in on the other missing, then its
    switch-out to sleep, a timer's wake-up and its run. Without the fix its wait spanned the sleep."""
    events = [
        ("S", 0, 0, 1, A),
        ("S", 10, A, 0x100, C),  # preempted (R+)
        # (A's switch-in on the other CPU at ~40 is not in the record)
        ("S", 50, A, 1, 0),  # ... its switch-out to sleep is
        ("W", 100, A, OUTSIDE, schedtrace.FLAG_HARDIRQ | 1),  # the timer
        ("S", 130, C, 1, A),
        ("S", 160, A, 1, 0),
    ]
    tl = _timeline(events)
    assert tl.missed == 1 and tl.waits[A] == [(100 * US, 130 * US)]
    w = tl.walk(A, 0, 150 * US)
    assert (w.on_ns, w.wait_ns, w.stop_ns) == (20 * US, 30 * US, 100 * US)


def test_a_thread_not_on_a_cpu_at_its_stamp_places_nothing():
    w = _timeline(CHAIN).walk(A, 20 * US, 130 * US)  # A was waiting, not running, at 130
    assert (w.on_ns, w.wait_ns, w.stop_ns) == (0, 0, 130 * US)


def test_the_handoff_split_takes_derived_phases_from_the_kernel_and_leaves_the_wire_unknown():
    """prefill.respond ends at the router's relay, stamped by its loop thread (``kvlens.cpu.tid``):
    walked back from there. The transfer itself stays unknown (its threads poll)."""
    t0 = PF // US
    events = [
        ("S", t0 - 10, 0, 1, B),
        ("W", t0 + 1_000, A, B, 1),  # P's API server (B) wakes the router's loop (A)
        ("S", t0 + 1_500, B, 1, 0),
        ("S", t0 + 4_000, 0, 1, A),  # the loop waited 3 ms for a CPU
        ("S", (KV // US) + 10, A, 1, 0),
    ]
    tl = _timeline(events)
    relay_at = PF + 5 * MS
    wire = {sc.ATTR_CPU_ON_S: 0.0, sc.ATTR_CPU_WAIT_S: 0.0, sc.ATTR_NIXL_XFER_S: 0.005}
    tr = _trace(
        [
            _span("prefill.finished", "prefill", PF, PF),
            _span("relay", "router", relay_at, relay_at + 10 * US, **{sc.ATTR_CPU_TID: A}),
            _span("read.complete", "decode", relay_at + 10 * US, KV, **wire, **{sc.ATTR_CPU_TID: A}),
            _span("kv.ready", "decode", KV, KV),
        ]
    )
    counters = cpusplit.handoff_cpu(tr)
    assert counters.phases_wait_s["prefill.respond"] is None  # the counters cannot place it
    h = cpusplit.handoff_cpu(tr, tl)
    assert h.notes["prefill.respond"] == cpusplit.KERNEL_NOTE
    assert h.phases_wait_s["prefill.respond"] == pytest.approx(0.003)  # A's wait, 1-4 ms after PF
    assert h.phases_on_s["prefill.respond"] == pytest.approx(0.001 + 0.001)  # A 4-5 ms, B 0-1 ms after PF
    assert h.phases_wait_s["read.wire"] is None and h.notes["read.wire"] == cpusplit.WIRE_NOTE
    assert cpusplit.handoff_cpu(tr, _timeline(events[:1])).phases_wait_s["prefill.respond"] is None  # not covered


#: A polls a socket (cookie 7): running 0-40, preempted and runnable 40-90, running 90-300, preempted and
#: runnable 300-400, running 400-500. Data reaches the socket at 60 (while A waits: counted 60-90) and A reads it
#: at 95; data reaches it at 200 while A runs and is read at 210 (no wait); data reaches it at 320, during A's
#: second wait (counted 320-400), read at 410. C (process 30) runs 40-90, is preempted and waits 90-500 with
#: data on its socket 8 since 60, read at 600: counted 90-500, only with its process asked.
POLLING = [
    ("S", 0, 0, 1, A),
    ("S", 40, A, 0, C),
    ("P", 60, 7, 4096, C),
    ("P", 70, 7, 4096, C),
    ("P", 60, 8, 100, C),
    ("S", 90, C, 0, A),
    ("R", 95, 7, A, 0),
    ("P", 200, 7, 4096, A),
    ("R", 210, 7, A, 0),
    ("S", 300, A, 0, B),
    ("P", 320, 7, 4096, B),
    ("S", 400, B, 1, A),
    ("R", 410, 7, A, 0),
    ("S", 500, A, 0, C),
    ("R", 600, 8, C, 0),
]


def test_a_pollers_cpu_wait_counts_only_while_data_waited_for_it():
    tl = _timeline(POLLING, net=True)
    assert tl.pending[A] == [(60 * US, 95 * US), (200 * US, 210 * US), (320 * US, 410 * US)]
    assert tl.starved_ns([10], 0, 500 * US) == 30 * US + 80 * US  # 60-90 and 320-400; not 40-60 nor 300-320
    assert tl.starved_ns([10], 80 * US, 350 * US) == 10 * US + 30 * US  # clipped to the stretch asked for
    assert tl.starved_ns([30], 0, 600 * US) == 410 * US
    assert tl.starved_ns([10, 30], 0, 600 * US) == 440 * US  # 60-500: A's and C's overlap counts once
    assert tl.starved_ns([20], 0, 600 * US) == 0  # B read no socket
    assert (tl.last_read([10], 0, 500 * US), tl.last_read([10], 0, 300 * US)) == (410 * US, 210 * US)
    assert tl.last_read([10], 420 * US, 500 * US) is None and tl.last_read([20], 0, 600 * US) is None
    assert schedtrace.parse(_lines(POLLING), 0).net is False  # the tracepoints were not said to be on


def test_a_thread_that_owes_its_peer_a_reply_waits_as_the_crossing():
    """A thread that read a message from a socket and has not yet answered on it (UCX's rendezvous on one host:
    D reads P's request, copies the KV, sends the acknowledgment) is on the crossing's path: its CPU wait
    between the read and its first send on that socket counts; after the send (spinning for the wire) it does
    not, nor does a send on another socket or one that sent nothing."""
    events = [
        ("S", 0, 0, 1, A),
        ("P", 100, 8, 10, C),  # socket 8's address is known (data reached it); nobody reads it
        ("P", 900, 7, 64, C),  # the request reaches A's socket 7
        ("R", 1_000, 7, A, 0),  # A reads it at 1 ms: it owes the reply from here
        ("X", 1_500, 8, 100, A),  # a send on socket 8: not the reply
        ("S", 2_000, A, 0x100, B),  # A preempted 2-5 ms: the crossing waits for its CPU
        ("S", 5_000, B, 1, A),
        ("X", 5_500, 7, 0, A),  # sent nothing (the socket was full): still owed
        ("X", 6_000, 7, 120, A),  # the reply at 6 ms
        ("S", 7_000, A, 0x100, B),  # preempted 7-9 ms while it spins for the peer: the wire's or the peer's
        ("S", 9_000, B, 1, A),
        ("X", 9_500, 7, 50, A),  # a second send opens nothing
        ("S", 10_000, A, 1, 0),
    ]
    tl = _timeline(events, net=True)
    assert tl.turns == {A: [(1_000 * US, 6_000 * US)]}
    assert tl.starved_ns([10], 0, 10_000 * US) == 3_000 * US
    assert tl.starved_ns([10], 3_000 * US, 10_000 * US) == 2_000 * US  # clipped to the stretch asked for
    assert tl.starved_ns([20, 30], 0, 10_000 * US) == 0  # B and C owed nothing
    assert _timeline([e for e in events if e[0] != "X"], net=True).starved_ns([10], 0, 10_000 * US) == 0
    # the reply from another thread of the process (NIXL's progress thread reads, the worker thread answers):
    # the turn is that thread's, and its wait before its send counts
    other = [
        ("S", 0, 0, 1, A2),
        ("P", 900, 7, 64, C),
        ("R", 1_000, 7, A, 0),  # A reads the request at 1 ms
        ("S", 2_000, A2, 0x100, B),  # A2, which will answer, preempted 2-5 ms
        ("S", 5_000, B, 1, A2),
        ("X", 6_000, 7, 120, A2),
        ("S", 8_000, A2, 1, A),
    ]
    tl = _timeline(other, net=True)
    assert tl.turns == {A2: [(1_000 * US, 6_000 * US)]}
    assert tl.starved_ns([10], 0, 10_000 * US) == 3_000 * US


def test_the_transfer_gets_its_cpu_wait_from_the_tcp_tracepoints():
    """read.wire: unknown without the TCP tracepoints; with them, the time data waited in a socket of the
    request's engines while its reader waited for a CPU (the engine's process from the spans' tids)."""
    start = PF + 5 * MS
    t = start // US
    events = [("S", t - 100, 0, 1, A), ("S", t + 100, A, 0, C), ("P", t + 200, 7, 4096, C),
              ("S", t + 1_200, C, 0, A), ("R", t + 1_300, 7, A, 0),
              # the router's loop (B, process 20) has HTTP data waiting 0.1-2 ms while it waits for a CPU
              ("S", t + 1_400, A, 0, C), ("P", t + 1_500, 8, 512, C), ("W", t + 1_600, B, C, 1),
              ("S", t + 3_400, C, 0, B),
              ("R", t + 3_500, 8, B, 0), ("S", (KV // US) + 10, B, 1, A)]  # fmt: skip
    wire = {sc.ATTR_CPU_ON_S: 0.0, sc.ATTR_CPU_WAIT_S: 0.0, sc.ATTR_NIXL_XFER_S: 0.003, sc.ATTR_CPU_TID: A}
    tr = _trace(
        [
            _span("prefill.finished", "prefill", PF, PF),
            _span("relay", "router", start - 10 * US, start - 5 * US, **{sc.ATTR_CPU_TID: B}),
            _span("read.complete", "decode", start, KV, **wire),
            _span("kv.ready", "decode", KV, KV),
        ]
    )
    assert cpusplit.handoff_cpu(tr, _timeline(events)).notes["read.wire"] == cpusplit.WIRE_NOTE
    h = cpusplit.handoff_cpu(tr, _timeline(events, net=True))
    assert h.notes["read.wire"] == cpusplit.NET_NOTE
    # data there at +0.2 ms, A runnable to +1.2 ms; the router's starved HTTP read is not the transfer's
    assert h.phases_wait_s["read.wire"] == pytest.approx(0.001)
    assert h.phases_on_s["read.wire"] is None  # the pollers spin: their work is not told from polling
    # the READ's other 2 ms (of NIXL's 3) are unknown, not off-CPU: the wire, P turning it round, P starved
    bare = cpusplit.handoff_cpu(tr, _timeline(events))
    assert h.unknown_s == pytest.approx(bare.unknown_s - 0.001)
    assert h.off_cpu_s == pytest.approx(bare.off_cpu_s or 0.0)


def test_push_notification_waits_for_its_reader_then_for_the_engine_loop():
    """write.notify (P's write done -> D's engine loop noticing, kv.ready): up to the notification's read in
    D's process, the data's wait for a starved reader; from there the loop's path, walked back from its end."""
    p = PF // US
    events = [
        ("S", p - 100, 0, 1, A),
        ("S", p + 6_000, A, 0, B),  # D's thread (A) preempted at +6 ms: runnable
        ("P", p + 8_000, 9, 64, B),  # P's notification reaches D's socket at +8 ms
        ("S", p + 12_000, B, 1, A),  # A back on a CPU at +12 ms: 4 ms of it starved
        ("R", p + 12_500, 9, A, 0),  # A takes the notification in
        ("S", p + 14_000, A, 0, B),  # preempted again: waits 14-17
        ("S", p + 17_000, B, 1, A),  # runs 17 ms -> past kv.ready at +20 ms
        ("S", (KV // US) + 10, A, 1, 0),
    ]
    done = {sc.ATTR_CPU_ON_S: 0.0, sc.ATTR_CPU_WAIT_S: 0.0, sc.ATTR_NIXL_XFER_S: 0.003, sc.ATTR_CPU_TID: B}
    tr = _trace(
        [
            _span("prefill.finished", "prefill", PF, PF),
            _span("write.complete", "prefill", PF, PF + 5 * MS, **done),
            _span("kv.ready", "decode", KV, KV, **{sc.ATTR_CPU_TID: A}),
        ]
    )
    h = cpusplit.handoff_cpu(tr, _timeline(events, net=True))
    assert h.notes["write.notify"] == cpusplit.NET_NOTE
    # 8-12 ms: the notification waited for A, runnable; 12.5-20: A ran 12.5-14 and 17-20, waited 14-17
    assert h.phases_wait_s["write.notify"] == pytest.approx(0.004 + 0.003)
    assert h.cpu_on_s == pytest.approx(0.0045)
    # unknown, not off-CPU: write.notify's 5-8 ms and 12-12.5 ms, when the notification was not in D's socket
    # for a starved reader (P's side, the wire), and write.wire's 0-3 ms (no data waited in a socket for it);
    # 12.5-20 ms is walked, all figures. Off-CPU: write.noticed's 3-5 ms only (its counters read 0 and 0)
    assert h.unknown_s == pytest.approx(0.0035 + 0.003)
    assert h.off_cpu_s == pytest.approx(0.002)


def test_load_says_why_there_is_no_record(tmp_path):
    with pytest.raises(schedtrace.SchedUnavailable, match="no kernel scheduler record"):
        schedtrace.load(tmp_path)
    (tmp_path / schedtrace.META).write_text(json.dumps({"offset_ns": 0, "pids": [10, 20]}))
    with pytest.raises(schedtrace.SchedUnavailable, match="has no data"):
        schedtrace.load(tmp_path)
    (tmp_path / schedtrace.TEXT).write_text("\n".join(_lines(CHAIN)))
    assert schedtrace.load(tmp_path).walk(A, 20 * US, 180 * US).tids == (A, B)


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's tracepoints need root")
def test_a_real_recording_walks_a_sleep_and_a_spin(tmp_path):
    """The kernel records a process that sleeps 50 ms and then spins 20 ms
    (a process of its own, one thread: in ours the spin would wait for the
    GIL, which the walk rightly follows into its holder): walked back from
    the spin's end, the spin is on a CPU or waiting for one, however busy the
    machine, and the walk stops at the timer's wake-up, so the sleep is
    off-CPU."""
    import subprocess
    import sys

    from kvlens.stack.schedrec import SchedRecording

    code = (
        "import os, socket, threading, time\n"
        "t0 = time.time_ns(); time.sleep(0.05); end = time.monotonic() + 0.02\n"
        "while time.monotonic() < end: pass\n"
        "t1 = time.time_ns()\n"
        # then data that waits 30 ms in a socket for its reader, asleep: the wire's time, not CPU wait
        "s = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection(s.getsockname())\n"
        "r, _ = s.accept(); c.sendall(b'x' * 100_000); time.sleep(0.03); n = 0\n"
        "while n < 100_000: n += len(r.recv(1 << 20))\n"
        "t2 = time.time_ns(); end = time.monotonic() + 0.01\n"
        # then the reader owes a reply: 10 ms of work, then the reply on the socket it read
        "while time.monotonic() < end: pass\n"
        "r.sendall(b'y' * 10); c.recv(10)\n"
        "print(threading.get_native_id(), t0, t1, t2, time.time_ns(), os.getpid(), flush=True)\n"
    )
    was_mounted = schedtrace.TRACEFS in open("/proc/self/mounts").read()
    with SchedRecording(tmp_path, []):  # no process of "the stack": a softirq's wake-up is never followed
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        live = schedtrace.load(tmp_path)  # while it records: the live buffer, through the holder's namespace
        assert not (tmp_path / schedtrace.TEXT).exists() and live.runs
    assert not (tmp_path / schedtrace.READY).exists()
    assert was_mounted or schedtrace.TRACEFS not in open("/proc/self/mounts").read(), "tracefs left mounted"
    tid, t0, t1, t2, t3, pid = (int(x) for x in out.stdout.split())
    tl = schedtrace.load(tmp_path)
    w = tl.walk(tid, t0, t1)
    assert w.on_ns > 0 and w.on_ns + w.wait_ns >= 19 * MS, w
    assert (t1 - t0) - w.on_ns - w.wait_ns >= 45 * MS, w
    assert w.tids == (tid,), w
    if tl.net:  # the kernel has the TCP tracepoints (this one does)
        (a, r), *_ = [p for p in tl.pending.get(tid, []) if p[0] >= t1]
        assert r - a >= 29 * MS and r <= t2, (a, r)  # the data waited for its sleeping reader
        assert tl.starved_ns([pid], a, r) <= (r - a) - 29 * MS  # asleep is not waiting for a CPU
        # the reply it owed: from its last read to its send on that socket (sock_send_length, matched to the
        # socket tcp_probe named), the 10 ms of work inside
        (rd, sent), *_ = [p for p in tl.turns.get(tid, []) if p[0] >= a]
        assert rd <= t2 and sent - rd >= 10 * MS and sent <= t3, (rd, sent, t2, t3)


def test_up_sched_trace_without_root_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    from kvlens.cli import main
    from kvlens.stack import schedrec

    monkeypatch.setattr(schedrec.os, "geteuid", lambda: 1000)
    rc = main(["up", "--mode", "push", "--sched-trace", "--log-dir", str(tmp_path / "run"), "--model", str(tmp_path)])
    assert rc == 1  # what the machine or user lacks, like --hosts' ip and tc (kvlens.exits)
    assert "--sched-trace needs root" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's tracepoints need root")
def _instances() -> list[str]:
    """The kernel's tracefs instances, looked at from a mount namespace of our own (the host's stays as it was)."""
    import subprocess

    script = f"mountpoint -q {schedtrace.TRACEFS} || mount -t tracefs nodev {schedtrace.TRACEFS}; ls {schedtrace.TRACEFS}/instances"
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], capture_output=True,
                         text=True, timeout=30, check=True)  # fmt: skip
    return out.stdout.split()


def test_a_killed_recorder_leaves_no_instance_no_holder_and_no_mount(tmp_path):
    """SIGKILL to the process that started the recording (nothing of it runs
    its clean-up): the parent-death guard stops the holder, which writes the
    record out and removes its instance; the tracefs it mounted went with its
    own mount namespace."""
    import signal
    import subprocess
    import sys

    import psutil

    mounts_before = open("/proc/self/mounts").read().count("tracefs")
    code = (
        "import os, sys, time\n"
        "from kvlens.stack.schedrec import SchedRecording\n"
        f"r = SchedRecording({str(tmp_path)!r}, [os.getpid()]).start()\n"
        "print(r.instance, flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        instance = p.stdout.readline().strip()
        assert instance.startswith("kvlens-") and instance in _instances()
        kids = psutil.Process(p.pid).children(recursive=True)
        assert kids, "the holder runs under the recording's process"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        _gone, alive = psutil.wait_procs(kids, timeout=120)
        assert not alive, [k.cmdline() for k in alive]
        assert instance not in _instances()
        assert (tmp_path / schedtrace.TEXT).stat().st_size > 0  # written out on the way
        assert open("/proc/self/mounts").read().count("tracefs") == mounts_before
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's tracepoints need root")
def test_a_frozen_record_ends_there_and_a_discarded_one_is_not_written(tmp_path):
    """A stack freezes its record before stopping its children (the text is written once the CPUs are free);
    a benchmark that read it live drops it: nothing written, the instance gone."""
    import time

    from kvlens.stack.schedrec import SchedRecording

    kept = SchedRecording(tmp_path / "kept", []).start()
    kept.freeze()
    time.sleep(0.3)
    frozen_at = time.time_ns()
    time.sleep(0.3)
    kept.stop()
    tl = schedtrace.load(tmp_path / "kept")
    assert tl.runs and tl.last_ns < frozen_at  # nothing recorded after the freeze
    dropped = SchedRecording(tmp_path / "dropped", []).start()
    dropped.stop(keep=False)
    assert not (tmp_path / "dropped" / schedtrace.TEXT).exists()
    assert not [i for i in _instances() if i in (kept.instance, dropped.instance)]


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's tracepoints need root")
def test_the_holder_writes_out_at_real_time_priority_beside_busy_threads(tmp_path):
    """The holder (and the ``cat`` it runs) is SCHED_FIFO: beside a normal-class thread busy on every core
    (NIXL's spinning progress threads, one bound to each core), a plain reader bound to a core waited 20-75 s
    for it, and a ``--hosts`` stack's record ran past the stop's grace (killed, no record)."""
    import subprocess
    import sys

    from kvlens.stack.schedrec import SchedRecording

    spin = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"
    hogs = [
        subprocess.Popen([sys.executable, "-c", spin, str(c)], start_new_session=True) for c in os.sched_getaffinity(0)
    ]
    try:
        rec = SchedRecording(tmp_path, []).start()
        assert rec.meta["holder_fifo"] is True
        assert os.sched_getscheduler(rec.meta["holder_pid"]) == os.SCHED_FIFO
        rec.stop()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert schedtrace.load(tmp_path).runs  # written out, busy cores or not


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's tracepoints need root")
def test_a_holder_killed_past_the_grace_leaves_no_instance(tmp_path, monkeypatch, caplog):
    """A holder that cannot write out within the grace is killed: kvlens removes its instance (its kernel
    memory) itself and says there is no record, instead of leaving both to the next recording."""
    import signal

    from kvlens.stack import schedrec

    monkeypatch.setattr(schedrec, "STOP_GRACE_S", 1.0)
    rec = schedrec.SchedRecording(tmp_path, []).start()
    os.kill(rec.meta["holder_pid"], signal.SIGSTOP)  # it cannot run its trap: killed at the grace's end
    with caplog.at_level("WARNING", logger="kvlens.up"):
        rec.stop()
    assert rec.instance not in _instances()
    assert not (tmp_path / schedtrace.TEXT).exists()
    assert "was not written out within 1 s" in caplog.text and rec.instance in caplog.text


def test_the_records_buffer_size_is_checked(capsys):
    from kvlens.cli import main
    from kvlens.stack.errors import StackError
    from kvlens.stack.schedrec import MIN_CPU_KB, buffer_kb
    from kvlens.stack.spec import StackSpec

    with pytest.raises(StackError, match="1..65536 MiB, got 0"):
        StackSpec(mode="push", sched_buffer_mb=0)
    with pytest.raises(SystemExit) as e:
        main(["up", "--sched-trace", "--sched-buffer-mb", "70000"])
    assert e.value.code == 2 and "out of range 1..65536" in capsys.readouterr().err
    assert buffer_kb(2, 512 * 1024) == 256 * 1024 and buffer_kb(4096, 1024) == MIN_CPU_KB  # shared out, a floor
