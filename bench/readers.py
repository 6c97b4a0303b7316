"""Many concurrent readers of `/` and `/api/roster/agents` against a stock Daphne.

Compares the PostgreSQL connection pool (REACH_DB_POOL=1, the default) with plain
CONN_MAX_AGE=0 (REACH_DB_POOL=0, a new connection per request). Each mode starts
`daphne -b 127.0.0.1 -p <free port> reachconsole.asgi:application` on its own database
(`reach_pool_bench`, created and migrated here), Redis on 127.0.0.1 for the cache, then
runs the readers for a fixed time. Loopback only; bounded to 500 readers and 60 s a run.

    .venv/bin/python bench/readers.py                     # 200 readers, 15 s, pool then plain
    .venv/bin/python bench/readers.py --modes pool --pool-max 4,8,16
    .venv/bin/python bench/readers.py --readers 100 --seconds 10 --repeat 2

Prints one table row per run and writes the JSON to bench/results/readers-<time>.json.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import common

DB = "reach_pool_bench"
DATABASE_URL = f"postgres://postgres@{common.HOST}:{common.PG_PORT}/{DB}"
TOKEN = "bench-readers-token-0123456789"
PATHS = ("/", "/api/roster/agents")
MAX_READERS, MAX_SECONDS = 500, 60.0
AGENTS = 50
assert DB not in common.FORBIDDEN_DBS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((common.HOST, 0))
        return sock.getsockname()[1]


def database_ready() -> None:
    import psycopg

    with psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                         dbname="postgres", autocommit=True, connect_timeout=5) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f'CREATE DATABASE "{DB}"')
    done = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                          cwd=common.ROOT, env={**os.environ, "DATABASE_URL": DATABASE_URL},
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"migrating {DB} failed:\n{done.stderr[-3000:]}")


def seed() -> tuple[str, str]:
    """A user with a session (the page needs a login) and some agents to list. Runs on the
    embedded cache and layer: nothing of ours reaches the shared Redis."""
    os.environ.update(DJANGO_SETTINGS_MODULE="reachconsole.settings", DATABASE_URL=DATABASE_URL,
                      REACH_LOG_LEVEL="WARNING")
    for name in ("REDIS_URL", "MQTT_URL"):
        os.environ.pop(name, None)
    common.project_on_path()
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.db import connection
    from django.test import Client

    from reachconsole.core.roles import VIEWER
    from roster import services

    user, _ = get_user_model().objects.get_or_create(username="bench-reader")
    # A viewer: an account in no role may not read the pages or the streams.
    user.groups.add(Group.objects.get(name=VIEWER))
    for i in range(AGENTS):
        services.agent_register(agent_id=f"bench.reader{i}", node_id=f"bench-node-{i % 5}")
    client = Client()
    client.force_login(user)
    # Hand our connections back: the peak counted during a run is Daphne's alone.
    connection.close()
    connection.close_pool()
    return client.cookies[settings.SESSION_COOKIE_NAME].value, settings.SECRET_KEY


class Readers:
    def __init__(self, port: int, session: str, count: int, seconds: float):
        self.port, self.count, self.seconds = port, count, seconds
        self.headers = {
            "/": {"Cookie": f"sessionid={session}"},
            "/api/roster/agents": {"Authorization": f"Bearer {TOKEN}",
                                   "X-OODER-Source": "studio"},
        }
        self.lock = threading.Lock()
        self.latencies: dict[str, list[float]] = {p: [] for p in PATHS}
        self.statuses: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.bodies_5xx: Counter[str] = Counter()

    def run(self) -> float:
        start = threading.Barrier(self.count + 1)
        threads = [threading.Thread(target=self._read, args=(start, i), daemon=True)
                   for i in range(self.count)]
        for thread in threads:
            thread.start()
        start.wait()
        began = time.monotonic()
        self.deadline = began + self.seconds
        for thread in threads:
            thread.join(self.seconds + 60)
        return time.monotonic() - began

    def _read(self, start: threading.Barrier, index: int) -> None:
        conn = http.client.HTTPConnection(common.HOST, self.port, timeout=30)
        start.wait()
        turn = index
        while time.monotonic() < self.deadline:
            path = PATHS[turn % 2]
            turn += 1
            sent = time.monotonic()
            try:
                conn.request("GET", path, headers=self.headers[path])
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                with self.lock:
                    self.errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
                conn.close()
                conn = http.client.HTTPConnection(common.HOST, self.port, timeout=30)
                continue
            took = time.monotonic() - sent
            with self.lock:
                self.statuses[f"{path} {response.status}"] += 1
                self.latencies[path].append(took)
                if response.status >= 500:
                    self.bodies_5xx[body[:160].decode("utf-8", "replace")] += 1
        conn.close()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def peak_connections(stop: threading.Event, peak: list[int]) -> None:
    import psycopg

    with psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                         dbname="postgres", autocommit=True) as conn:
        while not stop.wait(0.25):
            (count,) = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                    (DB,)).fetchone()
            peak[0] = max(peak[0], count)


@contextmanager
def daphne_running(secret: str, tag: str, **settings: str
                   ) -> Iterator[tuple[subprocess.Popen, int, IO[str]]]:
    """A stock Daphne on a free port, on the bench database and Redis, until the block
    ends: (the process, its port, its log so far)."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": DATABASE_URL, "REDIS_URL": common.REDIS_URL,
           "DJANGO_SECRET_KEY": secret, "REACH_SERVICE_TOKENS": TOKEN,
           "REACH_CHANNEL_PREFIX": common.run_tag(tag), "REACH_LOG_LEVEL": "WARNING",
           **settings}
    env.pop("MQTT_URL", None)
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        daphne = subprocess.Popen(
            [str(Path(sys.executable).parent / "daphne"), "-b", common.HOST, "-p", str(port),
             "reachconsole.asgi:application"],
            cwd=common.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port)
            yield daphne, port, log
        finally:
            daphne.send_signal(signal.SIGINT)
            try:
                daphne.wait(20)
            except subprocess.TimeoutExpired:
                daphne.kill()


