"""One message in, one answer out, one count: the console's own inbox is heard by every bridge
twice, through the shared group and through a plain subscription of its own that outlives a
broker restart (messages/subscriptions.py). Two real bridges in
shared mode on a private Mosquitto, the console's and a node's accounts."""

from __future__ import annotations

import shutil
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from messages import protocol
from messages.bridge import Bridge
from messages.models import Direction, Message
from reachconsole.core.metrics import counters_snapshot
from roster.models import BusHearing
from tests.conftest import expect_real_services
from tests.deploy_broker import private_mosquitto
from tests.test_bridge import eventually
from tests.test_broker_acl import Client

pytestmark = [
    pytest.mark.skipif(not (shutil.which("mosquitto") or expect_real_services()),
                       reason="starts a private Mosquitto: it is not installed"),
    pytest.mark.timeout(120),
]
PREFIX = "ooder"  # the prefix deploy/mosquitto.acl's node lines name
MT = protocol.MessageType


@pytest.fixture(scope="module")
def broker():
    with private_mosquitto(users={"node-b": "password-of-node-b"}) as running:
        yield running


def _request(to: str) -> protocol.Envelope:
    key = f"once-{uuid.uuid4().hex}"
    return protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id=to,
        target_node_id="console", task_id=key,
        headers={"replyNodeId": "node-b", "originNodeId": "node-b", "idempotencyKey": key},
        payload={"q": 1})


def _heard_after(bridges: list[Bridge], moment) -> bool:
    """Each bridge's probe sent after `moment` has come back: all it received before is
    stored (roster/hearing.py), every copy of every publish before `moment` included."""
    heard = dict(BusHearing.objects.filter(instance__in=[b.client_id for b in bridges])
                 .values_list("instance", "heard_at"))
    return all(heard.get(b.client_id) and heard[b.client_id] > moment for b in bridges)


def _answers(request_ids: list[str]) -> dict[str, list[str]]:
    """What the console sent back for each request, in the words of the test."""
    out: dict[str, list[str]] = {mid: [] for mid in request_ids}
    for reply in (Message.objects.filter(direction=Direction.SEND, in_reply_to__in=request_ids)
                  .order_by("pk")):
        duplicate = isinstance(reply.payload, dict) and reply.payload.get("duplicate")
        out[reply.in_reply_to].append("duplicate ACK" if duplicate else reply.message_type)
    return out


@pytest.mark.django_db(transaction=True)
def test_two_bridges_answer_each_publish_once_and_count_it_once(broker, settings):
    settings.MQTT_TOPIC_PREFIX = PREFIX
    before = counters_snapshot()
    bridges = [Bridge(url=broker.url(), node_id="console", prefix=PREFIX,
                      instance=f"once{i}-{uuid.uuid4().hex[:6]}", protocol_version="5",
                      heartbeat_ms=60_000) for i in range(2)]
    node = Client(broker, "node-b")
    inbox = protocol.inbox_topic(PREFIX, "console")
    try:
        for bridge in bridges:
            bridge.start()
        for bridge in bridges:
            assert bridge.wait_connected(15)
            session = bridge.session
            assert session.listening.wait(15), "the bridge never had its subscriptions granted"
            assert session.ingest_mode == "shared" and session.plan.plain_inbox() == inbox
        served = [_request("ops.probe") for _ in range(12)]
        refused = [_request("ops.nosuchagent") for _ in range(4)]
        for env in served + refused:
            node.publish(inbox, protocol.encode(env))
        node.publish(inbox, b"{not json")
        sent = timezone.now()
        eventually(lambda: _heard_after(bridges, sent), timeout=30,
                   what="both bridges hearing past the publishes")
        answers = _answers([e.message_id for e in served + refused])
        assert all(answers[e.message_id] == ["ACK", "TASK_RESPONSE"] for e in served), answers
        assert all(answers[e.message_id] == ["NACK"] for e in refused), answers
        assert Message.objects.filter(
            message_id__in=[e.message_id for e in served + refused]).count() == 16

        # A real repeat (the same transmission published again) is still one: answered
        # ACK `duplicate: true` once, and counted once.
        node.publish(inbox, protocol.encode(served[0]))
        again = timezone.now()
        eventually(lambda: _heard_after(bridges, again + timedelta(milliseconds=1)),
                   timeout=30, what="both bridges hearing past the repeat")
        assert _answers([served[0].message_id])[served[0].message_id] == [
            "ACK", "TASK_RESPONSE", "duplicate ACK"]
    finally:
        for bridge in bridges:
            bridge.stop()  # hands its counts to the shared counters
        node.close()
    after = counters_snapshot()

    def delta(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("rejected:not_json") == 1
    assert delta("duplicate_message_id") == 1
    assert delta("duplicate_idempotency_key") == 0
    # Every publish reached both bridges plainly and one through the group: the rest were
    # stand-ins (some dropped before a batch, beside their group copy, and not counted).
    assert 0 < delta("inbox_copies") <= 2 * 18


def _ingest(env_or_bytes, *, copy: bool) -> None:
    from messages.inbound import Incoming, messages_ingest

    payload = env_or_bytes if isinstance(env_or_bytes, bytes) else protocol.encode(env_or_bytes)
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"), payload,
                                    copy=copy)], node_id="console", prefix="ooder")


@pytest.mark.django_db
def test_a_stand_in_stored_first_silences_its_group_copy_but_not_a_real_repeat():
    """The order two bridges may see: the plain copy stored first, the group's copy after
    it, then the same transmission published again."""
    env = _request("ops.probe")
    _ingest(env, copy=True)
    assert _answers([env.message_id])[env.message_id] == ["ACK", "TASK_RESPONSE"]
    _ingest(env, copy=False)  # the group's copy of the same publish
    _ingest(env, copy=True)  # another bridge's stand-in
    assert _answers([env.message_id])[env.message_id] == ["ACK", "TASK_RESPONSE"]
    _ingest(env, copy=False)  # published again: a real repeat
    assert _answers([env.message_id])[env.message_id] == [
        "ACK", "TASK_RESPONSE", "duplicate ACK"]
    # Another transmission of the same work, as a stand-in first: answered by its group copy.
    retry = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
        target_node_id="console", task_id=env.task_id,
        headers={**env.headers, "idempotencyKey": env.idempotency_key}, payload={"q": 1})
    _ingest(retry, copy=True)
    assert _answers([retry.message_id])[retry.message_id] == []
    _ingest(retry, copy=False)
    assert _answers([retry.message_id])[retry.message_id] == ["duplicate ACK"]


@pytest.mark.django_db(transaction=True)  # the refusal gives its key back on commit
def test_a_refused_request_seen_again_as_a_copy_leaves_its_key_for_the_corrected_one():
    """A request without replyNodeId is refused and gives its idempotency key back; a later
    copy of it must not take the key again, or the sender's corrected request (same key)
    would be answered as a duplicate and never run."""
    key = f"fix-{uuid.uuid4().hex}"
    broken = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
        target_node_id="console", task_id=key,
        headers={"originNodeId": "node-b", "idempotencyKey": key}, payload={"q": 1})
    _ingest(broken, copy=True)
    _ingest(broken, copy=False)
    assert _answers([broken.message_id])[broken.message_id] == ["NACK"]
    fixed = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
        target_node_id="console", task_id=key,
        headers={"originNodeId": "node-b", "replyNodeId": "node-b", "idempotencyKey": key},
        payload={"q": 1})
    _ingest(fixed, copy=False)
    assert _answers([fixed.message_id])[fixed.message_id] == ["ACK", "TASK_RESPONSE"]
