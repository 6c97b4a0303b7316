"""The console as a requester of the A2A-over-MQTT profile (messages/profile_send.py): a send
to `{org}/{unit}/{agent}` is a JSON-RPC SendMessage with the console's Response Topic and a
Correlation Data of its own per attempt, moved by the replies heard on that topic, retried
by the profile's rules, canceled with CancelTask. The same against real SDK agents through
the bridge is in tests/test_profile_sdk.py."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from messages.cancel import task_cancel
from messages.models import Message
from messages.outbound import SendRefused, SendRequest, message_send
from messages.profile_send import (
    profile_encode,
    profile_response,
    publish_properties,
)
from messages.profile_traffic import (
    ProfileFrame,
    console_reply_topic,
    profile_traffic_ingest,
    request_key,
)
from messages.puback import Puback, pubacks_apply
from messages.sweeps import deliveries_sweep
from reachconsole.core.tokens import tokens_parse
from roster.models import Agent
from roster.profile import card_apply
from tests.conftest import TOKEN, ApiClient, bus_heard, register
from tests.test_profile_cards import card, frame

pytestmark = pytest.mark.django_db
AGENT = "acme/ops/echo"
CONSOLE_REPLY = "$a2a/v1/reply/reachconsole/ops/console/replies"


@pytest.fixture(autouse=True)
def _profile_on(settings):
    settings.REACH_A2A_PROFILE = True


def sent(now, **fields) -> Message:
    card_apply(frame(), now=now)
    return message_send(request=SendRequest(to=AGENT, **{"payload": {"text": "hi"},
                                                         "task_id": "t-p", **fields}), now=now)


def published(row: Message, at) -> Message:
    """What the bridge records on the broker's PUBACK."""
    pubacks_apply(pubacks=[Puback(pk=row.pk, request=True, at=at, ack_ms=15000)], release=[],
                  now=at)
    row.refresh_from_db()
    return row


def reply(row: Message, result: dict | None = None, *, error: dict | None = None,
          topic: str = CONSOLE_REPLY) -> ProfileFrame:
    body = {"jsonrpc": "2.0", "id": row.headers["jsonrpcId"]}
    body.update({"error": error} if error else {"result": result})
    return ProfileFrame(topic, json.dumps(body).encode(),
                        correlation=bytes.fromhex(row.headers["correlationData"]))


def state(task: str, name: str) -> dict:
    return {"statusUpdate": {"taskId": task, "contextId": "", "status": {"state": name}}}


def test_a_send_to_a_profile_agent_is_a_jsonrpc_request_on_its_request_topic(now):
    row = sent(now)
    assert (row.status, row.target_node_id, row.to_agent_id) == ("SENT", "a2a-mqtt", AGENT)
    assert row.topic == "$a2a/v1/request/acme/ops/echo"
    headers = row.headers
    assert console_reply_topic() == CONSOLE_REPLY == headers["responseTopic"]
    assert (headers["dialect"], headers["method"]) == ("a2a-mqtt", "SendMessage")
    correlation = bytes.fromhex(headers["correlationData"])
    # Its id is what its replies name it by: the console's reply topic and its correlation.
    assert row.message_id == request_key(CONSOLE_REPLY, correlation)
    assert publish_properties(row) == (CONSOLE_REPLY, correlation)
    # Room for every attempt of the profile's requester rule when no timeoutMs was given.
    assert row.deadline_at == now + timedelta(milliseconds=120000)
    body = json.loads(profile_encode(row))
    assert (body["jsonrpc"], body["method"], body["id"]) == ("2.0", "SendMessage",
                                                             row.message_id)
    message = body["params"]["message"]
    assert (message["parts"], message["taskId"], message["role"]) == (
        [{"text": "hi"}], "t-p", "ROLE_USER")
    # Anything else than {"text": …} is one data part.
    other = sent(now, payload={"rows": [1, 2]}, task_id="t-data")
    assert json.loads(profile_encode(other))["params"]["message"]["parts"] == [
        {"data": {"rows": [1, 2]}}]
    assert other.headers["correlationData"] != headers["correlationData"]


