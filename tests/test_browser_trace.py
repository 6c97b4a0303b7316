"""In Chromium: resend from the trace shows the new attempt beside the first, the trace
refreshes when an event of its task arrives, and an operator drains then undrains an agent
from its page, reading the drain preview first."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from django.db import transaction
from playwright.sync_api import expect

from messages.models import Change, Message, Status
from messages.outbound import SendRequest, message_send
from messages.state import changes_apply
from roster.models import Agent, RosterEvent
from tests.browser import chromium_page, sign_in
from tests.conftest import reader, register


def operator(*codenames: str) -> None:
    user = reader("olga", password="pw-olga-123")
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))


@pytest.mark.django_db(transaction=True)
def test_resend_from_the_trace_shows_the_new_attempt(live_server, async_unsafe):
    operator("resend_message")
    failed = message_send(request=SendRequest(to="fin.tax", task_id="job-tr"))
    assert failed.status == Status.UNDELIVERABLE
    register("fin.tax", "node-b")  # the agent is back

    with chromium_page() as page:
        sign_in(page, live_server.url, "olga", "pw-olga-123", f"/messages/{failed.message_id}/")
        expect(page.locator("#message-status")).to_have_text("UNDELIVERABLE")
        expect(page.locator("#trace-axis tbody tr")).to_have_count(1)
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#resend")
        expect(page.locator(".flash")).to_contain_text("Resent as")
        again = Message.objects.get(resend_of=failed)
        expect(page).to_have_url(re.compile(f"/messages/{again.message_id}/$"))
        expect(page.locator("#message-status")).to_have_text("SENT")
        rows = page.locator("#trace-axis tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.nth(0)).to_have_attribute("data-attempt", failed.message_id)
        expect(rows.nth(1)).to_have_attribute("data-attempt", again.message_id)
        expect(rows.nth(1)).to_have_class(re.compile("trace-current"))

        # The broker takes it; the stream's event for this task refreshes the trace (the
        # event is dispatched here as static/js/stream.js would: the test server has no
        # WebSocket). An event of another task changes nothing.
        with transaction.atomic():  # as the bridge records it
            changes_apply([Change(pk=again.pk, to=Status.PUBLISHED,
                                  allowed=frozenset({"SENT"}), actor="bridge", reason="PUBACK",
                                  fields={"published_at": again.created_at})],
                          now=again.created_at)
        page.evaluate("""() => document.body.dispatchEvent(new CustomEvent("a2a_message",
            {detail: {event: "a2a_message", taskId: "another-task", messageId: "x"}}))""")
        page.wait_for_timeout(800)
        expect(page.locator("#message-status")).to_have_text("SENT")
        page.evaluate("""(id) => document.body.dispatchEvent(new CustomEvent("a2a_message",
            {detail: {event: "a2a_message", taskId: "job-tr", messageId: id}}))""",
                      again.message_id)
        expect(page.locator("#message-status")).to_have_text("PUBLISHED")
        expect(page.locator('[data-hop="sent → published"]')).to_have_count(1)


@pytest.mark.django_db(transaction=True)
def test_an_operator_drains_then_undrains_an_agent_from_its_page(live_server, async_unsafe):
    operator("change_agent")
    register("fin.tax", "node-b", capabilities=["tax"], max_inflight=1)
    message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000))
    message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000))  # held

    with chromium_page() as page:
        sign_in(page, live_server.url, "olga", "pw-olga-123", "/agents/fin.tax/")
        expect(page.locator("#agent-status")).to_have_text("ONLINE")
        preview = page.locator("#drain-preview")
        expect(preview.locator('[data-preview="inflight"]')).to_have_text("1")
        expect(preview.locator('[data-preview="held"]')).to_have_text("1")
        expect(preview).to_contain_text("finishes on it while its lease holds")
        asked = []
        page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
        page.click("#drain")
        expect(page.locator("#agent-status")).to_have_text("DRAINING")
        assert "1 in flight, 1 held and 0 retrying finish on it" in asked[0]
        expect(page.locator("#drain-preview h2")).to_have_text("Draining")

        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#undrain")
        expect(page.locator("#agent-status")).to_have_text("ONLINE")
        expect(page.locator(".flash")).to_contain_text("fin.tax takes new work again.")
        expect(page.locator("#drain")).to_be_visible()

    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE
    kinds = list(RosterEvent.objects.filter(agent_id="fin.tax", actor="olga")
                 .order_by("at", "id").values_list("kind", flat=True))
    assert kinds == ["DRAINED", "UNDRAINED"]


@pytest.mark.django_db(transaction=True)
def test_after_a_resend_the_address_is_the_new_attempts_even_if_the_trace_refreshes(
        live_server, async_unsafe):
    """The resend's own events refresh the trace's live part while the boosted POST is on
    its way; that refresh replaced the form, htmx dropped the POST's answer, and the page
    showed the new attempt under the old attempt's address."""
    operator("resend_message")
    failed = message_send(request=SendRequest(to="fin.tax", task_id="job-race"))
    register("fin.tax", "node-b")

    with chromium_page() as page:
        sign_in(page, live_server.url, "olga", "pw-olga-123", f"/messages/{failed.message_id}/")
        expect(page.locator("#message-status")).to_have_text("UNDELIVERABLE")

        def slow_resend(route):
            # An event of this task arrives while the POST is still out, as it does live.
            page.evaluate("""(taskId) => document.body.dispatchEvent(new CustomEvent(
                "a2a_message", {detail: {event: "a2a_message", taskId}}))""", "job-race")
            page.wait_for_timeout(700)  # the refresh lands before the POST's answer
            route.continue_()

        page.route(re.compile(r"/resend$"), slow_resend)
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#resend")
        again = None
        for _ in range(50):
            again = Message.objects.filter(resend_of=failed).first()
            if again:
                break
            page.wait_for_timeout(100)
        assert again is not None
        expect(page).to_have_url(re.compile(f"/messages/{again.message_id}/$"))
        expect(page.locator(".flash")).to_contain_text("Resent as")
