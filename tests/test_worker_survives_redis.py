"""The stock Celery worker and beat ride out Redis restarts (production shape).

A private redis-server on a free port (never the shared one), the test database, and the
README's commands as subprocesses: `celery -A reachconsole worker -l info` (default prefork
pool) and `celery -A reachconsole beat -l info`, with REACH_BRIDGE=0 (no MQTT bridge). Redis
is killed and started again twice; afterwards the worker must still be alive and still run
what beat schedules: an agent whose lease lapsed long ago is made OFFLINE by the lease sweep.

Celery 5.7.0 fails this: on the connection loss its consumer closes the broken connection
twice (collect(), then close()); the second close finds the Redis channel half-closed and
reads the transport's client, which collect() already cleared, so it dies with
`Unrecoverable error: AttributeError("'NoneType' object has no attribute 'hostname'")`
whenever a task was unacknowledged at that moment (pyproject.toml pins celery<5.7). Before
each restart the test hands the worker a task with an ETA, which it holds unacknowledged, so
that moment is reached every time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import connection
from django.utils import timezone

from roster import services
from roster.models import Agent
from tests.conftest import bus_heard, expect_real_services, stop_process
from tests.mqtt import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the virtualenv's bin: celery, supervisord
CONNECTED = "Connected to redis://"  # the worker's line on every (re)connection


def redis_server_or_skip() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    reason = "redis-server is not installed (apt-get install redis-server)"
    if expect_real_services():
        pytest.fail(f"{reason}, and REACH_EXPECT_REAL_SERVICES=1")
    pytest.skip(reason)


def wait_for(check, timeout: float, what: str, interval: float = 0.2):
    """Poll `check()` until it returns something true; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} within {timeout} s (last: {last!r})")


class PrivateRedis:
    """redis-server on a free loopback port of its own, without persistence."""

    def __init__(self, binary: str, log_path: Path):
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        wait_for(self.ping, 10, f"redis-server did not answer on port {self.port}", 0.05)

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, down_s: float) -> None:
        """A crash and a restart on the same port: the data is gone, as after a failover."""
        self.kill()
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        self.kill()
        self.log.close()


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(redis_server_or_skip(), tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def subprocess_database_url() -> str:
    """The test database as a DATABASE_URL for processes started by the test."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{Path(db['NAME']).resolve()}"
    if connection.vendor == "postgresql":
        auth = quote(db["USER"] or "", safe="")
        if db["PASSWORD"]:
            auth += ":" + quote(db["PASSWORD"], safe="")
        host = db["HOST"] or "127.0.0.1"
        return f"postgres://{auth}@{host}:{db['PORT'] or 5432}/{quote(db['NAME'], safe='')}"
    pytest.skip(f"no DATABASE_URL for a {connection.vendor} test database")


def app_env(run_dir: Path, redis_url: str) -> dict[str, str]:
    """The environment of the console's processes: this run's Redis and database, no MQTT
    bridge, short leases. The sweeps keep their default pace: a worker flooded with them
    has its prefetch full and stops reading its queue, which hides the failure below."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "MQTT_URL"} and not k.startswith("CELERY_")}
    env.update(
        DATABASE_URL=subprocess_database_url(), REDIS_URL=redis_url, REACH_BRIDGE="0",
        REACH_RUN_DIR=str(run_dir), REACH_LEASE_TTL_MS="2000", REACH_HEARTBEAT_MS="500",
        PYTHONUNBUFFERED="1",
    )
    return env


def celery(args: list[str], env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "celery"), "-A", "reachconsole", *args, "-l", "info"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def log_text(path: Path) -> str:
    return path.read_text(errors="replace")


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(log_text(path).splitlines()[-lines:])


def hold_an_unacknowledged_task(redis_url: str) -> None:
    """Give the worker a task it holds unacknowledged while it keeps consuming: one with an
    ETA five minutes away (acks_late). A Redis restart then finds the worker mid-delivery,
    as it often does in production: the moment Celery 5.7.0 cannot survive."""
    import redis
    from celery import Celery

    sender = Celery("probe", broker=redis_url)
    try:
        task_id = sender.send_task("roster.tasks.nodes_sweep", countdown=300).id
    finally:
        sender.close()
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: any(task_id.encode() in raw for raw in client.hvals("unacked")),
                 15, "the worker did not take the ETA task")
    finally:
        client.close()


def assert_sweeps_run(timeout: float = 30) -> None:
    """The worker runs beat's lease sweep: an agent whose lease ran out long ago goes OFFLINE.
    The bus counts as heard all along (no bridge runs here, and the console judges leases
    only over time it heard the bus)."""
    moment = timezone.now()
    bus_heard(since=moment - timedelta(hours=1), until=moment + timedelta(hours=1))
    agent_id = f"probe.lapsed-{uuid.uuid4().hex[:8]}"
    services.agent_register(agent_id=agent_id, node_id="probe-node",
                            now=moment - timedelta(minutes=10))
    wait_for(
        lambda: Agent.objects.get(agent_id=agent_id).status == Agent.Status.OFFLINE,
        timeout, f"the lease sweep did not make {agent_id} OFFLINE", 0.25,
    )


@pytest.mark.django_db(transaction=True)
def test_the_worker_and_beat_ride_out_redis_restarts(private_redis, tmp_path):
    env = app_env(tmp_path, private_redis.url)
    worker_log, beat_log = tmp_path / "worker.log", tmp_path / "beat.log"
    with open(worker_log, "w") as wlog, open(beat_log, "w") as blog:
        worker = celery(["worker"], env, wlog)
        beat = celery(["beat"], env, blog)
        try:
            wait_for(lambda: " ready." in log_text(worker_log), 60,
                     "the worker did not start")
            for restart in (1, 2):
                connects = log_text(worker_log).count(CONNECTED)
                hold_an_unacknowledged_task(private_redis.url)
                private_redis.restart(down_s=1.5)
                wait_for(
                    lambda n=connects: (worker.poll() is not None
                                        or log_text(worker_log).count(CONNECTED) > n),
                    30, f"the worker did not reconnect after Redis restart {restart}",
                )
                assert worker.poll() is None, (
                    f"the worker died on Redis restart {restart}:\n{tail(worker_log)}")
                assert beat.poll() is None, (
                    f"beat died on Redis restart {restart}:\n{tail(beat_log)}")

            assert_sweeps_run()
            assert worker.poll() is None, f"the worker died:\n{tail(worker_log)}"
            assert beat.poll() is None, f"beat died:\n{tail(beat_log)}"
            fatal = [line for line in log_text(worker_log).splitlines()
                     if "Unrecoverable error" in line]
            assert not fatal, "\n".join(fatal)
        finally:
            stop_process(worker)
            stop_process(beat)
