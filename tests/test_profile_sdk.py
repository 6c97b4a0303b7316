"""The console's bridge and agents written with the A2A-over-MQTT profile's own SDK
(`a2a-over-mqtt`, emqx/mqtt-for-ai), on the real broker: the SDK's retained Agent Card puts
the agent on the roster, its Last Will (the process killed) or its goodbye (stopped) makes it
OFFLINE, and a cleared card removes it. Malformed cards the SDK never sends are published
with the broker's own `mosquitto_pub`.

The profile is MQTT 5 only: the embedded broker (`make test`'s) speaks 3.1.1, so these run
in CI's real-services run, against Mosquitto."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from messages.bridge import Bridge
from reachconsole.core.metrics import counters_snapshot
from roster.models import Agent, RosterEvent
from tests.conftest import stop_process

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def v5(broker):
    if broker.protocol != "5":
        pytest.skip("the A2A-over-MQTT profile is MQTT 5 only; the embedded broker speaks "
                    "3.1.1 (CI's real-services run has Mosquitto)")
    return broker


@pytest.fixture
def profile_bridge(v5, mqtt_settings, request):
    mqtt_settings.REACH_A2A_PROFILE = True
    # A root of the test's own where no SDK agent is needed: the counts are then its own.
    root = getattr(request, "param", "")
    if root:
        mqtt_settings.REACH_A2A_ROOT = root
    instance = Bridge(url=v5.url, node_id="console", prefix=mqtt_settings.MQTT_TOPIC_PREFIX,
                      instance=uuid.uuid4().hex[:8], protocol_version="5", heartbeat_ms=200,
                      a2a_profile=True)
    instance.start()
    assert instance.wait_connected(10)
    yield instance
    instance.stop()


@pytest.fixture
def org(v5):
    """An org of this test's own, and every card it left retained cleared afterwards."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    subprocess.run(["mosquitto_sub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port),
                    "-t", f"$a2a/v1/discovery/{name}/#", "-W", "1", "-v", "--retained-only",
                    "--remove-retained"], capture_output=True, check=False, timeout=10)


def agent_process(broker, org: str, agent: str, *skills: str,
                  version: str = "1.0.0") -> subprocess.Popen:
    args = [sys.executable, str(ROOT / "tests" / "profile_agent.py"), "--host", broker.host,
            "--port", str(broker.port), "--org", org, "--unit", "ops", "--agent", agent,
            "--version", version]
    for skill in skills:
        args += ["--skill", skill]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() else "")
    return proc


def eventually(check, *, timeout: float = 10.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def agent_in(agent_id: str, **expected) -> Agent | None:
    agent = Agent.objects.filter(agent_id=agent_id).first()
    if agent and all(getattr(agent, k) == v for k, v in expected.items()):
        return agent
    return None


def test_an_sdk_agent_is_on_the_roster_then_offline_by_its_last_will(v5, profile_bridge, org):
    proc = agent_process(v5, org, "echo", "echo", "summarize")
    agent_id = f"{org}/ops/echo"
    try:
        agent = eventually(lambda: agent_in(agent_id), what="the card on the roster")
        assert agent.dialect == "a2a-mqtt" and agent.namespace.name == org
        assert agent.capabilities == ["echo", "summarize"]
        assert '"protocolBinding": "MQTTv5+JSONRPCv2"' in agent.card  # verbatim, as sent
        assert (agent.status, agent.presence_source) == ("ONLINE", "agent")
        # Killed: no goodbye; the broker publishes the Last Will the SDK left with it.
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        agent = eventually(lambda: agent_in(agent_id, status="OFFLINE"),
                           what="OFFLINE by the Last Will")
        assert agent.presence_source == "lwt"
        assert list(RosterEvent.objects.filter(agent_id=agent_id).order_by("at", "id")
                    .values_list("kind", "detail")) == [
            ("REGISTERED", "Agent Card 'Echo echo' v1.0.0, online"),
            ("OFFLINE", "a2a-status=offline, source lwt")]
    finally:
        stop_process(proc)


def test_stopped_then_back_with_a_new_card_then_cleared(v5, profile_bridge, org):
    agent_id = f"{org}/ops/echo"
    proc = agent_process(v5, org, "echo", "echo")
    eventually(lambda: agent_in(agent_id, status="ONLINE"), what="registered")
    # Stopped gracefully, the SDK republishes its card offline, source agent.
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    eventually(lambda: agent_in(agent_id, status="OFFLINE", presence_source="agent"),
               what="OFFLINE by its goodbye")
    # Back, with another version and a skill more: ONLINE, the change in its history.
    proc = agent_process(v5, org, "echo", "echo", "translate", version="1.1.0")
    try:
        agent = eventually(lambda: agent_in(agent_id, status="ONLINE", version="1.1.0"),
                           what="back online with the new card")
        assert agent.capabilities == ["echo", "translate"]
        kinds = list(RosterEvent.objects.filter(agent_id=agent_id).order_by("at", "id")
                     .values_list("kind", flat=True))
        assert kinds == ["REGISTERED", "OFFLINE", "CARD", "REVIVED"]
    finally:
        stop_process(proc)
    # The profile's unregister: the retained card cleared.
    subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port),
                    "-t", f"$a2a/v1/discovery/{agent_id}", "-r", "-n", "-q", "1"],
                   check=True, timeout=10)
    eventually(lambda: not Agent.objects.filter(agent_id=agent_id).exists(),
               what="removed by the cleared card")