def test_replies_on_the_console_topic_complete_it_and_its_answer_is_the_task(now):
    row = published(sent(now), now)
    assert row.status == "PUBLISHED"
    # The first reply is the profile's ACK: 15 s for it, not the native ACK timeout.
    assert row.ack_deadline_at == now + timedelta(milliseconds=15000)
    # The bridges hear the console's own request go by on the request tree: not a second row.
    echo = ProfileFrame(row.topic, profile_encode(row), response_topic=CONSOLE_REPLY,
                        correlation=bytes.fromhex(row.headers["correlationData"]))
    assert profile_traffic_ingest([echo], now=now)["stored"] == 0
    profile_traffic_ingest([reply(row, state("t-p", "TASK_STATE_SUBMITTED"))], now=now)
    row.refresh_from_db()
    assert row.status == "ACKED" and row.deadline_at == now + timedelta(milliseconds=120000)
    artifact = {"artifactUpdate": {"taskId": "t-p", "artifact": {
        "artifactId": "a1", "parts": [{"text": "echo: hi"}]}}}
    profile_traffic_ingest([reply(row, artifact), reply(row, state("t-p",
                                                                   "TASK_STATE_COMPLETED"))],
                           now=now)
    row.refresh_from_db()
    assert row.status == "COMPLETED" and row.finished_at == now
    replies = Message.objects.filter(in_reply_to=row.message_id).order_by("id")
    # Received by the console, kept whole: they are the task's result.
    assert {(r.direction, r.status) for r in replies} == {("RECV", "RECV")}
    assert profile_response(row) == {"result": {"task": {
        "id": "t-p", "contextId": "", "status": {"state": "TASK_STATE_COMPLETED"},
        "artifacts": [{"artifactId": "a1", "parts": [{"text": "echo: hi"}]}]}}}
    # The same reply on another requester's topic moves nothing of the console's.
    other = published(sent(now, task_id="t-other"), now)
    profile_traffic_ingest([reply(other, state("t-other", "TASK_STATE_COMPLETED"),
                                  topic="$a2a/v1/reply/acme/ops/asker/s1")], now=now)
    other.refresh_from_db()
    assert other.status == "PUBLISHED"


@pytest.mark.parametrize("error, status, words", [
    ({"code": -32004, "message": "busy", "data": {"a2a_error": "responder_unavailable"}},
     "BUSY", "JSON-RPC error -32004: busy"),
    ({"code": -32003, "message": "late", "data": {"a2a_error": "request_expired"}},
     "EXPIRED", "JSON-RPC error -32003: late"),
    ({"code": -32601, "message": "no such method"}, "TASK_ERROR",
     "JSON-RPC error -32601: no such method"),
])
def test_the_profiles_error_codes_end_it_with_their_words(now, error, status, words):
    row = published(sent(now), now)
    profile_traffic_ingest([reply(row, error=error)], now=now)
    row.refresh_from_db()
    assert (row.status, row.error) == (status, words) and row.finished_at == now
    assert profile_response(row) == {"error": error}


def test_no_reply_is_retried_with_fresh_correlation_then_expires_with_words(now, settings):
    settings.REACH_A2A_JITTER = 0.0
    row = published(sent(now), now)
    bus_heard(since=now - timedelta(minutes=1), until=now + timedelta(minutes=5))
    moment, attempts = now, [row]
    for n in (1, 2, 3):
        moment += timedelta(milliseconds=15001)
        deliveries_sweep(now=moment)
        attempts[-1].refresh_from_db()
        if n == 3:
            break
        assert attempts[-1].status == "RETRYING"
        assert attempts[-1].next_attempt_at == moment + timedelta(milliseconds=1000 * 2 ** (n - 1))
        moment = attempts[-1].next_attempt_at
        deliveries_sweep(now=moment)
        nxt = Message.objects.get(task_id="t-p", attempt=n + 1, message_type="TASK_REQUEST")
        assert nxt.headers["dialect"] == "a2a-mqtt" and nxt.deadline_at == row.deadline_at
        attempts.append(published(nxt, moment))
    for attempt in attempts:
        attempt.refresh_from_db()
    assert [a.status for a in attempts] == ["RETRIED", "RETRIED", "EXPIRED"]
    assert len({a.headers["correlationData"] for a in attempts}) == 3
    assert attempts[-1].error == (
        "no reply within 15000 ms (REACH_A2A_FIRST_REPLY_MS, the profile's first-reply "
        "timeout) on attempt 3, and no retry: 3 attempts made, each with its own Correlation "
        "Data (REACH_A2A_MAX_ATTEMPTS, the profile's requester rule)")


