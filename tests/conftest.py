from __future__ import annotations

import os
import signal
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from reachconsole.core.identity import console_id, console_id_forget
from reachconsole.core.query_bound import query_bound_uninstall
from reachconsole.core.tokens import tokens_parse
from roster import services
from tests.mqtt import bridge, broker, mqtt_settings  # noqa: F401 - fixtures for every module

TOKEN = "test-token-aaaaaaaaaaaaaaaa"
ROTATED_TOKEN = "test-token-bbbbbbbbbbbbbbbb"
FIN_TOKEN = "test-token-fin-cccccccccccc"

# A suite started in the background by a non-interactive shell (`cmd &` in a script) has
# SIGINT ignored, and every process it starts inherits that: the tests that stop a console
# with Ctrl-C (SIGINT) as a person would then wait on a process that cannot hear it. Python
# handles SIGINT again for itself and, after exec, for its children.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _no_query_bound():
    """A module importing reachconsole.asgi bounds this process's queries as a web
    process's are (reachconsole/core/query_bound.py); the suite is not one, and its own big
    writes must not be cut off. tests/test_query_bound.py tries the bound itself."""
    query_bound_uninstall()


@pytest.fixture(scope="session", autouse=True)
def _console_identity(request, _no_query_bound):
    """The console's name is read from its database (reachconsole/core/identity.py), once a
    process: read it from the test database, before any test, so that the cache's and the
    channel layer's prefixes work in tests that use no database, and are the ones this
    run's Daphnes and workers (on the same test database) derive."""
    if settings.REACH_CONSOLE_ID:
        return
    if not _uses_database(request.session):
        # No test of this run may touch the database, so none can read the name from it:
        # one for the run (the cache and the channel layer need one).
        settings.REACH_CONSOLE_ID = "reach-tests-no-database"
        return
    # A pool made before the test database exists keeps the configured database's name
    # (Django's create_test_db renames it in the settings but keeps a pool it finds).
    from django.db import connections

    default = connections["default"]
    if "default" in getattr(type(default), "_connection_pools", {}):
        default.close_pool()
    request.getfixturevalue("django_db_setup")
    # Collecting the tests may have read it from the database the settings named before the
    # test database existed (a module importing reachconsole.asgi).
    console_id_forget()
    console_id(retry=True)


def _uses_database(session) -> bool:
    return any(item.get_closest_marker("django_db") or "db" in getattr(item, "fixturenames", ())
               or "transactional_db" in getattr(item, "fixturenames", ())
               for item in session.items)


@pytest.fixture(autouse=True)
def _service_tokens(settings):
    settings.REACH_SERVICE_TOKENS = tokens_parse([TOKEN, ROTATED_TOKEN, f"{FIN_TOKEN}@fin+llm"])


class ApiClient:
    """A machine caller: a bearer token and a trusted source on every request."""

    def __init__(self, token: str = TOKEN, source: str = "studio", actor: str = ""):
        self.client = Client()
        self.headers = {"Authorization": f"Bearer {token}", "X-OODER-Source": source}
        if actor:
            self.headers["X-OODER-Actor"] = actor

    def _call(self, method: str, path: str, body=None, raw: str | None = None):
        kwargs = {"headers": self.headers}
        if raw is not None:
            kwargs.update(data=raw, content_type="application/json")
        elif body is not None:
            kwargs.update(data=body, content_type="application/json")
        else:
            kwargs.update(data="", content_type="application/json")
        return getattr(self.client, method)(path, **kwargs)

    def get(self, path: str, params: dict | None = None):
        return self.client.get(path, params or {}, headers=self.headers)

    def post(self, path: str, body=None, raw: str | None = None):
        return self._call("post", path, body, raw)

    def delete(self, path: str):
        return self._call("delete", path)


@pytest.fixture(autouse=True)
def _no_profile_cards(settings):
    """Test bridges do not hear the A2A-over-MQTT profile's cards unless a test asks
    (tests/test_profile_sdk.py): on the machine's shared broker they would register any
    card another process left retained into the test's roster."""
    settings.REACH_A2A_PROFILE = False