def rejected(bridge, reason: str) -> int:
    key = f"profile_cards_rejected:{reason}"
    return bridge.counts[key] + counters_snapshot().get(key, 0)


PRIVATE_ROOT = f"$rc{uuid.uuid4().hex[:8]}/v1"


@pytest.mark.parametrize("profile_bridge", [PRIVATE_ROOT], indirect=True)
def test_malformed_cards_from_bare_frames_are_refused_and_counted(v5, profile_bridge, org):
    def publish(agent: str, payload: str, *props: str) -> None:
        args = ["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port), "-q", "1",
                "-r", "-t", f"{PRIVATE_ROOT}/discovery/{org}/ops/{agent}", "-m", payload]
        for prop in props:
            args += ["-D", "PUBLISH", "user-property", *prop.split("=")]
        subprocess.run(args, check=True, timeout=10)

    before = {r: rejected(profile_bridge, r) for r in ("bad_json", "missing_fields")}
    try:
        publish("broken", "{not json", "a2a-status=online")
        publish("bare", '{"name": "only a name"}')
        # Only this test publishes under its root: each refusal is one of these two.
        eventually(lambda: rejected(profile_bridge, "bad_json") == before["bad_json"] + 1
                   and rejected(profile_bridge, "missing_fields")
                   == before["missing_fields"] + 1, what="both refusals counted")
        assert not Agent.objects.filter(namespace__name=org).exists()
        assert not Agent.objects.filter(agent_id__startswith=f"{org}/").exists()
    finally:
        for agent in ("broken", "bare"):
            subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port),
                            "-t", f"{PRIVATE_ROOT}/discovery/{org}/ops/{agent}", "-r", "-n"],
                           check=False, timeout=10)


