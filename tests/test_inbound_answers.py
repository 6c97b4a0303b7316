"""Who may answer a request (PROTOCOL.md "Message types"): an ACK, NACK, BUSY or
TASK_RESPONSE moves a request's row only when it arrives on the requester's own inbox and
its headers.originNodeId is the node the request was sent to. Anything else is recorded as
seen, with the reason, and changes nothing."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.models import Direction, Message, Status, Transition
from messages.partitions import history_partitioned, legacy_end
from tests.conftest import reader

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
PREFIX = "ooder"


def inbox(node: str = "console") -> str:
    return protocol.inbox_topic(PREFIX, node)


def ingest(*items: tuple[str, protocol.Envelope]):
    return messages_ingest(batch=[Incoming(t, protocol.encode(e)) for t, e in items],
                           node_id="console", prefix=PREFIX)


def our_request(message_id: str = "req-1", target: str = "node-b") -> Message:
    return Message.objects.create(
        message_id=message_id, task_id=f"t-{message_id}", message_type="TASK_REQUEST",
        direction=Direction.SEND, status=Status.PUBLISHED, from_agent_id="console",
        to_agent_id="fin.tax", target_node_id=target, reply_node_id="console",
        origin_node_id="console", topic=inbox(target))


def answer(kind: MT, for_id: str, *, origin: str | None = "node-b", payload=None
           ) -> protocol.Envelope:
    header = "inReplyTo" if kind == MT.TASK_RESPONSE else "ackFor"
    headers = {header: for_id, "replyNodeId": origin or "node-b"}
    if origin is not None:
        headers["originNodeId"] = origin
    return protocol.new_envelope(message_type=kind, from_agent_id="fin.tax",
                                 to_agent_id="console", headers=headers,
                                 payload={"ok": True, "result": 1} if payload is None else payload)


def test_a_response_from_a_node_the_request_never_went_to_changes_nothing():
    request = our_request()
    forged = answer(MT.TASK_RESPONSE, "req-1", origin="node-x")
    result = ingest((inbox(), forged))
    request.refresh_from_db()
    assert request.status == Status.PUBLISHED and request.finished_at is None
    assert not Transition.objects.filter(message=request).exists()
    assert result.counts["answer_refused:wrong_node"] == 1
    seen = Message.objects.get(message_id=forged.message_id)
    assert seen.status == Status.RECV  # recorded as seen
    assert seen.error == ("not accepted, changed nothing: it came from node node-x, but the "
                          "request was sent to node-b")
    # Not acknowledged either: it was not accepted.
    assert not Message.objects.filter(in_reply_to=forged.message_id).exists()


def test_a_response_seen_in_monitor_mode_on_another_inbox_changes_nothing():
    request = our_request()
    elsewhere = answer(MT.TASK_RESPONSE, "req-1", origin="node-b")
    result = ingest((inbox("node-c"), elsewhere))
    request.refresh_from_db()
    assert request.status == Status.PUBLISHED
    assert result.counts["answer_refused:wrong_inbox"] == 1
    seen = Message.objects.get(message_id=elsewhere.message_id)
    assert seen.direction == Direction.OBSERVED
    assert "came on node-c's inbox" in seen.error
    assert result.to_publish == []


@pytest.mark.parametrize("kind", [MT.ACK, MT.NACK, MT.BUSY])
def test_an_acknowledgement_from_another_node_changes_nothing(kind):
    request = our_request()
    result = ingest((inbox(), answer(kind, "req-1", origin="node-x",
                                     payload={"reason": "no", "retryable": False})))
    request.refresh_from_db()
    assert (request.status, request.error, request.acked_at) == (Status.PUBLISHED, "", None)
    assert result.counts["answer_refused:wrong_node"] == 1
    assert result.busy == []


def test_an_answer_without_its_origin_changes_nothing():
    request = our_request()
    result = ingest((inbox(), answer(MT.ACK, "req-1", origin=None)))
    request.refresh_from_db()
    assert request.status == Status.PUBLISHED
    assert result.counts["answer_refused:no_origin"] == 1


def test_the_receivers_own_answers_still_move_the_request():
    request = our_request()
    ingest((inbox(), answer(MT.ACK, "req-1")))
    ingest((inbox(), answer(MT.TASK_RESPONSE, "req-1")))
    request.refresh_from_db()
    assert request.status == Status.COMPLETED
    assert list(request.transitions.values_list("to_status", flat=True)) == ["ACKED",
                                                                             "COMPLETED"]


def test_a_refused_answer_never_hides_a_good_one_in_the_same_batch():
    request = our_request()
    result = ingest((inbox(), answer(MT.TASK_RESPONSE, "req-1", origin="node-x",
                                     payload={"ok": False, "error": "forged"})),
                    (inbox(), answer(MT.TASK_RESPONSE, "req-1")))
    request.refresh_from_db()
    assert request.status == Status.COMPLETED and request.error == ""
    assert result.counts["answer_refused:wrong_node"] == 1


def test_a_completed_request_is_not_touched_by_a_forged_late_answer():
    request = our_request()
    ingest((inbox(), answer(MT.TASK_RESPONSE, "req-1")))
    result = ingest((inbox(), answer(MT.TASK_RESPONSE, "req-1", origin="node-x",
                                     payload={"ok": False, "error": "forged"})))
    request.refresh_from_db()
    assert request.status == Status.COMPLETED and request.error == ""
    assert result.counts["answer_refused:wrong_node"] == 1


def test_an_answer_cannot_move_a_request_the_console_received():
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="fin.elsewhere",
        target_node_id="console", headers={"replyNodeId": "node-b", "originNodeId": "node-b"})
    ingest((inbox(), env))
    before = Message.objects.get(message_id=env.message_id).status
    forged = protocol.new_envelope(message_type=MT.ACK, from_agent_id="fin.x",
                                   headers={"ackFor": env.message_id, "originNodeId": "console"})
    result = ingest((inbox("node-b"), forged))
    assert Message.objects.get(message_id=env.message_id).status == before
    assert result.counts["answer_refused:not_ours"] == 1


def test_observed_outcomes_come_from_the_receiver_on_the_requesters_inbox():
    request = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="llm.chat",
        target_node_id="node-c", headers={"replyNodeId": "node-b", "originNodeId": "node-b"})
    ingest((inbox("node-c"), request))
    forged = protocol.new_envelope(message_type=MT.ACK, from_agent_id="llm.chat",
                                   headers={"ackFor": request.message_id,
                                            "originNodeId": "node-x"})
    misplaced = protocol.new_envelope(message_type=MT.ACK, from_agent_id="llm.chat",
                                      headers={"ackFor": request.message_id,
                                               "originNodeId": "node-c"})
    result = ingest((inbox("node-b"), forged), (inbox("node-d"), misplaced))
    assert Message.objects.get(message_id=request.message_id).status == Status.OBSERVED
    assert result.counts["answer_refused:wrong_node"] == 1
    assert result.counts["answer_refused:wrong_inbox"] == 1
    real = protocol.new_envelope(message_type=MT.ACK, from_agent_id="llm.chat",
                                 headers={"ackFor": request.message_id, "originNodeId": "node-c"})
    ingest((inbox("node-b"), real))
    assert Message.objects.get(message_id=request.message_id).status == Status.ACKED


def test_the_check_costs_no_query_per_answer():
    """Judged on the rows the locked read of the change fetches anyway: a batch of thirty
    answers costs the queries of a batch of one."""

    def queries(count: int, origin: str) -> int:
        start = Message.objects.count()
        for n in range(count):
            our_request(message_id=f"q-{origin}-{count}-{n}-{start}")
        batch = [(inbox(), answer(MT.ACK, f"q-{origin}-{count}-{n}-{start}", origin=origin))
                 for n in range(count)]
        # The history's mode is cached for MODE_TTL_S: refreshed now, a slow run does not
        # count its refresh against one batch.
        if history_partitioned():
            legacy_end()
        with CaptureQueriesContext(connection) as captured:
            ingest(*batch)
        return len(captured)

    assert queries(1, "node-b") == queries(30, "node-b")
    assert queries(1, "node-x") == queries(30, "node-x")


def test_the_trace_shows_why_an_answer_was_not_accepted():
    our_request()
    forged = answer(MT.TASK_RESPONSE, "req-1", origin="node-x")
    ingest((inbox(), forged))
    client = Client()
    client.force_login(reader("victor", password="pw-victor-123"))
    own = client.get(f"/messages/{forged.message_id}/").content.decode()
    assert 'id="message-error"' in own and "it came from node node-x" in own
    # The request's trace lists it among its answers, with the reason.
    html = client.get("/messages/req-1/").content.decode()
    assert forged.message_id in html and "it came from node node-x" in html
