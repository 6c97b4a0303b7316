"""The trace of one message (/messages/{id}/): every attempt of its task on one time axis,
the time in each state and between hops, the directory's resolution, the reply, Resend, and
a row that never contradicts itself."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.models import Message, Status, Task
from messages.outbound import SendRequest, message_send
from messages.selectors import task_trace
from messages.state import LATE_PUBACK, late_pubacks_record
from messages.sweeps import deliveries_sweep
from roster import services
from tests.conftest import logged_in, published, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
ACK_MS = settings.REACH_ACK_TIMEOUT_MS


@pytest.fixture
def viewer() -> Client:
    return logged_in(reader("victor"))




def answer(kind: MT, row: Message, headers: dict, **payload) -> None:
    """An answer from node-b on the console's inbox, as the bridge hands it over."""
    env = protocol.new_envelope(message_type=kind, from_agent_id=row.to_agent_id,
                                task_id=row.task_id,
                                headers={"replyNodeId": "node-b", "originNodeId": "node-b",
                                         **headers}, payload=payload)
    messages_ingest(batch=[Incoming(protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX,
                                                         settings.REACH_NODE_ID),
                                    protocol.encode(env))],
                    node_id=settings.REACH_NODE_ID, prefix=settings.MQTT_TOPIC_PREFIX)


def two_attempts(now) -> tuple[Message, Message]:
    """A task whose first attempt got no ACK, and whose second was acknowledged and answered."""
    register("fin.tax", "node-b", now=now)
    first = message_send(request=SendRequest(to="fin.tax", task_id="job-t1", timeout_ms=600_000,
                                             payload={"q": 1}), now=now)
    published(first, now + timedelta(milliseconds=20))
    silent = now + timedelta(milliseconds=ACK_MS + 50)
    services.agent_renew(agent_id="fin.tax", now=silent)
    deliveries_sweep(now=silent)
    first.refresh_from_db()
    services.agent_renew(agent_id="fin.tax", now=first.next_attempt_at)
    deliveries_sweep(now=first.next_attempt_at)
    second = Message.objects.get(resend_of=first)
    published(second, second.created_at + timedelta(milliseconds=30))
    answer(MT.ACK, second, {"ackFor": second.message_id})
    answer(MT.TASK_RESPONSE, second, {"inReplyTo": second.message_id}, ok=True,
           result={"tax": "<b>42</b>"})
    second.refresh_from_db()
    assert second.status == Status.COMPLETED
    return first, second


def test_it_puts_every_attempt_on_one_axis_with_time_per_state_and_hops(now):
    first, second = two_attempts(now)
    trace = task_trace(second)
    assert [a.row.pk for a in trace.attempts] == [first.pk, second.pk]
    one, two = trace.attempts
    assert [s.label for s in one.states] == ["SENT", "PUBLISHED", "RETRYING", "RETRIED"]
    assert one.states[0].ms == 20  # SENT until the PUBACK
    assert one.states[1].ms == ACK_MS + 30  # PUBLISHED until the ACK time ran out
    assert [h.label for h in one.hops] == ["sent → published"]
    assert [h.label for h in two.hops] == ["sent → published", "published → acked",
                                           "acked → response"]
    assert two.hops[0].ms == 30
    assert two.response is not None and two.response.in_reply_to == second.message_id
    # One axis: the first attempt starts at 0 %, every bar stays inside it.
    assert one.states[0].left == 0
    for attempt in trace.attempts:
        for span in attempt.states + attempt.hops:
            assert 0 <= span.left <= 100 and span.left + span.width <= 100.5


def test_the_page_shows_the_axis_the_resolution_and_the_reply(viewer, now):
    first, second = two_attempts(now)
    html = viewer.get(f"/messages/{second.message_id}/").content.decode()
    assert f'data-attempt="{first.message_id}"' in html
    assert f'data-attempt="{second.message_id}"' in html
    assert html.count('class="trace-seg trace-') >= 6
    assert '<span data-hop="sent → published">sent → published 30 ms</span>' in html
    assert 'data-state="PUBLISHED">PUBLISHED ' in html
    assert "<h2>The directory's resolution</h2>" in html
    assert 'id="candidates"' in html and "fin.tax" in html
    assert 'id="response-payload"' in html
    assert "<b>42</b>" not in html  # the reply is data, shown as text
    assert "/ws/skill_progress/" in html  # no conversation: the stream its events go to


