"""Tasks as the unit an operator acts on (PROTOCOL.md, "Tasks, numbers and alarms"): the
task list and one task's story over the API, observed traffic's outcomes, and cancel."""

from __future__ import annotations

from datetime import timedelta

import pytest

from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.models import Change, Direction, Message, Status, Task, Transition
from messages.outbound import SendRequest, message_send, messages_send_group
from messages.state import changes_apply
from messages.sweeps import deliveries_sweep
from reachconsole.core.models import AuditEntry
from roster.models import Agent
from tests.conftest import FIN_TOKEN, ApiClient, acked, published, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
PREFIX = "ooder"


def ingest(*items: tuple[str, protocol.Envelope], now=None):
    return messages_ingest(batch=[Incoming(t, protocol.encode(e)) for t, e in items],
                           node_id="console", prefix=PREFIX, now=now)


def answer(kind: MT, for_id: str, *, origin: str = "node-b", to_node: str = "console",
           payload=None) -> tuple[str, protocol.Envelope]:
    header = "inReplyTo" if kind == MT.TASK_RESPONSE else "ackFor"
    env = protocol.new_envelope(
        message_type=kind, from_agent_id="fin.tax", to_agent_id="console",
        headers={header: for_id, "replyNodeId": origin, "originNodeId": origin},
        payload={"ok": True, "result": 1} if payload is None else payload)
    return protocol.inbox_topic(PREFIX, to_node), env


def test_it_lists_one_entry_per_task_with_its_attempts_outcome_and_answerer(api, now):
    register("fin.tax", "node-b")
    first = message_send(request=SendRequest(to="fin.tax", task_id="t-1", payload={"q": 1}))
    published(first, now)
    ingest(answer(MT.ACK, first.message_id))
    ingest(answer(MT.TASK_RESPONSE, first.message_id))
    message_send(request=SendRequest(to="fin.tax", task_id="t-2"))

    response = api.get("/api/a2a/tasks")

    assert response.status_code == 200
    tasks = response.json()
    assert [t["taskId"] for t in tasks] == ["t-2", "t-1"]  # newest first
    done = tasks[1]
    assert (done["status"], done["attempts"], done["answeredBy"], done["direction"]) == (
        "COMPLETED", 1, "node-b", "SEND")
    assert done["toAgentId"] == "fin.tax" and done["targetNodeId"] == "node-b"
    assert done["lastMessageId"] == first.message_id and done["durationMs"] >= 0
    assert set(done) >= {"taskId", "status", "toAgentId", "fromAgentId", "targetNodeId",
                         "direction", "attempts", "firstSentAt", "finishedAt", "durationMs",
                         "answeredBy", "error", "lastMessageId"}
    assert tasks[0]["status"] == "SENT" and tasks[0]["finishedAt"] is None


def test_a_task_with_three_attempts_is_one_entry(api, now):
    register("fin.tax", "node-b")
    row = message_send(request=SendRequest(to="fin.tax", task_id="t-r", timeout_ms=600_000))
    for _ in range(2):  # no ACK in time, twice: two more attempts
        published(row, now)
        Message.objects.filter(pk=row.pk).update(ack_deadline_at=now - timedelta(seconds=1))
        deliveries_sweep(now=now + timedelta(seconds=5))
        deliveries_sweep(now=now + timedelta(seconds=10))
        row = Message.objects.filter(task_id="t-r").order_by("-id").first()

    (task,) = api.get("/api/a2a/tasks", {"q": "t-r"}).json()
    assert task["attempts"] == 3 and task["lastMessageId"] == row.message_id
    assert task["status"] == row.status == Status.SENT
    detail = api.get("/api/a2a/tasks/t-r").json()
    requests = [m for m in detail["messages"] if m["messageType"] == "TASK_REQUEST"]
    assert [m["attempt"] for m in requests] == [1, 2, 3]
    assert [m["status"] for m in requests] == ["RETRIED", "RETRIED", "SENT"]


def test_a_group_send_is_a_task_per_member(api):
    register("fin.tax", "node-b", groups=["#accounting"])
    register("fin.vat", "node-c", groups=["#accounting"])
    messages_send_group(group="#accounting", request=SendRequest(to="#accounting",
                                                                 task_id="t-g"))
    tasks = api.get("/api/a2a/tasks", {"q": "t-g"}).json()
    assert sorted((t["member"], t["targetNodeId"]) for t in tasks) == [
        ("fin.tax", "node-b"), ("fin.vat", "node-c")]
    detail = api.get("/api/a2a/tasks/t-g").json()
    assert detail["member"] == "fin.tax" and [o["member"] for o in detail["others"]] == [
        "fin.vat"]


