"""The A2A-over-MQTT profile's traffic as rows and tasks (messages/profile_traffic.py): a
request and the replies its Correlation Data names, the state machine they drive, and the
profile's rules checked live. The same through the bridge, with the SDK's own agents and
with bare `mosquitto_pub` frames, is in tests/test_profile_sdk.py."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest

from messages.models import Message, Task
from messages.profile_traffic import ProfileFrame, profile_traffic_ingest, request_key
from messages.sweeps import deliveries_sweep
from tests.conftest import bus_heard

pytestmark = pytest.mark.django_db
ROOT = "$a2a/v1"
REPLY = f"{ROOT}/reply/acme/ops/asker/s1"


def request(task: str, *, correlation: bytes = b"c-1", agent: str = "echo",
            method: str = "SendMessage", **frame) -> ProfileFrame:
    body = {"jsonrpc": "2.0", "id": "req-1", "method": method,
            "params": {"message": {"messageId": uuid.uuid4().hex, "role": "ROLE_USER",
                                   "parts": [{"text": "hi"}], "taskId": task,
                                   "contextId": "ctx-1"}}}
    return ProfileFrame(f"{ROOT}/request/acme/ops/{agent}", json.dumps(body).encode(),
                        **{"response_topic": REPLY, "correlation": correlation, **frame})


def status(task: str, state: str, *, correlation: bytes = b"c-1", **frame) -> ProfileFrame:
    body = {"jsonrpc": "2.0", "id": "req-1", "result": {"statusUpdate": {
        "taskId": task, "status": {"state": state}}}}
    return ProfileFrame(REPLY, json.dumps(body).encode(), correlation=correlation, **frame)


def error(code: int, kind: str = "", *, correlation: bytes = b"c-1") -> ProfileFrame:
    body = {"jsonrpc": "2.0", "id": "req-1", "error": {
        "code": code, "message": "no", **({"data": {"a2a_error": kind}} if kind else {})}}
    return ProfileFrame(REPLY, json.dumps(body).encode(), correlation=correlation)


def the_request(task: str) -> Message:
    return Message.objects.get(task_id=task, message_type="TASK_REQUEST", in_reply_to="")


def test_a_request_acknowledged_streamed_and_completed(now):
    task = str(uuid.uuid4())
    counts = profile_traffic_ingest([request(task)], now=now)
    assert counts["stored"] == 1
    row = the_request(task)
    assert row.message_id == request_key(REPLY, b"c-1")
    assert (row.direction, row.status) == ("OBSERVED", "OBSERVED")
    assert (row.from_agent_id, row.to_agent_id, row.conversation_id) == (
        "acme/ops/asker", "acme/ops/echo", "ctx-1")
    assert row.payload is None  # observed traffic keeps no payload
    assert row.deadline_at == now + timedelta(milliseconds=15000)
    profile_traffic_ingest([status(task, "TASK_STATE_SUBMITTED")], now=now)
    row.refresh_from_db()
    assert row.status == "ACKED" and row.deadline_at == now + timedelta(seconds=30)
    later = now + timedelta(seconds=20)
    profile_traffic_ingest([status(task, "TASK_STATE_WORKING")], now=later)
    row.refresh_from_db()
    assert row.deadline_at == later + timedelta(seconds=30)  # the stream went on
    artifact = ProfileFrame(REPLY, json.dumps({"jsonrpc": "2.0", "id": "req-1", "result": {
        "artifactUpdate": {"taskId": task, "artifact": {"artifactId": "a1", "parts": [
            {"text": "done"}]}}}}).encode(), correlation=b"c-1")
    profile_traffic_ingest([artifact, status(task, "TASK_STATE_COMPLETED")], now=later)
    row.refresh_from_db()
    assert row.status == "COMPLETED"
    kinds = list(Message.objects.filter(in_reply_to=row.message_id).order_by("id")
                 .values_list("message_type", flat=True))
    assert kinds == ["ACK", "ACK", "EVENT", "TASK_RESPONSE"]
    assert Task.objects.get(task_id=task).status == "COMPLETED"
    # The same frames again (QoS 1 redelivery, a second bridge): one row each, no change.
    again = profile_traffic_ingest([request(task), status(task, "TASK_STATE_COMPLETED")],
                                   now=later)
    assert again["stored"] == 0
    assert Message.objects.filter(task_id=task).count() == 5


@pytest.mark.parametrize(("reply", "outcome", "words"), [
    (lambda t: status(t, "TASK_STATE_FAILED"), "TASK_ERROR", "the responder said "
                                                              "TASK_STATE_FAILED"),
    (lambda t: error(-32004, "responder_unavailable"), "BUSY", "JSON-RPC error -32004: no"),
    (lambda t: error(-32003, "request_expired"), "EXPIRED", "JSON-RPC error -32003: no"),
    # -32004 without the profile's a2a_error is core A2A's UnsupportedOperation.
    (lambda t: error(-32004), "TASK_ERROR", "JSON-RPC error -32004: no"),
])
def test_failures_end_the_request_with_words(now, reply, outcome, words):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task)], now=now)
    profile_traffic_ingest([reply(task)], now=now)
    row = the_request(task)
    assert (row.status, row.error) == (outcome, words)


def test_a_request_nobody_answers_expires(now):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task)], now=now)
    # Silence is judged only over time the console heard the bus (roster/hearing.py).
    bus_heard(since=now - timedelta(minutes=1), until=now + timedelta(seconds=17))
    deliveries_sweep(now=now + timedelta(seconds=16))
    row = the_request(task)
    assert (row.status, row.error) == ("EXPIRED", "no answer seen on the bus within 15000 ms")


def test_what_breaks_the_profile_is_flagged_and_counted(now):
    task, other = str(uuid.uuid4()), str(uuid.uuid4())
    counts = profile_traffic_ingest([
        request(task, response_topic="", correlation=b"", agent="a1"),
        request(task, correlation=b"", agent="a2", retain=True),
        request(other, correlation=b"c-9", agent="a3",
                user=(("a2a-authorization", "Bearer s3cret"),)),
    ], now=now)
    assert counts["profile_violations:no_response_topic"] == 1
    assert counts["profile_violations:no_correlation_data"] == 2
    assert counts["profile_violations:retained_request"] == 1
    flagged = {m.to_agent_id: m.headers.get("violations", []) for m in
               Message.objects.filter(task_id__in=[task, other])}
    assert flagged == {"acme/ops/a1": ["no_response_topic", "no_correlation_data"],
                       "acme/ops/a2": ["no_correlation_data", "retained_request"],
                       "acme/ops/a3": []}
    # The token is never kept, only that there was one.
    stored = Message.objects.get(to_agent_id="acme/ops/a3")
    assert stored.headers["bearer"] is True and "s3cret" not in json.dumps(stored.headers)
    # No reply path: nothing to wait for, so no deadline.
    assert Message.objects.get(to_agent_id="acme/ops/a1").deadline_at is None
    # Echoing the token back is the responder's fault.
    counts = profile_traffic_ingest([status(other, "TASK_STATE_COMPLETED", correlation=b"c-9",
                                            user=(("a2a-authorization", "Bearer s3cret"),))],
                                    now=now)
    assert counts["profile_violations:token_echoed"] == 1
    # The same Correlation Data on the same reply topic for another task.
    third = str(uuid.uuid4())
    counts = profile_traffic_ingest([request(third, correlation=b"c-9", agent="a4")], now=now)
    assert counts["profile_violations:correlation_reused"] == 1
    reused = Message.objects.get(task_id=third)
    assert reused.message_id != request_key(REPLY, b"c-9")
    assert reused.headers["violations"] == ["correlation_reused"]


def test_a_pool_request_and_who_answered_it(now):
    task = str(uuid.uuid4())
    pool = request(task, correlation=b"p-1")
    pool = ProfileFrame(f"{ROOT}/request/acme/ops/pool/summarizers", pool.payload,
                        response_topic=REPLY, correlation=b"p-1")
    profile_traffic_ingest([pool], now=now)
    row = the_request(task)
    assert row.to_agent_id == "acme/ops/pool/summarizers"
    assert row.headers["pool"] == "acme/ops/pool/summarizers"
    # A pooled reply must name the member that took it.
    counts = profile_traffic_ingest([status(task, "TASK_STATE_SUBMITTED", correlation=b"p-1")],
                                    now=now)
    assert counts["profile_violations:pooled_reply_without_responder"] == 1
    named = status(task, "TASK_STATE_COMPLETED", correlation=b"p-1",
                   user=(("a2a-responder-agent-id", "summarizer-2"),))
    counts = profile_traffic_ingest([named], now=now)
    assert not any(k.startswith("profile_violations") for k in counts)
    row.refresh_from_db()
    assert row.status == "COMPLETED"
    answer = Message.objects.get(in_reply_to=row.message_id, message_type="TASK_RESPONSE")
    assert answer.headers["responder"] == "summarizer-2"
    assert answer.from_agent_id == "summarizer-2"


def test_a_reply_that_names_no_request_changes_nothing(now):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task)], now=now)
    counts = profile_traffic_ingest([status(task, "TASK_STATE_COMPLETED",
                                            correlation=b"someone-else")], now=now)
    # Stored, counted as an answer that moved nothing, and the request untouched.
    assert counts["stored"] == 1 and counts["stale_answers"] == 1
    assert the_request(task).status == "OBSERVED"


def test_a_payload_that_is_not_json_is_counted_and_skipped(now):
    counts = profile_traffic_ingest([ProfileFrame(f"{ROOT}/request/acme/ops/echo", b"{oops",
                                                  response_topic=REPLY, correlation=b"x")],
                                    now=now)
    assert counts["rejected:profile_not_json"] == 1 and not Message.objects.exists()


def test_the_trace_and_the_task_list_show_a_profile_task(now):
    from tests.conftest import logged_in, reader

    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task)], now=now)
    profile_traffic_ingest([status(task, "TASK_STATE_SUBMITTED"),
                            status(task, "TASK_STATE_COMPLETED")], now=now)
    row = the_request(task)
    viewer = logged_in(reader("victor", password="pw-victor-123"))
    trace = viewer.get(f"/messages/{row.message_id}/")
    assert trace.status_code == 200
    html = trace.content.decode()
    assert "COMPLETED" in html and "acme/ops/echo" in html
    tasks = viewer.get("/tasks/", {"task": task})
    assert tasks.status_code == 200 and task in tasks.content.decode()