def test_an_agent_offline_or_without_a_card_is_undeliverable_with_words(now):
    card_apply(frame(status="offline", source="lwt"), now=now)
    row = message_send(request=SendRequest(to=AGENT, payload={"text": "hi"}), now=now)
    assert row.status == "UNDELIVERABLE"
    assert "its Agent Card says a2a-status=offline" in row.error
    row = message_send(request=SendRequest(to="acme/ops/nobody"), now=now)
    assert row.status == "UNDELIVERABLE"
    assert row.target_node_id == "a2a-mqtt"  # the profile's, for the dialect filter
    assert row.error.startswith("no Agent Card of acme/ops/nobody is known: nothing is "
                                "retained on $a2a/v1/discovery/acme/ops/nobody")


def test_a_capability_is_routed_over_both_dialects(now):
    card_apply(frame(), now=now)  # skills echo, shout
    row = message_send(request=SendRequest(to="capability:shout"), now=now)
    assert (row.to_agent_id, row.target_node_id, row.headers["method"]) == (
        AGENT, "a2a-mqtt", "SendMessage")
    register("fin.shouter", "node-b", capabilities=["shout"])
    bus_heard(since=now - timedelta(minutes=1), until=now)
    # Both can take it: the least loaded wins (the profile agent has one in flight now).
    row = message_send(request=SendRequest(to="capability:shout"), now=now)
    assert (row.to_agent_id, row.target_node_id) == ("fin.shouter", "node-b")
    assert {c["agentId"] for c in row.resolution["candidates"]} == {AGENT, "fin.shouter"}


def test_cancel_tells_the_agent_with_canceltask_on_its_request_topic(now):
    row = published(sent(now), now)
    done = task_cancel(task_id="t-p", by="olga", reason="wrong input", now=now)
    row.refresh_from_db()
    assert row.status == "CANCELED" and done.told == [AGENT]
    told = Message.objects.get(task_id="t-p", message_type="CANCEL")
    assert (told.topic, told.status, told.headers["method"]) == (row.topic, "SENT",
                                                                 "CancelTask")
    assert told.headers["correlationData"] != row.headers["correlationData"]
    assert json.loads(profile_encode(told))["params"] == {"id": "t-p"}
    # A late COMPLETED is recorded and reopens nothing.
    profile_traffic_ingest([reply(row, state("t-p", "TASK_STATE_COMPLETED"))], now=now)
    row.refresh_from_db()
    assert row.status == "CANCELED"


def test_the_size_limit_holds_the_jsonrpc_request_and_a_refusal_writes_nothing(now, settings):
    card_apply(frame(), now=now)
    # What goes on the wire is the JSON-RPC request (2,261 bytes here), not the native
    # envelope (about 150 bytes more): the limit is judged on it.
    settings.REACH_MAX_MESSAGE_BYTES = 2300
    row = message_send(request=SendRequest(to=AGENT, payload={"text": "x" * 1900}), now=now)
    assert row.status == "SENT" and len(profile_encode(row)) <= 2300
    settings.REACH_MAX_MESSAGE_BYTES = 2048
    with pytest.raises(SendRefused) as refused:
        message_send(request=SendRequest(to=AGENT, payload={"text": "x" * 1900},
                                         task_id="t-big"), now=now)
    assert refused.value.code == "payload_too_large"
    assert refused.value.detail.startswith("the JSON-RPC request is ")
    assert not Message.objects.filter(task_id="t-big").exists()


