from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from playwright.sync_api import expect

from messages.models import Message
from messages.outbound import SendRequest, message_send
from reachconsole.core.audit import AuditEntry
from tests.browser import chromium_page
from tests.conftest import reader, register


@pytest.mark.django_db(transaction=True)
def test_an_operator_finds_a_failed_message_and_resends_it(live_server, async_unsafe):
    user = reader("olga", password="pw-olga-123")
    user.user_permissions.add(Permission.objects.get(codename="resend_message"))
    failed = message_send(request=SendRequest(to="fin.tax", task_id="job-77",
                                              payload={"note": "<b>bold?</b>"}))
    register("fin.tax", "node-b")  # the agent is back

    with chromium_page() as page:
        page.goto(f"{live_server.url}/messages/?status=UNDELIVERABLE")
        page.fill("input[name=username]", "olga")
        page.fill("input[name=password]", "pw-olga-123")
        page.click("button[type=submit]")
        row = page.locator(f'tr[data-message="{failed.message_id}"]')
        expect(row).to_contain_text("no agent fin.tax is on the roster")
        row.locator("a").click()
        expect(page.locator("#message-status")).to_have_text("UNDELIVERABLE")
        expect(page.locator("#payload-text")).to_contain_text("<b>bold?</b>")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#resend")
        expect(page).to_have_url(re.compile(r"/messages/[0-9a-f-]{36}/$"))
        expect(page.locator("#message-status")).to_have_text("SENT")
        expect(page.locator(".flash")).to_contain_text("Resent as")

    again = Message.objects.get(resend_of=failed)
    assert again.task_id == "job-77" and again.status == "SENT"
    assert AuditEntry.objects.filter(action="resend", actor="olga", result="ok").count() == 1
