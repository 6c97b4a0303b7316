"""`/metrics`: prometheus-client's exposition of the whole console's numbers, parsed with
prometheus-client's own parser, carrying the traffic of a run through the real bridge and
broker; counted once whichever process counted and whichever process is scraped."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from django.conf import settings
from django.db.models import Count, F
from prometheus_client.parser import text_string_to_metric_families

from messages import protocol
from messages.client_ids import client_id_for
from messages.models import Direction, Message, Status, Transition
from messages.outbound import SendRequest, messages_send
from reachconsole.core.identity import console_id
from reachconsole.core.metrics import (
    LATENCY_BUCKETS_S,
    counters_add,
    delivery_add_later,
    delivery_forget,
    delivery_rate,
    metrics_flush,
)
from reachconsole.dev.simulator import Knobs, SimulatedCluster
from roster.models import Agent, ClusterNode
from tests.conftest import TOKEN, expect_real_services, stop_process
from tests.mqtt import free_port
from tests.processes import database_url
from tests.test_bridge import eventually

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parent.parent
MT = protocol.MessageType


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition, parsed by prometheus-client: (name, labels) → value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def metrics(client) -> dict:
    metrics_flush()  # what this process counted and has not handed over yet
    answer = client.get("/metrics")
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/plain")
    return scrape(answer.content.decode())


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_the_metrics_parse_and_carry_a_simulated_run(bridge, live_server, mqtt_settings,
                                                     client, settings):
    settings.REACH_ACK_TIMEOUT_MS = 500  # readiness judges a second 1.5 s after it ended
    sim = SimulatedCluster(
        base_url=live_server.url, token=TOKEN, mqtt_url=settings.MQTT_URL, nodes=1, agents=2,
        prefix=settings.MQTT_TOPIC_PREFIX, mqtt_protocol=settings.MQTT_PROTOCOL,
        knobs=Knobs(rate=0, slow_ms=0), heartbeat_ms=200,
    )
    sim.start()
    try:
        assert sim.wait_subscribed(), "the simulated node never subscribed to its inbox"
        agents = [a.agent_id for a in sim.nodes[0].agents]
        eventually(lambda: Agent.objects.filter(agent_id__in=agents,
                                                last_heartbeat_at__isnull=False).count() == 2,
                   what="the simulated agents heartbeating")
        time.sleep(1.2)  # the bridge's own counts of the start flush once a second
        from_bus = Message.objects.filter(direction__in=[Direction.RECV, Direction.OBSERVED])
        stored_before = from_bus.count()
        before = metrics(client)

        total = 40
        rows = messages_send(requests=[SendRequest(to=agents[i % 2], payload={"i": i})
                                       for i in range(total)]).rows
        pks = [row.pk for row in rows]
        eventually(lambda: Message.objects.filter(pk__in=pks, status=Status.COMPLETED).count()
                   == total, what=f"all {total} tasks completed")
        eventually(lambda: not Message.objects.filter(direction=Direction.SEND,
                                                      status=Status.SENT).exists(),
                   what="the console's ACKs of the responses published")
        stored = from_bus.count() - stored_before
        instance = bridge.client_id

        def settled():  # the bridge hands its own counts over once a second
            after = metrics(client)
            ingested = delta(after, before, "reach_bridge_ingested_total", instance=instance)
            return ingested == stored and after

        after = eventually(settled, what="the bridge's counts in /metrics")
    finally:
        sim.stop()

    # Every status change of our task requests, as the transition table records them.
    moves = Counter(dict(Transition.objects.filter(message__pk__in=pks)
                         .values_list("to_status").annotate(n=Count("id"))))
    assert moves[Status.SENT] == moves[Status.COMPLETED] == total
    for status, n in moves.items():
        assert delta(after, before, "reach_messages_total", status=status,
                     type="TASK_REQUEST") == n, status
    # Everything received: the nodes' ACKs and responses, as stored.
    received = Counter(dict(Message.objects.filter(direction=Direction.RECV)
                            .values_list("message_type").annotate(n=Count("id"))))
    assert received[MT.ACK] >= total and received[MT.TASK_RESPONSE] == total
    for kind, n in received.items():
        assert delta(after, before, "reach_messages_total", status="RECV", type=kind) == n
    assert delta(after, before, "reach_retries_total") == 0

    # publish → ACK, for each request whose ACK came after the broker's PUBACK was recorded
    # (an ACK that overtakes the PUBACK is left out: its publish time is only known later).
    acked = Message.objects.filter(pk__in=pks, acked_at__gte=F("published_at"))
    latencies = [(r.acked_at - r.published_at).total_seconds() for r in acked]
    assert latencies
    assert delta(after, before, "reach_delivery_latency_seconds_count") == len(latencies)
    assert math.isclose(delta(after, before, "reach_delivery_latency_seconds_sum"),
                        sum(latencies), abs_tol=1e-5 * len(latencies))
    for le in LATENCY_BUCKETS_S:
        assert delta(after, before, "reach_delivery_latency_seconds_bucket", le=str(le)) == (
            sum(1 for x in latencies if x <= le)), le
    assert delta(after, before, "reach_delivery_latency_seconds_bucket", le="+Inf") == len(
        latencies)

    # Gauges read from the database at scrape time.
    for status in Agent.Status.values:
        assert value(after, "reach_agents", status=status) == Agent.objects.filter(
            status=status).count()
    assert value(after, "reach_agents", status="ONLINE") >= 2
    assert value(after, "reach_nodes", status="ONLINE") == ClusterNode.objects.filter(
        status="ONLINE").count()
    assert value(after, "reach_inflight") == 0 and value(after, "reach_held") == 0
    assert value(after, "reach_messages_open", status="PUBLISHED") == 0
    assert value(after, "reach_bridge_connected", instance=instance) == 1
    assert value(after, "reach_scrape_source_ok", source="database") == 1
    assert value(after, "reach_scrape_source_ok", source="cache") == 1

    # Readiness: every transmission the broker took was answered.
    def judged():
        body = client.get("/readyz").json()
        return body["deliveryRate"]["min10s"] is not None and body
    body = eventually(judged, what="the run's seconds judged by readiness")
    assert body["deliveryRate"]["min10s"] == 1.0
    assert body["checks"]["delivery"]["ok"] is True


def test_counters_of_every_kind_are_families_of_their_own(client):
    before = metrics(client)
    reason = f"probe_{uuid.uuid4().hex[:6]}"
    counters_add({f"rejected:{reason}": 3, "duplicate_message_id": 2,
                  "duplicate_idempotency_key": 1, "storm_refused": 4,
                  "publish_deferred:out of memory": 1, "messages:FAILED:TASK_REQUEST": 5})
    after = metrics(client)
    assert delta(after, before, "reach_rejected_total", reason=reason) == 3
    assert delta(after, before, "reach_duplicates_total", kind="message_id") == 2
    assert delta(after, before, "reach_duplicates_total", kind="idempotency_key") == 1
    assert delta(after, before, "reach_storm_refused_total") == 4
    assert delta(after, before, "reach_publish_deferred_total", reason="out of memory") == 1
    assert delta(after, before, "reach_messages_total", status="FAILED",
                 type="TASK_REQUEST") == 5


def test_a_counter_the_cache_lost_is_listed_again_once_counted_again(client):
    """A Redis restart empties the counters and their index: a process that counts the name
    again must make it visible again, not only add to a value no scrape lists."""
    from django.core.cache import cache

    reason = f"probe_{uuid.uuid4().hex[:6]}"
    counters_add({f"rejected:{reason}": 3})
    cache.clear()  # what a Redis restart without persistence leaves
    counters_add({f"rejected:{reason}": 2})
    families = {f.name: f for f in text_string_to_metric_families(
        client.get("/metrics").content.decode())}
    samples = [s for s in families["reach_rejected"].samples
               if s.labels.get("reason") == reason and s.name.endswith("_total")]
    assert [s.value for s in samples] == [2.0]


def test_the_delivery_rate_is_the_lowest_share_answered_per_second():
    delivery_forget()
    now = time.time()
    base = int(now) - 30
    assert delivery_rate(now=now, settle_s=0.5).lowest is None  # no traffic: null
    delivery_add_later(published={base: 10, base + 1: 8, base + 2: 1},
                       answered={base: 10, base + 1: 2})
    metrics_flush()
    # A second is judged once `settle_s` has passed since it ended; the window is ten seconds.
    rate = delivery_rate(now=base + 3 + 0.5, settle_s=0.5)
    assert rate.seconds == [(base, 10, 10), (base + 1, 8, 2), (base + 2, 1, 0)]
    assert rate.lowest == 0.0  # the second with one unanswered transmission
    assert rate.lowest_of(at_least=5) == 0.25  # readiness judges seconds with enough traffic
    not_yet = delivery_rate(now=base + 3 + 0.4, settle_s=0.5)
    assert [s for s, _, _ in not_yet.seconds] == [base, base + 1]
    later = delivery_rate(now=base + 11 + 0.5, settle_s=0.5)  # base has left the window
    assert [s for s, _, _ in later.seconds] == [base + 1, base + 2]
    assert delivery_rate(now=base + 14, settle_s=0.5).lowest is None


def _start(args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
        return response.read().decode()


def _get_when_up(url: str) -> str | None:
    try:
        return _get(url)
    except OSError:
        return None


def test_a_count_is_made_once_and_every_process_shows_it(mqtt_settings, broker, client,
                                                         tmp_path):
    """A bridge in a process of its own stores what a node publishes; this process and a
    Daphne of its own, sharing the database and Redis, both show the count once."""
    if not settings.REDIS_URL:
        if expect_real_services():
            pytest.fail("REACH_EXPECT_REAL_SERVICES=1 but REDIS_URL is not set")
        pytest.skip("processes share counters through Redis; embedded defaults are one process")
    instance = f"mp-{uuid.uuid4().hex[:6]}"
    port = free_port()
    # No REACH_CONSOLE_ID: the processes are one console because they share its database,
    # though the Daphne spells the address another way (localhost, not 127.0.0.1).
    env = {**os.environ, "DATABASE_URL": database_url(), "REDIS_URL": settings.REDIS_URL,
           "MQTT_URL": settings.MQTT_URL, "MQTT_PROTOCOL": settings.MQTT_PROTOCOL,
           "MQTT_TOPIC_PREFIX": settings.MQTT_TOPIC_PREFIX, "REACH_NODE_ID": "console",
           "REACH_BRIDGE_INSTANCE": instance, "REACH_RUN_DIR": str(tmp_path),
           "PYTHONUNBUFFERED": "1"}
    env.pop("REACH_CONSOLE_ID", None)
    client_id = client_id_for("console", instance, console_id())
    log = open(tmp_path / "processes.log", "w+")  # noqa: SIM115 - closed below
    bridge_proc = _start([sys.executable, "manage.py", "mqtt_bridge"], env, log)
    elsewhere = {**env, "DATABASE_URL": env["DATABASE_URL"].replace("@127.0.0.1:", "@localhost:")}
    if env["DATABASE_URL"].startswith("postgres"):
        assert "@localhost:" in elsewhere["DATABASE_URL"], env["DATABASE_URL"]
    daphne = _start([str(Path(sys.executable).parent / "daphne"), "-b", "127.0.0.1", "-p",
                     str(port), "reachconsole.asgi:application"], elsewhere, log)
    publisher = broker.client()
    try:
        eventually(lambda: ClusterNode.objects.filter(node_id="console",
                                                      last_seen_at__isnull=False).exists(),
                   timeout=30, what="the bridge process starting")
        before = metrics(client)
        total = 25
        topic = protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, "node-z")
        ids = []
        for i in range(total):
            env_ = protocol.new_envelope(message_type=MT.EVENT, from_agent_id="fin.tax",
                                         to_agent_id="llm.chat", payload={"n": i})
            ids.append(env_.message_id)
            publisher.publish(topic, protocol.encode(env_), qos=1)
        eventually(lambda: Message.objects.filter(message_id__in=ids).count() == total,
                   what=f"the {total} messages stored by the bridge process")

        def shown():  # the other process hands its counts over within a second or so
            here = metrics(client)
            return (delta(here, before, "reach_bridge_ingested_total", instance=client_id)
                    == delta(here, before, "reach_messages_total", status="OBSERVED",
                             type="EVENT") == total and here)

        here = eventually(shown, what="this process showing the other's counts")
        time.sleep(1.5)  # nothing more arrives: each message was counted once
        again = metrics(client)
        for name, labels in (("reach_bridge_ingested_total", {"instance": client_id}),
                             ("reach_messages_total", {"status": "OBSERVED", "type": "EVENT"})):
            assert value(again, name, **labels) == value(here, name, **labels)
        there = scrape(eventually(lambda: _get_when_up(f"http://127.0.0.1:{port}/metrics"), 30,
                                  "the Daphne answering"))
        for name, labels in (("reach_bridge_ingested_total", {"instance": client_id}),
                             ("reach_messages_total", {"status": "OBSERVED", "type": "EVENT"})):
            assert value(there, name, **labels) == value(here, name, **labels)
        assert value(there, "reach_bridge_connected", instance=client_id) == 1
        ready = json.loads(_get(f"http://127.0.0.1:{port}/readyz"))
        assert ready["checks"]["broker"]["ok"] is True, ready
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        stop_process(daphne)
        stop_process(bridge_proc)
        log.seek(0)
        output = log.read()
        log.close()
    assert "Traceback" not in output, output[-3000:]
