"""The inbound rules of PROTOCOL.md, one by one, through the bridge's batch handler."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.models import Direction, Message, Status, Transition
from roster.models import Agent, ClusterNode, RosterEvent
from tests.conftest import register, run_at_once

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
PREFIX = "ooder"
NODE = "console"


def wire(env: protocol.Envelope) -> bytes:
    return protocol.encode(env)


def inbox(node: str = NODE) -> str:
    return protocol.inbox_topic(PREFIX, node)


def ingest(*items: tuple[str, bytes]):
    return messages_ingest(batch=[Incoming(t, p) for t, p in items], node_id=NODE, prefix=PREFIX)


def request(to: str = "ops.probe", *, key: str | None = None, reply: str = "node-b",
            message_id: str | None = None) -> protocol.Envelope:
    # A fresh key per call unless one is given: the idempotency window outlives a test.
    key = key or f"t-{uuid.uuid4().hex}"
    return protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id=to,
        target_node_id=NODE, task_id=key, message_id=message_id,
        headers={"replyNodeId": reply, "originNodeId": reply, "idempotencyKey": key},
        payload={"q": 1},
    )


def sent_row(status: str = Status.PUBLISHED, **extra) -> Message:
    return Message.objects.create(
        message_id=extra.pop("message_id", "req-1"), task_id="t-1", message_type="TASK_REQUEST",
        direction=Direction.SEND, status=status, to_agent_id="fin.tax", target_node_id="node-b",
        **extra,
    )


def answer(kind: MT, for_id: str, payload=None, header: str = "ackFor") -> protocol.Envelope:
    return protocol.new_envelope(
        message_type=kind, from_agent_id="fin.tax", to_agent_id=NODE,
        headers={header: for_id, "replyNodeId": "node-b", "originNodeId": "node-b"},
        payload=payload or {},
    )


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe not utf-8", "rejected:not_utf8"),
        (b"hello", "rejected:not_json"),
        (b"[1,2]", "rejected:not_object"),
        (json.dumps({"protocol": "mqtt-sn", "version": "1.0", "message": {}}).encode(),
         "rejected:wrong_protocol"),
        (json.dumps({"protocol": "a2a", "version": "2.0", "message": {}}).encode(),
         "rejected:bad_version"),
        (json.dumps({"protocol": "a2a", "version": "1.0",
                     "message": {"messageType": "ACK"}}).encode(), "rejected:missing_message_id"),
        (b"x" * (262144 + 1), "rejected:too_large"),
    ],
)
def test_it_counts_and_skips_what_is_not_an_envelope(raw, reason):
    result = ingest((inbox(), raw))
    assert result.counts[reason] == 1
    assert result.stored == 0
    assert Message.objects.count() == 0


def test_it_counts_an_unknown_topic():
    assert ingest(("elsewhere/x", wire(request()))).counts["rejected:unknown_topic"] == 1
    assert Message.objects.count() == 0


def test_it_drops_the_echo_of_its_own_heartbeat():
    beat = protocol.new_envelope(message_type=MT.HEARTBEAT, from_agent_id=NODE,
                                 headers={"originNodeId": NODE}, payload={"agents": []})
    result = ingest((protocol.heartbeat_topic(PREFIX, NODE), wire(beat)))
    assert result.counts["dropped_self"] == 1
    assert not ClusterNode.objects.filter(node_id=NODE).exists()


def test_it_drops_its_own_messages_seen_on_another_inbox():
    own = protocol.new_envelope(message_type=MT.TASK_REQUEST, from_agent_id=NODE,
                                to_agent_id="fin.tax", headers={"originNodeId": NODE})
    result = ingest((inbox("node-b"), wire(own)))
    assert result.counts["dropped_self"] == 1 and Message.objects.count() == 0


def test_a_heartbeat_renews_leases_records_load_and_reports_conflicts(now):
    register("fin.tax", "node-b", now=now)
    register("fin.vat", "node-c", now=now)
    beat = protocol.new_envelope(
        message_type=MT.HEARTBEAT, from_agent_id="node-b", headers={"originNodeId": "node-b"},
        payload={"heartbeatMs": 5000, "agents": [
            {"agentId": "fin.tax", "inflight": 3, "queueDepth": 1, "maxInflight": 6},
            {"agentId": "fin.vat", "inflight": 1},
            {"agentId": "fin.ghost", "inflight": 1},
        ]},
    )
    result = ingest((protocol.heartbeat_topic(PREFIX, "node-b"), wire(beat)))
    assert result.counts["heartbeats"] == 1 and result.counts["heartbeat_conflicts"] == 1
    tax = Agent.objects.get(agent_id="fin.tax")
    assert tax.lease_expires_at > now and (tax.inflight, tax.queue_depth, tax.max_inflight) == (
        3, 1, 6)
    assert Agent.objects.get(agent_id="fin.vat").node.node_id == "node-c"  # not moved
    assert RosterEvent.objects.filter(kind="CONFLICT", agent_id="fin.vat").count() == 1
    assert not Agent.objects.filter(agent_id="fin.ghost").exists()  # never registered
    node = ClusterNode.objects.get(node_id="node-b")
    assert node.last_seen_at is not None and node.heartbeat_ms == 5000
    assert Message.objects.count() == 0  # heartbeats renew the roster; they are not rows


def test_each_heartbeat_is_applied_by_the_first_bridge_that_claims_it(now):
    """Every bridge hears every heartbeat (messages/subscriptions.py): one applies it, the others
    count a copy; the claimer retrying its batch after an outage still applies it."""
    register("fin.tax", "node-b", now=now)
    beat = protocol.new_envelope(
        message_type=MT.HEARTBEAT, from_agent_id="node-b", headers={"originNodeId": "node-b"},
        payload={"heartbeatMs": 5000, "agents": [{"agentId": "fin.tax", "inflight": 2}]})
    item = [Incoming(protocol.heartbeat_topic(PREFIX, "node-b"), wire(beat))]

    def by(receiver: str):
        return messages_ingest(batch=item, node_id=NODE, prefix=PREFIX, receiver=receiver).counts

    first = by("bridge-1")
    assert (first["heartbeats"], first["heartbeat_copies"]) == (1, 0)
    assert by("bridge-1")["heartbeats"] == 1  # its own claim: a retried batch applies it
    second = by("bridge-2")
    assert (second["heartbeats"], second["heartbeat_copies"]) == (0, 1)
    assert Agent.objects.get(agent_id="fin.tax").inflight == 2


def test_the_same_message_id_twice_is_one_row():
    env = request("fin.other")
    first = ingest((inbox(), wire(env)))
    second = ingest((inbox(), wire(env)), (inbox(), wire(env)))
    assert first.stored == 1 and second.stored == 0
    assert second.counts["duplicate_message_id"] == 2
    assert Message.objects.filter(message_id=env.message_id).count() == 1


def test_a_local_request_is_consumed_once_and_answered():
    env = request("ops.probe")
    result = ingest((inbox(), wire(env)))
    row = Message.objects.get(message_id=env.message_id)
    assert row.direction == Direction.RECV and row.status == Status.LOCAL_CONSUMED
    replies = Message.objects.filter(in_reply_to=env.message_id).order_by("id")
    assert [r.message_type for r in replies] == ["ACK", "TASK_RESPONSE"]
    assert all(r.status == Status.SENT and r.target_node_id == "node-b" for r in replies)
    assert replies[1].payload["ok"] is True and replies[1].payload["result"]["nodeId"] == NODE
    assert sorted(result.to_publish) == sorted(r.pk for r in replies)
    # Delivered again (same message id), it is neither stored nor executed twice: it is
    # acknowledged as a duplicate.
    again = ingest((inbox(), wire(env)))
    assert again.stored == 0 and len(again.to_publish) == 1
    duplicate = Message.objects.get(pk=again.to_publish[0])
    assert (duplicate.message_type, duplicate.payload) == ("ACK", {"duplicate": True})
    assert Message.objects.filter(in_reply_to=env.message_id,
                                  message_type="TASK_RESPONSE").count() == 1


def test_a_repeated_idempotency_key_is_acked_as_duplicate_not_run():
    key = f"job-{uuid.uuid4().hex}"
    ingest((inbox(), wire(request("ops.probe", key=key))))
    retry = request("ops.probe", key=key)  # a new transmission of the same work
    result = ingest((inbox(), wire(retry)))
    assert result.counts["duplicate_idempotency_key"] == 1
    assert not Message.objects.filter(message_id=retry.message_id).exists()
    ack = Message.objects.get(in_reply_to=retry.message_id)
    assert ack.message_type == "ACK" and ack.payload == {"duplicate": True}
    assert Message.objects.filter(message_type="TASK_RESPONSE").count() == 1


def test_a_request_for_an_agent_the_console_does_not_host_is_nacked():
    env = request("fin.nobody")
    ingest((inbox(), wire(env)))
    nack = Message.objects.get(in_reply_to=env.message_id)
    assert nack.message_type == "NACK" and nack.payload["retryable"] is False
    assert "hosts no agent fin.nobody" in nack.payload["reason"]


def test_acks_nacks_and_busy_move_the_send():
    sent_row(message_id="a")
    sent_row(message_id="n", status=Status.SENT)
    sent_row(message_id="b")
    ingest(
        (inbox(), wire(answer(MT.ACK, "a"))),
        (inbox(), wire(answer(MT.NACK, "n", {"reason": "no quota", "retryable": False}))),
        (inbox(), wire(answer(MT.BUSY, "b"))),
    )
    a, n, b = (Message.objects.get(message_id=i) for i in "anb")
    assert a.status == Status.ACKED and a.acked_at is not None
    assert n.status == Status.NACKED and "no quota" in n.error and "not retryable" in n.error
    assert b.status == Status.BUSY
    assert list(Transition.objects.filter(message=a).values_list("from_status", "to_status")) == [
        ("PUBLISHED", "ACKED")]


def test_a_response_completes_its_request_and_is_acknowledged():
    sent_row(message_id="req-9")
    response = answer(MT.TASK_RESPONSE, "req-9", {"ok": True, "result": 42}, header="inReplyTo")
    result = ingest((inbox(), wire(response)))
    req = Message.objects.get(message_id="req-9")
    assert req.status == Status.COMPLETED and req.finished_at is not None
    ack = Message.objects.get(in_reply_to=response.message_id)
    assert ack.message_type == "ACK" and ack.pk in result.to_publish
    # A late ACK never turns a completed request back.
    late = ingest((inbox(), wire(answer(MT.ACK, "req-9"))))
    assert late.counts["stale_answers"] == 1
    assert Message.objects.get(message_id="req-9").status == Status.COMPLETED


def test_a_failed_response_is_a_task_error_with_words():
    sent_row(message_id="req-e")
    ingest((inbox(), wire(answer(MT.TASK_RESPONSE, "req-e", {"ok": False, "error": "no data"},
                                 header="inReplyTo"))))
    row = Message.objects.get(message_id="req-e")
    assert row.status == Status.TASK_ERROR and row.error == "the task failed: no data"


def test_monitor_mode_records_traffic_between_others_with_outcomes():
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="llm.chat",
        target_node_id="node-c", headers={"replyNodeId": "node-b"},
    )
    ack = protocol.new_envelope(message_type=MT.ACK, from_agent_id="llm.chat",
                                headers={"ackFor": env.message_id, "originNodeId": "node-c"})
    result = ingest((inbox("node-c"), wire(env)), (inbox("node-b"), wire(ack)))
    assert result.to_publish == []  # observed: never executed, never answered
    row = Message.objects.get(message_id=env.message_id)
    assert row.direction == Direction.OBSERVED and row.status == Status.ACKED
    assert Message.objects.get(message_id=ack.message_id).status == Status.OBSERVED


@pytest.mark.django_db(transaction=True)
def test_sixteen_writers_of_one_message_make_one_row_and_one_actor():
    env = request("ops.probe")  # a console-local request: acting twice would run it twice
    data = wire(env)
    results = run_at_once(lambda: ingest((inbox(), data)), threads=16)
    assert sum(r.stored for r in results) == 1
    assert Message.objects.filter(message_id=env.message_id).count() == 1
    # One ACK and one response from the writer that stored it; the others acknowledge a
    # duplicate and run nothing.
    assert sum(len(r.to_publish) for r in results) == 2 + 15
    assert Message.objects.filter(message_type="TASK_RESPONSE").count() == 1
    acks = Message.objects.filter(message_type="ACK", in_reply_to=env.message_id)
    assert sorted(bool(a.payload.get("duplicate")) for a in acks) == [False] + [True] * 15


def test_hostile_payloads_are_counted_by_reason_and_nothing_is_stored():
    from tests.test_protocol import _HOSTILE

    batch = [Incoming(protocol.inbox_topic("ooder", "console"), raw.encode())
             for raw, _, _ in _HOSTILE.values()]
    result = messages_ingest(batch=batch, node_id="console", prefix="ooder")
    assert result.counts == {"rejected:nul_character": 1, "rejected:lone_surrogate": 1,
                             "rejected:bad_node_id": 2, "rejected:number_out_of_range": 1}
    assert not Message.objects.exists()


def test_a_heartbeat_no_node_can_send_is_refused_alone_and_its_batch_is_stored(now, caplog):
    """`ooder/heartbeat/bad$node` is a topic MQTT allows, but no node can be named so: it
    made the roster raise inside the batch, and the whole batch of up to hundreds failed."""
    register("fin.tax", "node-b", now=now)

    def beat(node: str) -> bytes:
        return wire(protocol.new_envelope(
            message_type=MT.HEARTBEAT, from_agent_id=node, headers={"originNodeId": node},
            payload={"heartbeatMs": 5000, "agents": [{"agentId": "fin.tax", "inflight": 2}]}))

    poison = (f"{PREFIX}/heartbeat/bad$node", beat("bad$node"))
    good = (protocol.heartbeat_topic(PREFIX, "node-b"), beat("node-b"))
    work = request()
    with caplog.at_level(logging.WARNING):
        result = ingest(poison, good, (inbox(), wire(work)), poison)
    assert result.counts["rejected:invalid_node_id"] == 2
    assert result.counts["heartbeats"] == 1 and result.counts["stored"] == 1
    assert Message.objects.filter(message_id=work.message_id).count() == 1
    assert Agent.objects.get(agent_id="fin.tax").inflight == 2
    assert not ClusterNode.objects.filter(node_id="bad$node").exists()
    assert "Traceback" not in caplog.text
    assert sum("invalid_node_id" in r.getMessage() for r in caplog.records) <= 1
