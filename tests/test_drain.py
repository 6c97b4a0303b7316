"""Drain keeps its promise, and undrain undoes it.

A drain stops new work only: work already accepted for the agent (in flight, held behind its
maxInflight, retries of attempts sent to it) finishes on that agent while its lease holds;
once the lease lapses the agent is gone and what is left ends UNDELIVERABLE with words.
Runs on SQLite and on PostgreSQL (DATABASE_URL) alike.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client

from messages.backpressure import loads_reconcile
from messages.models import Message, Status
from messages.outbound import SendRequest, message_send
from messages.sweeps import deliveries_sweep
from reachconsole.core.audit import AuditEntry
from roster import errors, services
from roster.models import Agent, RosterEvent
from tests.conftest import ApiClient, acked, logged_in, published, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
ACK_MS = settings.REACH_ACK_TIMEOUT_MS






def retry_due(row: Message, now) -> Message:
    """Publish `row`, let its ACK time run out, and run the sweep that makes the next attempt;
    the agent keeps sending heartbeats all along. Returns the next attempt (or the row)."""
    published(row, now)
    silent = now + timedelta(milliseconds=ACK_MS + 1)
    services.agent_renew(agent_id=row.to_agent_id, now=silent)
    deliveries_sweep(now=silent)
    row.refresh_from_db()
    assert row.status == Status.RETRYING
    services.agent_renew(agent_id=row.to_agent_id, now=row.next_attempt_at)
    deliveries_sweep(now=row.next_attempt_at)
    row.refresh_from_db()
    return Message.objects.filter(resend_of=row).first() or row


def test_it_sends_held_work_to_a_draining_agent_as_its_slots_free(now):
    register("fin.tax", "node-b", max_inflight=1, now=now)
    first = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    held = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    assert held.held
    services.agent_drain(agent_id="fin.tax", actor="olga", now=now)

    # New work is refused at once, with the reason.
    new = message_send(request=SendRequest(to="fin.tax"), now=now)
    assert new.status == Status.UNDELIVERABLE and "draining: it takes no new work" in new.error

    # The slot frees (the first is acknowledged): the held one goes to the same agent.
    published(first, now)
    acked(first, now)
    deliveries_sweep(now=now + timedelta(milliseconds=10))
    held.refresh_from_db()
    assert (held.status, held.held, held.target_node_id) == (Status.SENT, False, "node-b")
    assert held.error == "" and held.publish_at is not None
    assert loads_reconcile() == 0  # the kept counts followed the rows


def test_it_retries_on_the_draining_agent_not_undeliverable(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", task_id="job-d1", timeout_ms=600_000),
                       now=now)
    services.agent_drain(agent_id="fin.tax", now=now)
    again = retry_due(row, now)
    assert again.pk != row.pk, row.error
    row.refresh_from_db()
    assert row.status == Status.RETRIED
    assert (again.to_agent_id, again.target_node_id, again.attempt) == ("fin.tax", "node-b", 2)
    assert (again.task_id, again.idempotency_key) == ("job-d1", "job-d1")
    assert again.status == Status.SENT
    assert again.resolution["candidates"][0]["why"] == (
        "draining, but this work was accepted for it before the drain")


def test_a_capability_retry_stays_on_the_draining_agent_new_work_goes_elsewhere(now):
    register("web.a", "node-a", capabilities=["crawl"], now=now)
    first = message_send(request=SendRequest(to="capability:crawl", from_agent_id="web.me",
                                             timeout_ms=600_000), now=now)
    assert first.to_agent_id == "web.a"
    register("web.b", "node-b", capabilities=["crawl"], now=now)
    services.agent_drain(agent_id="web.a", now=now)

    fresh = message_send(request=SendRequest(to="capability:crawl", from_agent_id="web.me"),
                         now=now)
    assert fresh.to_agent_id == "web.b"  # new work: routed elsewhere

    services.agent_renew(agent_id="web.b", now=now + timedelta(milliseconds=ACK_MS + 1))
    again = retry_due(first, now)
    assert (again.to_agent_id, again.target_node_id, again.attempt) == ("web.a", "node-a", 2)
    assert again.status == Status.SENT


def test_once_the_lease_lapses_what_is_left_ends_undeliverable_with_words(now):
    register("fin.tax", "node-b", max_inflight=1, now=now)
    first = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    held = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    services.agent_drain(agent_id="fin.tax", now=now)
    published(first, now)
    gone = now + timedelta(milliseconds=settings.REACH_LEASE_TTL_MS + 1)
    assert services.leases_expire(now=gone).removed == 1  # phase 2: off the roster
    assert RosterEvent.objects.filter(agent_id="fin.tax", kind="REMOVED").exists()

    deliveries_sweep(now=gone)  # the first gets no ACK: its retry finds no agent
    retry_at = Message.objects.get(pk=first.pk).next_attempt_at
    deliveries_sweep(now=retry_at)
    first.refresh_from_db()
    held.refresh_from_db()
    assert first.status == Status.UNDELIVERABLE
    assert first.error == ("attempt 2 not made: no agent fin.tax is on the roster; check the id "
                           "or register the agent")
    assert held.status == Status.UNDELIVERABLE and not held.held
    assert held.error.startswith("held for fin.tax, which can no longer take work: no agent "
                                 "fin.tax is on the roster")


def test_an_answer_to_an_attempt_that_was_not_retried_completes_it_after_all(now):
    """The node ran attempt 1 and its answer came after the console had given the retry up
    ("attempt 2 not made"): the work was done, and the record says so."""
    from messages import protocol
    from messages.inbound import Incoming, messages_ingest
    from messages.models import Task

    register("fin.tax", "node-b", now=now)
    first = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    published(first, now)
    services.agent_deregister(agent_id="fin.tax", actor="ops", now=now)
    late = now + timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS + 1)
    deliveries_sweep(now=late)  # no ACK in time: a retry is due, and finds no agent
    deliveries_sweep(now=Message.objects.get(pk=first.pk).next_attempt_at)
    first.refresh_from_db()
    assert first.status == Status.UNDELIVERABLE and "attempt 2 not made" in first.error

    answer = protocol.new_envelope(
        message_type=protocol.MessageType.TASK_RESPONSE, from_agent_id="fin.tax",
        to_agent_id=first.from_agent_id, task_id=first.task_id,
        headers={"inReplyTo": first.message_id, "originNodeId": "node-b",
                 "replyNodeId": "node-b"}, payload={"ok": True, "result": 42})
    messages_ingest(batch=[Incoming(protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX,
                                                         settings.REACH_NODE_ID),
                                    protocol.encode(answer))],
                    node_id=settings.REACH_NODE_ID, prefix=settings.MQTT_TOPIC_PREFIX)
    first.refresh_from_db()
    assert first.status == Status.COMPLETED and first.error == ""
    assert Task.objects.get(task_id=first.task_id).status == Status.COMPLETED


def test_undrain_takes_new_work_again_with_its_history_and_audit(now):
    register("fin.tax", "node-b", now=now)
    services.agent_drain(agent_id="fin.tax", actor="olga", now=now)
    agent = services.agent_undrain(agent_id="fin.tax", actor="olga", now=now)
    assert (agent.status, agent.drained_at) == (Agent.Status.ONLINE, None)
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE
    event = RosterEvent.objects.get(agent_id="fin.tax", kind=RosterEvent.Kind.UNDRAINED)
    assert (event.actor, event.node_id) == ("olga", "node-b")
    entry = AuditEntry.objects.get(action="undrain")
    assert (entry.actor, entry.target, entry.result) == ("olga", "fin.tax", "ok")
    assert message_send(request=SendRequest(to="fin.tax"), now=now).status == Status.SENT

    # Not draining: nothing changes, the request is audited all the same.
    services.agent_undrain(agent_id="fin.tax", actor="olga", now=now)
    assert RosterEvent.objects.filter(kind=RosterEvent.Kind.UNDRAINED).count() == 1
    assert AuditEntry.objects.filter(action="undrain").count() == 2


def test_undrain_refuses_an_agent_whose_lease_lapsed_while_draining(now):
    register("fin.tax", "node-b", now=now)
    services.agent_drain(agent_id="fin.tax", now=now)
    lapsed = now + timedelta(milliseconds=settings.REACH_LEASE_TTL_MS + 1)
    with pytest.raises(errors.LeaseLapsed) as refused:
        services.agent_undrain(agent_id="fin.tax", now=lapsed)
    assert refused.value.status == 409
    assert refused.value.detail.startswith("fin.tax's lease lapsed at ")
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING


@pytest.fixture
def operator() -> Client:
    return logged_in(staff_user("olga", "change_agent"), enforce_csrf_checks=False)


def test_the_page_action_undrains_and_a_viewer_is_refused(operator, now):
    register("fin.tax", "node-b", now=now)
    services.agent_drain(agent_id="fin.tax", now=now)
    html = operator.get("/agents/fin.tax/").content.decode()
    assert 'id="undrain"' in html and 'action="/agents/fin.tax/undrain"' in html

    viewer = logged_in(reader("victor"))
    assert viewer.post("/agents/fin.tax/undrain").status_code == 403
    assert viewer.get("/agents/fin.tax/undrain").status_code in (403, 405)
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING

    done = operator.post("/agents/fin.tax/undrain", follow=True)
    assert "fin.tax takes new work again." in done.content.decode()
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE
    assert 'id="undrain"' not in done.content.decode()


def test_the_page_action_needs_csrf(now):
    register("fin.tax", "node-b", now=now)
    services.agent_drain(agent_id="fin.tax", now=now)
    strict = logged_in(staff_user("olga", "change_agent"), enforce_csrf_checks=True)
    assert strict.post("/agents/fin.tax/undrain").status_code == 403
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING


def test_undrain_of_an_agent_gone_from_the_roster_is_a_404_with_words(operator, api, now):
    r = operator.post("/agents/fin.gone/undrain")
    assert r.status_code == 404
    assert "fin.gone is not on the roster" in r.content.decode()
    refused = AuditEntry.objects.get(action="undrain")
    assert (refused.result, refused.target) == ("refused", "fin.gone")

    answer = api.post("/api/roster/agents/fin.gone/undrain")
    assert answer.status_code == 404
    assert answer.json() == {"error": "agent_not_found", "detail": "fin.gone is not on the roster"}


def test_the_api_undrains_like_it_drains(api, now):
    register("fin.tax", "node-b")
    assert api.post("/api/roster/agents/fin.tax/drain").json()["status"] == "DRAINING"
    r = api.post("/api/roster/agents/fin.tax/undrain")
    assert r.status_code == 200
    assert (r.json()["status"], r.json()["drainedAt"]) == ("ONLINE", None)


def test_the_drain_preview_says_what_happens_to_held_and_retrying_work(operator, now):
    register("fin.tax", "node-b", max_inflight=1, now=now)
    first = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    Message.objects.filter(pk=first.pk).update(status=Status.RETRYING)  # one waits to retry
    html = operator.get("/messages/agents/fin.tax/load/").content.decode()
    assert 'data-preview="inflight">1<' in html  # the kept count: sent, not yet answered
    assert 'data-preview="held">2<' in html
    assert 'data-preview="retrying">1<' in html
    assert "2 held are sent to it as its slots free" in " ".join(html.split()).replace(
        '<span data-preview="held">2</span>', "2")
    assert "Already accepted: 1 in flight, 2 held and 1 retrying finish on it" in html
    assert 'id="drain"' in html

    services.agent_drain(agent_id="fin.tax", now=now)
    after = operator.get("/messages/agents/fin.tax/load/").content.decode()
    assert "<h2>Draining</h2>" in after and 'id="drain"' not in after


def test_the_roster_and_agent_pages_show_the_load_routing_uses(operator, now):
    register("fin.tax", "node-b", max_inflight=4, now=now)
    for _ in range(3):
        message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    # The node reports one task executing (acknowledged, running) in its heartbeat.
    services.heartbeat_record(node_id="node-b", now=now,
                              agents=[{"agentId": "fin.tax", "inflight": 1, "maxInflight": 4}])
    roster = operator.get("/").content.decode()
    assert 'data-load="100"' in roster and "4/4" in roster  # 3 in flight + 1 executing of 4
    work = operator.get("/messages/agents/fin.tax/load/").content.decode()
    assert 'data-count="load">100%<' in work
    assert 'data-count="inflight">3<' in work and 'data-count="executing">1<' in work
    detail = operator.get("/agents/fin.tax/").content.decode()
    assert "in flight of" not in detail  # one in-flight number: the Work section's


def test_only_the_owner_or_an_operator_undrains_over_the_api(now):
    ApiClient(actor="alice").post("/api/roster/agents", {"agentId": "fin.tax",
                                                         "nodeId": "node-a"})
    services.agent_drain(agent_id="fin.tax", now=now)
    r = ApiClient(actor="bob").post("/api/roster/agents/fin.tax/undrain")
    assert r.status_code == 403 and "alice" in r.json()["detail"]
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.DRAINING
    assert ApiClient(actor="alice").post("/api/roster/agents/fin.tax/undrain").status_code == 200
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE
