"""Reliable delivery: backoff, bounded attempts, the storm guard, backpressure, resend."""

from __future__ import annotations

import random
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import transaction

from messages import protocol
from messages.backpressure import loads_kept, loads_lock
from messages.delivery import retry_delay_ms
from messages.idempotency import idempotency_claim
from messages.inbound import Incoming, messages_ingest
from messages.models import Direction, Message, Status
from messages.outbound import SendRefused, SendRequest, message_send
from messages.outbox import outbox_claim
from messages.sweeps import deliveries_sweep
from reachconsole.core.audit import AuditEntry
from roster import services
from tests.conftest import published, register, run_at_once

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType




def answer(kind: MT, for_id: str, **payload) -> None:
    env = protocol.new_envelope(message_type=kind, from_agent_id="fin.tax",
                                headers={"ackFor": for_id, "replyNodeId": "node-b",
                                         "originNodeId": "node-b"},
                                payload=payload)
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                    protocol.encode(env))], node_id="console", prefix="ooder")


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 6, 9])
def test_backoff_grows_caps_and_jitters_within_bounds(attempt):
    base = min(2000, 100 * 2 ** (attempt - 1))
    rng = random.Random(attempt)
    delays = [retry_delay_ms(attempt, rng=rng) for _ in range(500)]
    assert min(delays) >= base * 0.8 and max(delays) <= base * 1.2
    assert max(delays) - min(delays) > base * 0.2  # the jitter is really there


def test_an_unanswered_task_is_tried_five_times_then_expires(now):
    register("fin.tax", "node-b", now=now)
    first = message_send(request=SendRequest(to="fin.tax", task_id="job-1", timeout_ms=600_000),
                         now=now)
    row, moment = first, now
    for attempt in range(1, 6):
        assert (row.attempt, row.task_id, row.idempotency_key) == (attempt, "job-1", "job-1")
        services.agent_renew(agent_id="fin.tax", now=moment)
        published(row, moment)
        moment += timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS + 1)
        deliveries_sweep(now=moment)
        row.refresh_from_db()
        if attempt == 5:
            break
        assert row.status == Status.RETRYING
        moment = row.next_attempt_at
        services.agent_renew(agent_id="fin.tax", now=moment)
        result = deliveries_sweep(now=moment)
        assert result.attempts == 1
        row.refresh_from_db()
        assert row.status == Status.RETRIED
        row = Message.objects.get(resend_of=row)
    assert row.status == Status.EXPIRED
    assert "no ACK within" in row.error and "5 attempts made" in row.error
    rows = Message.objects.filter(task_id="job-1").order_by("attempt")
    assert [r.status for r in rows] == ["RETRIED"] * 4 + ["EXPIRED"]
    assert len({r.message_id for r in rows}) == 5


def test_a_send_no_bridge_publishes_waits_then_fails_at_its_deadline(now, settings):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=10_000), now=now)
    # The console's own outage burns no attempt: the row waits in the outbox.
    deliveries_sweep(now=now + timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS * 2))
    row.refresh_from_db()
    assert (row.status, row.attempt) == (Status.SENT, 1)
    deliveries_sweep(now=now + timedelta(milliseconds=10_001))
    row.refresh_from_db()
    assert row.status == Status.FAILED
    assert row.error.startswith("not published within 10000 ms (the task's timeoutMs): the "
                                "console could not hand it to the MQTT broker")


def test_the_tasks_deadline_bounds_the_attempts(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=settings.REACH_ACK_TIMEOUT_MS
                                           + 50), now=now)
    published(row, now)
    deliveries_sweep(now=now + timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS + 1))
    row.refresh_from_db()
    assert row.status == Status.EXPIRED and "deadline (timeoutMs)" in row.error


