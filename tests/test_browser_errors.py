"""A refused htmx request says why on the page (static/js/console.js), in a real browser."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from playwright.sync_api import expect

from reachconsole.core.roles import action_refused_words
from roster.models import Agent
from tests.browser import chromium_page
from tests.conftest import reader, register


@pytest.mark.django_db(transaction=True)
def test_a_refused_action_shows_its_words_on_the_page(live_server, async_unsafe, settings):
    settings.DEBUG = False
    user = reader("olga", password="pw-olga-123")
    permission = Permission.objects.get(codename="change_agent")
    user.user_permissions.add(permission)
    register("fin.tax", "node-a")

    with chromium_page() as page:
        page.goto(f"{live_server.url}/accounts/login/?next=/agents/fin.tax/")
        page.fill("input[name=username]", "olga")
        page.fill("input[name=password]", "pw-olga-123")
        page.click("button[type=submit]")
        expect(page.locator("#drain")).to_be_visible()
        banner = page.locator("#request-error")
        expect(banner).to_be_hidden()

        user.user_permissions.remove(permission)  # taken away while the page is open
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#drain")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text("403 Not allowed")
        expect(banner).to_contain_text(action_refused_words("olga"))
        page.click("#request-error [data-dismiss]")
        expect(banner).to_be_hidden()

    assert Agent.objects.get().status == Agent.Status.ONLINE
