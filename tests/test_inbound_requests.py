"""Requests to the console on its inbox (PROTOCOL.md "Message types" and the receiver's
rules): a DRAIN does what the HTTP drain does; a repeated messageId is a duplicate; a request
without replyNodeId is refused, not run; a request the decoder rejects is told why. And
traffic between other nodes is stored without its payload unless asked."""

from __future__ import annotations

import json
import uuid

import pytest
from django.conf import settings

from messages import protocol
from messages.inbound import DRAIN_NO_ORIGIN, NO_REPLY_NODE, Incoming, messages_ingest
from messages.models import Direction, Message, Status
from reachconsole.core.audit import AuditEntry
from roster.models import Agent, RosterEvent
from tests.conftest import reader, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
PREFIX = "ooder"
INBOX = protocol.inbox_topic(PREFIX, "console")


def ingest(*items: tuple[str, bytes]):
    return messages_ingest(batch=[Incoming(t, p) for t, p in items], node_id="console",
                           prefix=PREFIX)


def drain(agent_ids, *, origin: str | None = "node-b", reply: str | None = "node-b"
          ) -> protocol.Envelope:
    headers = {}
    if origin:
        headers["originNodeId"] = origin
    if reply:
        headers["replyNodeId"] = reply
    return protocol.new_envelope(message_type=MT.DRAIN, from_agent_id="node-b",
                                 to_agent_id="console", target_node_id="console",
                                 headers=headers, payload={"agentIds": agent_ids})


def answer_to(env: protocol.Envelope) -> Message:
    return Message.objects.get(in_reply_to=env.message_id, direction=Direction.SEND)


# --- DRAIN ----------------------------------------------------------------------------------


def test_a_drain_on_the_bus_drains_like_the_http_drain_and_is_acked_after(now):
    register("fin.tax", "node-b", now=now)
    register("fin.vat", "node-b", now=now)
    env = drain(["fin.tax", "fin/vat"])
    result = ingest((INBOX, protocol.encode(env)))
    for agent_id in ("fin.tax", "fin.vat"):
        agent = Agent.objects.get(agent_id=agent_id)
        assert agent.status == Agent.Status.DRAINING and agent.drained_at is not None
        assert RosterEvent.objects.filter(agent_id=agent_id, kind="DRAINED",
                                          actor="node:node-b").count() == 1
        audit = AuditEntry.objects.get(action="drain", target=agent_id)
        assert (audit.actor, audit.result) == ("node:node-b", "ok")
    ack = answer_to(env)
    assert ack.message_type == "ACK" and ack.target_node_id == "node-b"
    assert ack.payload == {"drained": ["fin.tax", "fin.vat"]}
    assert ack.pk in result.to_publish
    row = Message.objects.get(message_id=env.message_id)
    assert row.status == Status.LOCAL_CONSUMED
    # Draining changes what the directory routes to: nothing new goes to fin.tax.
    from messages.outbound import SendRequest, message_send

    assert message_send(request=SendRequest(to="fin.tax")).status == Status.UNDELIVERABLE


def test_a_drain_leaves_unknown_agents_and_other_nodes_agents_alone_and_says_so(now):
    register("fin.tax", "node-b", now=now)
    register("fin.vat", "node-c", now=now)
    env = drain(["fin.tax", "fin.vat", "fin.ghost"])
    ingest((INBOX, protocol.encode(env)))
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING
    assert Agent.objects.get(agent_id="fin.vat").status == Agent.Status.ONLINE
    ack = answer_to(env)
    assert ack.message_type == "ACK"
    assert ack.payload == {"drained": ["fin.tax"], "unknown": ["fin.ghost"],
                           "elsewhere": {"fin.vat": "node-c"}}
    refused = AuditEntry.objects.filter(action="drain", result="refused")
    assert {(a.target, a.actor) for a in refused} == {("fin.vat", "node:node-b"),
                                                      ("fin.ghost", "node:node-b")}


