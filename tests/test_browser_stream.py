"""The live stream reaches the page (static/js/stream.js), against the console as it runs.

Production shape (REDIS_URL set): a stock daphne; embedded default: `manage.py runconsole`
(its one process binds the in-memory channel layer to Daphne's loop, which a bare daphne
without Redis cannot). Both serve the test database. Messages are sent through the console's
own API, so the event leaves from the process that serves the WebSocket in both modes.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.browser import chromium_page, sign_in
from tests.conftest import reader, register
from tests.mqtt import free_port
from tests.processes import HOST, api_send, console_serving

# Collects the stream's DOM events in the page, so the test reads what a page part would hear.
LISTEN = """() => {
  window.heard = [];
  for (const name of ["a2a_message", "a2a_failed", "reach:stream-resync"]) {
    document.body.addEventListener(name, (e) => window.heard.push({
      name: e.type, id: (e.detail || {}).messageId || null,
      event: (e.detail || {}).event || null}));
  }
}"""


def heard(page, name: str, message_id: str | None = None) -> bool:
    return page.evaluate(
        "([name, id]) => window.heard.some((h) => h.name === name && (!id || h.id === id))",
        [name, message_id])


@pytest.mark.django_db(transaction=True)
def test_it_dispatches_events_resyncs_after_a_restart_and_stops_when_signed_out(tmp_path):
    reader("olga", password="pw-olga-123")
    register("fin.tax", "node-a", capabilities=["tax"])
    port = free_port()
    base = f"http://{HOST}:{port}"

    with chromium_page() as page:
        with console_serving(port, tmp_path):
            sign_in(page, base, "olga", "pw-olga-123")
            expect(page.locator("h1")).to_have_text("Roster health")
            expect(page.locator("body")).to_have_attribute("data-stream", "/ws/timeline/")
            expect(page.locator("body")).to_have_attribute("data-stream-state", "open")
            expect(page.locator("[data-stream-indicator]")).to_have_text("Live")
            page.evaluate(LISTEN)

            # The roster's live part refreshes from the stream. Start right after its slow
            # poll (every 10 s): a refresh within the next 5 s can then only be the event's.
            def is_refresh(request) -> bool:
                return request.headers.get("hx-target") == "roster-live"

            with page.expect_request(is_refresh, timeout=15000):
                pass
            # No such agent: the row is UNDELIVERABLE, which is both events.
            with page.expect_request(is_refresh, timeout=5000):
                lost = api_send(port, "fin.nobody")
            page.wait_for_function(
                "(id) => window.heard.some((h) => h.name === 'a2a_failed' && h.id === id)",
                arg=lost)
            assert heard(page, "a2a_message", lost)
            names = page.evaluate("window.heard.filter((h) => h.id).map((h) => [h.name, h.event])")
            assert all(name == event for name, event in names), names
            assert not heard(page, "reach:stream-resync")

        # The console is down: the page says so and keeps trying.
        expect(page.locator("body")).to_have_attribute("data-stream-state", "closed")
        expect(page.locator("[data-stream-indicator]")).to_contain_text("reconnecting")

        with console_serving(port, tmp_path):
            expect(page.locator("body")).to_have_attribute("data-stream-state", "open",
                                                           timeout=30000)
            page.wait_for_function(
                "() => window.heard.some((h) => h.name === 'reach:stream-resync')")
            # The same page, not a reload: the listener installed before the restart heard it,
            # and the new socket carries events again.
            again = api_send(port, "fin.tax")
            page.wait_for_function(
                "(id) => window.heard.some((h) => h.name === 'a2a_message' && h.id === id)",
                arg=again)
            assert not heard(page, "a2a_failed", again)

        # Signed out meanwhile (another tab, an expired session): the next socket is closed
        # with 4401, and the page says so instead of retrying.
        page.context.clear_cookies()
        with console_serving(port, tmp_path):
            expect(page.locator("[data-stream-indicator]")).to_contain_text("Signed out",
                                                                           timeout=30000)
            expect(page.locator("body")).to_have_attribute("data-stream-state", "closed")
            page.wait_for_timeout(2000)  # a retry would have set "connecting" by now
            expect(page.locator("body")).to_have_attribute("data-stream-state", "closed")


@pytest.mark.django_db(transaction=True)
def test_live_stays_in_the_header_after_a_boosted_action(tmp_path, async_unsafe):
    """Resend swaps the page's body, header included, while the socket lives on: the new
    header's indicator was blank until a reload, though updates kept arriving."""
    from django.contrib.auth.models import Permission

    from messages.models import Message
    from messages.outbound import SendRequest, message_send

    user = reader("olga", password="pw-olga-123")
    user.user_permissions.add(Permission.objects.get(codename="resend_message"))
    failed = message_send(request=SendRequest(to="fin.tax", task_id="job-live"))
    register("fin.tax", "node-a")
    port = free_port()
    base = f"http://{HOST}:{port}"

    with chromium_page() as page, console_serving(port, tmp_path):
        sign_in(page, base, "olga", "pw-olga-123", f"/messages/{failed.message_id}/")
        expect(page.locator("[data-stream-indicator]")).to_have_text("Live")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#resend")
        expect(page.locator(".flash")).to_contain_text("Resent as")
        again = Message.objects.get(resend_of=failed)
        expect(page).to_have_url(re.compile(f"/messages/{again.message_id}/$"))
        expect(page.locator("[data-stream-indicator]")).to_have_text("Live")
        expect(page.locator("[data-stream-indicator]")).to_have_attribute("data-state", "open")