def ask(broker, org: str, agent: str, *, text: str = "hello", task: str = "",
        first_reply: float = 15.0) -> list[list[str]]:
    """The SDK's Requester, as `{org}/ops/asker`: its replies, as it read them."""
    task = task or str(uuid.uuid4())
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "profile_agent.py"), "--host", broker.host,
         "--port", str(broker.port), "--org", org, "--unit", "ops", "--agent", "asker",
         "--ask", agent, "--text", text, "--task", task, "--first-reply", str(first_reply)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_an_sdk_requesters_task_is_traced_to_completed_with_its_artifact(
        v5, profile_bridge, org):
    from messages.models import Message, Task

    proc = agent_process(v5, org, "echo", "echo")
    task = str(uuid.uuid4())
    try:
        replies = ask(v5, org, "echo", text="over the bus", task=task)
        assert ["artifact", "echo: over the bus"] in replies  # the SDK's own reading
        request = eventually(lambda: Message.objects.filter(
            task_id=task, message_type="TASK_REQUEST", status="COMPLETED").first(),
            what="the observed request COMPLETED")
        assert request.direction == "OBSERVED" and request.to_agent_id == f"{org}/ops/echo"
        assert request.from_agent_id == f"{org}/ops/asker"
        headers = request.headers
        assert headers["method"] == "SendMessage" and headers["jsonrpcId"] == "req-1"
        assert headers["responseTopic"].startswith(f"$a2a/v1/reply/{org}/ops/asker/")
        assert bytes.fromhex(headers["correlationData"]) == task[:16].encode()
        assert "violations" not in headers
        # Its replies, in the order they came: acknowledged, working, the artifact, done.
        answers = list(Message.objects.filter(in_reply_to=request.message_id)
                       .order_by("created_at", "id").values_list("message_type", "headers"))
        assert [(kind, h["reply"]) for kind, h in answers] == [
            ("ACK", "TASK_STATE_SUBMITTED"), ("ACK", "TASK_STATE_WORKING"),
            ("EVENT", answers[2][1]["reply"]), ("TASK_RESPONSE", "TASK_STATE_COMPLETED")]
        assert answers[2][1]["reply"].startswith("artifact ")
        entry = Task.objects.get(task_id=task)
        assert (entry.status, entry.direction) == ("COMPLETED", "OBSERVED")
    finally:
        stop_process(proc)


def test_a_request_nobody_answers_is_retried_with_fresh_correlation_and_expires(
        v5, profile_bridge, org, settings):
    from messages.models import Message
    from messages.sweeps import deliveries_sweep

    settings.REACH_A2A_FIRST_REPLY_MS = 1000
    task = str(uuid.uuid4())
    assert ask(v5, org, "nobody", task=task, first_reply=1.0) == [["timeout", ""]]
    attempts = eventually(lambda: list(Message.objects.filter(task_id=task).order_by("id"))
                          if Message.objects.filter(task_id=task).count() == 3 else None,
                          what="the three attempts stored")
    # A fresh Correlation Data each attempt: three rows of one task.
    assert len({a.headers["correlationData"] for a in attempts}) == 3
    # The sweep judges silence over what the bridge's probes prove it heard: a moment on.
    def ended() -> bool:
        deliveries_sweep()
        return all(m.status == "EXPIRED" for m in Message.objects.filter(task_id=task))

    eventually(ended, what="every attempt EXPIRED")
    assert {m.error for m in Message.objects.filter(task_id=task)} == {
        "no answer seen on the bus within 1000 ms"}


