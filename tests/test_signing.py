"""Answers nobody on the bus can forge (docs/protocol.md "Signatures"): every node signs
with its own key, derived from the console's secret; the console signs what it sends a node
with that node's key; in strict mode (REACH_REQUIRE_SIGNED) an answer, heartbeat, DRAIN or
request that is not signed by the node it speaks for is recorded with the reason and
changes nothing. A signature that does not check is refused in every mode."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from messages import protocol, signing
from messages.inbound import Incoming, messages_ingest
from messages.models import Direction, Message, Status
from messages.rows import row_encode
from roster.models import Agent, ClusterNode
from tests.conftest import logged_in, reader, register

MT = protocol.MessageType
PREFIX = "ooder"
SECRET_NEW = "n" * 16 + "0123456789abcdef0123"
SECRET_OLD = "o" * 16 + "fedcba9876543210fedc"
KEYS = f"2026-12:{SECRET_NEW},2026-06:{SECRET_OLD}"


def key_of(node: str, kid: str = "2026-12") -> signing.NodeKey:
    return signing.keyring_parse(KEYS).key(kid, node)


def inbox(node: str = "console") -> str:
    return protocol.inbox_topic(PREFIX, node)


def ingest(*items: tuple[str, protocol.Envelope, signing.NodeKey | None]):
    return messages_ingest(
        batch=[Incoming(topic, protocol.encode(env, key=key)) for topic, env, key in items],
        node_id="console", prefix=PREFIX)


def our_request(message_id: str = "req-1", target: str = "node-d") -> Message:
    return Message.objects.create(
        message_id=message_id, task_id=f"t-{message_id}", message_type="TASK_REQUEST",
        direction=Direction.SEND, status=Status.PUBLISHED, from_agent_id="console",
        to_agent_id="fin.tax", target_node_id=target, reply_node_id="console",
        origin_node_id="console", topic=inbox(target))


def response(for_id: str, *, origin: str = "node-d") -> protocol.Envelope:
    return protocol.new_envelope(
        message_type=MT.TASK_RESPONSE, from_agent_id="fin.tax", to_agent_id="console",
        headers={"inReplyTo": for_id, "originNodeId": origin, "replyNodeId": origin},
        payload={"ok": True, "result": 42})


def heartbeat(node: str, agents: list[dict], **fields) -> protocol.Envelope:
    env = protocol.new_envelope(message_type=MT.HEARTBEAT, from_agent_id=node,
                                headers={"originNodeId": node},
                                payload={"heartbeatMs": 1000, "agents": agents})
    return replace(env, **fields)


def drain(agent_ids: list[str], *, origin: str = "node-d") -> protocol.Envelope:
    return protocol.new_envelope(message_type=MT.DRAIN, from_agent_id=origin,
                                 to_agent_id="console", target_node_id="console",
                                 headers={"originNodeId": origin, "replyNodeId": origin},
                                 payload={"agentIds": agent_ids})


@pytest.fixture
def keys(settings):
    settings.REACH_SIGNING_KEYS = KEYS
    settings.REACH_REQUIRE_SIGNED = False
    return settings


@pytest.fixture
def strict(keys):
    keys.REACH_REQUIRE_SIGNED = True
    return keys


# --- the signature itself ---------------------------------------------------------------------


def test_a_signed_envelope_checks_with_the_key_of_the_node_it_speaks_for_and_no_other():
    env = response("req-1")
    received = protocol.decode(protocol.encode(env, key=key_of("node-d")))
    keyring = signing.keyring_parse(KEYS)
    assert received.signature["node"] == "node-d" and received.signature["kid"] == "2026-12"
    assert received.signature_check(node_id="node-d", keyring=keyring).code == "signed"
    wrong = received.signature_check(node_id="node-e", keyring=keyring)
    assert wrong.code == "wrong_node" and wrong.refused
    assert wrong.words == "it is signed with the key of node node-d, but speaks for node node-e"
    # Another node's key, claiming to be node-d: the node field says node-d, the MAC does not.
    forged = json.loads(protocol.encode(env, key=key_of("node-e")))
    forged["signature"]["node"] = "node-d"
    verdict = protocol.decode(json.dumps(forged)).signature_check(node_id="node-d",
                                                                  keyring=keyring)
    assert verdict.code == "bad_signature"


def test_any_change_to_the_message_breaks_its_signature_but_key_order_and_spacing_do_not():
    wire = json.loads(protocol.encode(response("req-1"), key=key_of("node-d")))
    keyring = signing.keyring_parse(KEYS)
    # Re-serialized by another implementation: keys in another order, with spaces.
    shuffled = {"signature": wire["signature"], "version": wire["version"],
                "protocol": wire["protocol"],
                "message": dict(reversed(list(wire["message"].items())))}
    same = protocol.decode(json.dumps(shuffled, indent=2))
    assert same.signature_check(node_id="node-d", keyring=keyring).signed
    wire["message"]["payload"]["result"] = 43
    changed = protocol.decode(json.dumps(wire))
    assert changed.signature_check(node_id="node-d", keyring=keyring).code == "bad_signature"


def test_keys_rotate_by_secret_the_newest_signs_every_listed_one_checks():
    keyring = signing.keyring_parse(KEYS)
    assert keyring.signing_key("node-d").kid == "2026-12"
    old = protocol.decode(protocol.encode(response("r"), key=key_of("node-d", "2026-06")))
    assert old.signature_check(node_id="node-d", keyring=keyring).signed
    after = signing.keyring_parse(f"2026-12:{SECRET_NEW}")
    verdict = old.signature_check(node_id="node-d", keyring=after)
    assert verdict.code == "unknown_key"
    assert "key '2026-06', which the console does not hold (it holds 2026-12)" in verdict.words


@pytest.mark.django_db
def test_a_node_holds_only_its_own_key_and_checks_the_consoles_messages_with_it(keys):
    row = our_request(target="node-d")
    data = row_encode(row)
    received = protocol.decode(data)
    assert received.signature["node"] == "node-d"
    held = signing.node_key_parse(key_of("node-d").text(), node_id="node-d")
    assert received.signature_check(node_id="node-d", keyring=signing.OwnKey(held)).signed
    # node-e's key cannot check (or make) what the console sends node-d.
    other = signing.OwnKey(signing.node_key_parse(key_of("node-e").text(), node_id="node-e"))
    assert received.signature_check(node_id="node-e", keyring=other).refused


def test_the_node_key_command_prints_each_nodes_key_and_refuses_without_secrets(keys, capsys):
    call_command("node_key", "node-d", "node-e")
    out = capsys.readouterr().out.splitlines()
    assert out == [f"node-d REACH_NODE_KEY={key_of('node-d').text()}",
                   f"node-e REACH_NODE_KEY={key_of('node-e').text()}"]
    call_command("node_key", "node-d", "--kid", "2026-06")
    assert capsys.readouterr().out.strip().endswith(key_of("node-d", "2026-06").text())
    keys.REACH_SIGNING_KEYS = ""
    with pytest.raises(CommandError, match="REACH_SIGNING_KEYS is empty"):
        call_command("node_key", "node-d")


@pytest.mark.parametrize(("text", "words"), [
    ("k1:short", "the secret is 5 characters; use at least 32"),
    ("k 1:" + "x" * 40, "write kid:secret"),
    (f"a:{'x' * 40},a:{'y' * 40}", "kid a is listed twice"),
])
def test_bad_signing_keys_are_refused_with_words(text, words):
    with pytest.raises(ValueError, match=words):
        signing.keyring_parse(text)


def test_a_message_json_canonicalization_cannot_write_is_refused_as_unsignable(keys):
    env = protocol.new_envelope(message_type=MT.TASK_REQUEST, payload={"n": 2**60})
    with pytest.raises(ValueError, match="cannot be signed.*2\\^53"):
        protocol.encode(env, key=key_of("node-d"))


# --- strict: what is not signed by the node it speaks for changes nothing ---------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_strict_an_unsigned_response_is_recorded_with_the_reason_and_completes_nothing(strict):
    request = our_request()
    forged = response("req-1")  # originNodeId node-d, as the request's node: but unsigned
    result = ingest((inbox(), forged, None))
    request.refresh_from_db()
    assert request.status == Status.PUBLISHED and request.finished_at is None
    assert result.counts["rejected:signature_unsigned"] == 1
    seen = Message.objects.get(message_id=forged.message_id)
    assert seen.error.startswith("not accepted, changed nothing: it is not signed, and the "
                                 "console takes only signed")
    assert not Message.objects.filter(in_reply_to=forged.message_id).exists()  # no ACK
    assert ClusterNode.objects.filter(node_id="node-d").count() == 0  # nothing created

    signed = response("req-1")
    result = ingest((inbox(), signed, key_of("node-d")))
    request.refresh_from_db()
    assert request.status == Status.COMPLETED
    assert Message.objects.filter(in_reply_to=signed.message_id, message_type="ACK").exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_strict_an_answer_signed_by_another_node_is_refused_in_any_mode(keys):
    request = our_request()
    wrong = response("req-1")
    key = key_of("node-e")
    result = ingest((inbox(), wrong, key))  # node-e's key, speaking as node-d
    request.refresh_from_db()
    assert request.status == Status.PUBLISHED
    assert result.counts["rejected:signature_wrong_node"] == 1
    assert "signed with the key of node node-e, but speaks for node node-d" in (
        Message.objects.get(message_id=wrong.message_id).error)


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_strict_an_unsigned_heartbeat_renews_no_lease_and_the_node_says_why(strict, now):
    register("fin.tax", "node-d", now=now - timedelta(seconds=10))
    before = Agent.objects.get(agent_id="fin.tax").lease_expires_at
    agents = [{"agentId": "fin.tax", "inflight": 0, "queueDepth": 0, "maxInflight": 1}]
    result = ingest((protocol.heartbeat_topic(PREFIX, "node-d"), heartbeat("node-d", agents),
                     None))
    agent = Agent.objects.get(agent_id="fin.tax")
    assert agent.lease_expires_at == before and agent.max_inflight != 1
    assert result.counts["rejected:signature_unsigned"] == 1
    node = ClusterNode.objects.get(node_id="node-d")
    assert node.signature_refused_at is not None and node.signing == ""
    assert node.signature_refused.startswith("a heartbeat: it is not signed")

    # Signed, but with a timestamp a minute old: a replay.
    old = heartbeat("node-d", agents, timestamp=protocol.new_envelope(
        message_type=MT.HEARTBEAT).timestamp - 60_000)
    result = ingest((protocol.heartbeat_topic(PREFIX, "node-d"), old, key_of("node-d")))
    assert result.counts["rejected:signature_too_old"] == 1
    assert Agent.objects.get(agent_id="fin.tax").lease_expires_at == before

    result = ingest((protocol.heartbeat_topic(PREFIX, "node-d"), heartbeat("node-d", agents),
                     key_of("node-d")))
    agent = Agent.objects.get(agent_id="fin.tax")
    assert agent.lease_expires_at > before and agent.max_inflight == 1
    node.refresh_from_db()
    assert node.signing == "signed" and node.signed_at is not None


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_strict_an_unsigned_drain_drains_nothing_and_is_nacked_with_the_reason(strict, now):
    register("fin.tax", "node-d", now=now)
    env = drain(["fin.tax"])
    ingest((inbox(), env, None))
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE
    nack = Message.objects.get(in_reply_to=env.message_id, direction=Direction.SEND)
    assert nack.message_type == "NACK"
    assert nack.payload["reason"].startswith("nothing drained: it is not signed")
    signed = drain(["fin.tax"])
    ingest((inbox(), signed, key_of("node-d")))
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_strict_an_unsigned_request_to_a_console_agent_is_not_run(strict):
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.caller", to_agent_id="ops.probe",
        target_node_id="console", task_id="t-echo",
        headers={"originNodeId": "node-d", "replyNodeId": "node-d"}, payload={"x": 1})
    ingest((inbox(), env, None))
    row = Message.objects.get(message_id=env.message_id)
    assert row.status == Status.NACKED and row.error.startswith("not run: it is not signed")
    assert not Message.objects.filter(in_reply_to=env.message_id,
                                      message_type="TASK_RESPONSE").exists()


# --- not strict: unsigned is taken, and said ---------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_without_strict_unsigned_traffic_is_taken_and_its_node_card_says_it_is_unsigned(
        keys, now):
    register("fin.tax", "node-d", now=now)
    register("fin.vat", "node-e", now=now)
    agents_d = [{"agentId": "fin.tax", "inflight": 0, "queueDepth": 0, "maxInflight": 8}]
    agents_e = [{"agentId": "fin.vat", "inflight": 0, "queueDepth": 0, "maxInflight": 8}]
    ingest((protocol.heartbeat_topic(PREFIX, "node-d"), heartbeat("node-d", agents_d), None),
           (protocol.heartbeat_topic(PREFIX, "node-e"), heartbeat("node-e", agents_e),
            key_of("node-e")))
    assert ClusterNode.objects.get(node_id="node-d").signing == "unsigned"
    assert ClusterNode.objects.get(node_id="node-e").signing == "signed"
    request = our_request()
    ingest((inbox(), response("req-1"), None))
    request.refresh_from_db()
    assert request.status == Status.COMPLETED  # unsigned, but not strict: taken

    page = logged_in(reader("ops")).get(reverse("roster:nodes")).content.decode()
    card_d = page.split('id="node-node-d"')[1].split("</section>")[0]
    card_e = page.split('id="node-node-e"')[1].split("</section>")[0]
    assert 'data-signing="unsigned"' in card_d
    assert "Its traffic is unsigned" in card_d and "manage.py node_key node-d" in card_d
    assert 'data-signing="signed"' in card_e and "Signed: its last heartbeat" in card_e


@pytest.mark.django_db
def test_without_keys_every_node_card_says_nothing_is_signed(settings, now):
    settings.REACH_SIGNING_KEYS = ""
    register("fin.tax", "node-d", now=now)
    page = logged_in(reader("ops")).get(reverse("roster:nodes")).content.decode()
    card = page.split('id="node-node-d"')[1].split("</section>")[0]
    assert 'data-signing="off"' in card
    assert "the console holds no signing keys" in card
