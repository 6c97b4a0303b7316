"""One console, one name, whichever process asks and however it spells its database's
address; two consoles sharing one Redis server never see each other's events or cache keys
(reachconsole/core/identity.py: the name is read from the database itself)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from django.conf import settings

from tests.conftest import expect_real_services

ROOT = Path(__file__).resolve().parent.parent
SHOW = ("import django; django.setup(); import json; "
        "from django.core.cache import cache; from channels.layers import get_channel_layer; "
        "from reachconsole.core.identity import console_id; "
        "layer = get_channel_layer(); "
        "print(json.dumps([console_id(), cache.make_key('k'), "
        "layer.__dict__.get('_kwargs', {}).get('prefix', '')]))")


def _names(tmp_path, **env) -> list[str]:
    """[the console's name, a cache key, the channel layer's prefix] in a process of its own
    with this environment."""
    run = {**os.environ, "REACH_RUN_DIR": str(tmp_path), **env}
    for name in ("REACH_CONSOLE_ID", "REACH_CHANNEL_PREFIX"):
        if name not in env:
            run.pop(name, None)
    out = subprocess.run(  # noqa: S603
        [sys.executable, "-c", SHOW], cwd=ROOT,
        env={**run, "DJANGO_SETTINGS_MODULE": "reachconsole.settings"},
        capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_spellings_of_one_sqlite_database_are_one_console(tmp_path):
    (tmp_path / "sub").mkdir()
    direct = _names(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/console.sqlite3")
    around = _names(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/sub/../console.sqlite3")
    other = _names(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/other.sqlite3")
    assert direct[0].startswith("reach-") and direct[0] == around[0]
    assert other[0] != direct[0]
    named = _names(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/console.sqlite3",
                   REACH_CONSOLE_ID="ops-eu")
    assert named[0] == "ops-eu"


def _postgres_or_skip() -> None:
    try:
        psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", connect_timeout=3
                        ).close()
    except psycopg.OperationalError as exc:
        if expect_real_services():
            pytest.fail(f"PostgreSQL on 127.0.0.1:5432 must answer in CI's second run: {exc}")
        pytest.skip(f"needs PostgreSQL on 127.0.0.1:5432 ({exc})")


@pytest.fixture
def two_databases():
    _postgres_or_skip()
    names = ["reach_identity_a", "reach_identity_b"]
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres",
                         autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name}")
            conn.execute(f"CREATE DATABASE {name}")
    yield names
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres",
                         autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_localhost_and_127_0_0_1_are_one_console_and_each_database_its_own(
        tmp_path, two_databases):
    """What a second Daphne pointed at `localhost` did: it became another console, with
    other cache and channel-layer prefixes, and saw no events and empty counters."""
    a, b = two_databases
    redis = {"REDIS_URL": "redis://127.0.0.1:6379/0"}
    numeric = _names(tmp_path, DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{a}", **redis)
    named = _names(tmp_path, DATABASE_URL=f"postgres://postgres@localhost:5432/{a}", **redis)
    other = _names(tmp_path, DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{b}", **redis)
    assert numeric == named  # the name, the cache's keys and the channel layer's prefix
    assert numeric[1] == f"{numeric[0]}:1:k" and numeric[2] == numeric[0]
    assert other[0] != numeric[0]
    # REACH_CHANNEL_PREFIX still names the channel layer's alone.
    mine = _names(tmp_path, DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{a}",
                  REACH_CHANNEL_PREFIX="ops-layer", **redis)
    assert mine == [numeric[0], numeric[1], "ops-layer"]


def test_events_of_one_console_never_reach_another_on_the_same_redis(tmp_path, two_databases):
    if not settings.REDIS_URL:
        if expect_real_services():
            pytest.fail("REDIS_URL must be set in CI's second run")
        pytest.skip("needs Redis (REDIS_URL)")
    from channels_redis.pubsub import RedisPubSubChannelLayer

    a, b = two_databases
    prefix_a = _names(tmp_path, DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{a}",
                      REDIS_URL=settings.REDIS_URL)[2]
    prefix_b = _names(tmp_path, DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{b}",
                      REDIS_URL=settings.REDIS_URL)[2]
    assert prefix_a != prefix_b

    async def run() -> tuple[dict, bool]:
        layer_a = RedisPubSubChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix_a)
        layer_b = RedisPubSubChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix_b)
        try:
            listen_a, listen_b = await layer_a.new_channel(), await layer_b.new_channel()
            await layer_a.group_add("a2a.timeline", listen_a)
            await layer_b.group_add("a2a.timeline", listen_b)
            await asyncio.sleep(0.2)  # subscriptions are in place
            await layer_a.group_send("a2a.timeline", {"type": "a2a.events", "events": [1]})
            got_a = await asyncio.wait_for(layer_a.receive(listen_a), 5)
            try:
                await asyncio.wait_for(layer_b.receive(listen_b), 1)
                leaked = True
            except TimeoutError:
                leaked = False
            return got_a, leaked
        finally:
            await layer_a.flush()
            await layer_b.flush()

    got_a, leaked = asyncio.run(run())
    assert got_a["events"] == [1]
    assert leaked is False


def test_a_bridge_started_while_the_database_is_down_waits_for_it(tmp_path):
    """The bridge's client id carries the name, which needs the database: a bridge process
    started while it is down waits for it (and says so) instead of failing to start, and
    still stops cleanly."""
    from tests.mqtt import free_port

    port = free_port()  # nothing listens there
    env = {**os.environ, "DATABASE_URL": f"postgres://postgres@127.0.0.1:{port}/reach_down",
           "REDIS_URL": "redis://127.0.0.1:1/0", "MQTT_URL": "mqtt://127.0.0.1:1",
           "REACH_RUN_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "reachconsole.settings"}
    env.pop("REACH_CONSOLE_ID", None)
    log_path = tmp_path / "bridge.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen([sys.executable, "manage.py", "mqtt_bridge"], cwd=ROOT,  # noqa: S603
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while b"identity is not known yet" not in log_path.read_bytes():
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
            time.sleep(2)  # it goes on waiting: a second try, still alive
            assert proc.poll() is None, log_path.read_text()[-3000:]
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(30)
    assert code == 0, log_path.read_text()[-3000:]
    assert log_path.read_bytes().count(b"identity is not known yet") >= 2
