"""The timeline /messages/: its filters (all in the URL), keyset paging, the "N new" count,
the capped resendable count and the exports."""

from __future__ import annotations

import csv
import io
import json
import uuid
from datetime import timedelta
from html import unescape

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from messages import views
from messages.events import message_events
from messages.models import Message, Status
from messages.selectors import (
    MessageFilter,
    messages_new_count,
    messages_page,
    new_count_floor,
    newest_message_id,
    resendable_count,
)
from tests.conftest import logged_in, reader, staff_user

pytestmark = pytest.mark.django_db
XSS = '<img src=x onerror="window.pwned=1">'


@pytest.fixture
def viewer():
    return logged_in(reader("victor"))


@pytest.fixture
def operator():
    return logged_in(staff_user("olga", "resend_message"))


def row(minutes_ago: float = 0, **fields) -> Message:
    at = timezone.now() - timedelta(minutes=minutes_ago)
    values = {"message_id": str(uuid.uuid4()), "message_type": "TASK_REQUEST",
              "direction": "SEND", "status": Status.SENT, "from_agent_id": "console",
              "to_agent_id": "fin.tax", "target_node_id": "node-a", "created_at": at,
              "updated_at": at, **fields}
    return Message.objects.create(**values)


def shown(client, params=None) -> set[str]:
    response = client.get("/messages/", params or {})
    assert response.status_code == 200, response.content.decode()[:500]
    return {r.message_id for r in response.context["rows"]}


def test_it_shows_several_statuses_at_once(viewer):
    failed = row(status=Status.FAILED)
    gone = row(status=Status.UNDELIVERABLE)
    sent = row(status=Status.SENT)
    assert shown(viewer, {"status": ["FAILED", "UNDELIVERABLE"]}) == {failed.message_id,
                                                                      gone.message_id}
    assert shown(viewer, {"status": "FAILED,SENT"}) == {failed.message_id, sent.message_id}
    assert shown(viewer) == {failed.message_id, gone.message_id, sent.message_id}


def test_it_finds_an_agent_as_receiver_or_sender_once(viewer):
    to = row(to_agent_id="fin.tax", from_agent_id="console")
    by = row(to_agent_id="console", from_agent_id="fin.tax", direction="RECV")
    itself = row(to_agent_id="fin.tax", from_agent_id="fin.tax")
    row(to_agent_id="llm.chat")
    html = viewer.get("/messages/", {"agent": "fin.tax", "status": ["SENT", "FAILED"]})
    rows = html.context["rows"]
    assert [r.message_id for r in rows] == [itself.message_id, by.message_id, to.message_id]


@pytest.mark.parametrize(("params", "expected"), [
    ({"type": "ACK"}, {"ack"}),
    ({"direction": "RECV"}, {"ack"}),
    ({"node": "node-b"}, {"ack"}),
    ({"namespace": "llm"}, {"ack"}),
    ({"namespace": "fin."}, {"task"}),
    ({"conversation": "conv-1"}, {"task"}),
    ({"task": "job-7"}, {"task"}),
    ({"q": "job-7"}, {"task"}),
    ({"q": "conv-1"}, {"task"}),
    ({"error": "NO AGENT"}, {"task"}),
    ({"since": "30"}, {"ack"}),
    ({"since": "2h", "until": "30"}, {"task"}),
    ({"until": "1d"}, {"old"}),
])
def test_each_filter_narrows_the_set(viewer, params, expected):
    names = {
        "task": row(minutes_ago=45, task_id="job-7", conversation_id="conv-1",
                    error="no agent fin.tax is on the roster", status=Status.UNDELIVERABLE),
        "ack": row(minutes_ago=1, message_type="ACK", direction="RECV", to_agent_id="console",
                   from_agent_id="llm.chat", target_node_id="node-b"),
        "old": row(minutes_ago=3 * 1440, to_agent_id="x.y"),
    }
    ids = {r.message_id: name for name, r in names.items()}
    assert {ids[m] for m in shown(viewer, params)} == expected


def test_a_free_time_range_is_read_as_utc(viewer):
    inside = row(minutes_ago=60)
    row(minutes_ago=300)
    start = (timezone.now() - timedelta(minutes=120)).strftime("%Y-%m-%dT%H:%M")
    end = (timezone.now() - timedelta(minutes=30)).strftime("%Y-%m-%dT%H:%M:%S+00:00")
    assert shown(viewer, {"since": start, "until": end}) == {inside.message_id}