def test_the_api_sends_to_a_profile_id_and_a_bound_token_keeps_to_its_org(now, api,
                                                                           settings):
    acme = "test-token-acme-dddddddddddd"
    settings.REACH_SERVICE_TOKENS = tokens_parse([TOKEN, f"{acme}@acme"])
    card_apply(frame(), now=now)
    card_apply(frame(card(name="Other"), topic="$a2a/v1/discovery/other/ops/echo"), now=now)
    r = api.post("/api/a2a/send", {"to": AGENT, "payload": {"text": "hi"}})
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == "SENT" and body["messageId"].startswith("a2a-")
    assert Agent.objects.get(agent_id="other/ops/echo").namespace.name == "other"
    bound = ApiClient(token=acme)
    assert bound.post("/api/a2a/send", {"to": AGENT}).status_code == 202
    r = bound.post("/api/a2a/send", {"to": "other/ops/echo"})
    assert r.status_code == 403, r.content
    assert Message.objects.filter(to_agent_id="other/ops/echo").count() == 0


def named(frame_: ProfileFrame, responder: str) -> ProfileFrame:
    return ProfileFrame(frame_.topic, frame_.payload, user=(("a2a-responder-agent-id",
                                                             responder),),
                        correlation=frame_.correlation)


def test_a_pool_send_then_its_follow_ups_go_to_the_member_that_answered(now):
    pool = "acme/ops/pool/sum"
    row = published(message_send(request=SendRequest(to=pool, payload={"text": "add"},
                                                     task_id="t-pool"), now=now), now)
    # No roster entry for a pool: its shared topic, the broker picks the member.
    assert (row.status, row.to_agent_id, row.topic) == ("PUBLISHED", pool,
                                                        "$a2a/v1/request/acme/ops/pool/sum")
    assert row.headers["pool"] == pool and row.resolution["level"] == "pool"
    # The member answers naming itself, with a task id of its own making.
    waiting = {"statusUpdate": {"taskId": "srv-9", "status": {
        "state": "TASK_STATE_INPUT_REQUIRED"}}}
    profile_traffic_ingest([named(reply(row, waiting), "worker-1")], now=now)
    row.refresh_from_db()
    assert row.status == "ACKED"
    # The task's next send goes to that member's own request topic, not the pool's.
    follow = message_send(request=SendRequest(to=pool, payload={"text": "and 2"},
                                              task_id="t-pool"), now=now)
    assert (follow.to_agent_id, follow.topic) == ("acme/ops/worker-1",
                                                  "$a2a/v1/request/acme/ops/worker-1")
    assert follow.resolution["target"] == pool
    assert follow.resolution["candidates"][0]["why"].startswith(
        "answered task t-pool for acme/ops/pool/sum (a2a-responder-agent-id)")
    # ... and so does its CancelTask.
    task_cancel(task_id="t-pool", by="olga", now=now)
    told = Message.objects.get(task_id="t-pool", message_type="CANCEL")
    assert told.topic == "$a2a/v1/request/acme/ops/worker-1"


def test_a_pooled_reply_that_does_not_name_its_member_is_flagged(now):
    row = published(message_send(request=SendRequest(to="acme/ops/pool/sum", task_id="t-anon"),
                                 now=now), now)
    counts = profile_traffic_ingest([reply(row, state("t-anon", "TASK_STATE_COMPLETED"))],
                                    now=now)
    assert counts["profile_violations:pooled_reply_without_responder"] == 1
    answer = Message.objects.get(in_reply_to=row.message_id)
    assert answer.headers["violations"] == ["pooled_reply_without_responder"]


def test_an_artifact_before_any_status_acknowledges_the_request(now):
    row = published(sent(now), now)
    artifact = {"artifactUpdate": {"taskId": "t-p", "artifact": {"artifactId": "a0",
                                                                 "parts": [{"text": "…"}]}}}
    profile_traffic_ingest([reply(row, artifact)], now=now)
    row.refresh_from_db()
    assert row.status == "ACKED" and row.ack_deadline_at is None


def test_a_late_answer_to_a_retried_attempt_moves_the_attempt_under_way(now, settings):
    """The profile's requester holds every Correlation Data of its task valid: a responder
    that took the first attempt late answers it, and the task's current attempt is moved."""
    settings.REACH_A2A_JITTER = 0.0
    first = published(sent(now), now)
    bus_heard(since=now - timedelta(minutes=1), until=now + timedelta(minutes=5))
    moment = now + timedelta(milliseconds=15001)
    deliveries_sweep(now=moment)
    deliveries_sweep(now=moment + timedelta(seconds=1))
    second = published(Message.objects.get(task_id="t-p", attempt=2), moment)
    profile_traffic_ingest([reply(first, state("t-p", "TASK_STATE_WORKING")),
                            reply(first, state("t-p", "TASK_STATE_COMPLETED"))], now=moment)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, second.status) == ("RETRIED", "COMPLETED")
    # On the trace, the answers are the attempt's they moved.
    assert Message.objects.filter(in_reply_to=second.message_id).count() == 2
    assert profile_response(second)["result"]["task"]["status"] == {
        "state": "TASK_STATE_COMPLETED"}


