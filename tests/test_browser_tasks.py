"""In Chromium: the task list an operator starts from (filters, live refresh from the
stream, pause), the overview's tiles leading to it, and Cancel with its confirmation."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from django.db import transaction
from playwright.sync_api import expect

from messages.models import Change, Message, Status
from messages.outbound import SendRequest, message_send
from messages.state import changes_apply
from reachconsole.core import roles
from roster.models import Agent
from tests.browser import chromium_page, htmx_ready, sign_in
from tests.conftest import published, reader, register


def person(username: str, permissions: list[tuple[str, str]]) -> None:
    """A person holding a role's permissions (a transactional test's flush empties the
    groups that migrate made)."""
    user = reader(username, password=f"pw-{username}-123")
    for app_label, codename in permissions:
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label,
                                                         codename=codename))


def push(page, task_id: str) -> None:
    """An event of the stream, dispatched as static/js/stream.js would (the test server has
    no WebSocket): the event itself, then reach:changed, as the stream sends them."""
    page.evaluate("""(id) => {
        document.body.dispatchEvent(new CustomEvent("a2a_message",
            {detail: {event: "a2a_message", taskId: id}}));
        document.body.dispatchEvent(new CustomEvent("reach:changed", {detail: {}}));
    }""", task_id)


@pytest.mark.django_db(transaction=True)
def test_the_task_list_filters_refreshes_live_and_holds_while_paused(live_server,
                                                                    async_unsafe):
    person("vera", roles.VIEWER_PERMISSIONS)
    register("fin.tax", "node-b")
    message_send(request=SendRequest(to="fin.tax", task_id="t-first"))
    Agent.objects.filter(agent_id="fin.vat").delete()
    message_send(request=SendRequest(to="fin.vat", task_id="t-lost"))

    with chromium_page() as page:
        sign_in(page, live_server.url, "vera", "pw-vera-123", "/overview/")
        page.click('[data-tile="undeliverable"] a[data-tile-link]')
        page.wait_for_url(re.compile(r"/tasks/\?status=UNDELIVERABLE"))
        htmx_ready(page)
        rows = page.locator("#tasks tbody tr[data-task]")
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-task", "t-lost")

        page.click("text=Clear")
        page.wait_for_url(re.compile(r"/tasks/$"))
        htmx_ready(page)
        expect(rows).to_have_count(2)
        page.check('input[name="status"][value="SENT"]')
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-task", "t-first")
        expect(page).to_have_url(re.compile(r"status=SENT"))

        # Live: a new task matching the filters appears once the stream says so.
        message_send(request=SendRequest(to="fin.tax", task_id="t-new"))
        push(page, "t-new")
        expect(rows).to_have_count(2)
        expect(rows.first).to_have_attribute("data-task", "t-new")

        # Paused: nothing moves under the reader; the bar counts what came.
        page.click("#tasks-pause")
        expect(page.locator("#tasks-pause")).to_have_attribute("aria-pressed", "true")
        message_send(request=SendRequest(to="fin.tax", task_id="t-while-paused"))
        push(page, "t-while-paused")
        expect(page.locator("#tasks-new")).to_contain_text("1 update since")
        page.wait_for_timeout(600)
        expect(rows).to_have_count(2)
        page.click("#tasks-new")
        expect(rows).to_have_count(3)
        expect(rows.first).to_have_attribute("data-task", "t-while-paused")


@pytest.mark.django_db(transaction=True)
def test_an_operator_cancels_a_task_from_the_list_and_from_the_trace(live_server,
                                                                     async_unsafe):
    person("otto", roles.OPERATOR_PERMISSIONS)
    register("fin.tax", "node-b")
    on_bus = message_send(request=SendRequest(to="fin.tax", task_id="t-bus",
                                              timeout_ms=600_000))
    with transaction.atomic():
        published(on_bus, on_bus.created_at)
    unsent = message_send(request=SendRequest(to="fin.tax", task_id="t-unsent",
                                              timeout_ms=600_000))

    with chromium_page() as page:
        sign_in(page, live_server.url, "otto", "pw-otto-123", "/tasks/")
        page.click('[data-cancel="t-bus"]')
        preview = page.locator("#cancel-preview")
        expect(preview).to_contain_text("Cancel task t-bus?")
        expect(preview.locator(f'[data-open="{on_bus.message_id}"]')).to_contain_text(
            "on the bus: it ends CANCELED and node-b is sent CANCEL")
        page.fill("#cancel-form input[name=reason]", "wrong customer")
        page.click("#cancel-form button[type=submit]")
        expect(page.locator(".flash")).to_contain_text(
            "Task t-bus canceled: 1 transmission ended CANCELED; CANCEL sent to node-b.")
        expect(page.locator('tr[data-task="t-bus"]')).to_have_attribute("data-status",
                                                                         "CANCELED")
        assert Message.objects.filter(message_type="CANCEL", task_id="t-bus").count() == 1

        # From the trace: the task that never reached a node.
        page.goto(f"{live_server.url}/messages/{unsent.message_id}/")
        htmx_ready(page)
        page.click("#cancel")
        expect(page.locator("#cancel-preview")).to_contain_text(
            "not sent yet: it ends CANCELED and is never transmitted")
        page.fill("#cancel-form input[name=reason]", "duplicate")
        page.click("#cancel-form button[type=submit]")
        expect(page.locator(".flash")).to_contain_text("none had reached a node")
        expect(page).to_have_url(re.compile(f"/messages/{unsent.message_id}/$"))
        expect(page.locator("#message-status")).to_have_text("CANCELED")
        expect(page.locator("#cancel")).to_have_count(0)
        unsent.refresh_from_db()
        assert unsent.status == Status.CANCELED and unsent.error.endswith(": duplicate")

    # Applying a late answer to it changes nothing.
    with transaction.atomic():
        changes_apply([Change(pk=unsent.pk, to=Status.ACKED, actor="bridge", reason="ACK")],
                      now=unsent.created_at)
    unsent.refresh_from_db()
    assert unsent.status == Status.CANCELED