@pytest.fixture(autouse=True)
def _no_delivery_tallies_of_earlier_tests():
    """Readiness judges the deliveries of the last seconds, tallied in a cache that earlier
    tests of this process (or run) shared: each test starts without theirs."""
    from django.core.cache import cache

    from directory.coverage import CACHE_KEY
    from reachconsole.core.metrics import delivery_forget

    delivery_forget()
    # Nor the capability coverage an earlier test's overview kept for a few seconds, nor
    # the broker-drops note an earlier test's bridge left (it raises an alarm of its own).
    from reachconsole.core import broker_drops

    try:
        cache.delete_many([CACHE_KEY, broker_drops.KEY])
    except Exception:  # noqa: S110 - a test that took the cache away; nothing was kept
        pass


@pytest.fixture
def api() -> ApiClient:
    return ApiClient()


@pytest.fixture
def now() -> datetime:
    return timezone.now()


def register(agent_id: str, node_id: str = "node-a", *, now: datetime | None = None, **extra):
    return services.agent_register(agent_id=agent_id, node_id=node_id, now=now, **extra).agent


def staff_user(username: str, *codenames: str):
    """A person with exactly these permissions (by codename), and a password nobody uses."""
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user(username, password=f"pw-{username}-123")
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


def reader(username: str, password: str | None = None, **extra):
    """A person who may read the console (the viewer's permissions: reachconsole/core/roles.py),
    as a page test needs; an account with none sees only the page that says whom to ask.
    Granted directly rather than through the group: a flush empties the groups."""
    from django.contrib.auth.models import Permission, User
    from django.db.models import Q

    from reachconsole.core.roles import VIEWER_PERMISSIONS

    user = User.objects.create_user(username, password=password or f"pw-{username}-123",
                                    **extra)
    wanted = Q(pk__in=[])
    for app, codename in VIEWER_PERMISSIONS:
        wanted |= Q(content_type__app_label=app, codename=codename)
    user.user_permissions.add(*Permission.objects.filter(wanted))
    return user


def logged_in(user, **kwargs) -> Client:
    """A browser session of `user` (Client options, e.g. enforce_csrf_checks, in kwargs)."""
    client = Client(**kwargs)
    client.force_login(user)
    return client


def later(moment: datetime, ms: int) -> datetime:
    return moment + timedelta(milliseconds=ms)


def expect_real_services() -> bool:
    """CI's second run sets this: PostgreSQL, Redis and Mosquitto must really be in use."""
    return os.environ.get("REACH_EXPECT_REAL_SERVICES") == "1"


def run_at_once(work, *, threads: int = 2, timeout: float = 60) -> list:
    """Run `work()` in several threads released together (each on its own database
    connection); return their results, or raise the first error one of them hit."""
    import threading

    from django.db import close_old_connections, connection

    barrier = threading.Barrier(threads)
    results, errors = [], []

    def run() -> None:
        try:
            barrier.wait()
            results.append(work())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout)
    close_old_connections()
    if errors:
        raise errors[0]
    assert len(results) == threads, "a worker did not finish in time"
    return results


@pytest.fixture
def async_unsafe(monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the ORM calls in the test are
    # still plain synchronous calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


def stop_process(proc, timeout: float = 20) -> None:
    """Ask a process to stop (SIGINT, as Ctrl-C would), kill it if it does not."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def bus_heard(*, since: datetime, until: datetime, instance: str = "test-bridge") -> None:
    """Record that a bridge has heard the bus from `since` without a gap up to `until`."""
    from roster.hearing import hearing_record

    hearing_record(instance=instance, since=since, through=until)


def bridge_hears(instance: str) -> None:
    """A bridge whose probe has just come back: it hears the bus now."""
    moment = timezone.now()
    bus_heard(since=moment, until=moment, instance=instance)


@pytest.fixture
def console_hears(db):
    """A console whose bridge has heard the bus all along (a day back, a day ahead): leases,
    staleness and silence are judged on the clock alone, as tests that move `now` expect."""
    moment = timezone.now()
    bus_heard(since=moment - timedelta(days=1), until=moment + timedelta(days=1))


def published(row, when: datetime) -> None:
    """What the bridge records on the broker's PUBACK for `row`, at `when`."""
    from messages.puback import Puback, pubacks_apply

    pubacks_apply(pubacks=[Puback(pk=row.pk, request=row.message_type == "TASK_REQUEST",
                                  at=when)], release=[], now=when)


def acked(row, when: datetime) -> None:
    """What the bridge records when the receiver's ACK for `row` arrives at `when`."""
    from messages.models import Change, Status
    from messages.state import changes_apply

    changes_apply([Change(pk=row.pk, to=Status.ACKED, actor="bridge", reason="ACK",
                          fields={"acked_at": when, "ack_deadline_at": None})], now=when)