def test_a_retryable_nack_schedules_another_attempt(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax"), now=now)
    answer(MT.NACK, row.message_id, reason="warming up", retryable=True)
    row.refresh_from_db()
    assert row.status == Status.RETRYING and row.next_attempt_at is not None
    final = message_send(request=SendRequest(to="fin.tax"), now=now)
    answer(MT.NACK, final.message_id, reason="bad input", retryable=False)
    final.refresh_from_db()
    assert final.status == Status.NACKED and "not retryable" in final.error


def test_the_storm_guard_refuses_the_sixth_transmission_in_a_minute(now, api):
    register("fin.tax", "node-b", now=now)
    for _ in range(5):
        message_send(request=SendRequest(to="fin.tax", task_id="storm-1"))
    with pytest.raises(SendRefused) as err:
        message_send(request=SendRequest(to="fin.tax", task_id="storm-1"))
    assert err.value.status == 429 and "retry-storm guard" in err.value.detail
    r = api.post("/api/a2a/send", {"to": "fin.tax", "taskId": "storm-1"})
    assert r.status_code == 429 and r.json()["error"] == "retry_storm"
    assert Message.objects.filter(task_id="storm-1").count() == 5
    # A window later the guard lets it through again.
    moment = now + timedelta(seconds=settings.REACH_TASK_WINDOW_S + 1)
    services.agent_renew(agent_id="fin.tax", now=moment)
    later = message_send(request=SendRequest(to="fin.tax", task_id="storm-1"), now=moment)
    assert later.status == Status.SENT


@pytest.mark.django_db(transaction=True)
def test_two_sweepers_never_send_the_same_attempt(now):
    register("fin.tax", "node-b", now=now)
    rows = [message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
            for _ in range(30)]
    Message.objects.filter(pk__in=[r.pk for r in rows]).update(
        status=Status.RETRYING, next_attempt_at=now, held=False)
    results = run_at_once(lambda: deliveries_sweep(now=now + timedelta(milliseconds=1)))
    assert sum(r.attempts for r in results) == 30
    assert Message.objects.filter(attempt=2).count() == 30
    assert Message.objects.filter(status=Status.RETRIED).count() == 30
    assert Message.objects.filter(resend_of__isnull=False).values("resend_of").distinct(
    ).count() == 30


def test_max_inflight_holds_then_releases_in_order(now):
    register("fin.tax", "node-b", max_inflight=2, now=now)
    rows = [message_send(request=SendRequest(to="fin.tax", payload={"n": n})) for n in range(5)]
    assert [r.held for r in rows] == [False, False, True, True, True]
    assert all(r.status == Status.SENT for r in rows)
    answer(MT.ACK, rows[0].message_id)
    held = {r.pk: r.held for r in Message.objects.filter(pk__in=[r.pk for r in rows])}
    assert [held[r.pk] for r in rows] == [False, False, False, True, True]  # the oldest went
    answer(MT.ACK, rows[1].message_id)
    answer(MT.ACK, rows[2].message_id)
    held = {r.pk: r.held for r in Message.objects.filter(pk__in=[r.pk for r in rows])}
    assert [held[r.pk] for r in rows] == [False] * 5


def test_past_the_queue_limit_a_send_is_busy_at_once(now, settings):
    settings.REACH_QUEUE_LIMIT = 2
    register("fin.tax", "node-b", max_inflight=1, now=now)
    statuses = [message_send(request=SendRequest(to="fin.tax")) for _ in range(4)]
    assert [(r.status, r.held) for r in statuses] == [
        ("SENT", False), ("SENT", True), ("SENT", True), ("BUSY", False)]
    assert "REACH_QUEUE_LIMIT" in statuses[-1].error


def test_capability_routing_goes_around_a_full_agent(now):
    register("web.a", "node-a", capabilities=["crawl"], max_inflight=1, now=now)
    register("web.b", "node-b", capabilities=["crawl"], max_inflight=1, now=now)
    first = message_send(request=SendRequest(to="capability:crawl", from_agent_id="web.me"))
    second = message_send(request=SendRequest(to="capability:crawl", from_agent_id="web.me"))
    assert {first.to_agent_id, second.to_agent_id} == {"web.a", "web.b"}
    assert not first.held and not second.held


def test_held_work_for_an_agent_that_drains_still_goes_to_it(now):
    # A drain stops new work only: what was held for the agent before it finishes there
    # (tests/test_drain.py has the rest: retries, the lease lapsing, both databases).
    register("fin.tax", "node-b", max_inflight=1, now=now)
    first = message_send(request=SendRequest(to="fin.tax"))
    held = message_send(request=SendRequest(to="fin.tax"))
    services.agent_drain(agent_id="fin.tax")
    answer(MT.ACK, first.message_id)
    held.refresh_from_db()
    assert (held.status, held.held, held.target_node_id) == (Status.SENT, False, "node-b")
    assert held.publish_at is not None and held.error == ""


def test_a_resend_keeps_the_task_and_is_audited(now, api):
    row = message_send(request=SendRequest(to="fin.tax", task_id="job-9"))
    assert row.status == Status.UNDELIVERABLE
    register("fin.tax", "node-b")
    r = api.post(f"/api/a2a/messages/{row.message_id}/resend")
    assert r.status_code == 202, r.content
    again = Message.objects.get(message_id=r.json()["messageId"])
    assert (again.task_id, again.idempotency_key, again.resend_of_id) == (
        "job-9", "job-9", row.pk)
    assert again.status == Status.SENT
    assert AuditEntry.objects.filter(action="resend", target=row.message_id,
                                     result="ok").count() == 1
    fresh = api.post(f"/api/a2a/messages/{row.message_id}/resend", {"newIdempotencyKey": True})
    assert fresh.status_code == 202 and "run the work again" in fresh.json()["warning"]
    assert Message.objects.get(message_id=fresh.json()["messageId"]).idempotency_key != "job-9"
    busy = api.post(f"/api/a2a/messages/{again.message_id}/resend")
    assert busy.status_code == 409 and busy.json()["error"] == "not_resendable"
    assert AuditEntry.objects.filter(result="refused").count() == 1


def test_a_resend_answers_404_for_an_unknown_message(api):
    r = api.post("/api/a2a/messages/nope/resend")
    assert r.status_code == 404 and r.json()["error"] == "message_not_found"


def test_the_idempotency_window_is_one_for_every_instance():
    """Two console instances share the window through the cache (Redis in production)."""
    from django.core.cache import caches
    from django.core.cache.backends.base import BaseCache

    key = f"work-{uuid.uuid4().hex}"
    assert idempotency_claim(node_id="console", key=key, message_id="m-1")
    assert idempotency_claim(node_id="console", key=key, message_id="m-1")  # a redelivery
    assert not idempotency_claim(node_id="console", key=key, message_id="m-2")
    if settings.REDIS_URL:
        # A second, independent client of the same Redis: another console instance.
        other: BaseCache = caches.create_connection("default")
        from messages.idempotency import _key

        assert other.get(_key("console", key)) == "m-1"


def test_a_duplicate_from_another_instance_is_acked_not_run():
    key = f"work-{uuid.uuid4().hex}"
    topic = protocol.inbox_topic("ooder", "console")

    def request():
        return protocol.new_envelope(
            message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
            headers={"replyNodeId": "node-b", "idempotencyKey": key}, payload={})

    first, second = request(), request()
    messages_ingest(batch=[Incoming(topic, protocol.encode(first))], node_id="console",
                    prefix="ooder")
    with transaction.atomic():
        result = messages_ingest(batch=[Incoming(topic, protocol.encode(second))],
                                 node_id="console", prefix="ooder")
    assert result.counts["duplicate_idempotency_key"] == 1
    assert Message.objects.filter(direction=Direction.RECV, message_type="TASK_REQUEST",
                                  idempotency_key=key).count() == 1
    ack = Message.objects.get(in_reply_to=second.message_id)
    assert ack.payload == {"duplicate": True}


def test_held_work_of_an_agent_that_left_the_roster_ends(now):
    register("fin.tax", "node-b", max_inflight=1, now=now)
    message_send(request=SendRequest(to="fin.tax"))
    held = message_send(request=SendRequest(to="fin.tax"))
    services.agent_deregister(agent_id="fin.tax")
    deliveries_sweep()
    held.refresh_from_db()
    assert held.status == Status.UNDELIVERABLE and not held.held
    assert "no agent fin.tax is on the roster" in held.error


def test_a_publish_to_an_agent_that_left_after_it_was_resolved_is_counted():
    """A deregistration between a send's resolution and its lock on the load rows: the
    agent has no limit then, and the message goes out as resolved. It is counted all the
    same, so the kept count stays equal to the rows."""
    register("fin.tax", "node-a")
    services.agent_deregister(agent_id="fin.tax")
    with transaction.atomic():
        capacities = loads_lock(["fin.tax"])
        assert [capacities.decide("fin.tax") for _ in range(2)] == ["publish", "publish"]
        capacities.write()
    assert loads_kept(["fin.tax"]) == {"fin.tax": (2, 0)}


def test_held_work_past_its_deadline_expires(now):
    register("fin.tax", "node-b", max_inflight=1, now=now)
    message_send(request=SendRequest(to="fin.tax"), now=now)
    held = message_send(request=SendRequest(to="fin.tax", timeout_ms=500), now=now)
    deliveries_sweep(now=now + timedelta(seconds=1))
    held.refresh_from_db()
    assert held.status == Status.EXPIRED
    assert held.error == ("held behind fin.tax's maxInflight and not sent within 500 ms "
                          "(the task's timeoutMs)")


def test_a_console_agent_reached_by_capability_is_consumed_here(settings):
    register("ops.probe", settings.REACH_NODE_ID, capabilities=["probe"])
    row = message_send(request=SendRequest(to="capability:probe", from_agent_id="ops.me"))
    assert row.status == Status.LOCAL_CONSUMED


def test_an_answer_whose_bridge_died_is_claimed_again(now, settings):
    env = protocol.new_envelope(message_type=MT.TASK_REQUEST, from_agent_id="fin.tax",
                                to_agent_id="ops.probe", headers={"replyNodeId": "node-b"})
    result = messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                             protocol.encode(env))],
                             node_id="console", prefix="ooder", now=now)
    assert len(result.to_publish) == 2  # ACK and TASK_RESPONSE, in the outbox
    ack = Message.objects.get(pk__in=result.to_publish, message_type="ACK")
    # The ACK is due; the response waits for the broker to take the ACK.
    claimed = outbox_claim(limit=10, now=now)
    assert [r.pk for r in claimed] == [ack.pk]
    # Claimed by a bridge that then died before the PUBACK: nobody takes it meanwhile...
    assert outbox_claim(limit=10, now=now + timedelta(seconds=1)) == []
    # ...and once the claim has run out, any bridge publishes it again.
    later_on = now + timedelta(seconds=settings.REACH_OUTBOX_CLAIM_S + 0.1)
    assert [r.pk for r in outbox_claim(limit=10, now=later_on)] == [ack.pk]