@pytest.mark.parametrize("profile_bridge", [PRIVATE_ROOT], indirect=True)
def test_requests_that_break_the_profile_are_flagged_from_bare_frames(v5, profile_bridge, org):
    from messages.models import Message

    def publish(tree: str, path: str, body: dict, *options: str) -> None:
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port),
                        "-q", "1", "-t", f"{PRIVATE_ROOT}/{tree}/{org}/ops/{path}",
                        "-m", json.dumps(body), *options], check=True, timeout=10)

    def send(task: str) -> dict:
        return {"jsonrpc": "2.0", "id": task, "method": "SendMessage", "params": {
            "message": {"messageId": task, "role": "ROLE_USER", "parts": [{"text": "x"}],
                        "taskId": task}}}

    reply = f"{PRIVATE_ROOT}/reply/{org}/ops/cli/s1"
    publish("request", "echo", send("t-no-reply"))
    publish("request", "echo", send("t-retained"), "-r", "-D", "PUBLISH", "response-topic",
            reply, "-D", "PUBLISH", "correlation-data", "c-ret")
    publish("request", "pool/sum", send("t-pool"), "-D", "PUBLISH", "response-topic", reply,
            "-D", "PUBLISH", "correlation-data", "c-pool")
    try:
        rows = eventually(lambda: {m.task_id: m for m in Message.objects.filter(
            task_id__in=["t-no-reply", "t-retained", "t-pool"])} if Message.objects.filter(
            task_id__in=["t-no-reply", "t-retained", "t-pool"]).count() == 3 else None,
            what="the three requests stored")
        assert rows["t-no-reply"].headers["violations"] == ["no_response_topic",
                                                            "no_correlation_data"]
        assert rows["t-retained"].headers["violations"] == ["retained_request"]
        assert rows["t-pool"].headers["pool"] == f"{org}/ops/pool/sum"
        # The pool's member answers without naming itself.
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port),
                        "-q", "1", "-t", reply, "-D", "PUBLISH", "correlation-data", "c-pool",
                        "-m", json.dumps({"jsonrpc": "2.0", "id": "t-pool", "result": {
                            "statusUpdate": {"taskId": "t-pool", "status": {
                                "state": "TASK_STATE_COMPLETED"}}}})],
                       check=True, timeout=10)
        answer = eventually(lambda: Message.objects.filter(
            in_reply_to=rows["t-pool"].message_id).first(), what="the pool's reply stored")
        assert answer.headers["violations"] == ["pooled_reply_without_responder"]
        rows["t-pool"].refresh_from_db()
        assert rows["t-pool"].status == "COMPLETED"
    finally:
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port),
                        "-t", f"{PRIVATE_ROOT}/request/{org}/ops/echo", "-r", "-n"],
                       check=False, timeout=10)


def test_a_console_send_to_an_sdk_responder_completes_with_its_artifact(
        v5, profile_bridge, org, api):
    from messages.models import Message

    proc = agent_process(v5, org, "echo", "echo")
    agent_id = f"{org}/ops/echo"
    try:
        eventually(lambda: agent_in(agent_id, status="ONLINE"), what="the card on the roster")
        r = api.post("/api/a2a/send", {"to": agent_id, "payload": {"text": "from the console"},
                                       "taskId": f"{org}-t1", "wait": True, "timeoutMs": 20000})
        assert r.status_code == 200, r.content
        body = r.json()
        assert body["status"] == "COMPLETED" and body["messageId"].startswith("a2a-")
        task = body["response"]["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        assert [a["parts"] for a in task["artifacts"]] == [[{"text": "echo: from the console"}]]
        # One row for the request: the bridge heard it go by on the request tree, and the
        # row it would have made was the console's own. Its replies are the console's.
        rows = Message.objects.filter(task_id=f"{org}-t1")
        assert rows.filter(message_type="TASK_REQUEST").count() == 1
        replies = rows.exclude(message_type="TASK_REQUEST")
        assert set(replies.values_list("direction", flat=True)) == {"RECV"}
        request = rows.get(message_type="TASK_REQUEST")
        assert request.published_at is not None and request.acked_at is not None
    finally:
        stop_process(proc)


def test_a_console_send_nobody_answers_is_retried_with_fresh_correlation_and_expires(
        v5, profile_bridge, org, settings):
    """A card on the bus, nobody behind it: the profile's three attempts, each published
    with a Correlation Data of its own, then EXPIRED with the words why."""
    from messages.models import Message
    from messages.outbound import SendRequest, message_send
    from messages.sweeps import deliveries_sweep

    settings.REACH_A2A_FIRST_REPLY_MS = 500
    settings.REACH_A2A_BACKOFF_MS = [100, 200]
    agent_id = f"{org}/ops/mute"
    card = json.dumps({"name": "Mute", "description": "answers nothing", "version": "1",
                       "url": "mqtt://x", "capabilities": {}, "skills": [{"id": "mute"}],
                       "defaultInputModes": ["text/plain"],
                       "defaultOutputModes": ["text/plain"]})
    subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", v5.host, "-p", str(v5.port), "-q",
                    "1", "-r", "-t", f"$a2a/v1/discovery/{agent_id}", "-m", card],
                   check=True, timeout=10)
    eventually(lambda: agent_in(agent_id, status="ONLINE"), what="the card on the roster")
    row = message_send(request=SendRequest(to=agent_id, payload={"text": "anyone?"},
                                           task_id=f"{org}-mute", timeout_ms=30000))
    assert row.status == "SENT"

    def ended() -> bool:
        deliveries_sweep()
        rows = Message.objects.filter(task_id=f"{org}-mute", message_type="TASK_REQUEST")
        return rows.filter(status="EXPIRED").exists()

    eventually(ended, timeout=20, what="the last attempt EXPIRED")
    attempts = list(Message.objects.filter(task_id=f"{org}-mute", message_type="TASK_REQUEST")
                    .order_by("attempt"))
    assert [(a.attempt, a.status) for a in attempts] == [(1, "RETRIED"), (2, "RETRIED"),
                                                         (3, "EXPIRED")]
    assert all(a.published_at for a in attempts)  # each went on the bus
    assert len({a.headers["correlationData"] for a in attempts}) == 3
    assert "3 attempts made, each with its own Correlation Data" in attempts[-1].error


