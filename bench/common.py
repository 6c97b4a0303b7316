"""What the benchmarks share: where the services are, the bench database, result files.

Every bench talks to 127.0.0.1 only and to its own database, MQTT topic prefix, client ids
and channel-layer prefix, so that a test suite running at the same time is not disturbed.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"

HOST = "127.0.0.1"
PG_PORT, REDIS_PORT, MQTT_PORT = 5432, 6379, 1883
BENCH_DB = "reachconsole_bench"
DATABASE_URL = f"postgres://postgres@{HOST}:{PG_PORT}/{BENCH_DB}"
REDIS_URL = f"redis://{HOST}:{REDIS_PORT}/0"
# bench/ingest.py --worker's Celery worker: its queue, cache and channel layer apart.
WORKER_REDIS_URL = f"redis://{HOST}:{REDIS_PORT}/14"
MQTT_URL = f"mqtt://{HOST}:{MQTT_PORT}"
# The databases the test suite owns: a bench must never touch them.
FORBIDDEN_DBS = frozenset({"reachconsole", "test_reachconsole"})


def project_on_path() -> None:
    """Scripts run as `python bench/x.py` see bench/ first; the project lives one level up."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def run_tag(kind: str) -> str:
    """A fresh name for this run: topic prefix, client ids and layer prefix all derive
    from it, so nothing we publish can reach another run or a test."""
    return f"bench{kind}{secrets.token_hex(4)}"


