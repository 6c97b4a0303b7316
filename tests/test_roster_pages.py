from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from reachconsole.core.audit import AuditEntry
from roster import services
from roster.errors import AGENT_NOT_FOUND
from roster.models import Agent, RosterEvent
from tests.conftest import logged_in, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

XSS = '<img src=x onerror="window.pwned=1">'


@pytest.fixture
def operator() -> User:
    return staff_user("olga", "change_agent")


@pytest.fixture
def viewer() -> User:
    return reader("victor", password="pw-victor-123")


def test_it_requires_login(client):
    r = client.get("/")
    assert r.status_code == 302 and r["Location"].startswith("/accounts/login/")


def test_it_shows_counts_and_agents(viewer):
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.chat", "node-b")
    services.agent_drain(agent_id="llm.chat")
    r = logged_in(viewer).get("/")
    html = r.content.decode()
    assert r.status_code == 200
    assert 'data-count="online">1<' in html and 'data-count="draining">1<' in html
    assert 'data-agent="fin.tax"' in html and 'data-agent="llm.chat"' in html


def test_the_agent_page_says_stale_when_the_agent_missed_its_heartbeats(viewer, settings):
    settings.REACH_HEARTBEAT_MS = 1000
    now = timezone.now()
    register("fin.tax", "node-a", now=now - timedelta(seconds=30))
    register("fin.fresh", "node-a", now=now)
    page = logged_in(viewer)
    stale = page.get(reverse("roster:agent", args=["fin.tax"])).content.decode()
    fresh = page.get(reverse("roster:agent", args=["fin.fresh"])).content.decode()
    assert 'id="agent-stale"' in stale and 'id="agent-stale"' not in fresh


def test_it_filters_by_url_parameters(viewer):
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.chat", "node-b")
    client = logged_in(viewer)
    for params, shown, hidden in [
        ({"namespace": "fin"}, "fin.tax", "llm.chat"),
        ({"node": "node-b"}, "llm.chat", "fin.tax"),
        ({"capability": "tax"}, "fin.tax", "llm.chat"),
        ({"q": "cha"}, "llm.chat", "fin.tax"),
        ({"status": "ONLINE", "q": "fin"}, "fin.tax", "llm.chat"),
    ]:
        html = client.get("/", params).content.decode()
        assert f'data-agent="{shown}"' in html, params
        assert f'data-agent="{hidden}"' not in html, params


def test_it_answers_htmx_with_the_live_fragment_only(viewer):
    register("fin.tax")
    r = logged_in(viewer).get("/", {"namespace": "fin"},
                              headers={"HX-Request": "true", "HX-Target": "roster-live"})
    html = r.content.decode()
    assert 'data-agent="fin.tax"' in html
    assert "<html" not in html
    assert "HX-Request" in r["Vary"]


def test_it_drains_with_the_permission(operator):
    register("fin.tax")
    r = logged_in(operator).post("/agents/fin.tax/drain")
    assert r.status_code == 302
    agent = Agent.objects.get()
    assert agent.status == Agent.Status.DRAINING
    assert RosterEvent.objects.filter(kind="DRAINED", actor="olga").count() == 1
    assert list(AuditEntry.objects.values_list("actor", "action", "target", "result")) == [
        ("olga", "drain", "fin.tax", "ok")]


def test_it_refuses_drain_without_the_permission(viewer):
    register("fin.tax")
    r = logged_in(viewer).post("/agents/fin.tax/drain")
    assert r.status_code == 403
    assert Agent.objects.get().status == Agent.Status.ONLINE
    page = logged_in(viewer).get("/agents/fin.tax/").content.decode()
    assert 'id="drain"' not in page


def test_it_refuses_drain_without_csrf(operator):
    register("fin.tax")
    r = logged_in(operator, enforce_csrf_checks=True).post("/agents/fin.tax/drain")
    assert r.status_code == 403
    assert Agent.objects.get().status == Agent.Status.ONLINE


def test_it_refuses_drain_by_get(operator):
    register("fin.tax")
    assert logged_in(operator).get("/agents/fin.tax/drain").status_code == 405
    assert Agent.objects.get().status == Agent.Status.ONLINE


def test_it_deregisters_from_the_page(operator):
    register("fin.tax")
    r = logged_in(operator).post("/agents/fin.tax/deregister", follow=True)
    assert not Agent.objects.exists()
    assert "was deregistered from node node-a" in r.content.decode()
    assert list(AuditEntry.objects.values_list("actor", "action", "target", "result",
                                               "detail")) == [
        ("olga", "deregister", "fin.tax", "ok", "from node-a")]


def test_it_shows_an_action_on_a_missing_agent_as_words(operator):
    r = logged_in(operator).post("/agents/fin.nope/drain", follow=True)
    assert "fin.nope is not on the roster" in r.content.decode()
    assert list(AuditEntry.objects.values_list("actor", "action", "target", "result",
                                               "detail")) == [
        ("olga", "drain", "fin.nope", "refused", AGENT_NOT_FOUND.format(agent_id="fin.nope"))]


def test_it_renders_untrusted_fields_as_text(viewer):
    register("fin.tax", endpoint=XSS, version="v<b>1</b>", metadata={"note": XSS})
    html = logged_in(viewer).get("/agents/fin.tax/").content.decode()
    assert XSS not in html
    assert "&lt;img src=x onerror=" in html
    assert "v&lt;b&gt;1&lt;/b&gt;" in html
    # metadata travels in a json_script block, escaped for <script> context
    assert "\\u003Cimg src=x onerror=" in html


def test_it_lists_nodes_with_their_agents(viewer):
    register("fin.tax", "node-a")
    register("fin.vat", "node-a")
    register("llm.chat", "node-b")
    services.node_seen(node_id="node-a")
    html = logged_in(viewer).get("/cluster/").content.decode()
    assert 'id="node-node-a"' in html and 'id="node-node-b"' in html
    assert "2 of 2 agents online" in html and "last heard never" in html


def test_the_admin_edits_namespaces_and_aliases(admin_client):
    register("fin.tax")
    assert admin_client.get("/admin/roster/namespace/").status_code == 200
    ns = Agent.objects.get().namespace
    r = admin_client.post("/admin/directory/alias/add/", {
        "alias": "@资金日报", "agent_id": "fin.tax", "namespace": ns.pk,
    })
    assert r.status_code == 302, r.content.decode()[:500]
    from directory.models import Alias

    assert Alias.objects.get().alias == "资金日报"  # the @ is not part of the alias
    listing = admin_client.get("/admin/directory/alias/", {"q": "资金"}).content.decode()
    assert "资金日报" in listing
    assert admin_client.get("/admin/roster/agent/", {"q": "fin"}).status_code == 200
    assert admin_client.get("/admin/roster/clusternode/").status_code == 200


def test_login_is_throttled_after_repeated_failures(client, settings):
    # The full set (per user and address, every login path, the cool-off): test_login.py.
    settings.REACH_LOGIN_MAX_FAILURES = 3
    reader("olga", password="pw-olga-123")
    for _ in range(2):
        r = client.post("/accounts/login/", {"username": "olga", "password": "wrong"})
        assert r.status_code == 200
    locking = client.post("/accounts/login/", {"username": "olga", "password": "wrong"})
    assert locking.status_code == 429
    refused = client.post("/accounts/login/", {"username": "olga", "password": "pw-olga-123"})
    assert refused.status_code == 429
    assert "Too many failed attempts" in refused.content.decode()
    assert "_auth_user_id" not in client.session