class PoolMember:
    """A member of a pool, written on paho as the profile says (the SDK has no pools): it
    takes requests on the pool's topic and on its own, and answers each naming itself with
    `a2a-responder-agent-id`. Subscribed plainly: Mosquitto 2.0 delivers nothing through a
    shared filter of a `$` tree, so this one member is the whole pool."""

    def __init__(self, broker, org: str, member: str, pool: str):
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.asked: list[tuple[str, str]] = []  # (topic, text)
        self._props = lambda: Properties(PacketTypes.PUBLISH)
        self.member = member
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"{org}/ops/{member}", protocol=mqtt.MQTTv5)
        self.client.on_message = self._answer
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        for topic in (f"$a2a/v1/request/{org}/ops/pool/{pool}",
                      f"$a2a/v1/request/{org}/ops/{member}"):
            self.client.subscribe(topic, qos=1)

    def _answer(self, client, userdata, message) -> None:
        request = json.loads(message.payload)
        text = request["params"]["message"]["parts"][0]["text"]
        self.asked.append((message.topic, text))
        task = request["params"]["message"]["taskId"]
        props = self._props()
        props.CorrelationData = message.properties.CorrelationData
        props.UserProperty = [("a2a-responder-agent-id", self.member)]
        body = {"jsonrpc": "2.0", "id": request["id"], "result": {"statusUpdate": {
            "taskId": task, "status": {"state": "TASK_STATE_COMPLETED"}}}}
        client.publish(message.properties.ResponseTopic, json.dumps(body), qos=1,
                       properties=props)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_a_pool_send_is_answered_by_a_member_and_the_follow_up_goes_to_it(
        v5, profile_bridge, org, api):
    from messages.models import Message

    member = PoolMember(v5, org, "worker-1", "sum")
    try:
        time.sleep(0.5)  # its subscriptions are through
        first = api.post("/api/a2a/send", {"to": f"{org}/ops/pool/sum", "taskId": f"{org}-p",
                                           "payload": {"text": "1+1"}, "wait": True,
                                           "timeoutMs": 20000})
        assert first.status_code == 200, first.content
        assert first.json()["status"] == "COMPLETED"
        again = api.post("/api/a2a/send", {"to": f"{org}/ops/pool/sum", "taskId": f"{org}-p",
                                           "payload": {"text": "and 2"}, "wait": True,
                                           "timeoutMs": 20000})
        assert again.status_code == 200, again.content
        assert again.json()["toAgentId"] == f"{org}/ops/worker-1"
        assert member.asked == [(f"$a2a/v1/request/{org}/ops/pool/sum", "1+1"),
                                (f"$a2a/v1/request/{org}/ops/worker-1", "and 2")]
        replies = Message.objects.filter(task_id=f"{org}-p", direction="RECV")
        assert {r.headers.get("responder") for r in replies} == {"worker-1"}
        assert not any(r.headers.get("violations") for r in replies)
    finally:
        member.close()
