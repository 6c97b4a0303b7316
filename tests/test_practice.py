"""Making things go wrong on purpose in `make run`'s simulated cluster, while it runs
(reachconsole/dev/practice.py, the simulator's faults): each fault does what the page says,
on a real broker, and the page switches them in Chromium."""

from __future__ import annotations

import queue
import uuid

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from playwright.sync_api import expect

from messages import protocol
from reachconsole.core import roles
from reachconsole.core.audit import AuditEntry
from reachconsole.dev import simulator
from reachconsole.dev.practice import practice_offer
from reachconsole.dev.simulator import Knobs, SimulatedCluster
from tests.browser import chromium_page, htmx_ready, sign_in
from tests.conftest import TOKEN
from tests.test_bridge import eventually
from tests.test_browser_tasks import person

MT = protocol.MessageType


def _request(agent_id: str) -> protocol.Envelope:
    key = f"practice-{uuid.uuid4().hex}"
    return protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="ops.probe", to_agent_id=agent_id,
        target_node_id="sim-node-a", task_id=key,
        headers={"replyNodeId": "listener", "originNodeId": "listener",
                 "idempotencyKey": key}, payload={"q": 1})


def test_each_fault_does_what_it_says(broker, mqtt_settings, monkeypatch):
    """Silent: nothing comes back, not even to a retry. Failing: ACK, then ok=false. Slow:
    ACK at once, the answer later, and the node is not held up meanwhile."""
    monkeypatch.setattr(simulator, "SLOW_FAULT_MS", 1500)
    prefix = settings.MQTT_TOPIC_PREFIX
    cluster = SimulatedCluster(base_url="http://127.0.0.1:9", token=TOKEN, nodes=1, agents=4,
                               mqtt_url=broker.url, mqtt_protocol=broker.protocol,
                               knobs=Knobs(rate=0, slow_ms=0), prefix=prefix)
    node = cluster.nodes[0]
    silent, failing, slow, normal = (a.agent_id for a in node.agents)
    cluster.agent_fault(silent, "silent")
    cluster.agent_fault(failing, "failing")
    cluster.agent_fault(slow, "slow")
    with pytest.raises(ValueError, match="use one of"):
        cluster.agent_fault(normal, "sleepy")
    with pytest.raises(KeyError, match="no simulated agent"):
        cluster.agent_fault("fin.nobody", "slow")

    heard: queue.Queue = queue.Queue()
    listener = broker.client()
    node.client = broker.client()
    try:
        assert listener.subscribe(protocol.inbox_topic(prefix, "listener"), qos=1)[0] == 0
        listener.on_message = lambda c, u, m: heard.put(protocol.decode(m.payload))
        eventually(lambda: _echo(listener, node.client, prefix, heard), what="the SUBACK")
        requests = {name: _request(name) for name in (silent, failing, slow, normal)}
        for env in requests.values():
            cluster.handle(node, protocol.encode(env))
        # handle() came back before the slow agent answered: it works on a timer.
        assert next(a for a in node.agents if a.agent_id == slow).inflight == 1
        cluster.handle(node, protocol.encode(_request(silent)))  # a retry, as silent
        got: dict[str, list] = {}
        while sum(1 for kinds in got.values() for k in kinds if k[0] == MT.TASK_RESPONSE) < 3:
            answer = heard.get(timeout=15)
            got.setdefault(answer.from_agent_id, []).append(
                (answer.message_type, (answer.payload or {}).get("ok")))
    finally:
        for client in (listener, node.client):
            client.loop_stop()
            client.disconnect()
    assert silent not in got
    assert got[failing] == [(MT.ACK, None), (MT.TASK_RESPONSE, False)]
    assert got[slow] == [(MT.ACK, None), (MT.TASK_RESPONSE, True)]
    assert got[normal] == [(MT.ACK, None), (MT.TASK_RESPONSE, True)]


def _echo(listener, sender, prefix, heard) -> bool:
    """A marker to the listener came back: its subscription is in place."""
    sender.publish(protocol.inbox_topic(prefix, "listener"), b"{}", qos=1).wait_for_publish(5)
    try:
        heard.get(timeout=0.5)
    except queue.Empty:
        return False
    return True


