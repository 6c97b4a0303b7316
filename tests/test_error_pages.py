"""The console's own error pages (DEBUG off): words, the layout, a way back; a fragment for
htmx requests; JSON for the API."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils.html import escape

from reachconsole import error_pages
from reachconsole.core.roles import action_refused_words
from tests.conftest import logged_in, reader

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

HTMX = {"HX-Request": "true", "HX-Target": "roster-live", "HX-Current-URL": "http://testserver/"}


@pytest.fixture(autouse=True)
def _no_debug(settings):
    settings.DEBUG = False


@pytest.fixture
def viewer() -> User:
    return reader("victor", password="pw-victor-123")


def assert_console_page(response, status: int, words: str) -> str:
    html = response.content.decode()
    assert response.status_code == status
    assert response["Content-Type"].startswith("text/html")
    assert 'class="brand"' in html  # the console's layout (templates/base.html)
    assert f'data-error-status="{status}"' in html
    assert escape(words) in html
    assert 'href="/overview/"' in html  # back to the overview
    return html


def test_a_missing_page_is_the_consoles_404_with_a_way_back(viewer):
    r = logged_in(viewer).get("/agents/fin.gone/",
                              headers={"Referer": "http://testserver/messages/"})
    html = assert_console_page(r, 404, error_pages.WORDS[404][1].format(path="/agents/fin.gone/"))
    assert 'href="http://testserver/messages/"' in html  # the previous page


def test_the_previous_page_link_never_leads_off_the_console(viewer):
    r = logged_in(viewer).get("/nothing-here/", headers={"Referer": "https://evil.example/x"})
    html = assert_console_page(r, 404, "There is nothing at /nothing-here/")
    assert "evil.example" not in html


def test_a_missing_page_is_a_404_page_for_anonymous_people_too(client):
    assert_console_page(client.get("/nothing-here/"), 404, "There is nothing at /nothing-here/")


def test_a_forbidden_action_is_the_consoles_403(viewer):
    from tests.conftest import register

    register("fin.tax")
    r = logged_in(viewer).post("/agents/fin.tax/drain")
    # Signed in and refused a page action: the words name the missing role.
    assert_console_page(r, 403, action_refused_words("victor"))


def test_a_failing_page_is_the_consoles_500(viewer, monkeypatch):
    from roster import views

    def broken(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "roster_counts", broken)
    client = logged_in(viewer, raise_request_exception=False)
    html = assert_console_page(client.get("/"), 500, error_pages.WORDS[500][1])
    assert "a bug" not in html and "Traceback" not in html


def test_a_bad_request_is_the_consoles_400(client):
    r = client.get("/", headers={"Host": "evil.example"})  # not in ALLOWED_HOSTS
    assert_console_page(r, 400, error_pages.WORDS[400][1])


def test_a_csrf_failure_is_the_consoles_403_with_words(viewer):
    client = Client(enforce_csrf_checks=True)
    client.force_login(viewer)
    r = client.post("/accounts/logout/")
    assert_console_page(r, 403, "Reload the page")


def test_an_htmx_request_gets_a_fragment_with_the_words(viewer):
    client = logged_in(viewer)
    r = client.get("/nothing-here/", headers=HTMX)
    html = r.content.decode()
    assert r.status_code == 404
    assert "<html" not in html and 'class="brand"' not in html
    assert 'data-error-detail' in html and "There is nothing at /nothing-here/" in html
    assert "HX-Request" in r["Vary"]


def test_an_htmx_request_that_fails_gets_a_fragment(viewer, monkeypatch):
    from roster import views

    def broken(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "roster_counts", broken)
    r = logged_in(viewer, raise_request_exception=False).get("/", headers=HTMX)
    html = r.content.decode()
    assert r.status_code == 500 and "<html" not in html
    assert escape(error_pages.WORDS[500][1]) in html


def test_an_htmx_csrf_failure_gets_a_fragment(viewer):
    client = Client(enforce_csrf_checks=True)
    client.force_login(viewer)
    r = client.post("/accounts/logout/", headers=HTMX)
    html = r.content.decode()
    assert r.status_code == 403 and "<html" not in html and "Reload the page" in html


def test_the_page_shows_why_an_htmx_request_failed():
    # htmx swaps no 4xx/5xx answer; without a listener the page would say nothing.
    from django.contrib.staticfiles import finders

    script = open(finders.find("js/console.js"), encoding="utf-8").read()
    assert "htmx:responseError" in script and "textContent" in script
    assert "innerHTML" not in script


def test_the_layout_loads_the_error_listener(viewer):
    html = logged_in(viewer).get("/").content.decode()
    assert "js/console.js" in html and 'id="request-error"' in html


def test_the_api_keeps_its_json_errors(client, api):
    r = client.get("/api/no-such-endpoint")
    assert r.status_code == 404 and r["Content-Type"].startswith("application/json")
    assert r.json()["error"] == "not_found" and "/api/no-such-endpoint" in r.json()["detail"]
    missing = api.get("/api/roster/agents/fin.nope")
    assert missing.status_code == 404 and missing.json()["error"] == "agent_not_found"
    unauthorized = client.get("/api/roster/agents")
    assert unauthorized.status_code == 401 and unauthorized.json()["error"] == "unauthorized"


def test_an_api_csrf_or_host_failure_is_json(client):
    r = client.get("/api/roster/agents", headers={"Host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"] == "bad_request"


@pytest.mark.parametrize("path", ["/?q=a%00b", "/?after=1%7Cx%00", "/messages/?q=%00",
                                  "/admin/roster/agent/?q=%00"])
def test_a_nul_in_a_pages_query_is_a_400_with_words(admin_client, path):
    r = admin_client.get(path)
    assert r.status_code == 400
    assert "NUL character" in r.content.decode()
