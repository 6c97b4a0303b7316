"""Secrets in payloads and headers (REACH_REDACT_KEYS) are masked wherever a message is
shown; what is stored is not changed (a resend needs it)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from messages import protocol
from messages.events import message_events
from messages.inbound import Incoming, messages_ingest
from messages.models import Message
from messages.redact import MASK, redacted
from tests.conftest import reader

MT = protocol.MessageType
SECRET = "hunter2-do-not-show"
PAYLOAD = {"user": "ann", "Password": SECRET,
           "steps": [{"auth": {"TOKEN": SECRET, "kind": "bearer"}}, "plain"],
           "nested": {"deeper": [[{"secret": SECRET}]]}}


def test_it_masks_the_named_keys_at_any_depth_whatever_their_case():
    shown = redacted(PAYLOAD)
    assert shown == {"user": "ann", "Password": MASK,
                     "steps": [{"auth": {"TOKEN": MASK, "kind": "bearer"}}, "plain"],
                     "nested": {"deeper": [[{"secret": MASK}]]}}
    assert PAYLOAD["Password"] == SECRET  # the value given is left as it is
    assert redacted("a string") == "a string" and redacted(None) is None


def test_the_keys_come_from_the_setting(settings):
    settings.REACH_REDACT_KEYS = frozenset({"pin"})
    assert redacted({"PIN": 1234, "password": "x"}) == {"PIN": MASK, "password": "x"}
    settings.REACH_REDACT_KEYS = frozenset()
    assert redacted({"password": "x"}) == {"password": "x"}


def test_a_payload_nested_as_deep_as_the_parser_allows_is_masked():
    deep: object = {"password": SECRET}
    for _ in range(5000):
        deep = [deep]
    shown = redacted(deep)
    for _ in range(5000):
        shown = shown[0]
    assert shown == {"password": MASK}


@pytest.fixture
def received(db, console_hears) -> Message:
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="fin.elsewhere",
        target_node_id="console",
        headers={"replyNodeId": "node-b", "originNodeId": "node-b", "Authorization": SECRET},
        payload=PAYLOAD)
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                    protocol.encode(env))], node_id="console", prefix="ooder")
    return Message.objects.get(message_id=env.message_id)


def test_the_trace_page_masks_secrets_and_the_row_keeps_them(received):
    client = Client()
    client.force_login(reader("victor", password="pw-victor-123"))
    html = client.get(f"/messages/{received.message_id}/").content.decode()
    assert SECRET not in html
    assert MASK in html and "bearer" in html
    received.refresh_from_db()
    assert received.payload == PAYLOAD and received.headers["Authorization"] == SECRET


def test_the_api_message_detail_masks_payload_headers_and_replies(received, api):
    body = api.get(f"/api/a2a/messages/{received.message_id}").json()
    assert SECRET not in json.dumps(body)
    assert body["payload"]["Password"] == MASK and body["payload"]["user"] == "ann"
    assert body["headers"]["Authorization"] == MASK
    assert body["headers"]["originNodeId"] == "node-b"
    # Its answer (a NACK: no such agent here) is listed, and masked the same way.
    assert [r["messageType"] for r in body["replies"]] == ["NACK"]


def test_events_never_carry_a_payload(received):
    assert SECRET not in json.dumps(message_events(received, previous=""))


@pytest.mark.usefixtures("console_hears")
def test_the_answers_listed_with_a_message_are_masked_too(db, api):
    Message.objects.create(
        message_id="req-1", task_id="t-1", message_type="TASK_REQUEST", direction="SEND",
        status="PUBLISHED", to_agent_id="fin.tax", target_node_id="node-b",
        reply_node_id="console")
    response = protocol.new_envelope(
        message_type=MT.TASK_RESPONSE, from_agent_id="fin.tax",
        headers={"inReplyTo": "req-1", "originNodeId": "node-b", "replyNodeId": "node-b"},
        payload={"ok": True, "result": {"token": SECRET}})
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                    protocol.encode(response))],
                    node_id="console", prefix="ooder")
    body = api.get("/api/a2a/messages/req-1").json()
    assert body["status"] == "COMPLETED"
    assert [r["payload"] for r in body["replies"]] == [{"ok": True, "result": {"token": MASK}}]
    assert SECRET not in json.dumps(body)
