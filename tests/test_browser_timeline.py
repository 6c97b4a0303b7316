"""The live timeline in Chromium against the console as it runs (static/js/timeline.js on
static/js/stream.js): rows arrive without a reload, failures reach the page as `a2a_failed`,
a paused or read list holds still while counting what is new, and the exports hold the
filtered rows. Messages are sent through the console's own API, so their events leave from
the process that serves the WebSocket (see tests/test_browser_stream.py)."""

from __future__ import annotations

import csv
import io
import json
import uuid

import pytest
from playwright.sync_api import expect

from messages.models import Message
from tests.browser import chromium_page
from tests.conftest import reader, register
from tests.mqtt import free_port
from tests.processes import HOST, api_send, console_serving

HEAR_FAILED = """() => {
  window.failed = [];
  document.body.addEventListener("a2a_failed", (e) => window.failed.push(e.detail.messageId));
}"""


def open_timeline(page, base: str, query: str = "") -> None:
    page.goto(f"{base}/messages/{query}")
    page.fill("input[name=username]", "olga")
    page.fill("input[name=password]", "pw-olga-123")
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Messages")
    expect(page.locator("body")).to_have_attribute("data-stream", "/ws/timeline/")
    expect(page.locator("body")).to_have_attribute("data-stream-state", "open")


def stored_quietly(status: str) -> str:
    """A row written straight to the table: no event announces it."""
    row = Message.objects.create(message_id=str(uuid.uuid4()), message_type="TASK_REQUEST",
                                 direction="SEND", status=status, to_agent_id="fin.quiet")
    return row.message_id


def shown_ids(page) -> list[str]:
    return page.eval_on_selector_all("#messages tr[data-message]",
                                     "rows => rows.map(r => r.dataset.message)")


@pytest.mark.django_db(transaction=True)
def test_rows_and_failures_arrive_live_and_a_paused_list_holds_still(tmp_path):
    reader("olga", password="pw-olga-123")
    register("fin.tax", "node-a", capabilities=["tax"])
    port = free_port()
    base = f"http://{HOST}:{port}"

    with chromium_page() as page, console_serving(port, tmp_path):
        open_timeline(page, base)
        page.evaluate(HEAR_FAILED)

        # A send the broker can take, and one no node can: both rows appear, no reload.
        sent = api_send(port, "fin.tax")
        lost = api_send(port, "fin.nobody")
        expect(page.locator(f'tr[data-message="{sent}"]')).to_be_visible()
        row = page.locator(f'tr[data-message="{lost}"]')
        expect(row).to_contain_text("UNDELIVERABLE")
        expect(row).to_contain_text("no agent fin.nobody is on the roster")
        page.wait_for_function("(id) => window.failed.includes(id)", arg=lost)
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1

        # Paused (key "p"): new rows are counted, none is inserted.
        page.locator("body").press("p")
        expect(page.locator("#timeline-pause")).to_have_attribute("aria-pressed", "true")
        before = shown_ids(page)
        news = [api_send(port, "fin.nobody") for _ in range(3)]
        expect(page.locator("#timeline-new")).to_have_text("3 new messages: show them")
        assert shown_ids(page) == before
        page.wait_for_timeout(1500)  # two refresh periods: still nothing moved
        assert shown_ids(page) == before

        # The bar shows them, at the top, and the list is live again.
        page.click("#timeline-new")
        expect(page.locator("#timeline-pause")).to_have_attribute("aria-pressed", "false")
        expect(page.locator("#timeline-new")).to_be_hidden()
        for message_id in news:
            expect(page.locator(f'tr[data-message="{message_id}"]')).to_be_visible()
        assert shown_ids(page)[:3] == list(reversed(news))

        # Reading (the pointer on the rows) holds the list too, until the pointer leaves.
        page.hover(f'tr[data-message="{news[0]}"]')
        held = shown_ids(page)
        late = api_send(port, "fin.nobody")
        expect(page.locator("#timeline-new")).to_have_text("1 new message: show it")
        expect(page.locator("#timeline-hold")).to_have_text("Held: pointer on the rows.")
        assert shown_ids(page) == held
        page.mouse.move(5, 5)
        expect(page.locator(f'tr[data-message="{late}"]')).to_be_visible()


@pytest.mark.django_db(transaction=True)
def test_a_filtered_list_counts_only_matching_rows_and_exports_them(tmp_path, async_unsafe):
    reader("olga", password="pw-olga-123")
    register("fin.tax", "node-a", capabilities=["tax"])
    port = free_port()
    base = f"http://{HOST}:{port}"

    with chromium_page() as page, console_serving(port, tmp_path):
        kept = api_send(port, "fin.nobody")
        other = api_send(port, "fin.tax")
        open_timeline(page, base, "?status=UNDELIVERABLE&status=FAILED")
        expect(page.locator("input[name=status][value=FAILED]")).to_be_checked()
        assert shown_ids(page) == [kept]

        page.click("#timeline-pause")
        api_send(port, "fin.tax")  # SENT: not in this list
        fresh = [api_send(port, "fin.nobody"), api_send(port, "fin.elsewhere")]
        expect(page.locator("#timeline-new")).to_have_text("2 new messages: show them")
        assert shown_ids(page) == [kept]
        page.click("#timeline-pause")
        expect(page.locator(f'tr[data-message="{fresh[1]}"]')).to_be_visible()
        assert set(shown_ids(page)) == {kept, *fresh}

        with page.expect_download() as download:
            page.click("#export-csv")
        assert download.value.suggested_filename.endswith(".csv")
        rows = list(csv.DictReader(io.StringIO(download.value.path().read_text())))
        assert {r["messageId"] for r in rows} == {kept, *fresh}
        assert {r["status"] for r in rows} == {"UNDELIVERABLE"}

        with page.expect_download() as download:
            page.click("#export-jsonl")
        lines = [json.loads(x) for x in download.value.path().read_text().splitlines()]
        assert [x["messageId"] for x in lines] == list(reversed(fresh)) + [kept]

        # A gap in the stream: rows stored meanwhile sent no event to this page. After the
        # resync a paused page asks the server what it missed; a live one shows it.
        page.click("#timeline-pause")
        missed = [stored_quietly("UNDELIVERABLE"), stored_quietly("UNDELIVERABLE")]
        stored_quietly("SENT")
        page.evaluate("document.body.dispatchEvent(new CustomEvent('reach:stream-resync'))")
        expect(page.locator("#timeline-new")).to_have_text("2 new messages: show them")
        assert set(shown_ids(page)) == {kept, *fresh}
        page.click("#timeline-new")
        for message_id in missed:
            expect(page.locator(f'tr[data-message="{message_id}"]')).to_be_visible()
    assert other not in {r["messageId"] for r in rows}
    assert Message.objects.filter(message_id=other, status="SENT").exists()
