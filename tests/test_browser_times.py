"""In Chromium: a viewer chooses to read times in their own zone (kept for their account in
this browser), with UTC on hover, and back; the words naming the zone follow."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from playwright.sync_api import expect

from reachconsole.core import roles
from roster.models import Agent
from tests.browser import chromium_page, htmx_ready, sign_in
from tests.conftest import register
from tests.test_browser_tasks import person


@pytest.mark.django_db(transaction=True)
def test_a_viewer_switches_times_to_local_and_back(live_server, async_unsafe):
    person("lea", roles.VIEWER_PERMISSIONS)
    register("fin.tax", "node-a")
    Agent.objects.filter(agent_id="fin.tax").update(
        registered_at=datetime(2026, 12, 2, 20, 15, 7, tzinfo=UTC))

    with chromium_page(timezone_id="Asia/Kolkata") as page:  # UTC+05:30, no summer time
        sign_in(page, live_server.url, "lea", "pw-lea-123", next_path="/agents/fin.tax/")
        htmx_ready(page)
        registered = page.locator("dt:text('Registered') + dd")
        expect(registered).to_have_text("2026-12-02 20:15:07 UTC")
        toggle = page.locator("[data-times-toggle]")
        expect(toggle).to_have_text("Times: UTC")

        toggle.click()
        expect(registered.locator("time")).to_have_text("2026-12-03 01:45:07")
        expect(registered.locator("time")).to_have_attribute("title", "2026-12-02 20:15:07 UTC")
        expect(registered.locator("[data-tz]")).to_have_text("GMT+5:30")
        expect(toggle).to_have_attribute("aria-pressed", "true")

        page.reload()  # the choice is kept
        htmx_ready(page)
        expect(registered.locator("time")).to_have_text("2026-12-03 01:45:07")
        page.locator("[data-times-toggle]").click()
        expect(registered).to_have_text("2026-12-02 20:15:07 UTC")
