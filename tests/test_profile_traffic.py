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



def test_correlation_data_used_again(now):
    first, second, third = (str(uuid.uuid4()) for _ in range(3))
    profile_traffic_ingest([request(first, correlation=b"c-9")], now=now)
    # Another task with the same Correlation Data on the same reply topic while the first
    # is open: its replies cannot be told apart. Flagged, and a key of its own.
    counts = profile_traffic_ingest([request(second, correlation=b"c-9")], now=now)
    assert counts["profile_violations:correlation_reused"] == 1
    reused = Message.objects.get(task_id=second)
    assert reused.message_id != request_key(REPLY, b"c-9")
    assert reused.headers["violations"] == ["correlation_reused"]
    # Once the first has ended, using it again is allowed: not flagged, and the replies
    # that name the new task find it.
    profile_traffic_ingest([status(first, "TASK_STATE_COMPLETED", correlation=b"c-9")],
                           now=now)
    counts = profile_traffic_ingest([request(third, correlation=b"c-9")], now=now)
    assert not counts["profile_violations:correlation_reused"]
    profile_traffic_ingest([status(third, "TASK_STATE_COMPLETED", correlation=b"c-9")],
                           now=now)
    assert the_request(third).status == "COMPLETED"
    assert the_request(first).status == "COMPLETED"


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
    assert counts["stored"] == 1 and the_request(task).status == "OBSERVED"
    # Nor does a reply to what is no task request (a GetTask).
    other = str(uuid.uuid4())
    profile_traffic_ingest([request(other, correlation=b"g-1", method="GetTask")], now=now)
    profile_traffic_ingest([status(other, "TASK_STATE_COMPLETED", correlation=b"g-1")],
                           now=now)
    assert Message.objects.get(task_id=other, in_reply_to="").status == "OBSERVED"


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
    from django.urls import reverse

    tasks = viewer.get("/tasks/", {"task": task})
    # The task's row links its trace (the filter's own echo of the id would not tell).
    html = tasks.content.decode()
    assert tasks.status_code == 200 and f'href="{reverse("tasks:detail", args=[task])}"' in html
    # ... which is its request's trace.
    assert viewer.get(reverse("tasks:detail", args=[task]))["Location"] == (
        f"/messages/{row.message_id}/")



@pytest.mark.parametrize(("replies", "outcome", "error"), [
    # The SDK replays CANCELED to a retry of a canceled task, with nothing before it.
    (["TASK_STATE_CANCELED"], "CANCELED", "canceled by the responder"),
    (["TASK_STATE_SUBMITTED", "TASK_STATE_REJECTED"], "TASK_ERROR",
     "the responder said TASK_STATE_REJECTED"),
    # These end the request's stream (no deadline); the task goes on with another request.
    (["TASK_STATE_INPUT_REQUIRED"], "ACKED", ""),
    (["TASK_STATE_AUTH_REQUIRED"], "ACKED", ""),
])
def test_the_states_of_a_reply(now, replies, outcome, error):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task)], now=now)
    profile_traffic_ingest([status(task, state) for state in replies], now=now)
    row = the_request(task)
    assert (row.status, row.error) == (outcome, error)
    if outcome == "ACKED":
        assert row.deadline_at is None


def test_a_task_or_a_message_answered_whole(now):
    working, done = str(uuid.uuid4()), str(uuid.uuid4())
    profile_traffic_ingest([request(working, correlation=b"w"), request(done, correlation=b"d")],
                           now=now)
    whole = {"jsonrpc": "2.0", "id": "req-1", "result": {"task": {
        "id": working, "status": {"state": "TASK_STATE_WORKING"}}}}
    message = {"jsonrpc": "2.0", "id": "req-1", "result": {"message": {
        "messageId": "m", "role": "ROLE_AGENT", "parts": [{"text": "done"}]}}}
    profile_traffic_ingest([ProfileFrame(REPLY, json.dumps(whole).encode(), correlation=b"w"),
                            ProfileFrame(REPLY, json.dumps(message).encode(),
                                         correlation=b"d")], now=now)
    # A task answered whole while WORKING: that request has its answer; nothing follows.
    assert (the_request(working).status, the_request(working).deadline_at) == ("ACKED", None)
    assert the_request(done).status == "COMPLETED"


def test_a_reply_heard_before_its_request_moves_it_once_the_request_is_stored(now):
    task = str(uuid.uuid4())
    profile_traffic_ingest([status(task, "TASK_STATE_SUBMITTED"),
                            status(task, "TASK_STATE_COMPLETED")], now=now)
    profile_traffic_ingest([request(task)], now=now)
    row = the_request(task)
    assert row.status == "COMPLETED"
    assert Task.objects.get(task_id=task).status == "COMPLETED"
    # And in one batch, the reply first.
    other = str(uuid.uuid4())
    profile_traffic_ingest([status(other, "TASK_STATE_COMPLETED", correlation=b"o"),
                            request(other, correlation=b"o")], now=now)
    assert the_request(other).status == "COMPLETED"


def test_an_identical_stream_item_heard_again_still_moves_the_deadline_on(now):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task), status(task, "TASK_STATE_WORKING")], now=now)
    later = now + timedelta(seconds=25)
    counts = profile_traffic_ingest([status(task, "TASK_STATE_WORKING")], now=later)
    assert counts["stored"] == 0  # the same frame: one row
    assert the_request(task).deadline_at == later + timedelta(seconds=30)


def test_an_acknowledged_request_whose_stream_went_silent_expires_in_words(now):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task), status(task, "TASK_STATE_WORKING")], now=now)
    bus_heard(since=now - timedelta(minutes=1), until=now + timedelta(seconds=32))
    deliveries_sweep(now=now + timedelta(seconds=31))
    row = the_request(task)
    assert (row.status, row.error) == ("EXPIRED", "acknowledged on the bus, then nothing for "
                                                  "30000 ms (the profile's stream idle timeout)")


