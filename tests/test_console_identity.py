"""One console is one name, whichever process asks and however it spells its database's
address; two consoles sharing one Redis server never see each other's events or cache keys
(the channel layer's and the cache's prefixes are that name)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reachconsole.core.identity import address_identity
from tests.conftest import expect_real_services

ROOT = Path(__file__).resolve().parent.parent
SHOW = ("import django, json; django.setup(); "
        "from reachconsole.core.identity import console_id; "
        "from channels.layers import get_channel_layer; from django.core.cache import cache; "
        "layer = get_channel_layer()._kwargs['prefix']; "
        "print(json.dumps([console_id(), layer, cache.make_key('k')]))")


def _run(tmp_path: Path, database_url: str, *args: str, code: str = "", **env: str) -> str:
    run = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379/0", "REACH_RUN_DIR": str(tmp_path),
           "DATABASE_URL": database_url, "DJANGO_SETTINGS_MODULE": "reachconsole.settings"}
    for name in ("REACH_CONSOLE_ID", "REACH_CHANNEL_PREFIX"):
        run.pop(name, None)
    run.update(env)
    command = [sys.executable, "-c", code] if code else [sys.executable, "manage.py", *args]
    out = subprocess.run(command, cwd=ROOT, env=run, capture_output=True, text=True,  # noqa: S603
                         check=False, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _names(tmp_path: Path, database_url: str, **env: str) -> list[str]:
    return json.loads(_run(tmp_path, database_url, code=SHOW, **env).strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_databases(tmp_path_factory) -> tuple[Path, Path]:
    """Two consoles' databases, migrated as `manage.py migrate` does (the core app is where
    the identity lives)."""
    base = tmp_path_factory.mktemp("consoles")
    files = base / "a" / "db.sqlite3", base / "b" / "db.sqlite3"
    for file in files:
        file.parent.mkdir()
        _run(base, f"sqlite:///{file}", "migrate", "core", "--verbosity", "0")
    return files


def test_every_spelling_of_one_database_is_one_console(two_databases, tmp_path):
    a, b = two_databases
    first = _names(tmp_path, f"sqlite:///{a}")
    # The same file spelled another way, as a second Daphne might be given it.
    again = _names(tmp_path, f"sqlite:///{a.parent}/../{a.parent.name}/./{a.name}")
    other = _names(tmp_path, f"sqlite:///{b}")
    name = first[0]
    assert first == again == [name, name, f"{name}:1:k"]
    assert other[0] != name and other[1] == other[0]
    # The first process to ask wrote the name the address gave before identities were rows:
    # a console that upgrades keeps its broker sessions and Redis keys.
    assert name == address_identity({"NAME": str(a)})


def test_reach_console_id_names_the_console_outright(two_databases, tmp_path):
    a, _ = two_databases
    assert _names(tmp_path, f"sqlite:///{a}", REACH_CONSOLE_ID="ops-eu") == [
        "ops-eu", "ops-eu", "ops-eu:1:k"]
    prefixed = _names(tmp_path, f"sqlite:///{a}", REACH_CHANNEL_PREFIX="eu-events")
    assert prefixed[1] == "eu-events" and prefixed[0] != "eu-events"


def test_events_of_one_console_never_reach_another_on_the_same_redis(two_databases, tmp_path,
                                                                    settings):
    if not settings.REDIS_URL:
        if expect_real_services():
            pytest.fail("REDIS_URL must be set in CI's second run")
        pytest.skip("needs Redis (REDIS_URL)")
    from channels_redis.pubsub import RedisPubSubChannelLayer

    a, b = two_databases
    prefix_a = _names(tmp_path, f"sqlite:///{a}")[1]
    prefix_b = _names(tmp_path, f"sqlite:///{b}")[1]

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