def test_the_trace_starts_with_the_first_step():
    row = message_send(request=SendRequest(to="fin.nobody"))
    steps = list(row.transitions.values_list("from_status", "to_status"))
    assert steps == [("", "SENT"), ("SENT", "UNDELIVERABLE")]


def test_absurd_load_figures_are_refused_not_a_500(api):
    register("fin.tax", "node-b")
    r = api.post("/api/roster/agents/fin.tax/heartbeat", {"inflight": 10**20})
    # Beyond 64 bits: refused by the API's parser, before any validation, with where it is.
    assert r.status_code == 422 and r.json()["error"] == "number_out_of_range"
    assert r.json()["detail"].startswith("body.inflight is a number beyond 64 bits")
    long = api.post("/api/a2a/send", {"to": "fin.tax", "taskId": "t" * 121})
    assert long.status_code == 422


def test_old_messages_are_pruned_by_age(now, settings):
    settings.REACH_RETENTION_DAYS = 7
    old = message_send(request=SendRequest(to="fin.nobody"), now=now - timedelta(days=8))
    retry = message_send(request=SendRequest(to="fin.nobody", task_id=old.task_id),
                         now=now - timedelta(days=1))
    Message.objects.filter(pk=retry.pk).update(resend_of=old)
    recent = message_send(request=SendRequest(to="fin.nobody"), now=now)
    from messages.sweeps import messages_prune

    assert messages_prune(now=now) == 1
    assert set(Message.objects.values_list("pk", flat=True)) == {retry.pk, recent.pk}
    assert Message.objects.get(pk=retry.pk).resend_of_id is None
    settings.REACH_RETENTION_DAYS = 0
    assert messages_prune(now=now + timedelta(days=30)) == 0