def test_the_filters_and_paging_of_the_list(api, now):
    register("fin.tax", "node-b")
    register("llm.chat", "node-c")
    for i in range(5):
        message_send(request=SendRequest(to="fin.tax", task_id=f"t-a{i}"))
    Agent.objects.filter(agent_id="llm.chat").delete()
    message_send(request=SendRequest(to="llm.chat", task_id="t-lost"))  # UNDELIVERABLE

    page = api.get("/api/a2a/tasks", {"limit": 2, "agent": "fin.tax"})
    assert [t["taskId"] for t in page.json()] == ["t-a4", "t-a3"]
    assert 'rel="next"' in page["Link"]
    cursor = page.json()[-1]["cursor"]
    second = api.get("/api/a2a/tasks", {"limit": 2, "agent": "fin.tax", "before": cursor})
    assert [t["taskId"] for t in second.json()] == ["t-a2", "t-a1"]
    failed = api.get("/api/a2a/tasks", {"status": ["UNDELIVERABLE", "EXPIRED"]}).json()
    assert [t["taskId"] for t in failed] == ["t-lost"]
    assert "no agent llm.chat is on the roster" in failed[0]["error"]
    assert api.get("/api/a2a/tasks", {"node": "node-b", "limit": 500}).json()[0]["taskId"] == "t-a4"
    assert api.get("/api/a2a/tasks", {"namespace": "llm"}).json()[0]["taskId"] == "t-lost"
    assert api.get("/api/a2a/tasks", {"direction": "OBSERVED"}).json() == []
    assert len(api.get("/api/a2a/tasks", {"since": "60"}).json()) == 6


@pytest.mark.parametrize(("params", "words"), [
    ({"status": "SOMETIMES"}, "status.0: Input should be 'SENT', 'PUBLISHED'"),
    ({"direction": "UP"}, "direction: Input should be 'SEND', 'RECV' or 'OBSERVED'"),
    ({"since": "yesterday"}, "'yesterday' is neither minutes back (60), hours or days back"),
    ({"until": "99999999"}, "'99999999' is neither minutes back"),  # out of the calendar
])
def test_a_bad_filter_is_a_422_with_words(api, params, words):
    response = api.get("/api/a2a/tasks", params)
    assert response.status_code == 422
    assert response.json()["error"] == "invalid_request" and words in response.json()["detail"]


def test_a_date_time_the_filters_read_is_taken_on_any_day(api):
    message_send(request=SendRequest(to="fin.nobody", task_id="t-day"))
    assert api.get("/api/a2a/tasks", {"since": "2026-01-31T14:00"}).status_code == 200
    assert api.get("/api/a2a/tasks", {"since": "2026-02-30T14:00"}).status_code == 422


def test_a_window_that_ends_before_it_starts_holds_nothing(api):
    message_send(request=SendRequest(to="fin.nobody", task_id="t-any"))
    assert api.get("/api/a2a/tasks", {"since": "5", "until": "10"}).json() == []
    assert len(api.get("/api/a2a/tasks", {"since": "10", "until": "0"}).json()) == 1


def test_bad_paging_and_unknown_tasks_are_4xx(api):
    assert api.get("/api/a2a/tasks", {"limit": 501}).status_code == 422
    assert api.get("/api/a2a/tasks", {"before": "x"}).status_code == 422
    response = api.get("/api/a2a/tasks/t-nothing")
    assert response.status_code == 404
    assert response.json() == {"error": "task_not_found",
                               "detail": "no task t-nothing is recorded"}


def test_a_token_bound_to_namespaces_sees_its_own_tasks_only():
    register("fin.tax", "node-b")
    register("ops.audit", "node-b")
    message_send(request=SendRequest(to="fin.tax", task_id="t-fin"))
    message_send(request=SendRequest(to="ops.audit", task_id="t-ops"))
    bound = ApiClient(FIN_TOKEN)
    assert [t["taskId"] for t in bound.get("/api/a2a/tasks").json()] == ["t-fin"]
    assert bound.get("/api/a2a/tasks/t-ops").status_code == 404
    # Another namespace's task does not exist for it, open or final alike.
    refused = bound.post("/api/a2a/tasks/t-ops/cancel", {})
    assert (refused.status_code, refused.json()["error"]) == (404, "task_not_found")
    assert Message.objects.get(task_id="t-ops").status == Status.SENT


