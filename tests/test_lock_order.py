"""One lock order (messages/backpressure.py, roster/services.py): heartbeats, sends, answers, sweeps
and deregistration of one agent, all at once, never deadlock. PostgreSQL counts every
deadlock it breaks (pg_stat_database.deadlocks), whoever retried after it."""

from __future__ import annotations

import itertools
import threading

import pytest
from django.db import connection

from messages import protocol
from messages.backpressure import loads_reconcile
from messages.inbound import Incoming, messages_ingest
from messages.models import AgentLoad, Direction, Message, Status
from messages.outbound import SendRequest, message_send
from messages.sweeps import deliveries_sweep
from roster import services
from roster.errors import RosterError
from tests.conftest import bus_heard, register, run_at_once

pytestmark = pytest.mark.django_db(transaction=True)
MT = protocol.MessageType
ROUNDS = 40


def _deadlocks() -> int | None:
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = "
                       "current_database()")
        return cursor.fetchone()[0]


def _ack_everything_published() -> None:
    published = list(Message.objects.filter(
        direction=Direction.SEND, status=Status.PUBLISHED).values_list("message_id", flat=True))
    batch = [Incoming(protocol.inbox_topic("ooder", "console"), protocol.encode(
        protocol.new_envelope(message_type=MT.ACK, from_agent_id="fin.tax",
                              headers={"ackFor": mid, "originNodeId": "node-b"})))
             for mid in published]
    messages_ingest(batch=batch, node_id="console", prefix="ooder")


def _publish_everything_due() -> None:
    from messages.models import Change
    from messages.outbox import outbox_claim
    from messages.state import atomic_retrying, changes_apply

    rows = outbox_claim(limit=50)
    atomic_retrying(lambda: changes_apply(
        [Change(pk=r.pk, to=Status.PUBLISHED, allowed=frozenset({Status.SENT}),
                actor="bridge", reason="PUBACK") for r in rows], now=r_now()))


def r_now():
    from django.utils import timezone

    return timezone.now()


def test_heartbeats_sends_answers_sweeps_and_deregistration_never_deadlock(now):
    from datetime import timedelta

    bus_heard(since=now - timedelta(days=1), until=now + timedelta(days=1))
    for name in ("fin.tax", "fin.vat"):
        register(name, "node-b", max_inflight=4)
    before = _deadlocks()
    roles = itertools.count()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def heartbeats():
        services.heartbeat_record(node_id="node-b", agents=[
            {"agentId": "fin.tax", "inflight": 1}, {"agentId": "fin.vat", "inflight": 2}])
        try:
            services.agent_renew(agent_id="fin.vat", node_id="node-b")
        except RosterError:
            pass  # deregistered by churn() just now: a legitimate answer

    def sends():
        for to in ("fin.tax", "fin.vat", "fin.tax"):
            message_send(request=SendRequest(to=to, timeout_ms=60_000))

    def churn():
        try:
            services.agent_deregister(agent_id="fin.vat", actor="test")
        except RosterError:
            pass
        register("fin.vat", "node-b", max_inflight=4)

    def sweeps():
        deliveries_sweep()
        services.leases_expire()
        loads_reconcile()

    work = [heartbeats, sends, _publish_everything_due, _ack_everything_published, sweeps,
            churn]

    def role():
        mine = work[next(roles) % len(work)]
        for _ in range(ROUNDS):
            try:
                mine()
            except Exception as exc:  # any error at all fails the test below
                with lock:
                    errors.append(exc)
        return mine.__name__

    done = run_at_once(role, threads=len(work), timeout=240)
    assert sorted(done) == sorted(w.__name__ for w in work)
    assert errors == []
    if before is not None:
        assert _deadlocks() - before == 0
    # The kept counts agree with the rows after all that.
    assert loads_reconcile() == 0
    assert AgentLoad.objects.filter(inflight__lt=0).count() == 0
