"""A database or Redis that is really unreachable gives 503 + Retry-After, never 500.

"Unreachable" is real: the connection is pointed at a port nothing listens on (PostgreSQL,
Redis) or at a file in a directory that does not exist (SQLite), and the driver fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.http import HttpResponse
from django.test import AsyncClient, Client
from django.urls import include, path
from django.utils.html import escape

from reachconsole import unavailable
from reachconsole.unavailable import (
    DATABASE,
    DATABASE_WAIT,
    DETAILS,
    REDIS,
    RETRY_AFTER_S,
    unavailable_reason,
)
from tests.conftest import ApiClient, reader
from tests.mqtt import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def _session_touching_view(request):
    # Writes the session without reading the database: SessionMiddleware's save, after the
    # view, is what meets the database.
    request.session["seen"] = True
    return HttpResponse("ok")


# The console's URLs plus one view whose database work happens in a middleware.
urlpatterns = [
    path("session-touch", _session_touching_view),
    path("", include("reachconsole.urls")),
]


@pytest.fixture(autouse=True)
def _fresh_log_window():
    unavailable._last_logged.clear()
    unavailable._suppressed.clear()


def _drop(conn) -> None:
    conn.close()
    if conn.vendor == "postgresql":
        conn.close_pool()  # the next connection makes a pool with the current settings


@contextmanager
def database_unreachable(tmp_path) -> Iterator[str]:
    """Point the default database at nothing; yield the reason the console should give."""
    real = connection.settings_dict  # shared by every thread's connection object
    saved = {key: real[key] for key in ("NAME", "HOST", "PORT", "OPTIONS")}
    _drop(connection)
    reason = DATABASE
    if connection.vendor == "sqlite":
        real["NAME"] = str(tmp_path / "no-such-dir" / "db.sqlite3")
    else:
        real["HOST"], real["PORT"] = "127.0.0.1", str(free_port())
        if "pool" in real["OPTIONS"]:
            # The pool keeps trying in the background; a caller waits for its timeout.
            real["OPTIONS"] = {**real["OPTIONS"],
                               "pool": {**real["OPTIONS"]["pool"], "timeout": 1.0}}
            reason = DATABASE_WAIT
    try:
        yield reason
    finally:
        _drop(connection)
        real.update(saved)


@pytest.fixture
def user_client() -> Client:
    client = Client()
    client.force_login(reader("ops", password="pw-123456"))
    return client


@pytest.fixture
def redis_unreachable(settings):
    settings.CACHES = {"default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
        "OPTIONS": {"socket_connect_timeout": 1},
    }}


def assert_page_503(response, reason: str) -> None:
    assert response.status_code == 503, response.content[:300]
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert response["Content-Type"].startswith("text/html")
    assert escape(DETAILS[reason]) in response.content.decode()


def assert_api_503(response, reason: str) -> None:
    assert response.status_code == 503, response.content[:300]
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert response.json() == {"error": "unavailable", "detail": DETAILS[reason]}


def test_a_page_answers_503_while_the_database_is_unreachable(user_client, tmp_path):
    with database_unreachable(tmp_path) as reason:
        response = user_client.get("/")
    assert_page_503(response, reason)


def test_the_api_answers_503_json_while_the_database_is_unreachable(tmp_path):
    api = ApiClient()
    with database_unreachable(tmp_path) as reason:
        response = api.get("/api/roster/agents")
    assert_api_503(response, reason)


@pytest.mark.urls(__name__)
@pytest.mark.parametrize("client_class", [Client, AsyncClient], ids=["wsgi", "asgi"])
def test_an_error_in_a_later_middleware_is_a_503_without_a_traceback(
        client_class, tmp_path, caplog):
    client = client_class(raise_request_exception=False)
    with database_unreachable(tmp_path) as reason, caplog.at_level(logging.INFO):
        get = async_to_sync(client.get) if client_class is AsyncClient else client.get
        response = get("/session-touch")
    assert_page_503(response, reason)
    assert not [r for r in caplog.records if r.name == "django.request"]


def test_it_logs_once_a_minute_not_per_request(user_client, tmp_path, caplog):
    with database_unreachable(tmp_path), caplog.at_level(logging.INFO):
        statuses = [user_client.get("/").status_code for _ in range(3)]
    assert statuses == [503, 503, 503]
    lines = [r for r in caplog.records if r.name == "reachconsole.unavailable"]
    assert len(lines) == 1
    assert not [r for r in caplog.records if r.name == "django.request"]


def test_a_page_answers_503_while_redis_is_unreachable(user_client, redis_unreachable):
    assert_page_503(user_client.get("/"), REDIS)


def test_the_api_answers_503_json_while_redis_is_unreachable(redis_unreachable):
    # Registering bumps the roster generation in the cache, inside the transaction.
    response = ApiClient().post("/api/roster/agents", {"agentId": "ops.x", "nodeId": "node-a"})
    assert_api_503(response, REDIS)


def test_an_sql_mistake_is_not_called_an_outage():
    from django.db import DatabaseError

    with pytest.raises(DatabaseError) as caught, connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table_here")
    assert unavailable_reason(caught.value) is None


def test_readyz_asks_the_database_once_while_it_is_unreachable(client, tmp_path):
    """The broker check reads the bridges' hearing from the database: with the database
    gone it says it cannot tell rather than wait for a connection a second time (through a
    stalled path each wait is the pool's whole timeout)."""
    with database_unreachable(tmp_path):
        answer = client.get("/readyz")
    body = answer.json()
    assert answer.status_code == 503
    assert body["checks"]["database"]["ok"] is False
    assert body["checks"]["broker"] == {"ok": False,
                                        "detail": "cannot tell (the database does not answer)"}