def test_the_trace_says_the_dialect_and_how_the_replies_find_the_request(now):
    from tests.conftest import logged_in, reader

    row = published(sent(now), now)
    page = logged_in(reader("tess", password="pw-tess-1234567")).get(
        f"/messages/{row.message_id}/").content.decode()
    assert 'data-dialect="a2a-mqtt">A2A over MQTT · <code>SendMessage</code>' in page
    assert f"replies to <code>{CONSOLE_REPLY}</code>" in page
    assert f"Correlation Data <code>{row.headers['correlationData']}</code>" in page


def pool_send(now, task: str) -> Message:
    return published(message_send(request=SendRequest(to="acme/ops/pool/sum", task_id=task,
                                                       payload={"text": task}), now=now), now)


def test_a_bulk_resend_sends_each_pool_task_to_its_own_member(now):
    from messages.outbound import messages_resend

    rows = {task: pool_send(now, task) for task in ("t-a", "t-b")}
    for (task, row), member in zip(rows.items(), ("worker-1", "worker-2"), strict=True):
        profile_traffic_ingest([named(reply(row, state(task, "TASK_STATE_FAILED")), member)],
                               now=now)
    again = messages_resend(message_ids=[r.message_id for r in rows.values()], by="olga",
                            now=now)
    assert {r.task_id: r.to_agent_id for r in again} == {"t-a": "acme/ops/worker-1",
                                                         "t-b": "acme/ops/worker-2"}


def test_a_member_naming_an_agent_outside_the_pools_unit_is_not_followed(now):
    row = pool_send(now, "t-out")
    waiting = {"statusUpdate": {"taskId": "t-out", "status": {
        "state": "TASK_STATE_INPUT_REQUIRED"}}}
    profile_traffic_ingest([named(reply(row, waiting), "other/unit/agent")], now=now)
    follow = message_send(request=SendRequest(to="acme/ops/pool/sum", task_id="t-out"),
                          now=now)
    assert follow.to_agent_id == "acme/ops/pool/sum"


def test_cancel_tells_a_pools_member_once(now):
    row = pool_send(now, "t-c")
    waiting = {"statusUpdate": {"taskId": "t-c", "status": {
        "state": "TASK_STATE_INPUT_REQUIRED"}}}
    profile_traffic_ingest([named(reply(row, waiting), "worker-1")], now=now)
    pool_send(now, "t-c")  # the follow-up, to worker-1, on the bus too
    done = task_cancel(task_id="t-c", by="olga", now=now)
    assert done.told == ["acme/ops/worker-1"]
    assert Message.objects.filter(task_id="t-c", message_type="CANCEL").count() == 1


def test_nothing_goes_to_a_pool_while_the_console_does_not_speak_the_profile(now, settings):
    settings.REACH_A2A_PROFILE = False
    row = message_send(request=SendRequest(to="acme/ops/pool/sum", task_id="t-off"), now=now)
    assert row.status == "UNDELIVERABLE" and "REACH_A2A_PROFILE=0" in row.error


def test_the_storm_guard_and_the_audit_hold_for_profile_sends(now, settings):
    from reachconsole.core.audit import AuditEntry

    settings.REACH_TASK_MAX_SENDS = 2
    for _ in range(2):
        sent(now, task_id="t-storm")
    with pytest.raises(SendRefused) as refused:
        sent(now, task_id="t-storm")
    assert refused.value.code == "retry_storm"
    assert "task t-storm was already transmitted 2 times to acme/ops/echo" in (
        refused.value.detail)
    task_cancel(task_id="t-storm", by="olga", reason="storm", now=now)
    assert AuditEntry.objects.filter(action="cancel", target="t-storm", actor="olga").exists()