def test_a_drain_that_drains_nothing_is_nacked_with_the_reasons(now):
    register("fin.vat", "node-c", now=now)
    env = drain(["fin.vat", "fin.ghost"])
    ingest((INBOX, protocol.encode(env)))
    nack = answer_to(env)
    assert nack.message_type == "NACK" and nack.payload["retryable"] is False
    assert nack.payload["reason"] == ("nothing drained: not in the roster: fin.ghost; on "
                                      "another node: fin.vat (on node-c)")
    assert Agent.objects.get(agent_id="fin.vat").status == Agent.Status.ONLINE
    row = Message.objects.get(message_id=env.message_id)
    assert row.status == Status.NACKED and row.error == nack.payload["reason"]


@pytest.mark.parametrize(("agent_ids", "words"), [
    (None, "payload.agentIds must be a list of 1 to 1000 agent ids"),
    ([], "payload.agentIds must be a list of 1 to 1000 agent ids"),
    ("fin.tax", "got the string 'fin.tax'"),
    (["fin.tax", 7], "payload.agentIds[1]:"),
    (["fin.tax", "not an id!"], "payload.agentIds[1]:"),
])
def test_a_malformed_drain_is_nacked_with_words_and_drains_nothing(now, agent_ids, words):
    register("fin.tax", "node-b", now=now)
    env = drain(agent_ids)
    ingest((INBOX, protocol.encode(env)))
    nack = answer_to(env)
    assert nack.message_type == "NACK" and nack.payload["retryable"] is False
    assert words in nack.payload["reason"]
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE
    assert not AuditEntry.objects.exists()


def test_a_drain_without_its_origin_is_nacked(now):
    register("fin.tax", "node-b", now=now)
    env = drain(["fin.tax"], origin=None)
    ingest((INBOX, protocol.encode(env)))
    assert answer_to(env).payload == {"reason": DRAIN_NO_ORIGIN, "retryable": False}
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE


def test_a_drain_naming_the_consoles_node_as_origin_drains_nothing(now):
    register("ops.probe", settings.REACH_NODE_ID, now=now)
    env = drain(["ops.probe"], origin=settings.REACH_NODE_ID)
    ingest((INBOX, protocol.encode(env)))
    nack = answer_to(env)
    assert nack.message_type == "NACK"
    assert "the console's own node" in nack.payload["reason"]
    assert Agent.objects.get(agent_id="ops.probe").status == Agent.Status.ONLINE


def test_a_repeated_drain_is_a_duplicate_not_done_again(now):
    register("fin.tax", "node-b", now=now)
    env = drain(["fin.tax"])
    ingest((INBOX, protocol.encode(env)))
    ingest((INBOX, protocol.encode(env)))
    acks = Message.objects.filter(in_reply_to=env.message_id).order_by("id")
    assert [a.payload for a in acks] == [{"drained": ["fin.tax"]}, {"duplicate": True}]
    assert AuditEntry.objects.filter(action="drain").count() == 1


# --- a repeated messageId -------------------------------------------------------------------


def test_a_repeated_message_id_is_acked_as_a_duplicate_and_not_run():
    key = f"job-{uuid.uuid4().hex}"
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
        target_node_id="console", task_id=key,
        headers={"replyNodeId": "node-b", "originNodeId": "node-b", "idempotencyKey": key})
    ingest((INBOX, protocol.encode(env)))
    result = ingest((INBOX, protocol.encode(env)))
    assert result.counts["duplicate_message_id"] == 1
    ack = Message.objects.get(pk__in=result.to_publish)
    assert (ack.message_type, ack.payload, ack.in_reply_to) == ("ACK", {"duplicate": True},
                                                               env.message_id)
    assert ack.headers["ackFor"] == env.message_id and ack.target_node_id == "node-b"
    assert Message.objects.filter(message_type="TASK_RESPONSE",
                                  in_reply_to=env.message_id).count() == 1


# --- no replyNodeId -------------------------------------------------------------------------


