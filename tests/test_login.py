"""Login throttling: per (user name, address) pair, on every path that checks a password."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth import authenticate
from django.contrib.auth.models import User
from django.test import Client, RequestFactory

from reachconsole.core.audit import AuditEntry
from tests.conftest import reader

pytestmark = pytest.mark.django_db

X = "203.0.113.7"  # one address (a proxy, an office NAT)
Y = "198.51.100.9"  # another
LIMIT = 3


@pytest.fixture(autouse=True)
def _limits(settings):
    settings.REACH_LOGIN_MAX_FAILURES = LIMIT
    settings.REACH_LOGIN_LOCKOUT_S = 300


@pytest.fixture
def anna() -> User:
    return reader("anna", password="pw-anna-123", is_staff=True)


@pytest.fixture
def bert() -> User:
    return reader("bert", password="pw-bert-123", is_staff=True)


def attempt(path: str, username: str, password: str, address: str, **headers):
    client = Client(REMOTE_ADDR=address)
    response = client.post(path, {"username": username, "password": password, "next": "/"},
                           headers=headers)
    return client, response


def fail(path: str, username: str, address: str, times: int = LIMIT) -> None:
    for _ in range(times):
        attempt(path, username, "wrong", address)


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_one_users_failures_never_lock_another_user_out(anna, bert):
    fail("/accounts/login/", "anna", X)
    client, r = attempt("/accounts/login/", "bert", "pw-bert-123", X)
    assert r.status_code == 302 and logged_in(client)
    client, r = attempt("/admin/login/", "bert", "pw-bert-123", X)
    assert r.status_code == 302 and logged_in(client)


def test_the_failure_that_reaches_the_limit_locks_the_pair(anna):
    fail("/accounts/login/", "anna", X, times=LIMIT - 1)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 302 and logged_in(client)  # below the limit: not locked yet
    fail("/accounts/login/", "anna", X)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429 and not logged_in(client)


def test_a_lockout_at_the_console_login_holds_at_the_admin_login(anna):
    fail("/accounts/login/", "anna", X)
    client, r = attempt("/admin/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429 and not logged_in(client)
    html = r.content.decode()
    assert "Too many failed attempts" in html and "5 minutes" in html
    assert r["Retry-After"] == "300"


def test_the_admin_login_is_throttled_too(anna):
    fail("/admin/login/", "anna", X)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429 and not logged_in(client)
    client, r = attempt("/admin/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429 and not logged_in(client)


def test_the_same_user_from_another_address_is_not_locked(anna):
    fail("/accounts/login/", "anna", X)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", Y)
    assert r.status_code == 302 and logged_in(client)


def test_a_forwarded_header_does_not_change_the_address(anna):
    # The address is the peer's (REMOTE_ADDR, which Daphne sets from X-Forwarded-For only
    # when it runs with --proxy-headers): a client cannot step out of a lock with a header.
    fail("/accounts/login/", "anna", X)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X, x_forwarded_for=Y)
    assert r.status_code == 429 and not logged_in(client)


def test_authenticate_from_any_view_is_refused_for_a_locked_pair(anna):
    fail("/accounts/login/", "anna", X)
    request = RequestFactory().post("/anywhere/", REMOTE_ADDR=X)
    assert authenticate(request, username="anna", password="pw-anna-123") is None
    other = RequestFactory().post("/anywhere/", REMOTE_ADDR=Y)
    assert authenticate(other, username="anna", password="pw-anna-123") == anna


def test_authenticate_without_a_request_is_refused_outright(anna):
    # Without a request there is no address to throttle by: the check refuses to run blind.
    from axes.exceptions import AxesBackendRequestParameterRequired

    with pytest.raises(AxesBackendRequestParameterRequired):
        authenticate(username="anna", password="pw-anna-123")


def test_every_refusal_is_audited(anna):
    fail("/accounts/login/", "anna", X)
    attempt("/admin/login/", "anna", "pw-anna-123", X)
    rows = list(AuditEntry.objects.filter(action="login").order_by("id")
                .values_list("actor", "target", "result", "detail"))
    assert [row[:3] for row in rows] == [("anna", X, "refused"), ("anna", X, "refused")]
    assert f"{LIMIT} failed logins" in rows[0][3] and "/accounts/login/" in rows[0][3]
    assert "/admin/login/" in rows[1][3]


def test_the_lockout_ends_after_the_cool_off(anna, settings):
    fail("/accounts/login/", "anna", X)
    assert attempt("/accounts/login/", "anna", "pw-anna-123", X)[1].status_code == 429
    # A short cool-off from here on (the lock is judged against it on every attempt); locking
    # with it already short would race the password hashing of the failures themselves.
    settings.REACH_LOGIN_LOCKOUT_S = 1
    time.sleep(1.1)
    client, r = attempt("/admin/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 302 and logged_in(client)


def test_a_success_clears_the_pairs_failures(anna):
    fail("/accounts/login/", "anna", X, times=LIMIT - 1)
    assert attempt("/accounts/login/", "anna", "pw-anna-123", X)[1].status_code == 302
    fail("/accounts/login/", "anna", X, times=LIMIT - 1)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 302 and logged_in(client)


def test_the_lockout_page_is_served_under_asgi_too(anna):
    # Daphne runs the middleware chain asynchronously; axes calls the lockout page from there
    # with other arguments than from the synchronous chain.
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    local = "127.0.0.1"  # AsyncClient's peer address
    fail("/accounts/login/", "anna", local)
    r = async_to_sync(AsyncClient().post)("/admin/login/",
                                          {"username": "anna", "password": "pw-anna-123"})
    assert r.status_code == 429 and "Too many failed attempts" in r.content.decode()
    assert AuditEntry.objects.filter(action="login", actor="anna", target=local).count() == 2


def test_a_nul_in_the_headers_is_counted_not_a_500(anna):
    # PostgreSQL text holds no NUL: the attempt's row is stored without it.
    client = Client(REMOTE_ADDR=X, raise_request_exception=False)
    statuses = [client.post("/accounts/login/", {"username": "anna", "password": "wrong"},
                            headers={"User-Agent": "a\x00b", "Accept": "text/html\x00"})
                .status_code for _ in range(LIMIT)]
    assert statuses == [200] * (LIMIT - 1) + [429]


def test_one_address_trying_many_user_names_is_stopped(anna, settings):
    """Password spraying: one failure each for many user names from one address. The pair
    limit never trips; the address's does, for every user name, with the same 429."""
    settings.REACH_LOGIN_MAX_FAILURES_PER_ADDRESS = 10
    for i in range(9):
        _, r = attempt("/accounts/login/", f"user{i}", "wrong", X)
        assert r.status_code == 200  # a plain refusal: wrong password
    _, r = attempt("/accounts/login/", "user9", "wrong", X)  # the tenth reaches the limit
    assert r.status_code == 429
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429 and not logged_in(client)
    assert "whatever the user name" in r.content.decode() and r["Retry-After"] == "300"
    client, r = attempt("/admin/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429 and not logged_in(client)
    # Another address is not touched by this one's failures.
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", Y)
    assert r.status_code == 302 and logged_in(client)
    refused = AuditEntry.objects.filter(action="login", result="refused", target=X)
    assert refused.exists()
    assert all("from this address, whatever the user name" in e.detail for e in refused)


def test_the_address_limit_ends_after_the_cool_off(anna, settings):
    settings.REACH_LOGIN_MAX_FAILURES_PER_ADDRESS = 4
    for i in range(4):
        attempt("/accounts/login/", f"user{i}", "wrong", X)
    _, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 429
    settings.REACH_LOGIN_LOCKOUT_S = 1  # short from here on, as in the test above
    time.sleep(1.1)
    client, r = attempt("/accounts/login/", "anna", "pw-anna-123", X)
    assert r.status_code == 302 and logged_in(client)