@pytest.mark.parametrize(("params", "words"), [
    ({"status": "DONE"}, "There is no status 'DONE'"),
    ({"type": "PING"}, "There is no message type 'PING'"),
    ({"direction": "UP"}, "There is no direction 'UP'"),
    ({"since": "yesterday"}, "since='yesterday' is neither minutes back"),
    ({"since": "10", "until": "60"}, "since (10) is later than until (60)"),
    ({"before": "abc"}, "before='abc' is not a row id"),
    # Out of the calendar, by a span back from now or an offset at its edges: not a 500.
    ({"since": "9999999d"}, "since='9999999d' is neither minutes back"),
    ({"until": "0001-01-01T00:00+01:00"}, "is neither minutes back"),
    ({"since": "9999-12-31T23:59:59-01:00"}, "is neither minutes back"),
])
def test_a_filter_it_cannot_read_is_refused_with_words(viewer, params, words):
    page = viewer.get("/messages/", params)
    assert page.status_code == 400 and words in unescape(page.content.decode())
    part = viewer.get("/messages/", params, headers={"HX-Request": "true",
                                                     "HX-Target": "messages-live"})
    assert part.status_code == 400 and words in unescape(part.content.decode())
    assert "data-error-detail" in part.content.decode()
    if "before" not in params:
        export = viewer.get("/messages/export.csv", params)
        assert export.status_code == 400 and words in unescape(export.content.decode())