@pytest.mark.django_db(transaction=True)
def test_the_storm_guard_holds_against_concurrent_sends(now):
    register("fin.tax", "node-b", now=now)

    def send_one():
        try:
            return message_send(request=SendRequest(to="fin.tax", task_id="race-1")).status
        except SendRefused as exc:
            return exc.code

    outcomes = run_at_once(send_one, threads=8)
    assert sorted(outcomes).count("retry_storm") == 3
    assert Message.objects.filter(task_id="race-1").count() == 5


def test_held_work_follows_its_agent_to_its_new_node_but_never_swaps_an_explicit_one(now):
    register("fin.tax", "node-b", max_inflight=1, now=now)
    first = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    held = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    explicit = message_send(request=SendRequest(to="fin.tax", target_node_id="node-b",
                                                timeout_ms=600_000), now=now)
    assert (held.held, explicit.held) == (True, True)
    # The agent moves to node-c while its work is held.
    services.agent_deregister(agent_id="fin.tax", actor="test")
    register("fin.tax", "node-c", max_inflight=2, now=now)
    published(first, now)
    answer(MT.ACK, first.message_id)
    held.refresh_from_db()
    explicit.refresh_from_db()
    assert (held.held, held.target_node_id) == (False, "node-c")
    assert held.topic == protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, "node-c")
    assert explicit.status == Status.UNDELIVERABLE
    assert "the explicit node named at send time is never swapped" in explicit.error
