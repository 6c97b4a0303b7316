"""Two consoles sharing one Redis server never see each other's events or cache keys: the
channel-layer and cache prefixes derive from the console's identity (its database)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import expect_real_services

ROOT = Path(__file__).resolve().parent.parent
SHOW = ("from django.conf import settings; import json; print(json.dumps("
        "[settings.CHANNEL_LAYERS['default']['CONFIG']['prefix'], "
        "settings.CACHES['default']['KEY_PREFIX']]))")


def _prefixes(tmp_path, **env) -> list[str]:
    run = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379/0",
           "REACH_RUN_DIR": str(tmp_path), **env}
    run.pop("REACH_CONSOLE_ID", None)
    run.pop("REACH_CHANNEL_PREFIX", None)
    run.update(env)
    out = subprocess.run(  # noqa: S603
        [sys.executable, "-c", "import django; django.setup(); " + SHOW], cwd=ROOT,
        env={**run, "DJANGO_SETTINGS_MODULE": "reachconsole.settings"},
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_console_gets_its_own_prefixes(tmp_path):
    a = _prefixes(tmp_path, DATABASE_URL="postgres://u@db.example:5432/console_a")
    b = _prefixes(tmp_path, DATABASE_URL="postgres://u@db.example:5432/console_b")
    again = _prefixes(tmp_path, DATABASE_URL="postgres://u@db.example:5432/console_a")
    assert a[0] == a[1] and a[0].startswith("reach-")
    assert a != b and a == again  # distinct per console, stable across restarts
    named = _prefixes(tmp_path, DATABASE_URL="postgres://u@db.example:5432/console_a",
                      REACH_CONSOLE_ID="ops-eu")
    assert named == ["ops-eu", "ops-eu"]


def test_events_of_one_console_never_reach_another_on_the_same_redis(tmp_path, settings):
    if not settings.REDIS_URL:
        if expect_real_services():
            pytest.fail("REDIS_URL must be set in CI's second run")
        pytest.skip("needs Redis (REDIS_URL)")
    from channels_redis.pubsub import RedisPubSubChannelLayer

    prefix_a = _prefixes(tmp_path, DATABASE_URL="postgres://u@h:5432/console_a")[0]
    prefix_b = _prefixes(tmp_path, DATABASE_URL="postgres://u@h:5432/console_b")[0]

    async def run() -> tuple[dict, bool]:
        a = RedisPubSubChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix_a)
        b = RedisPubSubChannelLayer(hosts=[settings.REDIS_URL], prefix=prefix_b)
        try:
            listen_a, listen_b = await a.new_channel(), await b.new_channel()
            await a.group_add("a2a.timeline", listen_a)
            await b.group_add("a2a.timeline", listen_b)
            await asyncio.sleep(0.2)  # subscriptions are in place
            await a.group_send("a2a.timeline", {"type": "a2a.events", "events": [1]})
            got_a = await asyncio.wait_for(a.receive(listen_a), 5)
            try:
                await asyncio.wait_for(b.receive(listen_b), 1)
                leaked = True
            except TimeoutError:
                leaked = False
            return got_a, leaked
        finally:
            await a.flush()
            await b.flush()

    got_a, leaked = asyncio.run(run())
    assert got_a["events"] == [1]
    assert leaked is False