def redis_cleanup(tag: str, *, url: str | None = None) -> None:
    """Leave nothing of ours in Redis: the core layer keeps group keys for a day, and the
    console's metric counters (cache keys under our prefix) never expire."""
    import redis

    client = redis.Redis.from_url(url or REDIS_URL)
    keys = list(client.scan_iter(match=f"{tag}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def django_setup(*, channel_prefix: str, topic_prefix: str = "bench", node_id: str = "") -> None:
    """Configure Django the way production does, against the bench database only."""
    assert BENCH_DB not in FORBIDDEN_DBS
    os.environ["DJANGO_SETTINGS_MODULE"] = "reachconsole.settings"
    os.environ["DATABASE_URL"] = DATABASE_URL
    os.environ["REDIS_URL"] = REDIS_URL
    # Our own channel-layer prefix: events must not reach a test's consumers.
    os.environ["REACH_CHANNEL_PREFIX"] = channel_prefix
    os.environ["MQTT_TOPIC_PREFIX"] = topic_prefix
    if node_id:
        os.environ["REACH_NODE_ID"] = node_id
    os.environ.setdefault("REACH_LOG_LEVEL", "WARNING")
    project_on_path()
    import django
    from django.conf import settings

    django.setup()
    # The metric counters live in the shared cache; keep ours apart from a test run's.
    # Safe only because nothing has touched the cache yet.
    settings.CACHES["default"]["KEY_PREFIX"] = channel_prefix
    assert settings.DATABASES["default"]["NAME"] == BENCH_DB, "not the bench database"


def write_result(kind: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = RESULTS / f"{kind}-{stamp}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0],
            "platform": sys.platform}


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    for row in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(out)


# --- CPU accounting: who burned the two cores during a run -----------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SERVICES = {"postgres": "postgres", "mosquitto": "mosquitto", "redis-server": "redis"}


def stat_cpu_with_children(path: str) -> float:
    """utime + stime + cutime + cstime of /proc/<pid>/stat, in seconds: the process's own
    CPU (its ended threads' too) and that of its children it has reaped."""
    with open(path, encoding="ascii", errors="replace") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / _TICK


def _stat_cpu(path: str) -> float:
    """utime + stime of /proc/<pid>[/task/<tid>]/stat, in seconds."""
    with open(path, encoding="ascii") as fh:
        # The command name may hold spaces; the fields we want come after its ')'.
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far: this process's threads by name, and the services by name.

    Services are summed over all their processes, so work for a test suite running at
    the same time lands here too: read them as an upper bound.
    """
    import threading

    out: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            cpu = _stat_cpu(f"/proc/self/task/{thread.native_id}/stat")
        except (OSError, TypeError):
            continue
        name = thread.name.split("-benchi")[0].split("-reach-")[0]
        out[f"thread:{name}"] = out.get(f"thread:{name}", 0.0) + cpu
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            label = SERVICES.get((proc / "comm").read_text(encoding="ascii").strip())
            if label:
                out[label] = out.get(label, 0.0) + _stat_cpu(str(proc / "stat"))
        except OSError:
            continue
    return out


def process_tree(root: int) -> list[int]:
    """`root` and every live process under it."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "stat", encoding="ascii", errors="replace") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in sorted(after)
            if after[k] - before.get(k, 0.0) > 0.0005}


# --- the services -------------------------------------------------------------------------------
class ServiceDown(Exception):
    """A service the benches need is not there; the message says what to do."""


def check_postgres() -> None:
    """Reachable, and the bench database exists (created here when it does not)."""
    import psycopg

    try:
        with psycopg.connect(host=HOST, port=PG_PORT, user="postgres",
                             dbname="postgres", connect_timeout=5, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                  (BENCH_DB,)).fetchone()
            if not exists:
                print(f"creating database {BENCH_DB}")
                conn.execute(f'CREATE DATABASE "{BENCH_DB}"')
    except psycopg.Error as exc:
        raise ServiceDown(
            f"PostgreSQL is not reachable at {HOST}:{PG_PORT} as user postgres "
            f"({exc}). Start it (pg_ctlcluster <version> main start) and run make bench again."
        ) from exc


def check_redis() -> None:
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        client.ping()
        client.close()
    except redis.RedisError as exc:
        raise ServiceDown(
            f"Redis is not reachable at {REDIS_URL} ({exc}). Start it "
            "(redis-server --daemonize yes --bind 127.0.0.1) and run make bench again."
        ) from exc


def check_mosquitto() -> None:
    import threading

    import paho.mqtt.client as mqtt

    connected = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=run_tag("chk"),
                         protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, u, f, rc, p: rc.is_failure or connected.set()
    try:
        client.connect(HOST, MQTT_PORT, keepalive=10)
    except OSError as exc:
        raise ServiceDown(
            f"Mosquitto is not reachable at {MQTT_URL} ({exc}). Start it "
            "(mosquitto -d -c /etc/mosquitto/mosquitto.conf) and run make bench again."
        ) from exc
    client.loop_start()
    ok = connected.wait(10)
    client.disconnect()
    client.loop_stop()
    if not ok:
        raise ServiceDown(f"Mosquitto at {MQTT_URL} accepted TCP but sent no CONNACK "
                          "for an MQTT 5 client within 10 s.")


def services_check() -> None:
    """Fail before measuring anything, in words, when a service is not there."""
    for check in (check_postgres, check_redis, check_mosquitto):
        check()


def git_state() -> dict[str, Any]:
    """Which code was measured: the commit, and whether the tree had changes on top."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        return done.stdout.strip()

    # bench/ itself is left out: what matters is the console code under measurement.
    changed = git("status", "--porcelain", "--", ".", ":!bench").splitlines()
    return {"head": git("rev-parse", "--short", "HEAD"), "changed_outside_bench": changed}


# Zero values for NOT NULL columns Django fills in Python (it sets no database defaults).
_ZERO_BY_TYPE = {"boolean": False, "integer": 0, "bigint": 0, "smallint": 0,
                 "character varying": "", "text": "", "jsonb": "{}"}


def unfilled_required(conn: Any, table: str, filled: tuple[str, ...]) -> dict[str, Any]:
    """NOT NULL columns without a default that `filled` does not cover, with the value
    Django would give an observed row (False, 0, ''): the schema grows while the benches
    stay put, and a bench row must still fit."""
    rows = conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = %s "
        "AND is_nullable = 'NO' AND column_default IS NULL AND is_identity = 'NO'",
        (table,)).fetchall()
    missing = {name: kind for name, kind in rows if name not in filled}
    unknown = [f"{n} ({k})" for n, k in missing.items() if k not in _ZERO_BY_TYPE]
    if unknown:
        raise RuntimeError(f"{table} has required columns the bench cannot fill: {unknown}")
    return {name: _ZERO_BY_TYPE[kind] for name, kind in missing.items()}


def migrate() -> None:
    """The schema follows the code: migrate the bench database every time (quick when
    there is nothing to do)."""
    env = {**os.environ, "DATABASE_URL": DATABASE_URL}
    done = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ServiceDown(f"migrating {BENCH_DB} failed:\n{done.stderr[-3000:]}")


def signed_in_client(username: str, *codenames: str):
    """The bench database migrated, and a Django test client signed in as `username`
    (created on first use) holding these permissions: how the page benches read pages."""
    from django.conf import settings
    from django.contrib.auth.models import Group, Permission, User
    from django.core.management import call_command
    from django.test import Client

    from reachconsole.core.roles import VIEWER

    call_command("migrate", verbosity=0)
    settings.ALLOWED_HOSTS = ["*"]
    user = User.objects.filter(username=username).first() or User.objects.create_user(
        username, password=f"{username}-pw")
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    # A viewer at least: an account in no role sees only the page that says whom to ask.
    user.groups.add(Group.objects.get(name=VIEWER))
    client = Client()
    client.force_login(user)
    return client


# --- what the history benches share (bench/payloads.py, bench/retention.py) ---------------
class Writer(threading.Thread):
    """Inserts one message every 10 ms and keeps each insert's latency."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            n = 0
            while not self.stop.is_set():
                n += 1
                started = time.perf_counter()
                conn.execute(
                    "INSERT INTO a2a_message (message_id, task_id, idempotency_key, message_type,"
                    " direction, status, from_agent_id, to_agent_id, target_node_id,"
                    " origin_node_id, reply_node_id, conversation_id, scene_group_id,"
                    " session_id, topic, headers, payload, error, attempt, in_reply_to,"
                    " created_at, updated_at, held) VALUES (%s, %s, '', 'TASK_REQUEST', 'SEND',"
                    " 'PUBLISHED', 'console', 'ns1.agent1', 'node-1', 'console', 'console', '',"
                    " '', '', '', '{}', '{\"q\": 1}', '', 1, '', now(), now(), false)",
                    [f"w-{time.time_ns()}-{n}", f"w-task-{n}"])
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.01)

    def window(self) -> tuple[int, float, float]:
        """Inserts since the last call, their median and slowest ms; starts a new window."""
        seen, self.latencies = self.latencies, []
        if not seen:
            return 0, 0.0, 0.0
        return len(seen), statistics.median(seen) * 1000, max(seen) * 1000


def calls_until_none(call) -> tuple[list[tuple[int, float]], int, float]:
    """`call()` again and again, as beat would each minute, until it does nothing: each
    call's (count, seconds), the sum of the counts and the whole time."""
    calls, total, started = [], 0, time.monotonic()
    while True:
        t0 = time.monotonic()
        n = call()
        calls.append((n, time.monotonic() - t0))
        total += n
        if n == 0:
            return calls, total, time.monotonic() - started
