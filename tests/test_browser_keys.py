"""In Chromium: the keyboard's way in. The first Tab stop skips the nav (nine stops before
a page's first filter), "/" puts the cursor in the page's search field and "?" lists the
keys; none of them acts while a person types."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from reachconsole.core import roles
from tests.browser import chromium_page, htmx_ready, sign_in
from tests.test_browser_tasks import person


def active(page) -> str:
    return page.evaluate("(() => { const e = document.activeElement;"
                         " return e.id || e.getAttribute('name') || e.textContent.trim(); })()")


@pytest.mark.django_db(transaction=True)
def test_skip_link_search_key_and_the_list_of_keys(live_server, async_unsafe):
    person("kai", roles.VIEWER_PERMISSIONS)
    with chromium_page() as page:
        sign_in(page, live_server.url, "kai", "pw-kai-123", next_path="/tasks/")
        htmx_ready(page)
        page.keyboard.press("Tab")
        assert active(page) == "Skip to content"
        expect(page.locator(".skip-link")).to_be_visible()
        page.keyboard.press("Enter")
        assert active(page) == "main"

        page.keyboard.press("/")
        assert active(page) == "q"
        page.keyboard.type("t-1/?")  # typed into the field: no key acts
        assert page.input_value("main input[name=q]") == "t-1/?"
        expect(page.locator("#keys-help")).not_to_be_visible()

        page.locator("h1").click()  # out of the field
        page.keyboard.press("?")
        expect(page.locator("#keys-help")).to_be_visible()
        expect(page.locator("#keys-help")).to_contain_text("pause or resume")
        page.keyboard.press("Escape")
        expect(page.locator("#keys-help")).not_to_be_visible()

        # Every page answers "/" with its own search field.
        page.goto(f"{live_server.url}/")
        htmx_ready(page)
        page.locator("h1").click()
        page.keyboard.press("/")
        assert active(page) == "q"
