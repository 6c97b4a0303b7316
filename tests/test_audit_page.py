"""The audit page (/audit/): who did what to what, when, with what result; filters in the URL,
keyset paging, bad input refused with words; an action on a page shows up there."""

from __future__ import annotations

import html as htmllib
import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from reachconsole import audit_views
from reachconsole.core import roles
from reachconsole.core.audit import AuditEntry
from tests.conftest import logged_in, reader, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

ROW = re.compile(r'data-audit="(\d+)"')
NEXT = re.compile(r'<a href="\?([^"]*)"[^>]*id="audit-next"')


@pytest.fixture
def viewer() -> Client:
    user = reader("vera", password="pw-vera-123")
    user.groups.add(Group.objects.get(name=roles.VIEWER))
    return logged_in(user)


def shown(response) -> list[int]:
    assert response.status_code == 200, response.content[:500]
    return [int(pk) for pk in ROW.findall(response.content.decode())]


def entry(minutes_ago: float, **fields) -> AuditEntry:
    values = {"actor": "olga", "action": "drain", "target": "fin.tax", "result": "ok"}
    values.update(fields)
    return AuditEntry.objects.create(at=timezone.now() - timedelta(minutes=minutes_ago),
                                     **values)


def test_it_needs_a_login(client):
    response = client.get("/audit/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_it_shows_who_did_what_to_what_when_and_how_it_ended(viewer):
    row = entry(1, actor="olga", action="deregister", target="fin.tax", result="refused",
                detail='it holds <b>2</b> "tasks"')
    page = viewer.get("/audit/")
    assert shown(page) == [row.pk]
    html = page.content.decode()
    for text in ("olga", "deregister", "refused", row.at.strftime("%Y-%m-%d %H:%M:%S")):
        assert text in html
    assert "it holds &lt;b&gt;2&lt;/b&gt; &quot;tasks&quot;" in html  # detail is text
    assert 'href="/agents/fin.tax/"' in html  # the target links to its page
    assert 'href="/audit/?actor=olga"' in html  # and the actor to everything they did


def test_it_filters_by_actor_action_target_result_and_time(viewer):
    old = entry(120, actor="olga", action="drain", target="fin.tax")
    refused = entry(30, actor="victor", action="drain", target="fin.vat", result="refused")
    resend = entry(10, actor="olga", action="resend", target="m-1")
    node = entry(5, actor="olga", action="retire-node", target="node-a")

    def only(**query):
        return shown(viewer.get("/audit/", query))

    assert only() == [node.pk, resend.pk, refused.pk, old.pk]
    assert only(actor="olga") == [node.pk, resend.pk, old.pk]
    assert only(action="drain") == [refused.pk, old.pk]
    assert only(target="fin.") == [refused.pk, old.pk]  # the start of a target
    assert only(target="fin.vat") == [refused.pk]
    assert only(result="refused") == [refused.pk]
    assert only(actor="olga", action="drain") == [old.pk]
    since = (timezone.now() - timedelta(minutes=60)).strftime("%Y-%m-%dT%H:%M:%S")
    until = (timezone.now() - timedelta(minutes=7)).strftime("%Y-%m-%dT%H:%M")
    assert only(**{"from": since}) == [node.pk, resend.pk, refused.pk]
    assert only(**{"from": since, "to": until}) == [resend.pk, refused.pk]
    assert only(actor="nobody") == []
    empty = viewer.get("/audit/", {"actor": "x"}).content.decode()
    assert "No actions match these filters" in empty
    # The filters live in the URL and come back in the form.
    html = viewer.get("/audit/", {"actor": "olga", "result": "ok"}).content.decode()
    assert 'name="actor" value="olga"' in html and "<option selected>ok</option>" in html


def test_htmx_gets_the_rows_alone(viewer):
    row = entry(1)
    response = viewer.get("/audit/", {"actor": "olga"},
                          headers={"HX-Request": "true", "HX-Target": "audit-live"})
    assert shown(response) == [row.pk]
    assert "<html" not in response.content.decode()


def test_it_pages_by_key_through_every_row_once(viewer):
    now = timezone.now()
    # 250 rows, with runs of equal times: the cursor must break ties by id.
    AuditEntry.objects.bulk_create([
        AuditEntry(at=now - timedelta(seconds=i // 3), actor="olga", action="drain",
                   target=f"fin.a{i}", result="ok") for i in range(250)
    ])
    expected = list(AuditEntry.objects.order_by("-at", "-id").values_list("pk", flat=True))
    seen, query, pages = [], "", 0
    while True:
        response = viewer.get(f"/audit/?{query}")
        rows = shown(response)
        assert len(rows) <= audit_views.PAGE_SIZE
        seen += rows
        pages += 1
        found = NEXT.search(response.content.decode())
        if not found:
            break
        query = htmllib.unescape(found.group(1))
        assert "after=" in query
    assert pages == 3
    assert seen == expected


def test_paging_keeps_the_filters(viewer):
    now = timezone.now()
    AuditEntry.objects.bulk_create([
        AuditEntry(at=now - timedelta(seconds=i), actor="olga" if i % 2 else "victor",
                   action="drain", target=f"fin.b{i}", result="ok")
        for i in range(2 * audit_views.PAGE_SIZE + 10)
    ])
    first = viewer.get("/audit/", {"actor": "olga"})
    query = htmllib.unescape(NEXT.search(first.content.decode()).group(1))
    assert "actor=olga" in query
    rest = shown(viewer.get(f"/audit/?{query}"))
    everything = shown(first) + rest
    assert set(everything) == set(AuditEntry.objects.filter(actor="olga").values_list("pk",
                                                                                      flat=True))
    assert len(everything) == len(set(everything))


@pytest.mark.parametrize(("query", "words"), [
    ({"from": "yesterday"}, "'from' must be a date and time such as"),
    ({"to": "2026-13-45T99:00"}, "'to' must be a date and time such as"),
    ({"from": "2026-11-30T10:00", "to": "2026-11-30T09:00"}, "is after 'to'"),
    ({"after": "not-a-cursor"}, "is not one the audit page made"),
    ({"after": "99999999999999999999999-1"}, "is not one the audit page made"),
    # At the calendar's edges an offset leaves it: refused, not a 500.
    ({"from": "0001-01-01T00:00:00+01:00"}, "'from' must be a date and time such as"),
    ({"to": "9999-12-31T23:59:59-01:00"}, "'to' must be a date and time such as"),
])
def test_bad_input_is_refused_with_words(viewer, query, words):
    response = viewer.get("/audit/", query)
    assert response.status_code == 400
    assert htmllib.escape(words, quote=True) in response.content.decode()


def test_a_drain_on_the_page_writes_a_row_the_audit_page_shows(world_operator):
    client, agent_id = world_operator
    assert client.post(f"/agents/{agent_id}/drain").status_code == 302
    row = AuditEntry.objects.get(action="drain", target=agent_id)
    assert (row.actor, row.result) == ("otto", "ok")
    page = client.get("/audit/", {"target": agent_id})
    assert shown(page) == [row.pk]
    assert "otto" in page.content.decode()


def test_a_refused_action_is_shown_refused(world_operator):
    client, agent_id = world_operator
    # The second drain is refused by the service (already draining) and audited as such.
    client.post(f"/agents/{agent_id}/drain")
    client.post(f"/agents/{agent_id}/deregister")
    client.post(f"/agents/{agent_id}/drain")
    refused = shown(client.get("/audit/", {"result": "refused", "actor": "otto"}))
    assert refused and all(AuditEntry.objects.get(pk=pk).result == "refused" for pk in refused)


@pytest.fixture
def world_operator():
    user = reader("otto", password="pw-otto-123")
    user.groups.add(Group.objects.get(name=roles.OPERATOR))
    agent = register("fin.tax", "node-a")
    return logged_in(user), agent.agent_id
