"""Sending: a row first, a resolution by the directory, and honest outcomes."""

from __future__ import annotations

import pytest

from messages.models import Direction, Message, Status, Transition
from messages.outbound import SendRefused, SendRequest, message_send
from roster import services
from tests.conftest import FIN_TOKEN, ApiClient, later, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


def send(to: str, **kwargs) -> Message:
    return message_send(request=SendRequest(to=to, **kwargs))


def test_a_send_to_a_live_agent_waits_for_the_bridge_as_sent(settings):
    register("fin.tax", "node-b")
    row = send("fin.tax", payload={"q": 1}, task_id="job-1", conversation_id="c-9")
    assert row.status == Status.SENT and row.direction == Direction.SEND
    assert row.target_node_id == "node-b"
    assert row.topic == f"{settings.MQTT_TOPIC_PREFIX}/node/node-b/inbox"
    assert row.headers["replyNodeId"] == settings.REACH_NODE_ID
    assert row.headers["originNodeId"] == settings.REACH_NODE_ID
    assert row.headers["idempotencyKey"] == "job-1" and row.task_id == "job-1"
    assert row.resolution["level"] == "roster"
    assert list(row.transitions.values_list("from_status", "to_status")) == [("", "SENT")]


@pytest.mark.parametrize(
    ("setup", "to", "target", "words"),
    [
        (lambda: None, "fin.ghost", None, "no agent fin.ghost is on the roster"),
        (lambda: register("fin.tax", "node-b"), "fin.tax", "node-c",
         "node node-c does not host fin.tax; the roster places it on node-b"),
        (lambda: (register("fin.tax", "node-b"), services.agent_drain(agent_id="fin.tax")),
         "fin.tax", None, "draining"),
    ],
)
def test_it_is_undeliverable_with_the_reason_and_candidates(setup, to, target, words):
    setup()
    row = send(to, target_node_id=target)
    assert row.status == Status.UNDELIVERABLE
    assert words in row.error
    assert row.finished_at is not None
    assert row.published_at is None and row.target_node_id == (target or "")
    if row.resolution["candidates"]:
        assert "Considered: fin.tax on node-b" in row.error
    assert Transition.objects.filter(message=row, to_status="UNDELIVERABLE").count() == 1


def test_an_agent_whose_lease_lapsed_is_undeliverable(now, settings):
    register("fin.tax", "node-b", now=later(now, -settings.REACH_LEASE_TTL_MS - 1000))
    row = send("fin.tax")
    assert row.status == Status.UNDELIVERABLE and "lease has lapsed" in row.error


def test_a_console_agent_is_consumed_locally():
    row = send("ops.probe", payload={})
    assert row.status == Status.LOCAL_CONSUMED
    response = Message.objects.get(in_reply_to=row.message_id)
    assert response.message_type == "TASK_RESPONSE" and response.payload["ok"] is True


def test_a_payload_over_the_limit_is_refused_and_nothing_written(settings):
    register("fin.tax", "node-b")
    settings.REACH_MAX_MESSAGE_BYTES = 2048
    with pytest.raises(SendRefused) as err:
        send("fin.tax", payload={"blob": "x" * 4000})
    assert err.value.status == 413 and "limit" in err.value.detail
    assert Message.objects.count() == 0


def test_the_api_sends_and_shows_the_story(api):
    register("fin.tax", "node-b")
    r = api.post("/api/a2a/send", {"to": "fin/tax", "payload": {"q": 1}, "taskId": "job-2",
                                   "conversationId": "c-1"})
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == "SENT" and body["targetNodeId"] == "node-b"
    detail = api.get(f"/api/a2a/messages/{body['messageId']}").json()
    assert detail["taskId"] == "job-2" and detail["payload"] == {"q": 1}
    assert [t["to"] for t in detail["transitions"]] == ["SENT"]
    assert detail["attempts"] == [{"messageId": body["messageId"], "attempt": 1,
                                   "status": "SENT"}]


def test_the_api_answers_undeliverable_with_candidates(api):
    register("fin.tax", "node-b")
    r = api.post("/api/a2a/send", {"to": "fin.tax", "targetNodeId": "node-z"})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "UNDELIVERABLE"
    assert body["candidates"] == [{"agentId": "fin.tax", "nodeId": "node-b", "status": "ONLINE",
                                   "routable": True, "why": "live", "namespace": "fin",
                                   "load": 0.0, "chosen": False}]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"payload": {}}, 422, "invalid_request"),
        ({"to": "not an agent"}, 422, "invalid_agent_id"),
        ({"to": "capability:"}, 422, "send_refused"),
        ({"to": "fin.tax", "timeoutMs": -5}, 422, "invalid_request"),
    ],
)
def test_the_api_refuses_bad_sends_with_words(api, body, status, code):
    r = api.post("/api/a2a/send", body)
    assert r.status_code == status, r.content
    assert r.json()["error"] == code and r.json()["detail"]
    assert Message.objects.count() == 0


def test_the_api_keeps_namespaces_apart():
    register("llm.chat", "node-b")
    fin = ApiClient(token=FIN_TOKEN)  # bound to fin and llm
    assert fin.post("/api/a2a/send", {"to": "llm.chat"}).status_code == 202
    other = register("ops.secret", "node-b")
    r = fin.post("/api/a2a/send", {"to": other.agent_id})
    assert r.status_code == 403 and r.json()["error"] == "namespace_forbidden"
    assert not Message.objects.filter(to_agent_id="ops.secret").exists()


def test_the_api_answers_404_for_an_unknown_message(api):
    r = api.get("/api/a2a/messages/nope")
    assert r.status_code == 404 and r.json()["error"] == "message_not_found"
