"""Content is not history: a payload is kept only while a resend may need it
(REACH_PAYLOAD_KEEP_HOURS after its row's last change), then dropped; the row's status,
times and transitions stay, and the trace, the API and resend say what happened."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction

from messages.models import Direction, Message, Status, Transition
from messages.outbound import SendRefused, SendRequest, message_send, messages_resend
from messages.protocol import MessageType
from messages.selectors import message_is_resendable, resendable
from messages.sweeps import payloads_drop, payloads_due
from tests.conftest import logged_in, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

SECRET = {"password": "hunter2", "question": "what is owed"}


def failed(*, task_id: str) -> Message:
    """A request of ours that ended UNDELIVERABLE (no such agent): final, resendable."""
    row = message_send(request=SendRequest(to="fin.nobody", task_id=task_id, payload=SECRET))
    assert row.status == Status.UNDELIVERABLE and row.payload == SECRET
    return row


def stored(status: str, *, message_type: str = MessageType.TASK_REQUEST,
           direction: str = Direction.SEND) -> Message:
    return Message.objects.create(
        message_id=str(uuid.uuid4()), task_id=f"t-{uuid.uuid4().hex[:8]}",
        message_type=message_type, direction=direction, status=status,
        to_agent_id="fin.tax", target_node_id="node-b", payload=SECRET)


def last_changed(row: Message, when) -> None:
    """`row` written, ended and last changed at `when` (its deadline too)."""
    Message.objects.filter(pk=row.pk).update(created_at=when, updated_at=when, deadline_at=when)


def test_what_nothing_will_send_again_loses_its_payload_after_the_keep(now, settings):
    settings.REACH_PAYLOAD_KEEP_HOURS = 24
    old = now - timedelta(hours=25)
    final = failed(task_id="t-final")
    steps = list(Transition.objects.filter(message=final).values_list("to_status", "at"))
    recent = failed(task_id="t-recent")
    answered = stored(Status.COMPLETED)
    received = stored(Status.RECV, message_type=MessageType.TASK_RESPONSE,
                      direction=Direction.RECV)
    our_answer = stored(Status.PUBLISHED, message_type=MessageType.TASK_RESPONSE)
    # Still needed: a request under way (a retry copies its payload), one waiting to be
    # retried, and anything the outbox has not published yet.
    open_request = stored(Status.PUBLISHED)
    retrying = stored(Status.RETRYING)
    unpublished = stored(Status.SENT, message_type=MessageType.TASK_RESPONSE)
    for row in (final, answered, received, our_answer, open_request, retrying, unpublished):
        last_changed(row, old)

    assert payloads_drop(now=now) == 4

    dropped = {r.pk: r for r in Message.objects.filter(payload_dropped_at=now)}
    assert set(dropped) == {final.pk, answered.pk, received.pk, our_answer.pk}
    assert all(r.payload is None for r in dropped.values())
    kept = Message.objects.exclude(pk__in=dropped)
    assert set(kept.values_list("pk", flat=True)) == {
        recent.pk, open_request.pk, retrying.pk, unpublished.pk}
    assert all(r.payload == SECRET and r.payload_dropped_at is None for r in kept)
    # History, timing and outcome stay.
    final.refresh_from_db()
    assert final.status == Status.UNDELIVERABLE
    assert final.error.startswith("no agent fin.nobody is on the roster")
    assert list(Transition.objects.filter(message=final)
                .values_list("to_status", "at")) == steps
    # Nothing is due twice, and the next run finds only what fell due since.
    assert payloads_drop(now=now + timedelta(minutes=1)) == 0
    assert payloads_drop(now=now + timedelta(hours=25)) == 1  # `recent`, a day later
    assert Message.objects.get(pk=recent.pk).payload is None


def test_the_drop_goes_in_bounded_batches_oldest_change_first(now, settings, monkeypatch):
    settings.REACH_PAYLOAD_KEEP_HOURS = 1
    monkeypatch.setattr("messages.sweeps.PRUNE_BATCH", 2)
    rows = [failed(task_id=f"t-{i}") for i in range(5)]
    for i, row in enumerate(rows):
        last_changed(row, now - timedelta(hours=10 - i))
    assert payloads_drop(now=now, max_batches=2) == 4
    left = Message.objects.get(payload__isnull=False)
    assert left.pk == rows[-1].pk  # the most recently changed waits for the next run
    assert payloads_drop(now=now) == 1


def test_keep_zero_keeps_every_payload_as_long_as_its_row(now, settings):
    settings.REACH_PAYLOAD_KEEP_HOURS = 0
    row = failed(task_id="t-kept")
    last_changed(row, now - timedelta(days=300))
    assert payloads_drop(now=now) == 0
    assert Message.objects.get(pk=row.pk).payload == SECRET


def test_a_dropped_payload_cannot_be_resent_and_says_why(now, api, settings):
    settings.REACH_PAYLOAD_KEEP_HOURS = 24
    row = failed(task_id="t-gone")
    last_changed(row, now - timedelta(hours=30))
    assert message_is_resendable(row)
    payloads_drop(now=now)
    row.refresh_from_db()
    assert not message_is_resendable(row)
    assert not resendable(Message.objects.all()).exists()  # the bulk resend counts none
    register("fin.nobody", "node-b")  # a resend now would reach somebody

    r = api.post(f"/api/a2a/messages/{row.message_id}/resend")
    assert r.status_code == 409, r.content
    body = r.json()
    assert body["error"] == "payload_dropped"
    assert "payload was dropped" in body["detail"]
    assert "REACH_PAYLOAD_KEEP_HOURS" in body["detail"]
    with pytest.raises(SendRefused) as refused:
        messages_resend(message_ids=[row.message_id], by="ops")
    assert refused.value.code == "payload_dropped"
    assert Message.objects.count() == 1  # nothing half-written

    detail = api.get(f"/api/a2a/messages/{row.message_id}").json()
    assert detail["payload"] is None
    assert detail["payloadDroppedAt"] == now.isoformat()
    assert detail["status"] == Status.UNDELIVERABLE


def test_the_trace_says_the_payload_was_dropped_and_when(now, settings):
    settings.REACH_PAYLOAD_KEEP_HOURS = 24
    row = failed(task_id="t-trace")
    operator = logged_in(staff_user("olga", "resend_message"))
    before = operator.get(f"/messages/{row.message_id}/").content.decode()
    assert "hunter2" not in before  # redacted when shown, while it is kept
    assert 'id="resend"' in before and "payload dropped" not in before
    last_changed(row, now - timedelta(hours=25))
    payloads_drop(now=now)

    viewer = logged_in(reader("victor"))
    html = viewer.get(f"/messages/{row.message_id}/").content.decode()
    assert "payload dropped after 24 h" in html
    assert 'id="payload-dropped"' in html  # a step of the trace, with its time
    assert "no agent fin.nobody is on the roster" in html  # the outcome stays
    assert 'id="resend"' not in operator.get(f"/messages/{row.message_id}/").content.decode()


def test_what_may_still_be_needed_keeps_its_payload(now, settings):
    settings.REACH_PAYLOAD_KEEP_HOURS = 24
    settings.REACH_RETENTION_DAYS = 14
    old = now - timedelta(hours=30)
    # The protocol's own words: an ACK's duplicate flag is read by the numbers' rebuild.
    ack = stored(Status.PUBLISHED, message_type=MessageType.ACK)
    # A request whose task has not reached its deadline: a late retryable NACK may still
    # ask for another attempt, which copies the payload.
    failed_early = failed(task_id="t-early")
    # Past the retention: the prune takes the whole row; no point writing it again first.
    ancient = failed(task_id="t-ancient")
    for row in (ack, failed_early):
        last_changed(row, old)
    Message.objects.filter(pk=failed_early.pk).update(deadline_at=now + timedelta(hours=1))
    last_changed(ancient, now - timedelta(days=15))

    assert payloads_drop(now=now) == 0
    assert Message.objects.filter(payload_dropped_at__isnull=False).count() == 0
    # Once the task's deadline has passed, the request's goes.
    assert payloads_drop(now=now + timedelta(hours=2)) == 1
    assert Message.objects.get(pk=failed_early.pk).payload is None
    assert Message.objects.get(pk=ack.pk).payload == SECRET


@pytest.mark.skipif(connection.vendor != "postgresql", reason="reads PostgreSQL's plan")
def test_the_sweep_reads_the_partial_index_of_kept_payloads(now):
    failed(task_id="t-plan")
    due = payloads_due(now=now).values_list("pk", flat=True)[:2000]
    with transaction.atomic(), connection.cursor() as cursor:
        # A test table is small enough to scan; the question is whether the index serves.
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = due.explain()
    assert "a2a_payload_kept" in plan, plan
