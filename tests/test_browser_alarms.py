"""The alarms page in Chromium: an operator sees an active alarm, acknowledges it with a
note (confirming), and sees it acknowledged; the header's count follows."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from alarms.evaluate import alarms_evaluate
from alarms.models import Alarm
from reachconsole.core.audit import AuditEntry
from roster import services
from tests.browser import chromium_page, htmx_ready, sign_in
from tests.conftest import register, staff_user


@pytest.mark.django_db(transaction=True)
def test_an_operator_acknowledges_an_alarm_with_a_note(live_server, async_unsafe,
                                                       console_hears):
    # A transactional test starts without the groups migrate made: the permissions directly.
    staff_user("otto", "view_alarm", "acknowledge_alarm")
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.audit", "node-b", capabilities=["audit"])
    services.agent_drain(agent_id="llm.audit", actor="ops")
    alarms_evaluate()  # what beat does every few seconds
    assert Alarm.objects.filter(cleared_at=None).count() == 1
    alarm = Alarm.objects.get(kind=Alarm.Kind.CAPABILITY_UNCOVERED, subject="audit")

    with chromium_page() as page:
        sign_in(page, live_server.url, "otto", "pw-otto-123", "/overview/")
        expect(page.locator("header nav [data-alarm-count]")).to_have_text("1")
        page.click("header nav >> text=Alarms")
        expect(page.locator("h1")).to_have_text("Alarms")
        htmx_ready(page)

        card = page.locator(f"#alarm-{alarm.id}")
        expect(card).to_contain_text("No agent can take capability:audit")
        expect(card).to_contain_text("llm.audit: draining")
        card.locator("summary").click()
        card.locator("textarea[name=note]").fill("draining on purpose until the 16:00 deploy")
        page.once("dialog", lambda dialog: dialog.accept())
        card.locator(f'[data-ack="{alarm.id}"]').click()

        expect(page.locator(".flash")).to_contain_text("is acknowledged by you")
        acknowledged = page.locator(f"#alarm-{alarm.id} [data-acknowledged-by]")
        expect(acknowledged).to_contain_text("Acknowledged by otto")
        expect(acknowledged).to_contain_text("draining on purpose until the 16:00 deploy")
        expect(page.locator(f'[data-ack="{alarm.id}"]')).to_have_count(0)
        # Still listed until its condition clears; no longer counted as unacknowledged.
        expect(page.locator(f"[data-active-alarms] #alarm-{alarm.id}")).to_have_count(1)
        expect(page.locator("header nav [data-alarm-count]")).to_have_count(0)

    alarm.refresh_from_db()
    assert (alarm.acknowledged_by, alarm.ack_note, alarm.cleared_at) == (
        "otto", "draining on purpose until the 16:00 deploy", None)
    assert AuditEntry.objects.filter(action="acknowledge-alarm", actor="otto",
                                     result="ok").count() == 1