def test_a_request_without_reply_node_is_refused_to_its_origin_and_not_run(monkeypatch):
    from messages import handlers

    ran = []
    monkeypatch.setitem(handlers.LOCAL_HANDLERS, "ops.probe", lambda payload: ran.append(1))
    env = protocol.new_envelope(message_type=MT.TASK_REQUEST, from_agent_id="fin.tax",
                                to_agent_id="ops.probe", headers={"originNodeId": "node-b"})
    result = ingest((INBOX, protocol.encode(env)))
    assert ran == []
    row = Message.objects.get(message_id=env.message_id)
    assert row.status == Status.NACKED and row.error == NO_REPLY_NODE
    nack = answer_to(env)
    assert nack.message_type == "NACK" and nack.target_node_id == "node-b"
    assert nack.topic == protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, "node-b")
    assert nack.payload == {"reason": NO_REPLY_NODE, "retryable": False}
    assert result.to_publish == [nack.pk]
    assert not Message.objects.filter(message_type="TASK_RESPONSE").exists()


def test_the_corrected_request_after_a_refusal_runs_and_is_no_duplicate(
        monkeypatch, django_capture_on_commit_callbacks):
    from messages import handlers

    ran = []
    monkeypatch.setitem(handlers.LOCAL_HANDLERS, "ops.probe", lambda payload: ran.append(1))
    key = f"work-{uuid.uuid4().hex}"
    bare = protocol.new_envelope(message_type=MT.TASK_REQUEST, from_agent_id="fin.tax",
                                 to_agent_id="ops.probe",
                                 headers={"originNodeId": "node-b", "idempotencyKey": key})
    with django_capture_on_commit_callbacks(execute=True):
        ingest((INBOX, protocol.encode(bare)))
    assert ran == [] and Message.objects.get(message_id=bare.message_id).status == "NACKED"
    # The sender sets replyNodeId, as the NACK told it to, and sends the same work again.
    fixed = protocol.new_envelope(message_type=MT.TASK_REQUEST, from_agent_id="fin.tax",
                                  to_agent_id="ops.probe",
                                  headers={"originNodeId": "node-b", "replyNodeId": "node-b",
                                           "idempotencyKey": key})
    with django_capture_on_commit_callbacks(execute=True):
        ingest((INBOX, protocol.encode(fixed)))
    assert ran == [1]
    ack = Message.objects.get(in_reply_to=fixed.message_id, message_type="ACK")
    assert ack.payload.get("duplicate") is not True
    assert Message.objects.filter(in_reply_to=fixed.message_id,
                                  message_type="TASK_RESPONSE").exists()


def test_a_request_without_reply_or_origin_node_is_recorded_as_refused():
    env = protocol.new_envelope(message_type=MT.TASK_REQUEST, from_agent_id="fin.tax",
                                to_agent_id="ops.probe")
    result = ingest((INBOX, protocol.encode(env)))
    row = Message.objects.get(message_id=env.message_id)
    assert row.status == Status.NACKED
    assert row.error == f"{NO_REPLY_NODE} (no NACK sent: it named no reply or origin node)"
    assert result.to_publish == []
    assert not Message.objects.filter(message_type="TASK_RESPONSE").exists()


# --- rejected by the decoder ----------------------------------------------------------------


def _raw(headers: dict, payload, message_type: str = "TASK_REQUEST",
         message_id: str = "m-bad") -> bytes:
    return json.dumps({"protocol": "a2a", "version": "1.0", "message": {
        "messageId": message_id, "messageType": message_type, "toAgentId": "ops.probe",
        "headers": headers, "payload": payload}}).encode()


@pytest.mark.parametrize(("headers", "payload", "reason"), [
    ({"originNodeId": "node-b", "replyNodeId": "node-b"}, {"t": "a\u0000b"}, "nul_character"),
    ({"originNodeId": "node-b", "replyNodeId": "node-b"}, "\ud800", "lone_surrogate"),
    ({"originNodeId": "node-b", "replyNodeId": "node-b"}, {"n": 10**30}, "number_out_of_range"),
    ({"originNodeId": "node-b", "replyNodeId": "+/#"}, {}, "bad_node_id"),
])
def test_a_rejected_request_is_nacked_to_its_origin_with_the_reason(headers, payload, reason):
    result = ingest((INBOX, _raw(headers, payload)))
    assert result.counts[f"rejected:{reason}"] == 1
    assert not Message.objects.filter(message_id="m-bad").exists()  # never stored
    nack = Message.objects.get(in_reply_to="m-bad")
    assert nack.message_type == "NACK" and nack.target_node_id == "node-b"
    assert nack.topic == protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, "node-b")
    assert nack.payload["retryable"] is False
    assert nack.payload["reason"].startswith(f"rejected ({reason}): message 'm-bad'")
    assert result.to_publish == [nack.pk]


