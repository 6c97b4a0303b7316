from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from playwright.sync_api import expect

from roster.models import Agent, RosterEvent
from tests.browser import chromium_page, htmx_ready
from tests.conftest import reader, register

XSS = '<img src=x onerror="window.pwned=1">'


@pytest.mark.django_db(transaction=True)
def test_it_logs_in_filters_and_drains_an_agent(live_server, async_unsafe):
    user = reader("olga", password="pw-olga-123")
    user.user_permissions.add(Permission.objects.get(codename="change_agent"))
    register("fin.tax", "node-a", capabilities=["tax"], metadata={"note": XSS})
    register("fin.vat", "node-b", capabilities=["vat"])
    register("llm.chat", "node-b", capabilities=["chat"])

    with chromium_page() as page:
        page.goto(f"{live_server.url}/")
        expect(page).to_have_url(re.compile(r"/accounts/login/"))
        page.fill("input[name=username]", "olga")
        page.fill("input[name=password]", "pw-olga-123")
        page.click("button[type=submit]")
        expect(page.locator("h1")).to_have_text("Roster health")
        htmx_ready(page)
        expect(page.locator("tr[data-agent]")).to_have_count(3)

        page.select_option("select[name=namespace]", "fin")
        expect(page.locator("tr[data-agent]")).to_have_count(2)
        expect(page).to_have_url(re.compile(r"namespace=fin"))
        page.fill("input[name=q]", "vat")
        expect(page.locator("tr[data-agent]")).to_have_count(1)
        expect(page.locator("tr[data-agent]")).to_have_attribute("data-agent", "fin.vat")
        page.reload()  # the filters live in the URL
        expect(page.locator("tr[data-agent]")).to_have_count(1)

        page.goto(f"{live_server.url}/agents/fin.tax/")
        expect(page.locator("#metadata-text")).to_contain_text("<img src=x onerror=")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#drain")
        expect(page.locator("#agent-status")).to_have_text("DRAINING")
        expect(page.locator(".flash")).to_contain_text("fin.tax is draining")
        assert page.evaluate("window.pwned") is None

    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING
    assert RosterEvent.objects.filter(kind="DRAINED", actor="olga").count() == 1
