"""The overview page in Chromium, against the console as it runs (tests/processes.py
console_serving: stock daphne with Redis, `runconsole` embedded): it draws its
charts, and follows traffic from the stream without a reload."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from alarms.evaluate import alarms_evaluate
from roster import services
from tests.browser import chromium_page, sign_in
from tests.conftest import reader, register
from tests.mqtt import free_port
from tests.processes import HOST, api_send, console_serving


def tile_value(page, key: str):
    return page.locator(f'[data-tile="{key}"] [data-value]')


@pytest.mark.django_db(transaction=True)
def test_the_overview_draws_charts_and_follows_traffic_without_a_reload(tmp_path):
    reader("olga", password="pw-olga-123")
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.audit", "node-b", capabilities=["audit"])
    services.agent_drain(agent_id="llm.audit", actor="ops")
    # What beat does every few seconds (this console runs no worker): the strip shows the
    # alarm records.
    alarms_evaluate()
    port = free_port()
    base = f"http://{HOST}:{port}"

    with chromium_page() as page, console_serving(port, tmp_path):
        sign_in(page, base, "olga", "pw-olga-123")
        page.click("header nav >> text=Overview")
        expect(page.locator("h1")).to_have_text("Overview")
        expect(page.locator("header nav a[aria-current=page]")).to_have_text("Overview")
        # The alarm comes first and names what is wrong.
        alarm = page.locator('.ov-alarms [data-uncovered="audit"]')
        expect(alarm).to_contain_text("No agent can take capability:audit")
        expect(alarm).to_contain_text("llm.audit: draining")
        expect(page.locator('tr[data-capability="tax"] [data-routable]')).to_have_text("1")

        charts = page.locator("svg.ov-chart[role=img]")
        expect(charts).to_have_count(11)  # the eleven tiles of message_tiles
        expect(page.locator("#chart-rate-title")).to_contain_text("Messages per second")
        expect(tile_value(page, "undeliverable")).to_have_text("0")
        expect(page.locator('[data-chart="chart-undeliverable"] rect')).to_have_count(0)
        expect(page.locator("body")).to_have_attribute("data-stream-state", "open")
        page.evaluate("window.sameDocument = true")

        # Traffic: one send nobody can take, one the roster can route (no bridge runs here,
        # so it stays SENT). The stream's events re-render the live part; the fallback poll
        # is 15 s away, and the page is the same document throughout.
        api_send(port, "fin.nobody")
        api_send(port, "fin.tax")
        expect(tile_value(page, "undeliverable")).to_have_text("1", timeout=10000)
        expect(page.locator('[data-chart="chart-undeliverable"] rect')).to_have_count(1)
        expect(page.locator('[data-chart="chart-rate"] rect')).to_have_count(1)
        expect(page.locator('[data-tile="rate"] .ov-note')).to_contain_text("2 in the last")
        assert page.evaluate("window.sameDocument") is True

        # The hour, per minute: the same numbers in a coarser chart, and in the URL.
        page.click('[data-window="1h"]')
        expect(page.locator("#ov-messages")).to_contain_text("the last hour, per minute")
        expect(tile_value(page, "undeliverable")).to_have_text("1")