def test_a_conversation_trace_listens_to_its_conversation(viewer, now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", conversation_id="conv 42"), now=now)
    html = viewer.get(f"/messages/{row.message_id}/").content.decode()
    assert 'data-stream="/ws/conversation/conv%2042/"' in html
    assert 'data-task-id="' + row.task_id + '"' in html


def test_the_live_refresh_renders_the_same_fragment(viewer, now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax"), now=now)
    part = viewer.get(f"/messages/{row.message_id}/", HTTP_HX_REQUEST="true",
                      HTTP_HX_TARGET="trace-live").content.decode()
    assert 'id="message-status">SENT<' in part and 'id="trace-axis"' in part
    assert "<html" not in part and 'id="payload-text"' not in part


def test_a_late_puback_never_leaves_a_failed_row_saying_it_was_not_published(viewer, now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=1000), now=now)
    deliveries_sweep(now=now + timedelta(milliseconds=1001))  # no bridge took it in time
    row.refresh_from_db()
    assert row.status == Status.FAILED and row.error.startswith("not published within 1000 ms")

    took = now + timedelta(milliseconds=1500)
    late_pubacks_record(pks=[row.pk], now=took)  # what the bridge does with a late PUBACK
    row.refresh_from_db()
    assert row.published_at == took
    assert row.error == LATE_PUBACK.format(at=took)
    # Its task says the same words.
    assert Task.objects.get(task_id=row.task_id).error == row.error
    html = viewer.get(f"/messages/{row.message_id}/").content.decode()
    error = html.split('id="message-error">', 1)[1].split("</p>", 1)[0]
    assert "not published" in error and "the broker took it at" in error
    times = re.sub(r"<[^>]+>", "", html.split('id="message-times">', 1)[1].split("</dd>", 1)[0])
    assert "published " + took.strftime("%H:%M:%S") in times
    assert "The broker took it at" in html  # the note beside the times
    # The history keeps what was believed at the deadline, then what the PUBACK showed.
    steps = list(row.transitions.values_list("to_status", "reason"))
    assert [s for s, _ in steps] == ["SENT", "FAILED", "FAILED"]
    assert steps[1][1].startswith("not published within 1000 ms")
    assert steps[2][1] == "late PUBACK: " + LATE_PUBACK.format(at=took)

    # The receiver answers after all: the row is right again, with nothing of the failure.
    answer(MT.ACK, row, {"ackFor": row.message_id})
    row.refresh_from_db()
    assert (row.status, row.error, row.finished_at) == (Status.ACKED, "", None)


def test_an_answer_to_a_row_failed_as_unpublished_clears_the_failure(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=1000), now=now)
    deliveries_sweep(now=now + timedelta(milliseconds=1001))
    row.refresh_from_db()
    assert row.status == Status.FAILED and row.finished_at is not None
    answer(MT.ACK, row, {"ackFor": row.message_id})
    row.refresh_from_db()
    assert (row.status, row.error, row.finished_at) == (Status.ACKED, "", None)
    trace = task_trace(row)
    assert trace.attempts[0].notes == ["No PUBACK was recorded, but the receiver acknowledged "
                                       "it: the broker did take it."]


def test_an_operator_resends_from_the_trace_and_sees_both_attempts(now):
    row = message_send(request=SendRequest(to="fin.tax", task_id="job-r"), now=now)
    assert row.status == Status.UNDELIVERABLE
    register("fin.tax", "node-b", now=now)
    operator = logged_in(staff_user("olga", "resend_message"))
    html = operator.get(f"/messages/{row.message_id}/").content.decode()
    assert 'id="resend"' in html
    done = operator.post(f"/messages/{row.message_id}/resend", follow=True)
    again = Message.objects.get(resend_of=row)
    page = done.content.decode()
    assert f'data-attempt="{row.message_id}"' in page
    assert f'data-attempt="{again.message_id}"' in page and 'class="trace-current"' in page


def test_the_trace_costs_the_same_reads_for_two_attempts_or_twelve(now):
    def reads(task_id: str, attempts: int) -> int:
        rows = [message_send(request=SendRequest(to="fin.gone", task_id=task_id), now=now)
                for _ in range(attempts)]
        # The history's mode is cached for MODE_TTL_S; read once first so a cache that expires
        # during a slow run is not counted as a read of the trace.
        task_trace(rows[-1], now=now)
        with CaptureQueriesContext(connection) as queries:
            trace = task_trace(rows[-1], now=now)
        assert len(trace.attempts) == attempts
        return len(queries)

    # On a partitioned history one more: the task's first day, which bounds the partitions
    # the attempts are read from (messages/partitions.py).
    from messages.partitions import history_partitioned

    assert reads("job-q2", 2) == reads("job-q12", 12) == 3 + history_partitioned()


def test_a_row_seen_between_other_nodes_is_not_said_to_lack_a_puback(now):
    """Observed traffic is never ours to publish: no PUBACK is expected, so none is missing."""
    seen = Message.objects.create(message_id="seen-1", message_type="TASK_REQUEST",
                                  direction="OBSERVED", status=Status.ACKED, task_id="t-seen",
                                  from_agent_id="fin.a", to_agent_id="web.b",
                                  target_node_id="node-b", created_at=now, updated_at=now,
                                  acked_at=now + timedelta(milliseconds=4))
    assert task_trace(seen).attempts[0].notes == []


def test_the_trace_and_the_api_list_the_same_attempts_and_a_cancel_is_none(now, api):
    """One notion of a task's attempts (messages/selectors.py task_attempts): the trace page
    and GET /api/messages/{id} cannot disagree about one task."""
    from messages.cancel import task_cancel

    register("fin.tax", "node-b", now=now)
    first = message_send(request=SendRequest(to="fin.tax", task_id="job-c1", timeout_ms=600_000),
                         now=now)
    published(first, now + timedelta(milliseconds=20))
    task_cancel(task_id="job-c1", by="ops", reason="wrong invoice", now=now)
    assert Message.objects.filter(task_id="job-c1", message_type=MT.CANCEL).count() == 1
    listed = api.get(f"/api/a2a/messages/{first.message_id}").json()["attempts"]
    assert [a["messageId"] for a in listed] == [
        a.row.message_id for a in task_trace(first).attempts] == [first.message_id]
