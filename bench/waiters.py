"""200 callers waiting on `wait: true` against a stock Daphne, and what the others see.

An agent that never answers (its requests stay SENT: no worker runs), 200 concurrent
`POST /api/a2a/send` with `wait: true` and `timeoutMs` 60 s; once every send is stored,
a few readers read `GET /api/roster/agents` (the plain read). The same readers alone first,
on the same Daphne, give the baseline.

Goal (issue "Faults and forgery", part 0): the readers' p99 while the waiters wait within
2x of alone, no reader gets a 5xx, and every waiter gets its 202 (or its answer).

    .venv/bin/python bench/waiters.py                 # 200 waiters, 60 s; readers 20 x 15 s
    .venv/bin/python bench/waiters.py --waiters 50 --timeout-ms 20000
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from collections import Counter

import common
import readers

GOAL_P99_RATIO = 2.0


def daphne_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def wait_once(port: int, timeout_ms: int, task_id: str, out: list, lock: threading.Lock
              ) -> None:
    conn = http.client.HTTPConnection(common.HOST, port, timeout=timeout_ms / 1000 + 60)
    body = json.dumps({"to": "bench.silent", "wait": True, "timeoutMs": timeout_ms,
                       "taskId": task_id})
    started = time.monotonic()
    try:
        conn.request("POST", "/api/a2a/send", body=body, headers={
            "Authorization": f"Bearer {readers.TOKEN}", "X-OODER-Source": "studio",
            "Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        result = str(response.status)
    except (OSError, http.client.HTTPException) as exc:
        result = f"{type(exc).__name__}"
    finally:
        conn.close()
    with lock:
        out.append((result, time.monotonic() - started))


def read_phase(port: int, count: int, seconds: float) -> dict:
    """`count` readers of GET /api/roster/agents for `seconds`, each on its own keep-alive
    connection."""
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {readers.TOKEN}", "X-OODER-Source": "studio"}

    def read() -> None:
        conn = http.client.HTTPConnection(common.HOST, port, timeout=60)
        while time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                conn.request("GET", "/api/roster/agents", headers=headers)
                response = conn.getresponse()
                response.read()
                status = str(response.status)
            except (OSError, http.client.HTTPException) as exc:
                status = type(exc).__name__
                conn.close()
                conn = http.client.HTTPConnection(common.HOST, port, timeout=60)
            with lock:
                statuses[status] += 1
                latencies.append(time.monotonic() - sent)
        conn.close()

    threads = [threading.Thread(target=read, daemon=True) for _ in range(count)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 90)
    elapsed = time.monotonic() - began
    return {"requests": len(latencies), "rps": round(len(latencies) / elapsed, 1),
            "p50Ms": readers.pct(latencies, 0.5), "p99Ms": readers.pct(latencies, 0.99),
            "maxMs": readers.pct(latencies, 1.0),
            "fivexx": sum(n for k, n in statuses.items() if k.startswith("5")),
            "statuses": dict(statuses)}


def sends_stored(prefix: str, want: int, timeout_s: float) -> int:
    """How many of the waiters' sends are stored, once all are or `timeout_s` passed."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    with psycopg.connect(readers.DATABASE_URL, autocommit=True) as conn:
        while True:
            (n,) = conn.execute("SELECT count(*) FROM a2a_message WHERE task_id LIKE %s",
                                (f"{prefix}%",)).fetchone()
            if n >= want or time.monotonic() > deadline:
                return n
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiters", type=int, default=200)
    ap.add_argument("--timeout-ms", type=int, default=60000)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0, help="each reading phase")
    ap.add_argument("--pool-max", type=int, default=8)
    ap.add_argument("--strict", action="store_true", help="exit 2 when the goal is not met")
    args = ap.parse_args(argv)
    if not 1 <= args.waiters <= 500 or not 1000 <= args.timeout_ms <= 120000:
        raise SystemExit("--waiters 1..500, --timeout-ms 1000..120000")
    common.check_redis()
    readers.database_ready()
    _session, secret = readers.seed()
    from roster import services  # set up by readers.seed()

    services.agent_register(agent_id="bench.silent", node_id="bench-silent-node")

    with readers.daphne_running(secret, "waiters", REACH_DB_POOL_MAX=str(args.pool_max)) as (
            daphne, port, log):
        alone = read_phase(port, args.readers, args.seconds)
        threads_idle = daphne_threads(daphne.pid)
        results: list[tuple[str, float]] = []
        lock = threading.Lock()
        prefix = f"bench-wait-{time.time_ns()}-"
        waiters = [threading.Thread(target=wait_once, daemon=True, args=(
            port, args.timeout_ms, f"{prefix}{i}", results, lock))
            for i in range(args.waiters)]
        began = time.monotonic()
        for thread in waiters:
            thread.start()
        # Read while every waiter waits: its send stored, its first second's reads done.
        stored = sends_stored(prefix, args.waiters, args.timeout_ms / 2000)
        stored_s = time.monotonic() - began
        time.sleep(1.5)
        threads_waiting = daphne_threads(daphne.pid)
        stop, peak = threading.Event(), [0]
        sampler = threading.Thread(target=readers.peak_connections, args=(stop, peak),
                                   daemon=True)
        sampler.start()
        during = read_phase(port, args.readers, args.seconds)
        stop.set()
        sampler.join(5)
        for thread in waiters:
            thread.join(args.timeout_ms / 1000 + 90)
        waited_s = time.monotonic() - began
        log.seek(0)
        logged = log.read()
    outcomes = Counter(result for result, _ in results)
    ratio = (during["p99Ms"] / alone["p99Ms"]) if alone["p99Ms"] and during["p99Ms"] else None
    met = (ratio is not None and ratio <= GOAL_P99_RATIO and during["fivexx"] == 0
           and sum(n for k, n in outcomes.items() if k in ("200", "202")) == args.waiters)
    doc = {"machine": common.machine(), "git": common.git_state(), "args": vars(args),
           "alone": alone, "whileWaiting": during, "p99Ratio": ratio,
           "waiterOutcomes": dict(outcomes), "waitedS": round(waited_s, 1),
           "sendsStored": stored, "sendsStoredAfterS": round(stored_s, 1),
           "daphneThreadsIdle": threads_idle, "daphneThreadsWaiting": threads_waiting,
           "peakPgConnectionsWhileWaiting": peak[0],
           "poolWaitsInLog": logged.count("requests waiting"), "met": met}
    print(f"readers alone:          p50 {common.fmt(alone['p50Ms'])} ms, p99 "
          f"{common.fmt(alone['p99Ms'])} ms, {alone['rps']} req/s, 5xx {alone['fivexx']}")
    print(f"while {args.waiters} wait:     p50 {common.fmt(during['p50Ms'])} ms, p99 "
          f"{common.fmt(during['p99Ms'])} ms, {during['rps']} req/s, 5xx {during['fivexx']}")
    print(f"sends stored: {stored} of {args.waiters} after {stored_s:.1f} s")
    print(f"waiters: {dict(outcomes)} after {waited_s:.0f} s; Daphne threads {threads_idle} "
          f"idle -> {threads_waiting} waiting; PostgreSQL connections at most {peak[0]}")
    shown = "n/a" if ratio is None else f"{ratio:.2f}x"
    print(f"goal: p99 within {GOAL_P99_RATIO:.0f}x ({shown}), no 5xx, every waiter 202/200 "
          f"-> {'MET' if met else 'NOT MET'}")
    path = common.write_result("waiters", doc)
    print(f"results: {path.relative_to(common.ROOT)}")
    return 2 if args.strict and not met else 0


if __name__ == "__main__":
    raise SystemExit(main())
