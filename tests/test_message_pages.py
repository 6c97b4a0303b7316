"""The message pages: list, trace, resend (one and a filtered set), an agent's load."""

from __future__ import annotations

import re
from datetime import datetime

import pytest
from django.test import Client

from messages.models import Message, Status
from messages.outbound import SendRequest, message_send
from reachconsole.core.audit import AuditEntry
from roster import services
from tests.conftest import logged_in, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
XSS = '<img src=x onerror="window.pwned=1">'


@pytest.fixture
def operator() -> Client:
    return logged_in(staff_user("olga", "resend_message"))


@pytest.fixture
def viewer() -> Client:
    client = Client()
    client.force_login(reader("victor", password="pw-victor-123"))
    return client


def undeliverable(**kwargs) -> Message:
    row = message_send(request=SendRequest(to="fin.tax", **kwargs))
    assert row.status == Status.UNDELIVERABLE
    return row


def test_the_list_filters_and_links_to_traces(viewer):
    a = undeliverable(task_id="job-a")
    register("llm.chat", "node-b")
    b = message_send(request=SendRequest(to="llm.chat", task_id="job-b"))
    html = viewer.get("/messages/").content.decode()
    assert f'data-message="{a.message_id}"' in html and f'data-message="{b.message_id}"' in html
    only = viewer.get("/messages/", {"status": "UNDELIVERABLE"}).content.decode()
    assert f'data-message="{a.message_id}"' in only
    assert f'data-message="{b.message_id}"' not in only
    by_task = viewer.get("/messages/", {"q": "job-b"}).content.decode()
    assert f'data-message="{b.message_id}"' in by_task
    assert f'data-message="{a.message_id}"' not in by_task


def test_the_list_needs_a_login(client):
    assert client.get("/messages/").status_code == 302


def test_the_trace_shows_every_step_and_untrusted_text_as_text(viewer):
    row = undeliverable(payload={"note": XSS})
    html = viewer.get(f"/messages/{row.message_id}/").content.decode()
    assert "no agent fin.tax is on the roster" in html
    assert html.count('class="badge UNDELIVERABLE"') >= 2  # the status and the trace step
    assert XSS not in html and "\\u003Cimg src=x" in html


def test_a_viewer_cannot_resend(viewer):
    row = undeliverable()
    html = viewer.get(f"/messages/{row.message_id}/").content.decode()
    assert 'id="resend"' not in html
    assert viewer.post(f"/messages/{row.message_id}/resend").status_code == 403
    assert Message.objects.count() == 1


def test_an_operator_resends_from_the_trace(operator):
    row = undeliverable(task_id="job-r")
    register("fin.tax", "node-b")
    assert 'id="resend"' in operator.get(f"/messages/{row.message_id}/").content.decode()
    r = operator.post(f"/messages/{row.message_id}/resend", follow=True)
    again = Message.objects.exclude(pk=row.pk).get()
    assert (again.task_id, again.resend_of_id, again.status) == ("job-r", row.pk, "SENT")
    assert r.redirect_chain[-1][0] == f"/messages/{again.message_id}/"
    entry = AuditEntry.objects.get(action="resend")
    assert (entry.actor, entry.target, entry.result) == ("olga", row.message_id, "ok")


def test_a_resend_needs_csrf(operator):
    row = undeliverable()
    strict = Client(enforce_csrf_checks=True)
    strict.cookies = operator.cookies
    assert strict.post(f"/messages/{row.message_id}/resend").status_code == 403
    assert Message.objects.count() == 1


def test_bulk_resend_previews_the_count_and_checks_it(operator):
    rows = [undeliverable() for _ in range(3)]
    register("fin.tax", "node-b")
    page = operator.get("/messages/", {"status": "UNDELIVERABLE", "agent": "fin.tax"})
    assert 'id="bulk-count"' in page.content.decode()
    preview = operator.get("/messages/resendable", {"status": "UNDELIVERABLE",
                                                     "agent": "fin.tax", "since": "60"})
    html = preview.content.decode()
    assert 'data-resendable="3"' in html
    # The form pins what the operator saw: the newest row id then, and the window as moments.
    up_to = re.search(r'name="up_to" value="(\d+)"', html)[1]
    since = re.search(r'name="since" value="([^"]+)"', html)[1]
    assert since != "60" and datetime.fromisoformat(since)
    filters = {"status": "UNDELIVERABLE", "agent": "fin.tax", "since": since, "up_to": up_to}
    stale = operator.post("/messages/bulk-resend", {**filters, "expected": "2"}, follow=True)
    assert "The selection changed" in stale.content.decode()
    assert Message.objects.count() == 3
    # Stored after the preview (as a send would be), so not part of what was confirmed.
    later = Message.objects.create(message_id="late-1", message_type="TASK_REQUEST",
                                   direction="SEND", status=Status.UNDELIVERABLE,
                                   from_agent_id="console", to_agent_id="fin.tax")
    done = operator.post("/messages/bulk-resend", {**filters, "expected": "3"}, follow=True)
    assert "Resent 3 messages as 3 new transmissions" in done.content.decode()
    assert Message.objects.filter(resend_of__in=rows, status="SENT").count() == 3
    assert not Message.objects.filter(resend_of=later).exists()
    no_pin = operator.post("/messages/bulk-resend", {**filters, "up_to": "", "expected": "1"},
                           follow=True)
    assert "ask for the count again" in no_pin.content.decode()
    assert AuditEntry.objects.get(action="resend-bulk").result == "ok"


def test_the_agent_load_shows_inflight_held_and_coverage(viewer):
    register("web.a", "node-a", capabilities=["crawl", "scrape"], max_inflight=1)
    register("web.b", "node-b", capabilities=["crawl"])
    first = message_send(request=SendRequest(to="web.a"))
    held = message_send(request=SendRequest(to="web.a"))
    assert held.held
    html = viewer.get("/messages/agents/web.a/load/").content.decode()
    assert 'data-count="inflight">1<' in html and 'data-count="held">1<' in html
    assert first.message_id in html
    assert 'data-capability="crawl"' in html and "web.b on node-b" in html
    assert "nobody else can take it now" in html  # scrape
    services.agent_drain(agent_id="web.b")
    again = viewer.get("/messages/agents/web.a/load/").content.decode()
    assert "draining: it takes no new work" in again


def test_the_drain_preview_says_what_is_covered_where_and_takes_no_routing_turn(viewer):
    """`/agents/fin.bank-statement/` said draining leaves `bank-statement` uncovered while
    `llm.bank-statement` was ONLINE and took the next capability send; and each look at the
    page advanced the routing round robin."""
    from directory import routing

    register("fin.bank-statement", "node-a", capabilities=["bank-statement", "ledger"])
    register("llm.bank-statement", "node-b", capabilities=["bank-statement"])
    register("fin.ledger-a", "node-a", capabilities=["ledger"])
    register("fin.ledger-b", "node-b", capabilities=["ledger"])
    turns = {key: repr(routing._turns.get(key)) for key in ("cap:bank-statement",
                                                              "cap:ledger")}
    for _ in range(3):
        html = viewer.get("/messages/agents/fin.bank-statement/load/").content.decode()
    item = html[html.index('data-capability="bank-statement"'):]
    item = item[:item.index("</li>")]
    assert "uncovered" not in item and 'data-covered="elsewhere"' in item
    assert "llm.bank-statement on node-b takes it for API sends and callers outside " \
           "namespace fin" in item
    assert "their sends to capability:bank-statement end UNDELIVERABLE" in item
    ledger = html[html.index('data-capability="ledger"'):]
    assert "fin.ledger-a on node-a, fin.ledger-b on node-b" in ledger[:ledger.index("</li>")]
    # Looking took no turn: the next real sends go where they would have gone.
    assert {key: repr(routing._turns.get(key)) for key in turns} == turns
    # What the page said is what routing does: an API send reaches the other namespace.
    services.agent_drain(agent_id="fin.bank-statement")
    sent = message_send(request=SendRequest(to="capability:bank-statement"))
    assert sent.to_agent_id == "llm.bank-statement"


def test_the_timeline_shows_untrusted_text_as_text(viewer):
    row = Message.objects.create(message_id="m-xss", task_id=XSS, message_type="TASK_REQUEST",
                                 direction="RECV", status="RECV", from_agent_id=XSS,
                                 error=XSS, payload={"note": XSS})
    for headers in ({}, {"HX-Request": "true", "HX-Target": "messages-live"}):
        html = viewer.get("/messages/", {"q": XSS}, headers=headers).content.decode()
        assert f'data-message="{row.message_id}"' in html
        assert "<img src=x" not in html
        assert "&lt;img src=x" in html
    export = viewer.get("/messages/export.jsonl", {"task": XSS})
    assert XSS in b"".join(export.streaming_content).decode("utf-8").replace("\\", "")