# --- observed traffic gets outcomes ---------------------------------------------------------
def observed_request(task_id: str, *, to_node: str = "node-d", timeout_ms: int = 2000):
    env = protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="ops.main", to_agent_id="fin.tax",
        task_id=task_id, headers={"replyNodeId": "node-c", "originNodeId": "node-c",
                                  "timeoutMs": timeout_ms})
    return protocol.inbox_topic(PREFIX, to_node), env


def test_an_observed_request_to_a_silent_node_expires_at_its_deadline(api, now):
    topic, env = observed_request("t-obs")
    ingest((topic, env), now=now)
    row = Message.objects.get(message_id=env.message_id)
    assert (row.direction, row.status) == (Direction.OBSERVED, Status.OBSERVED)
    assert row.deadline_at == now + timedelta(milliseconds=2000)

    deliveries_sweep(now=now + timedelta(seconds=1))
    row.refresh_from_db()
    assert row.status == Status.OBSERVED  # not yet
    deliveries_sweep(now=now + timedelta(seconds=3))
    row.refresh_from_db()
    assert row.status == Status.EXPIRED
    assert row.error == "no answer seen on the bus within 2000 ms"
    (task,) = api.get("/api/a2a/tasks", {"direction": "OBSERVED", "status": "EXPIRED"}).json()
    assert task["taskId"] == "t-obs" and task["error"] == row.error


def test_an_observed_request_moves_with_the_answers_seen_on_the_bus(api, now):
    topic, env = observed_request("t-seen")
    ingest((topic, env), now=now)
    # The answers go to the requester's inbox (node-c), from the node it was sent to.
    ingest(answer(MT.ACK, env.message_id, origin="node-d", to_node="node-c"), now=now)
    (task,) = api.get("/api/a2a/tasks", {"q": "t-seen"}).json()
    assert task["status"] == "ACKED"
    ingest(answer(MT.TASK_RESPONSE, env.message_id, origin="node-d", to_node="node-c",
                  payload={"ok": False, "error": "no such ledger"}), now=now)
    (task,) = api.get("/api/a2a/tasks", {"q": "t-seen"}).json()
    assert (task["status"], task["answeredBy"]) == ("TASK_ERROR", "node-d")
    assert task["error"] == "the task failed: no such ledger"
    deliveries_sweep(now=now + timedelta(seconds=10))  # answered: its deadline ends nothing
    assert Message.objects.get(message_id=env.message_id).status == Status.TASK_ERROR


# --- cancel ---------------------------------------------------------------------------------
def test_cancel_ends_held_and_published_work_and_tells_the_node(api, now):
    register("fin.tax", "node-b", max_inflight=1)
    on_bus = message_send(request=SendRequest(to="fin.tax", task_id="t-c", timeout_ms=600_000))
    published(on_bus, now)
    held = message_send(request=SendRequest(to="fin.tax", task_id="t-h", timeout_ms=600_000))
    assert held.held

    response = api.post("/api/a2a/tasks/t-c/cancel", {"reason": "wrong ledger"})

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "CANCELED" and body["cancelSentTo"] == ["node-b"]
    assert body["canceled"] == [{"messageId": on_bus.message_id, "was": "PUBLISHED"}]
    on_bus.refresh_from_db()
    assert on_bus.status == Status.CANCELED
    assert on_bus.error.startswith("canceled by ") and on_bus.error.endswith(": wrong ledger")
    cancel = Message.objects.get(message_type="CANCEL", task_id="t-c")
    assert (cancel.status, cancel.target_node_id) == (Status.SENT, "node-b")
    assert cancel.headers["cancelFor"] == "t-c" and cancel.publish_at is not None
    # Its slot is free: the held task goes now.
    held.refresh_from_db()
    assert (held.held, held.status) == (False, Status.SENT) and held.publish_at is not None
    step = Transition.objects.get(message=on_bus, to_status=Status.CANCELED)
    assert step.actor == "operator" and "wrong ledger" in step.reason
    (audit,) = AuditEntry.objects.filter(action="cancel")
    assert audit.target == "t-c" and "CANCEL sent to node-b" in audit.detail

    # A late answer is recorded on the trace and reopens nothing.
    ingest(answer(MT.TASK_RESPONSE, on_bus.message_id))
    on_bus.refresh_from_db()
    assert on_bus.status == Status.CANCELED
    assert Message.objects.filter(in_reply_to=on_bus.message_id,
                                  message_type="TASK_RESPONSE").exists()
    assert Task.objects.get(task_id="t-c").status == Status.CANCELED

    again = api.post("/api/a2a/tasks/t-c/cancel", {})
    assert again.status_code == 409 and again.json()["error"] == "task_final"
    assert "already final (CANCELED)" in again.json()["detail"]


