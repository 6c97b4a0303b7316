"""The numbers in a real browser: the agent page's success rate and EXPIRED count after
traffic, its window picker and live refresh; the roster sorted by success rate with the
failing agent first, kept through a live refresh and a filter change; the cluster page's
cards filled from one request and kept through a refresh of the cards."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.browser import chromium_page, sign_in
from tests.conftest import register, staff_user
from tests.test_stats_pages import completed, expire_what_is_due, sent_to_expire

pytestmark = pytest.mark.django_db(transaction=True)

# What static/js/stream.js dispatches when the stream carries a message event (the test's
# live server has no WebSocket): the event itself, then reach:changed.
STREAM_EVENT = """() => {
    document.body.dispatchEvent(new CustomEvent("a2a_message", {detail: {}}));
    document.body.dispatchEvent(new CustomEvent("reach:changed", {detail: {}}));
}"""


def viewer(username: str = "vera") -> str:
    """Someone who may read the numbers (view_message, as the viewer role has it) and act on
    nothing. By permission, not the group: a transactional test's flush empties the groups
    the migrations made (tests/test_stats_pages.py reads them as a viewer-group member)."""
    staff_user(username, "view_message", "view_agent", "view_clusternode")
    return f"pw-{username}-123"


def test_the_agent_page_shows_its_success_rate_and_expired_count(live_server, async_unsafe,
                                                                 console_hears):
    password = viewer()
    register("fin.tax", "node-b")
    completed("fin.tax", "node-b", "t-1")
    sent_to_expire("fin.tax", "t-2")
    expire_what_is_due()

    with chromium_page() as page:
        sign_in(page, live_server.url, "vera", password, "/agents/fin.tax/")
        stats = page.locator("#agent-stats .stats")
        expect(stats.locator("[data-stat=success]")).to_have_text("50.0 %")
        expect(stats.locator("[data-count=expired]")).to_have_text("1")
        expect(stats.locator("[data-count=tasks]")).to_have_text("2")
        expect(stats.locator("[data-count-link=expired]")).to_have_attribute(
            "href", "/tasks/?status=EXPIRED&agent=fin.tax&since=15")
        expect(stats.locator(".stats-bounds")).to_contain_text("approximate")
        expect(page.locator("#request-error")).to_be_hidden()

        # Another window: the partial swaps itself, and the page's address keeps it.
        stats.locator("a[data-window='1h']").click()
        expect(page.locator("#agent-stats .stats")).to_have_attribute("data-window", "1h")
        expect(page).to_have_url(re.compile(r"/agents/fin\.tax/\?window=1h$"))
        expect(page.locator("[data-count-link=expired]")).to_have_attribute(
            "href", "/tasks/?status=EXPIRED&agent=fin.tax&since=60")

        # New traffic, then the stream's hint: the numbers refresh, in the window picked.
        sent_to_expire("fin.tax", "t-3")
        expire_what_is_due()
        page.evaluate(STREAM_EVENT)
        expect(page.locator("#agent-stats [data-count=expired]")).to_have_text("2")
        expect(page.locator("#agent-stats [data-stat=success]")).to_have_text("33.3 %")
        expect(page.locator("#agent-stats .stats")).to_have_attribute("data-window", "1h")


def test_the_roster_sorted_by_success_shows_the_failing_agent_first(live_server,
                                                                     async_unsafe,
                                                                     console_hears):
    password = viewer()
    for agent_id in ("fin.alpha", "fin.beta", "fin.zulu", "llm.chat"):
        register(agent_id, "node-a")
    completed("fin.alpha", "node-a", "t-a")
    completed("fin.beta", "node-a", "t-b1")
    sent_to_expire("fin.beta", "t-b2")
    sent_to_expire("fin.zulu", "t-z")  # last by id, and failing everything
    expire_what_is_due()

    with chromium_page() as page:
        sign_in(page, live_server.url, "vera", password, "/")
        rows = page.locator("tr[data-agent]")
        expect(rows).to_have_count(4)
        expect(rows.first).to_have_attribute("data-agent", "fin.alpha")

        page.click("a[data-sort-link=success]")
        expect(page).to_have_url(re.compile(r"sort=success"))
        expect(rows.first).to_have_attribute("data-agent", "fin.zulu")
        expect(rows.nth(1)).to_have_attribute("data-agent", "fin.beta")
        expect(rows.nth(2)).to_have_attribute("data-agent", "fin.alpha")
        expect(rows.nth(3)).to_have_attribute("data-agent", "llm.chat")  # no traffic: last
        expect(rows.first.locator("td[data-success]")).to_have_text("0.0 %")
        expect(page.locator("#sort-order")).to_contain_text("by success rate, lowest first")

        # A live refresh and a filter change keep the sort.
        page.evaluate(STREAM_EVENT)
        page.wait_for_timeout(500)
        expect(rows.first).to_have_attribute("data-agent", "fin.zulu")
        page.select_option("select[name=namespace]", "fin")
        expect(rows).to_have_count(3)
        expect(rows.first).to_have_attribute("data-agent", "fin.zulu")
        expect(page).to_have_url(re.compile(r"namespace=fin.*sort=success|sort=success.*"
                                            r"namespace=fin"))

        # The other direction.
        page.click("a[data-sort-link=success]")
        expect(page).to_have_url(re.compile(r"sort=-success"))
        expect(rows.first).to_have_attribute("data-agent", "fin.alpha")


def test_the_cluster_cards_show_their_numbers_through_a_refresh(live_server, async_unsafe,
                                                                console_hears):
    password = viewer()
    register("fin.tax", "node-b")
    register("llm.chat", "node-a")
    completed("fin.tax", "node-b", "t-1")
    sent_to_expire("fin.tax", "t-2")
    expire_what_is_due()

    with chromium_page() as page:
        sign_in(page, live_server.url, "vera", password, "/cluster/")
        card = page.locator("#node-node-b [data-node-numbers=node-b]")
        expect(card.locator("[data-node-stat=tasks]")).to_have_text("2")
        expect(card.locator("[data-node-stat=success]")).to_have_text("50.0 %")
        expect(card.locator("[data-node-stat=expired]")).to_have_text("1")
        expect(page.locator("#node-node-a [data-node-stat=tasks]")).to_have_text("0")

        # A refresh of the cards keeps the numbers in place and brings new ones.
        sent_to_expire("fin.tax", "t-3")
        expire_what_is_due()
        page.evaluate(STREAM_EVENT)
        expect(card.locator("[data-node-stat=expired]")).to_have_text("2")

        # Every number of one node, in its card.
        page.locator("#node-node-b a[data-node-more]").click()
        more = page.locator("#node-node-b .node-more .stats")
        expect(more.locator("[data-count=expired]")).to_have_text("2")
        page.evaluate(STREAM_EVENT)
        page.wait_for_timeout(1000)  # the cards' refresh and the numbers' own
        expect(page.locator("#node-node-b .node-more .stats")).to_have_count(1)
        expect(card.locator("[data-node-stat=expired]")).to_have_text("2")
        expect(page.locator("#request-error")).to_be_hidden()
