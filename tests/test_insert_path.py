"""`messages_insert_new` writes what it is given, value for value, on either database: on
PostgreSQL the batch travels as one JSON document that the database turns into rows
(json_to_recordset), so every kind of value is read back through the ORM and compared."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from messages.models import Direction, Message, Status
from messages.rows import ReceivedRow
from messages.state import messages_insert_new

pytestmark = pytest.mark.django_db

AWKWARD_TEXT = 'quote " backslash \\ tab \t newline \n é ☃ 😀 %s %(x)s \' -- ;'


def received(message_id: str, now: datetime, **extra) -> ReceivedRow:
    fields = dict(
        message_id=message_id, task_id="task-" + message_id, idempotency_key=message_id,
        message_type="TASK_REQUEST", direction=Direction.OBSERVED, status=Status.OBSERVED,
        from_agent_id="fin.tax", to_agent_id="llm.chat", target_node_id="node-a",
        origin_node_id="node-b", reply_node_id="node-b", conversation_id="conv",
        scene_group_id="", session_id="", topic="p/node/node-a/inbox",
        headers={"originNodeId": "node-b", "attempt": 2}, payload={"q": 1}, attempt=2,
        in_reply_to="", created_at=now, updated_at=now)
    return ReceivedRow(**{**fields, **extra})


def test_every_kind_of_value_comes_back_as_it_went_in():
    now = datetime(2026, 11, 30, 18, 1, 2, 345678, tzinfo=UTC)
    later = now + timedelta(seconds=30, microseconds=1)
    base = Message.objects.create(message_id=f"m-{uuid.uuid4()}", message_type="TASK_REQUEST",
                                  direction=Direction.SEND, status=Status.SENT)
    payload = {"text": AWKWARD_TEXT, "big": 2**62, "negative": -(2**63), "float": 0.1,
               "nested": [None, True, False, {"k": []}], "empty": {}}
    rows = [
        received(f"a-{uuid.uuid4()}", now, payload=payload, error=AWKWARD_TEXT,
                 headers={"idempotencyKey": AWKWARD_TEXT, "n": 1}),
        # None columns are left out of the document: they must read back as NULL.
        received(f"b-{uuid.uuid4()}", now, payload=None, deadline_at=later, held=True,
                 resend_of_id=base.pk, resolution={"why": ["a", "b"]}),
        received(f"c-{uuid.uuid4()}", now, payload="a bare string", attempt=7),
        received(f"d-{uuid.uuid4()}", now, payload=[1, 2, 3], publish_at=later,
                 ack_deadline_at=later, next_attempt_at=later, finished_at=later,
                 acked_at=later, published_at=later),
        # A whole second (written without a fraction) and another offset than UTC.
        received(f"e-{uuid.uuid4()}", now, published_at=datetime(2026, 11, 30, 18, 1, 3,
                                                                 tzinfo=UTC),
                 deadline_at=datetime(2026, 11, 30, 23, 31, 2, 7,
                                      tzinfo=timezone(timedelta(hours=5, minutes=30)))),
    ]
    fresh = messages_insert_new(list(rows))
    assert {r.message_id for r in fresh} == {r.message_id for r in rows}
    for row in rows:
        stored = Message.objects.get(message_id=row.message_id)
        assert stored.pk == row.pk
        for name in ("task_id", "idempotency_key", "message_type", "direction", "status",
                     "from_agent_id", "to_agent_id", "target_node_id", "origin_node_id",
                     "reply_node_id", "conversation_id", "topic", "headers", "payload",
                     "attempt", "error", "resolution", "resend_of_id", "held", "created_at",
                     "updated_at", "deadline_at", "publish_at", "ack_deadline_at",
                     "next_attempt_at", "finished_at", "acked_at", "published_at"):
            assert getattr(stored, name) == getattr(row, name), name


def test_only_new_message_ids_are_inserted_and_returned():
    now = datetime.now(UTC)
    first = received(f"x-{uuid.uuid4()}", now)
    assert [r.message_id for r in messages_insert_new([first])] == [first.message_id]
    again = received(first.message_id, now, payload={"other": True})
    new = received(f"y-{uuid.uuid4()}", now)
    fresh = messages_insert_new([again, new, received(new.message_id, now)])
    assert [r.message_id for r in fresh] == [new.message_id]
    assert again.pk is None
    # The first copy stays as it was stored.
    assert Message.objects.get(message_id=first.message_id).payload == {"q": 1}
    assert Message.objects.filter(message_id=new.message_id).count() == 1


def test_a_batch_too_large_for_one_statement_is_split_and_all_stored(monkeypatch):
    from messages import state

    # About three rows' worth of JSON a statement: nine rows take several statements.
    monkeypatch.setattr(state, "JSON_STATEMENT_MAX_CHARS", 3 * 1200)
    now = datetime.now(UTC)
    rows = [received(f"s{i}-{uuid.uuid4()}", now, payload={"text": "é😀" * 100, "i": i})
            for i in range(9)]
    documents = state._json_documents(state._json_rows(rows, state._insert_fields()))
    assert len(documents) > 1
    assert all(len(d) <= 3 * 1200 for d in documents)
    fresh = messages_insert_new(list(rows))
    assert len(fresh) == 9
    for row in rows:
        stored = Message.objects.get(message_id=row.message_id)
        assert (stored.pk, stored.payload) == (row.pk, row.payload)