def run_once(mode: str, pool_max: int, args, session: str, secret: str) -> dict:
    with daphne_running(secret, "readers", REACH_DB_POOL="1" if mode == "pool" else "0",
                        REACH_DB_POOL_MAX=str(pool_max)) as (daphne, port, log):
        cpu_before = daphne_cpu(daphne.pid)
        stop, peak = threading.Event(), [0]
        sampler = threading.Thread(target=peak_connections, args=(stop, peak), daemon=True)
        sampler.start()
        readers = Readers(port, session, args.readers, args.seconds)
        elapsed = readers.run()
        stop.set()
        sampler.join(5)
        cpu = daphne_cpu(daphne.pid) - cpu_before
        log.seek(0)
        too_many = log.read().count("too many clients")
    every = [x for values in readers.latencies.values() for x in values]
    return {
        "mode": mode, "poolMax": pool_max if mode == "pool" else None,
        "readers": args.readers, "seconds": round(elapsed, 1), "requests": len(every),
        "rps": round(len(every) / elapsed, 1),
        "okRps": round(sum(n for k, n in readers.statuses.items() if k.endswith(" 200"))
                       / elapsed, 1),
        "p50Ms": pct(every, 0.50), "p99Ms": pct(every, 0.99), "maxMs": pct(every, 1.0),
        "byPath": {p: {"p50Ms": pct(v, 0.5), "p99Ms": pct(v, 0.99), "count": len(v)}
                   for p, v in readers.latencies.items()},
        "statuses": dict(readers.statuses), "errors": dict(readers.errors),
        "bodies5xx": dict(readers.bodies_5xx.most_common(5)),
        "peakPgConnections": peak[0], "daphneCpuS": round(cpu, 1),
        "tooManyClientsInLog": too_many,
    }


def wait_healthy(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(common.HOST, port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"daphne did not answer on port {port} within {timeout} s")


def daphne_cpu(pid: int) -> float:
    return common._stat_cpu(f"/proc/{pid}/stat")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--modes", default="pool,plain", help="pool, plain, or both (in order)")
    ap.add_argument("--pool-max", default="8", help="REACH_DB_POOL_MAX; a list runs each")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    if not 1 <= args.readers <= MAX_READERS or not 1 <= args.seconds <= MAX_SECONDS:
        raise SystemExit(f"--readers 1..{MAX_READERS}, --seconds 1..{MAX_SECONDS:.0f}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - {"pool", "plain"}:
        raise SystemExit("--modes takes pool and/or plain")
    common.check_redis()
    database_ready()
    session, secret = seed()

    runs = []
    for _ in range(args.repeat):
        for mode in modes:
            for pool_max in ([int(n) for n in args.pool_max.split(",")] if mode == "pool"
                             else [0]):
                result = run_once(mode, pool_max, args, session, secret)
                runs.append(result)
                print_run(result)
    path = common.write_result("readers", {"machine": common.machine(), "runs": runs})
    print(f"\nwrote {path.relative_to(common.ROOT)}")
    return 0


def print_run(r: dict) -> None:
    ok = sum(n for k, n in r["statuses"].items() if k.endswith(" 200"))
    five = sum(n for k, n in r["statuses"].items() if k.split()[-1].startswith("5"))
    label = f"pool max {r['poolMax']}" if r["mode"] == "pool" else "CONN_MAX_AGE=0"
    print(common.table(
        ["mode", "req/s", "200/s", "p50 ms", "p99 ms", "max ms", "200", "5xx", "errors",
         "peak conns", "daphne cpu s"],
        [[label, common.fmt(r["rps"]), common.fmt(r["okRps"]), common.fmt(r["p50Ms"], 0),
          common.fmt(r["p99Ms"], 0), common.fmt(r["maxMs"], 0), str(ok), str(five),
          str(sum(r["errors"].values())), str(r["peakPgConnections"]),
          common.fmt(r["daphneCpuS"])]]))
    for path, stats in r["byPath"].items():
        print(f"  {path}: {stats['count']} answers, p50 {common.fmt(stats['p50Ms'], 0)} ms, "
              f"p99 {common.fmt(stats['p99Ms'], 0)} ms")
    for text, n in list(r["errors"].items())[:5]:
        print(f"  error x{n}: {text}")
    for text, n in r["bodies5xx"].items():
        print(f"  5xx x{n}: {text[:100]!r}")
    if r["tooManyClientsInLog"]:
        print(f"  daphne log: 'too many clients' x{r['tooManyClientsInLog']}")


if __name__ == "__main__":
    sys.exit(main())