def test_cancel_of_held_or_retrying_work_sends_nothing_to_the_bus(api, now):
    register("fin.tax", "node-b", max_inflight=1)
    message_send(request=SendRequest(to="fin.tax", task_id="t-first", timeout_ms=600_000))
    held = message_send(request=SendRequest(to="fin.tax", task_id="t-held",
                                            timeout_ms=600_000))
    assert api.post("/api/a2a/tasks/t-held/cancel", {}).status_code == 200
    held.refresh_from_db()
    assert (held.status, held.held, held.publish_at) == (Status.CANCELED, False, None)
    assert not Message.objects.filter(message_type="CANCEL").exists()
    retrying = message_send(request=SendRequest(to="fin.tax", task_id="t-first"))
    # (the retry-storm guard lets the second transmission of t-first through)
    changes_apply([Change(pk=retrying.pk, to=Status.RETRYING, actor="sweeper", reason="test",
                          fields={"next_attempt_at": now})], now=now)
    api.post("/api/a2a/tasks/t-first/cancel", {})
    deliveries_sweep(now=now + timedelta(seconds=5))
    assert not Message.objects.filter(task_id="t-first", status=Status.SENT,
                                      attempt__gt=1).exists()


def test_cancel_refusals_have_words(api, now):
    assert api.post("/api/a2a/tasks/t-none/cancel", {}).status_code == 404
    register("fin.tax", "node-b")
    row = message_send(request=SendRequest(to="fin.tax", task_id="t-done"))
    published(row, now)
    acked(row, now)
    ingest(answer(MT.TASK_RESPONSE, row.message_id))
    response = api.post("/api/a2a/tasks/t-done/cancel", {})
    assert response.status_code == 409
    assert response.json()["detail"] == ("task t-done is already final (COMPLETED): nothing is "
                                         "open to cancel")
    topic, env = observed_request("t-theirs")
    ingest((topic, env))
    theirs = api.post("/api/a2a/tasks/t-theirs/cancel", {})
    assert theirs.status_code == 409 and theirs.json()["error"] == "not_ours"
    assert api.post("/api/a2a/tasks/t-done/cancel", {"reason": "x" * 501}).status_code == 422


# --- numbers per agent and node -------------------------------------------------------------
def test_agent_and_node_stats_count_what_became_of_the_tasks(api, now):
    register("fin.tax", "node-b")
    for i in range(3):
        row = message_send(request=SendRequest(to="fin.tax", task_id=f"t-s{i}"))
        published(row, now)
        ingest(answer(MT.ACK, row.message_id))
        ingest(answer(MT.TASK_RESPONSE, row.message_id,
                      payload={"ok": i != 2, "result": 1, "error": "boom"}))
    expired = message_send(request=SendRequest(to="fin.tax", task_id="t-x", timeout_ms=200))
    published(expired, now)
    deliveries_sweep(now=timezone_now() + timedelta(seconds=2))

    stats = api.get("/api/ops/agents/fin.tax/stats", {"window": "15m"}).json()

    assert (stats["tasks"], stats["completed"], stats["taskErrors"], stats["expired"]) == (
        4, 2, 1, 1)
    assert stats["successRate"] == 0.5
    assert stats["acked"] == 3 and stats["publishToAckMs"]["p95"] is not None
    assert stats["answered"] == 3 and stats["sentToAnsweredMs"]["p50"] is not None
    assert stats["latencyBoundsMs"][0] == 5.0
    node = api.get("/api/ops/nodes/node-b/stats", {"window": "1h"}).json()
    assert (node["tasks"], node["completed"]) == (4, 2)
    assert api.get("/api/ops/agents/llm.other/stats").json()["tasks"] == 0
    bad = api.get("/api/ops/agents/fin.tax/stats", {"window": "2d"})
    assert bad.status_code == 422
    assert "Input should be '5m', '15m', '1h', '6h' or '24h'" in bad.json()["detail"]


