"""Request and response with the console's own agents (messages/handlers.py): over the API
with `wait`, and over the bus, where the console acknowledges a request before it answers it
(PROTOCOL.md "Message types": ACK/NACK when accepted, then TASK_RESPONSE)."""

from __future__ import annotations

import queue
import time
import uuid

import pytest
from django.conf import settings
from django.utils import timezone

from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.models import Message, Status
from messages.outbox import outbox_claim, outbox_release_responses
from tests.conftest import register

MT = protocol.MessageType


def _probe(reply: str = "node-b") -> protocol.Envelope:
    key = f"probe-{uuid.uuid4().hex}"
    return protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
        target_node_id="console", task_id=key,
        headers={"replyNodeId": reply, "originNodeId": reply, "idempotencyKey": key},
        payload={"q": 1})


@pytest.mark.django_db
def test_wait_on_a_console_agent_answers_with_its_response(api):
    r = api.post("/api/a2a/send", {"to": "ops.probe", "payload": {"q": 1}, "wait": True})
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["status"] == Status.LOCAL_CONSUMED
    assert body["response"]["ok"] is True
    assert body["response"]["result"]["nodeId"] == settings.REACH_NODE_ID


@pytest.mark.django_db(transaction=True)
def test_wait_that_times_out_reports_the_status_the_request_has_reached(
        bridge, broker, api):
    """A node that acknowledges and never responds: the wait ends with the request's real
    status, ACKED, not the SENT it started from."""
    register("fin.slow", "node-slow")
    node = broker.client()
    prefix = settings.MQTT_TOPIC_PREFIX

    def acknowledge(client, userdata, message):
        request = protocol.decode(message.payload)
        ack = protocol.new_envelope(
            message_type=MT.ACK, from_agent_id="fin.slow", to_agent_id=request.from_agent_id,
            headers={"ackFor": request.message_id, "originNodeId": "node-slow"})
        client.publish(protocol.inbox_topic(prefix, request.reply_node_id),
                       protocol.encode(ack), qos=1)

    try:
        node.on_message = acknowledge
        node.subscribe(protocol.inbox_topic(prefix, "node-slow"), qos=1)
        time.sleep(0.3)  # the SUBACK
        r = api.post("/api/a2a/send", {"to": "fin.slow", "wait": True, "timeoutMs": 1500})
    finally:
        node.loop_stop()
        node.disconnect()
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == Status.ACKED and body["ackedAt"] is not None
    assert body["detail"] == (
        "the response did not arrive in time; the task may have been accepted — query "
        f"GET /api/a2a/messages/{body['messageId']} later")


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_the_response_of_a_console_agent_waits_until_the_broker_has_its_ack():
    """Not left to the order rows are claimed in: with several bridges, two claims may be
    published by two clients, whose messages the broker does not order."""
    env = _probe()
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                    protocol.encode(env))], node_id="console", prefix="ooder")
    claimed = outbox_claim(limit=50)
    assert [r.message_type for r in claimed] == ["ACK"]
    response = Message.objects.get(in_reply_to=env.message_id, message_type="TASK_RESPONSE")
    assert response.status == Status.SENT and response.publish_at is None
    # What the bridge does when the broker acknowledges the ACK (messages/bridge.py).
    assert outbox_release_responses(request_ids=[env.message_id], now=timezone.now()) == 1
    assert [r.pk for r in outbox_claim(limit=50)] == [response.pk]


@pytest.mark.django_db(transaction=True)
def test_on_the_bus_the_console_acks_a_request_before_it_responds(bridge, broker):
    """A node subscribed to its inbox hears, for each request, the ACK and then the
    TASK_RESPONSE."""
    heard: queue.Queue = queue.Queue()
    node = broker.client()
    prefix = settings.MQTT_TOPIC_PREFIX
    try:
        subscribed = node.subscribe(protocol.inbox_topic(prefix, "node-b"), qos=1)
        assert subscribed[0] == 0
        node.on_message = lambda c, u, m: heard.put(protocol.decode(m.payload))
        time.sleep(0.3)  # the SUBACK
        requests = [_probe() for _ in range(20)]
        for env in requests:
            node.publish(protocol.inbox_topic(prefix, "console"), protocol.encode(env),
                         qos=1).wait_for_publish(5)
        order: dict[str, list[str]] = {env.message_id: [] for env in requests}
        # Until every request has its response. A bridge in shared mode hears its own inbox
        # twice (shared and plain, messages/subscriptions.py): still one answer of each kind.
        while sum(kinds.count("TASK_RESPONSE") for kinds in order.values()) < len(requests):
            answer = heard.get(timeout=20)
            if answer.message_type == MT.TASK_RESPONSE:
                order[answer.in_reply_to].append("TASK_RESPONSE")
            elif (answer.payload or {}).get("duplicate") is True:
                order[answer.ack_for].append("duplicate ACK")
            else:
                order[answer.ack_for].append(str(answer.message_type))
    finally:
        node.loop_stop()
        node.disconnect()
    # Each request: one ACK first, then one response, and nothing else.
    assert all(kinds == ["ACK", "TASK_RESPONSE"] for kinds in order.values()), order