def test_attempts_of_one_task_are_numbered(now):
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task, correlation=b"a1")], now=now)
    profile_traffic_ingest([request(task, correlation=b"a2"), request(task, correlation=b"a3")],
                           now=now)
    attempts = [(m.attempt, m.headers["correlationData"])
                for m in Message.objects.filter(task_id=task).order_by("attempt")]
    assert attempts == [(1, b"a1".hex()), (2, b"a2".hex()), (3, b"a3".hex())]


def test_frames_the_console_cannot_read_are_counted_and_skipped(now, settings):
    settings.REACH_MAX_MESSAGE_BYTES = 8192
    task = str(uuid.uuid4())
    big = request(task)
    big = ProfileFrame(big.topic, big.payload + b" " * 10_000, response_topic=REPLY,
                       correlation=b"c-1")
    nan = ProfileFrame(REPLY, b'{"jsonrpc": "2.0", "id": NaN, "result": {}}', correlation=b"x")
    odd = ProfileFrame(REPLY, json.dumps({"jsonrpc": "2.0", "id": {"a": "b" * 5000},
                                          "result": {"artifactUpdate": {"artifact": "oops"}},
                                          "error": "not an object"}).encode(),
                       correlation=b"c-1")
    counts = profile_traffic_ingest([big, nan, odd], now=now)
    assert counts["rejected:profile_too_large"] == 1
    assert counts["rejected:profile_not_json"] == 1
    # A shape it cannot read is stored as what it is, with nothing of it kept at length.
    stored = Message.objects.get()
    assert stored.message_type == "EVENT" and stored.headers["jsonrpcId"] is None
    assert len(json.dumps(stored.headers)) < 600


@pytest.mark.parametrize(("profile", "monitor", "held", "unheld"), [
    (True, True, ["discovery", "request", "reply", "event"], []),
    # Monitor mode off: the traffic is not observed, and an earlier run's filters go; the
    # replies to the console's own requests are still heard (their topic only).
    (True, False, ["discovery", "reply"], ["request", "reply", "event"]),
    (False, True, [], ["discovery", "request", "reply", "event"]),
])
@pytest.mark.parametrize("setting", ["shared", "single"])
def test_what_a_bridge_subscribes_of_the_profile_and_what_it_lets_go(
        profile, monitor, held, unheld, setting):
    from messages.subscriptions import IngestPlan

    plan = IngestPlan(prefix="p", node_id="console", monitor=monitor, share_group="g",
                      probe_topic="p/console/x/probe", setting=setting, v5=True, caps={},
                      profile_root=ROOT, profile=profile)
    plan.decide(lock_held=True)

    def trees(filters) -> list[str]:
        return [f.split("/")[2] for f in filters if f.startswith(f"{ROOT}/")]

    subscribed = plan.profile_subscriptions()
    assert trees(t for t, _ in subscribed) == held
    # Plain, never `$share/`: Mosquitto 2.0 delivers nothing through a shared `$` filter.
    assert not any(t.startswith("$share/") and "$a2a" in t for t, _ in plan.subscriptions())
    # A retained request keeps its flag (Retain As Published).
    assert all(o.retainAsPublished for t, o in subscribed if "/request/" in t)
    assert sorted(trees(plan.stale_filters())) == sorted(unheld)
    if profile and not monitor:
        assert [t for t, _ in subscribed if "/reply/" in t] == [
            f"{ROOT}/reply/reachconsole/ops/console/replies"]


def test_the_lists_and_the_api_tell_the_dialects_apart_by_node_and_dialect(now, api):
    """Every row of the profile is on the node `a2a-mqtt` (its agents' node on the roster):
    the lists show it in their node column with a badge, and `node=a2a-mqtt` or
    `dialect=a2a-mqtt` keeps only them; `dialect=native` the others."""
    from messages.outbound import SendRequest, message_send
    from tests.conftest import logged_in, reader, register

    register("fin.tax", "node-a", now=now)
    native = message_send(request=SendRequest(to="fin.tax", payload={"n": 1},
                                              task_id="t-native"))
    task = str(uuid.uuid4())
    profile_traffic_ingest([request(task)], now=now)
    observed = the_request(task)
    viewer = logged_in(reader("victor", password="pw-victor-123"))
    # The timeline by message, the task list by task.
    for path, ours, theirs in (("/messages/", native.message_id, observed.message_id),
                               ("/tasks/", "t-native", task)):
        both = viewer.get(path).content.decode()
        assert ours in both and theirs in both
        for query in ({"node": "a2a-mqtt"}, {"dialect": "a2a-mqtt"}):
            profile = viewer.get(path, query).content.decode()
            assert theirs in profile and ours not in profile
            assert 'data-dialect="a2a-mqtt"' in profile
        plain = viewer.get(path, {"dialect": "native"}).content.decode()
        assert ours in plain and theirs not in plain
        assert 'data-dialect="a2a-mqtt"' not in plain.split("<tbody", 1)[-1]
    assert [t["taskId"] for t in api.get("/api/a2a/tasks", {"dialect": "a2a-mqtt"}).json()] == [
        task]
    assert [t["taskId"] for t in api.get("/api/a2a/tasks", {"dialect": "native"}).json()] == [
        "t-native"]
    wrong = api.get("/api/a2a/tasks", {"dialect": "mqtt"})
    assert wrong.status_code == 422, wrong.content
    page = viewer.get("/messages/", {"dialect": "mqtt"})
    assert page.status_code == 400
    assert "the dialects are native, a2a-mqtt" in page.content.decode()