def timezone_now():
    from django.utils import timezone

    return timezone.now()


def test_the_console_answers_a_cancel_for_its_own_agents():
    env = protocol.new_envelope(
        message_type=MT.CANCEL, from_agent_id="ops.main", to_agent_id="ops.probe",
        headers={"replyNodeId": "node-c", "originNodeId": "node-c", "cancelFor": "t-probe"})
    ingest((protocol.inbox_topic(PREFIX, "console"), env))
    row = Message.objects.get(message_id=env.message_id)
    assert (row.direction, row.status) == (Direction.RECV, Status.LOCAL_CONSUMED)
    ack = Message.objects.get(in_reply_to=env.message_id)
    assert (ack.message_type, ack.target_node_id) == ("ACK", "node-c")
    assert ack.payload["cancelFor"] == "t-probe" and ack.payload["stopped"] is False
    # Sent twice: answered as a duplicate, done once.
    ingest((protocol.inbox_topic(PREFIX, "console"), env))
    acks = Message.objects.filter(in_reply_to=env.message_id).order_by("id")
    assert [a.payload.get("duplicate", False) for a in acks] == [False, True]


@pytest.mark.parametrize("path", ["/api/a2a/tasks/t%00x", "/api/ops/agents/fin.t%00x/stats",
                                  "/api/ops/nodes/node%00x/stats"])
def test_a_nul_in_a_path_is_a_422_with_words(api, path):
    response = api.get(path)
    assert response.status_code == 422
    assert response.json()["error"] == "nul_character"
    assert "contains a NUL character" in response.json()["detail"]
    assert api.post("/api/a2a/tasks/t%00x/cancel", {}).status_code == 422


def test_a_puback_after_the_cancel_tells_the_node_after_all(api, now):
    from messages.state import late_pubacks_record

    register("fin.tax", "node-b")
    row = message_send(request=SendRequest(to="fin.tax", task_id="t-late", timeout_ms=600_000))
    # Not claimed by a bridge at the cancel (as far as the console can tell): no CANCEL yet.
    Message.objects.filter(pk=row.pk).update(publish_at=now - timedelta(seconds=60))
    assert api.post("/api/a2a/tasks/t-late/cancel", {}).json()["cancelSentTo"] == []
    # A bridge whose claim had run out published it all the same: its PUBACK comes now.
    late_pubacks_record(pks=[row.pk], now=now + timedelta(seconds=1))
    row.refresh_from_db()
    assert row.status == Status.CANCELED and row.published_at is not None
    cancel = Message.objects.get(message_type="CANCEL", task_id="t-late")
    assert cancel.target_node_id == "node-b" and cancel.publish_at is not None
    step = Transition.objects.filter(message=row).order_by("-id").first()
    assert (step.from_status, step.to_status) == (Status.CANCELED, Status.CANCELED)
    assert "after it was canceled" in step.reason


def test_an_outcome_is_kept_against_late_answers_but_not_against_a_new_attempt(api, now):
    register("fin.tax", "node-b")
    first = message_send(request=SendRequest(to="fin.tax", task_id="t-keep"))
    published(first, now)
    ingest(answer(MT.TASK_RESPONSE, first.message_id,
                  payload={"ok": False, "error": "no ledger"}))
    assert Task.objects.get(task_id="t-keep").status == Status.TASK_ERROR
    # A resend goes out: the task follows the new attempt; its response completes it.
    assert api.post(f"/api/a2a/messages/{first.message_id}/resend", {}).status_code == 202
    again = Message.objects.get(resend_of=first)
    task = Task.objects.get(task_id="t-keep")
    assert (task.status, task.attempts, task.last_message_id) == ("SENT", 2, again.message_id)
    published(again, now)
    ingest(answer(MT.TASK_RESPONSE, again.message_id))
    assert Task.objects.get(task_id="t-keep").status == Status.COMPLETED
    # A late error answer to the first attempt changes nothing of a completed task.
    ingest(answer(MT.TASK_RESPONSE, first.message_id, payload={"ok": False, "error": "x"}))
    assert Task.objects.get(task_id="t-keep").status == Status.COMPLETED