@pytest.fixture
def practice_cluster(live_server, mqtt_settings, broker):
    mqtt_settings.ROOT_URLCONF = "reachconsole.dev.urls"  # as runconsole mounts it
    cluster = SimulatedCluster(base_url=live_server.url, token=TOKEN, nodes=2, agents=4,
                               mqtt_url=broker.url, mqtt_protocol=broker.protocol,
                               knobs=Knobs(rate=0), prefix=settings.MQTT_TOPIC_PREFIX)
    cluster.start()
    assert cluster.wait_subscribed(20), "the simulated nodes did not hear their inboxes"
    practice_offer(cluster)
    yield cluster
    practice_offer(None)
    cluster.stop()


@pytest.mark.django_db(transaction=True)
def test_an_operator_stops_a_node_and_silences_an_agent_from_the_page(
        practice_cluster, live_server, async_unsafe):
    person("olga", roles.OPERATOR_PERMISSIONS)
    node_b = practice_cluster.node("sim-node-b")
    agent = practice_cluster.nodes[0].agents[0].agent_id
    with chromium_page() as page:
        sign_in(page, live_server.url, "olga", "pw-olga-123", next_path="/practice/")
        htmx_ready(page)
        expect(page.locator("header nav a[aria-current=page]")).to_have_text("Practice")
        page.get_by_role("button", name="Stop sim-node-b").click()
        expect(page.locator("[data-practice-done]")).to_contain_text("sim-node-b stopped")
        expect(page.locator("#node-sim-node-b")).to_contain_text("stopped")
        assert node_b.alive is False and node_b.client is None
        page.get_by_role("button", name="Start sim-node-b").click()
        expect(page.locator("#node-sim-node-b")).to_contain_text("running")
        assert node_b.connected.wait(15), "the started node did not connect again"

        page.get_by_label(f"Fault for {agent}").select_option("silent")
        page.locator(f"tr[data-agent='{agent}'] button").click()
        expect(page.locator(f"tr[data-agent='{agent}'] [data-fault]")).to_have_text(
            simulator.FAULTS["silent"])
    assert practice_cluster.agent(agent).fault == "silent"
    assert list(AuditEntry.objects.filter(action__startswith="practice_").order_by("pk")
                .values_list("action", "target", "actor")) == [
        ("practice_node_stop", "sim-node-b", "olga"),
        ("practice_node_start", "sim-node-b", "olga"),
        ("practice_agent_fault", agent, "olga")]


@pytest.mark.django_db(transaction=True)
def test_a_viewer_sees_the_faults_but_cannot_switch_them(practice_cluster):
    person("vic", roles.VIEWER_PERMISSIONS)
    client = Client()
    client.force_login(User.objects.get(username="vic"))
    assert client.get("/practice/").status_code == 200
    response = client.post("/practice/nodes/sim-node-a/stop/")
    assert response.status_code == 403
    assert practice_cluster.node("sim-node-a").alive is True


@pytest.mark.django_db
def test_the_console_without_a_simulated_cluster_has_no_practice_page(settings):
    """Production's URLs have none, and its nav no link to one; runconsole's, without a
    cluster, say why."""
    person("ola", roles.OPERATOR_PERMISSIONS)
    client = Client()
    client.force_login(User.objects.get(username="ola"))
    assert client.get("/practice/").status_code == 404
    assert "/practice/" not in client.get("/").content.decode()
    settings.ROOT_URLCONF = "reachconsole.dev.urls"
    response = client.get("/practice/")
    assert response.status_code == 404
    assert "runs no simulated cluster" in response.content.decode()


def test_make_run_checks_its_fault_flags_before_it_starts_anything():
    from django.core.management.base import CommandError

    from reachconsole.management.commands.runconsole import Command, faults_parse

    agents = ["fin.tax", "llm.chat"]
    assert faults_parse(["fin.tax=silent", " llm.chat = slow "], agents=agents) == [
        ("fin.tax", "silent"), ("llm.chat", "slow")]
    for bad, words in [("fin.tax", "write AGENT=FAULT"),
                       ("fin.nobody=silent", "they are fin.tax, llm.chat"),
                       ("fin.tax=sleepy", "the faults are slow, failing, silent")]:
        with pytest.raises(CommandError, match=words):
            faults_parse([bad], agents=agents)
    # Every flag says what it does (make run ARGS="…" is how a newcomer passes them).
    parser = Command().create_parser("manage.py", "runconsole")
    mine = [a for a in parser._actions if a.dest.startswith("simulate_")]  # noqa: SLF001
    assert len(mine) >= 8 and all(a.help for a in mine), [a.dest for a in mine if not a.help]
