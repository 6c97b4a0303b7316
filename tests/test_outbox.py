"""The database is the outbox: any process writes rows, any bridge claims and publishes them."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from messages import protocol
from messages.models import OPEN_STATUSES, Message, Status
from messages.outbound import SendRequest, message_send
from messages.outbox import outbox_claim
from messages.sweeps import deliveries_sweep
from tests.conftest import register, run_at_once, stop_process
from tests.processes import database_url
from tests.test_bridge import eventually

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.django_db(transaction=True)
def test_the_stock_prefork_worker_publishes(mqtt_settings, broker, tmp_path):
    """`celery -A reachconsole worker` exactly as the README says (prefork pool): rows
    written by another process are claimed and published by the worker's bridge."""
    register("fin.tax", "node-w", max_inflight=100)
    heard: list[str] = []
    got_all = threading.Event()
    listener = broker.client(client_id=f"node-w-{uuid.uuid4().hex[:6]}")

    def on_message(client, userdata, message):
        heard.append(protocol.decode(message.payload).message_id)
        if len(heard) >= 20:
            got_all.set()

    listener.on_message = on_message
    listener.subscribe(protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, "node-w"), qos=1)
    env = {**os.environ, "DATABASE_URL": database_url(), "MQTT_URL": settings.MQTT_URL,
           "MQTT_PROTOCOL": settings.MQTT_PROTOCOL,
           "MQTT_TOPIC_PREFIX": settings.MQTT_TOPIC_PREFIX, "REACH_NODE_ID": "console",
           "REACH_BRIDGE_INSTANCE": f"prefork-{uuid.uuid4().hex[:6]}",
           "REACH_RUN_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "worker.log"
    with open(log_path, "w+") as log:
        worker = subprocess.Popen(  # noqa: S603
            [str(Path(os.sys.executable).parent / "celery"), "-A", "reachconsole", "worker",
             "-l", "info"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rows = [message_send(request=SendRequest(to="fin.tax", payload={"n": n},
                                                     timeout_ms=120_000))
                    for n in range(20)]
            assert {r.status for r in rows} == {Status.SENT}
            assert got_all.wait(60), (f"the worker published {len(heard)} of 20:\n"
                                      + log_path.read_text()[-3000:])
            assert set(heard) == {r.message_id for r in rows}
            eventually(lambda: Message.objects.filter(
                pk__in=[r.pk for r in rows], status=Status.PUBLISHED).count() == 20,
                timeout=30, what="all 20 rows PUBLISHED")
        finally:
            stop_process(worker, 30)
            listener.loop_stop()
            listener.disconnect()
    text = log_path.read_text()
    assert "prefork" in text  # really the stock pool
    assert "LookupError" not in text


@pytest.mark.django_db(transaction=True)
def test_two_bridges_claim_disjoint_rows():
    register("fin.tax", "node-b", max_inflight=1000)
    sent = [message_send(request=SendRequest(to="fin.tax", timeout_ms=120_000))
            for _ in range(150)]
    claims = run_at_once(lambda: [row.pk for row in outbox_claim(limit=100)], threads=2)
    first, second = (set(c) for c in claims)
    assert not first & second
    assert first | second == {row.pk for row in sent}


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_every_open_status_ends_at_its_deadline(now):
    """No row outlives its deadline: one of each open status, and a held request and an
    answer of ours, are all final after one sweep past their deadlines."""
    register("fin.tax", "node-b", max_inflight=1000, now=now)

    def request(status: str, **fields) -> Message:
        row = message_send(request=SendRequest(to="fin.tax", timeout_ms=30_000), now=now)
        Message.objects.filter(pk=row.pk).update(status=status, **fields)
        return row

    rows = {status: request(status) for status in OPEN_STATUSES}
    rows["held"] = request(Status.SENT, held=True, publish_at=None)
    rows["answer"] = request(Status.SENT, message_type="ACK")
    assert set(rows) - {"held", "answer"} == set(OPEN_STATUSES)  # a new status needs a case
    result = deliveries_sweep(now=now + timedelta(seconds=31))
    assert result.ended == len(rows)
    final = {key: Message.objects.get(pk=row.pk) for key, row in rows.items()}
    assert {key: row.status for key, row in final.items()} == {
        Status.SENT: Status.FAILED, Status.PUBLISHED: Status.EXPIRED,
        Status.ACKED: Status.EXPIRED, Status.RETRYING: Status.EXPIRED,
        "held": Status.EXPIRED, "answer": Status.FAILED,
    }
    assert final[Status.ACKED].error == "acknowledged, no response within 30000 ms"
    assert all(row.finished_at and row.error for row in final.values())
    assert not Message.objects.filter(status__in=OPEN_STATUSES).exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_an_answered_request_leaves_the_deadline_indexes(now):
    from messages.inbound import Incoming, messages_ingest

    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax"), now=now)
    Message.objects.filter(pk=row.pk).update(
        status=Status.PUBLISHED, publish_at=None, ack_deadline_at=now + timedelta(seconds=3))
    ack = protocol.new_envelope(message_type=protocol.MessageType.ACK, from_agent_id="fin.tax",
                                headers={"ackFor": row.message_id, "originNodeId": "node-b"})
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                    protocol.encode(ack))], node_id="console", prefix="ooder")
    row.refresh_from_db()
    assert (row.status, row.ack_deadline_at, row.publish_at) == (Status.ACKED, None, None)


@pytest.mark.django_db
def test_a_row_due_later_is_not_claimed_before(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax"), now=now)
    assert [r.pk for r in outbox_claim(limit=5, now=now - timedelta(seconds=1))] == []
    assert [r.pk for r in outbox_claim(limit=5, now=timezone.now())] == [row.pk]


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_an_answer_acked_before_its_puback_never_jams_the_deadline_sweep(now, settings):
    """A receiver may ACK our TASK_RESPONSE before our PUBACK is recorded (SENT → ACKED).
    When its deadline passes it leaves the deadline index quietly, and the sweep still ends
    every task request due with it."""
    from messages.inbound import Incoming, messages_ingest

    env = protocol.new_envelope(message_type=protocol.MessageType.TASK_REQUEST,
                                from_agent_id="fin.tax", to_agent_id="ops.probe",
                                headers={"replyNodeId": "node-b"})
    result = messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                             protocol.encode(env))],
                             node_id="console", prefix="ooder", now=now)
    result_ids = result.to_publish
    response = Message.objects.get(pk__in=result_ids, message_type="TASK_RESPONSE")
    ack = protocol.new_envelope(message_type=protocol.MessageType.ACK, from_agent_id="fin.tax",
                                headers={"ackFor": response.message_id,
                                         "originNodeId": "node-b"})
    messages_ingest(batch=[Incoming(protocol.inbox_topic("ooder", "console"),
                                    protocol.encode(ack))], node_id="console", prefix="ooder")
    response.refresh_from_db()
    assert response.status == Status.ACKED and response.deadline_at is not None
    register("fin.tax", "node-b", now=now)
    task = message_send(request=SendRequest(to="fin.tax", timeout_ms=1000), now=now)
    after = now + timedelta(seconds=settings.REACH_IDEMPOTENCY_TTL_S + 1)
    result = deliveries_sweep(now=after)
    task.refresh_from_db()
    response.refresh_from_db()
    assert task.status == Status.FAILED
    assert (response.status, response.deadline_at) == (Status.ACKED, None)
    # Our ACK of that request was never published either: it ends with the task.
    our_ack = Message.objects.get(pk__in=result_ids, message_type="ACK")
    assert our_ack.status == Status.FAILED and result.ended == 2