@pytest.mark.parametrize("raw", [
    # The origin itself is hostile: no topic is ever built from it.
    _raw({"originNodeId": "node/../x", "replyNodeId": "node-b"}, {"t": "a\u0000b"}),
    _raw({"originNodeId": "+", "replyNodeId": "node-b"}, {}),
    _raw({"originNodeId": "a\u0000b"}, {}),
    _raw({"originNodeId": "\ud800"}, {}),
    # No origin at all.
    _raw({"replyNodeId": "node-b"}, {"t": "a\u0000b"}),
    # Not a request: nothing to answer.
    _raw({"originNodeId": "node-b"}, {"t": "a\u0000b"}, message_type="EVENT"),
    # A message id the console could not name in an answer.
    _raw({"originNodeId": "node-b"}, {}, message_id="m\u0000"),
])
def test_a_rejected_message_is_not_answered_without_a_safe_origin_and_id(raw):
    result = ingest((INBOX, raw))
    assert sum(n for k, n in result.counts.items() if k.startswith("rejected:")) == 1
    assert result.to_publish == []
    assert not Message.objects.exists()


def test_a_rejected_request_seen_on_another_nodes_inbox_is_not_answered():
    raw = _raw({"originNodeId": "node-b", "replyNodeId": "node-b"}, {"t": "a\u0000b"})
    result = ingest((protocol.inbox_topic(PREFIX, "node-c"), raw))
    assert result.counts["rejected:nul_character"] == 1
    assert not Message.objects.exists()


# --- observed payloads ----------------------------------------------------------------------


def _between_others() -> protocol.Envelope:
    return protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="llm.chat",
        target_node_id="node-c", headers={"replyNodeId": "node-b", "originNodeId": "node-b"},
        payload={"question": "private"})


def test_traffic_between_other_nodes_is_stored_without_its_payload():
    env = _between_others()
    failed = protocol.new_envelope(
        message_type=MT.TASK_RESPONSE, from_agent_id="llm.chat",
        headers={"inReplyTo": env.message_id, "originNodeId": "node-c"},
        payload={"ok": False, "error": "no model"})
    ingest((protocol.inbox_topic(PREFIX, "node-c"), protocol.encode(env)),
           (protocol.inbox_topic(PREFIX, "node-b"), protocol.encode(failed)))
    row = Message.objects.get(message_id=env.message_id)
    assert row.direction == Direction.OBSERVED and row.payload is None
    assert Message.objects.get(message_id=failed.message_id).payload is None
    # Its outcome is still recorded: the rules read the payload as it came.
    assert row.status == Status.TASK_ERROR and row.error == "the task failed: no model"


def test_observed_payloads_are_kept_when_asked(settings):
    settings.REACH_STORE_OBSERVED_PAYLOADS = True
    env = _between_others()
    ingest((protocol.inbox_topic(PREFIX, "node-c"), protocol.encode(env)))
    assert Message.objects.get(message_id=env.message_id).payload == {"question": "private"}


def test_the_consoles_own_traffic_keeps_its_payloads():
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
        target_node_id="console", headers={"replyNodeId": "node-b", "originNodeId": "node-b"},
        payload={"question": "mine"})
    ingest((INBOX, protocol.encode(env)))
    assert Message.objects.get(message_id=env.message_id).payload == {"question": "mine"}
    response = Message.objects.get(in_reply_to=env.message_id, message_type="TASK_RESPONSE")
    assert response.payload["ok"] is True


def test_the_trace_of_an_observed_message_says_its_payload_was_not_stored():
    from django.test import Client

    env = _between_others()
    ingest((protocol.inbox_topic(PREFIX, "node-c"), protocol.encode(env)))
    client = Client()
    client.force_login(reader("victor", password="pw-victor-123"))
    html = client.get(f"/messages/{env.message_id}/").content.decode()
    assert "not stored: traffic between other nodes" in html and "private" not in html