def test_it_pages_with_a_row_cursor_and_no_offset(viewer):
    moment = timezone.now()
    # Equal times: the cursor still splits them by id, without losing or repeating one.
    rows = [row(created_at=moment - timedelta(seconds=i // 2)) for i in range(7)]
    newest_first = sorted(rows, key=lambda r: (r.created_at, r.pk), reverse=True)
    flt = MessageFilter()
    seen, before = [], None
    with CaptureQueriesContext(connection) as queries:
        while True:
            page = messages_page(flt, before=before, limit=3)
            seen += page.rows
            if page.older is None:
                break
            before = page.older
    assert [r.pk for r in seen] == [r.pk for r in newest_first]
    assert not any("OFFSET" in q["sql"].upper() for q in queries.captured_queries)


def test_the_page_links_to_older_rows(viewer, monkeypatch):
    monkeypatch.setattr(views, "messages_page", _small_pages(messages_page))
    rows = [row(minutes_ago=i) for i in range(3)]
    html = viewer.get("/messages/", {"agent": "fin.tax"}).content.decode()
    assert f"agent=fin.tax&amp;before={rows[1].pk}" in html
    older = viewer.get("/messages/", {"agent": "fin.tax", "before": rows[1].pk})
    assert [r.message_id for r in older.context["rows"]] == [rows[2].message_id]
    assert 'id="timeline-newest"' in older.content.decode()
    assert 'data-before="' in older.content.decode()


def _small_pages(page):
    return lambda flt, before=None, **kw: page(flt, before=before, limit=2)


def test_a_cursor_on_a_pruned_row_ends_the_list(viewer):
    row()
    assert shown(viewer, {"before": "999999999"}) == set()


def test_the_list_counts_nothing_and_the_resendable_count_is_capped(operator, monkeypatch):
    for _ in range(3):
        row(status=Status.FAILED)
    with CaptureQueriesContext(connection) as queries:
        page = operator.get("/messages/", {"agent": "fin.tax"})
    assert not [q for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert 'id="bulk-count"' in page.content.decode()
    assert resendable_count(MessageFilter(), cap=2, up_to=newest_message_id()) == 3  # "> 2"
    monkeypatch.setattr(views, "BULK_LIMIT", 2)
    with CaptureQueriesContext(connection) as queries:
        html = operator.get("/messages/resendable", {"agent": "fin.tax"}).content.decode()
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT 3" in sql.upper() for sql in counts)
    assert 'data-resendable="2+"' in html and "More than 2" in html
    assert "Resend the first 2" in html
    assert 'name="agent" value="fin.tax"' in html
    none = operator.get("/messages/resendable", {"status": "SENT"}).content.decode()
    assert 'data-resendable="0"' in none and 'id="bulk-resend"' not in none


def test_a_viewer_is_told_why_there_is_no_bulk_resend(viewer):
    row(status=Status.FAILED)
    html = viewer.get("/messages/").content.decode()
    assert 'id="bulk-count"' not in html
    assert 'data-not-allowed="resend failed messages"' in html
    assert viewer.get("/messages/resendable").status_code == 403


def test_it_counts_the_rows_a_held_page_has_not_shown(viewer):
    row(status=Status.FAILED)
    seen = newest_message_id()
    row(status=Status.FAILED)
    row(status=Status.SENT)
    late = row(status=Status.FAILED, to_agent_id="llm.chat")
    flt = MessageFilter.from_query({"status": "FAILED"})
    assert messages_new_count(flt, after=seen, up_to=late.pk) == (2, True)
    answer = viewer.get("/messages/new-count", {"status": "FAILED", "agent": "fin.tax",
                                                "after": seen}).json()
    assert answer == {"after": seen, "upTo": late.pk, "count": 1, "more": False,
                      "partial": False}
    # Held for longer than the scan bound: only the newest ids are looked at
    # (here all three FAILED rows), and the answer says the count is a floor.
    assert messages_new_count(flt, after=new_count_floor(late.pk) - 5,
                              up_to=late.pk) == (3, False)
    refused = viewer.get("/messages/new-count", {"after": "x"})
    assert refused.status_code == 400 and "is not a row id" in refused.json()["detail"]


def test_the_page_says_what_it_has_seen_and_its_filters(viewer):
    first = row()
    html = viewer.get("/messages/", {"status": ["FAILED", "SENT"], "agent": "fin.tax"})
    text = html.content.decode()
    assert f'data-seen-id="{first.pk}"' in text
    assert 'data-query="status=FAILED&amp;status=SENT&amp;agent=fin.tax"' in text
    script = text.split('id="timeline-filter" type="application/json">')[1].split("</script>")[0]
    assert json.loads(script)["statuses"] == ["FAILED", "SENT"]
    assert 'data-stream="/ws/timeline/"' in text and "js/timeline.js" in text


def test_events_carry_every_field_the_page_filters_on():
    """static/js/timeline.js tells from an event's fields whether its row is in the page's
    filtered set: each filter's field must be in the event."""
    message = row(conversation_id="c", task_id="t", error="e")
    event = message_events(message, previous="")[0]
    for key in ("id", "messageId", "taskId", "conversationId", "messageType", "direction",
                "status", "fromAgentId", "toAgentId", "targetNodeId", "error", "at"):
        assert key in event, key
    assert event["id"] == message.pk


def test_the_csv_export_has_the_filtered_rows_redacted(viewer):
    kept = row(status=Status.FAILED, payload={"token": "s3cret", "note": XSS},
               error="=HYPERLINK(\"http://x\")")
    row(status=Status.SENT)
    response = viewer.get("/messages/export.csv", {"status": "FAILED"})
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment;" in response["Content-Disposition"]
    assert response["X-Export-Limit"] == str(views.EXPORT_LIMIT)
    text = b"".join(response.streaming_content).decode()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["messageId"] for r in rows] == [kept.message_id]
    assert json.loads(rows[0]["payload"]) == {"token": "[redacted]", "note": XSS}
    assert "s3cret" not in text
    assert rows[0]["error"] == "'=HYPERLINK(\"http://x\")"  # not a formula in a spreadsheet


def test_the_jsonl_export_pages_through_the_set(viewer, monkeypatch):
    monkeypatch.setattr(views, "EXPORT_CHUNK", 2)
    rows = [row(minutes_ago=i, to_agent_id="fin.tax" if i % 2 else "llm.chat",
                payload={"password": "p", "n": i}) for i in range(7)]
    response = viewer.get("/messages/export.jsonl", {"namespace": "fin"})
    lines = [json.loads(line) for line in
             b"".join(response.streaming_content).decode().splitlines()]
    assert [x["messageId"] for x in lines] == [r.message_id for r in rows if r.to_agent_id ==
                                               "fin.tax"]
    assert all(x["payload"]["password"] == "[redacted]" for x in lines)


def test_an_export_is_bounded(viewer, monkeypatch):
    monkeypatch.setattr(views, "EXPORT_LIMIT", 3)
    monkeypatch.setattr(views, "EXPORT_CHUNK", 2)
    for i in range(5):
        row(minutes_ago=i)
    response = viewer.get("/messages/export.jsonl")
    assert len(b"".join(response.streaming_content).decode().splitlines()) == 3
    empty = viewer.get("/messages/export.csv", {"status": "EXPIRED"})
    assert b"".join(empty.streaming_content).decode().strip() == ",".join(views.EXPORT_FIELDS)


def test_exports_need_a_login(client):
    assert client.get("/messages/export.csv").status_code == 302
    assert client.get("/messages/export.jsonl").status_code == 302
    assert client.get("/messages/new-count").status_code == 302


def test_bulk_resend_keeps_several_statuses(operator):
    row(status=Status.FAILED, to_agent_id="nobody.here")
    row(status=Status.EXPIRED, to_agent_id="nobody.here")
    done = operator.post("/messages/bulk-resend", {"status": ["FAILED", "EXPIRED"],
                                                   "agent": "nobody.here", "expected": "2",
                                                   "up_to": newest_message_id()})
    assert done.status_code == 302
    assert done["Location"] == "/messages/?status=FAILED&status=EXPIRED&agent=nobody.here"
    # Both were resent (the redirect alone is the same when nothing is).
    assert Message.objects.filter(resend_of__to_agent_id="nobody.here").count() == 2
