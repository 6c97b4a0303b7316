"""The console on a broker that wants TLS and a password: a Mosquitto of this module's own,
with a self-signed CA made here and a password file made by mosquitto_passwd.

With the right CA and credentials the bridge connects, stores what it hears and publishes
what the console sends; with a wrong password or a CA that did not sign the broker's
certificate it says why once in the log, readiness answers 503 with those words, and
nothing crashes or loops with tracebacks."""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import shutil
import subprocess
import threading
import uuid

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.conf import settings
from django.core.cache import cache

from messages import protocol
from messages.bridge import Bridge
from messages.broker_caps import CAPS_KEY
from messages.models import Direction, Message, Status
from messages.mqtt_client import broker_target, mqtt_client
from messages.outbound import SendRequest, message_send
from tests.conftest import expect_real_services, register
from tests.mqtt import free_port
from tests.test_bridge import _port_open, eventually

pytestmark = pytest.mark.django_db(transaction=True)

USER, PASSWORD = "reach", "s3cret-broker-pw"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _ca(name: str):
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _server_cert(ca_key, ca_cert):
    key = _key()
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


class TlsMosquitto:
    def __init__(self, root):
        self.port = free_port()
        pem = serialization.Encoding.PEM
        ca_key, ca_cert = _ca("reach test CA")
        key, cert = _server_cert(ca_key, ca_cert)
        self.ca_file = root / "ca.pem"
        self.ca_file.write_bytes(ca_cert.public_bytes(pem))
        (root / "server.pem").write_bytes(cert.public_bytes(pem))
        (root / "server.key").write_bytes(_pem(key))
        # A CA that signed nothing the broker shows: "unknown CA".
        self.other_ca_file = root / "other-ca.pem"
        self.other_ca_file.write_bytes(_ca("someone else's CA")[1].public_bytes(pem))
        passwd = root / "passwd"
        subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), USER, PASSWORD],
                       check=True, capture_output=True)
        self.conf = root / "mosquitto.conf"
        # Run as whoever runs the tests: as root, Mosquitto would switch to its own user,
        # who cannot read the test's private directory.
        self.conf.write_text(
            f"user {os.environ.get('USER') or 'root'}\n"
            f"listener {self.port} 127.0.0.1\n"
            f"cafile {self.ca_file}\ncertfile {root / 'server.pem'}\n"
            f"keyfile {root / 'server.key'}\n"
            f"allow_anonymous false\npassword_file {passwd}\npersistence false\n")
        self.proc = None

    def url(self, password: str = PASSWORD) -> str:
        return f"mqtts://{USER}:{password}@127.0.0.1:{self.port}"

    def start(self):
        self.proc = subprocess.Popen(["mosquitto", "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        eventually(lambda: _port_open(self.port) or self.proc.poll() is not None, 10,
                   "mosquitto listening")
        if self.proc.poll() is not None:
            raise AssertionError(f"mosquitto exited: {self.proc.stderr.read().decode()}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    if not (shutil.which("mosquitto") and shutil.which("mosquitto_passwd")):
        if expect_real_services():
            pytest.fail("REACH_EXPECT_REAL_SERVICES=1 but mosquitto / mosquitto_passwd "
                        "are not installed")
        pytest.skip("needs the mosquitto and mosquitto_passwd binaries (Debian: mosquitto)")
    broker = TlsMosquitto(tmp_path_factory.mktemp("tls-broker"))
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def tls_settings(settings, tls_broker):
    settings.MQTT_URL = tls_broker.url()
    settings.MQTT_PROTOCOL = "5"
    settings.MQTT_CA_FILE = str(tls_broker.ca_file)
    settings.MQTT_TOPIC_PREFIX = f"t{uuid.uuid4().hex[:10]}"
    settings.REACH_NODE_ID = "console"
    settings.REACH_BRIDGE_INSTANCE = f"tls-{uuid.uuid4().hex[:6]}"
    settings.REACH_HEARTBEAT_MS = 200
    yield settings
    cache.delete(CAPS_KEY)  # a failing bridge's words must not reach the next test


@pytest.fixture
def started():
    bridges = []

    def start() -> Bridge:
        bridge = Bridge.from_settings()
        bridge.start()
        bridges.append(bridge)
        return bridge

    yield start
    for bridge in bridges:
        bridge.stop()


def _readyz(client):
    response = client.get("/readyz")
    return response.status_code, response.json()


def _count_connacks(bridge: Bridge) -> list:
    """Every CONNACK the bridge's own client gets (the bridge's callback still runs)."""
    seen = []
    inner = bridge.session.client.on_connect

    def counting(*args):
        seen.append(args[3])
        inner(*args)

    bridge.session.client.on_connect = counting
    return seen


def _bridge_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("messages.")]


def test_it_ingests_and_publishes_over_mqtts_with_a_password(tls_settings, tls_broker,
                                                              started, client, caplog):
    caplog.set_level(logging.INFO)
    bridge = started()
    assert bridge.wait_connected(15), "the bridge did not connect over mqtts"
    prefix = settings.MQTT_TOPIC_PREFIX

    # A peer on the same broker, built by the same factory: it needs the CA and the password.
    peer = mqtt_client(target=broker_target(tls_broker.url()), client_id="tls-peer")
    heard, subscribed = [], threading.Event()
    peer.on_message = lambda c, u, m: heard.append(m.payload)
    peer.on_subscribe = lambda *a: subscribed.set()
    peer.on_connect = lambda c, u, f, rc, p: c.subscribe(protocol.inbox_topic(prefix, "node-b"),
                                                         qos=1)
    peer.connect("127.0.0.1", tls_broker.port)
    peer.loop_start()
    try:
        assert subscribed.wait(10)
        # Ingest: a request from node-b to the console is stored.
        env = protocol.new_envelope(message_type=protocol.MessageType.EVENT,
                                    from_agent_id="node-b.worker", to_agent_id="console.ops",
                                    target_node_id="console",
                                    headers={"originNodeId": "node-b"},
                                    payload={"over": "tls"})
        peer.publish(protocol.inbox_topic(prefix, "console"), protocol.encode(env), qos=1)
        row = eventually(lambda: Message.objects.filter(message_id=env.message_id).first(),
                         what="the message heard over mqtts stored")
        assert row.direction == Direction.RECV

        # Publish: a send to an agent on node-b reaches node-b's inbox over TLS.
        register("fin.tax", "node-b")
        sent = message_send(request=SendRequest(to="fin.tax", payload={"q": 1}))
        eventually(lambda: Message.objects.filter(pk=sent.pk, status=Status.PUBLISHED).exists()
                   or Message.objects.filter(pk=sent.pk, acked_at__isnull=False).exists(),
                   what="the broker taking the console's send (PUBACK)")
        eventually(lambda: any(sent.message_id.encode() in p for p in heard),
                   what="node-b receiving the console's send")
    finally:
        peer.disconnect()
        peer.loop_stop()

    status, body = eventually(lambda: (r := _readyz(client))[0] == 200 and r, 15,
                              "ready over mqtts")
    assert body["checks"]["broker"]["ok"] is True
    assert bridge.session.caps["connected"] is True and bridge.session.caps["mqtt5"] is True
    assert bridge.session.caps["shared_subscriptions"] is True  # Mosquitto 2 says so in its CONNACK
    assert "mqtts://reach@127.0.0.1" in bridge.url
    assert PASSWORD not in caplog.text, "the broker password reached the log"


def test_a_wrong_password_is_said_once_and_makes_the_console_not_ready(
        tls_settings, tls_broker, started, client, caplog):
    caplog.set_level(logging.INFO)
    tls_settings.MQTT_URL = tls_broker.url(password="wrong-password")
    bridge = started()
    connacks = _count_connacks(bridge)

    # Not ready at once ("no bridge hears the bus"); the reason names the refusal as soon as
    # the bridge has recorded it.
    status, body = eventually(
        lambda: (r := _readyz(client))[0] == 503 and "refused" in r[1]["reason"] and r, 20,
        "not ready, saying the broker refused the credentials")
    assert body["checks"]["broker"]["ok"] is False
    assert "refused the credentials (user 'reach': Not authorized)" in body["reason"]
    assert "MQTT_PASSWORD" in body["reason"]
    # paho keeps trying (1 s, then 2 s, …): the reason is logged once, not per attempt.
    eventually(lambda: len(connacks) >= 2, 15, "a second refused attempt")
    assert not bridge.session.connected.is_set()
    said = [r for r in _bridge_records(caplog) if "refused the credentials" in r.getMessage()]
    assert len(said) == 1
    assert not [r for r in _bridge_records(caplog) if r.exc_info], "tracebacks in the log"
    assert "wrong-password" not in caplog.text


def test_an_unknown_ca_is_said_once_and_makes_the_console_not_ready(
        tls_settings, tls_broker, started, client, caplog):
    caplog.set_level(logging.INFO)
    tls_settings.MQTT_CA_FILE = str(tls_broker.other_ca_file)
    bridge = started()

    status, body = eventually(
        lambda: (r := _readyz(client))[0] == 503 and "certificate" in r[1]["reason"] and r, 20,
        "not ready, saying the broker's certificate is not trusted")
    assert "is not trusted" in body["reason"]
    assert "certificate" in body["reason"] and "other-ca.pem" in body["reason"]
    # Let paho fail a few more times: the log still says it once.
    failures = []
    inner = bridge.session.client.on_connect_fail

    def counting(*args):
        failures.append(1)
        inner(*args)

    bridge.session.client.on_connect_fail = counting
    eventually(lambda: len(failures) >= 1, 15, "another failed attempt")
    said = [r for r in _bridge_records(caplog) if "is not trusted" in r.getMessage()]
    assert len(said) == 1
    assert not [r for r in _bridge_records(caplog) if r.exc_info], "tracebacks in the log"
    assert not bridge.session.connected.is_set()


def test_without_the_ca_the_probe_says_the_certificate_is_not_trusted(
        tls_settings, tls_broker):
    """No MQTT_CA_FILE: the system's CAs are used, and the self-signed broker is not trusted
    (never "trust anything"); the probe says so in words."""
    from messages.mqtt_client import connect_failure_reason

    tls_settings.MQTT_CA_FILE = None
    reason = connect_failure_reason(broker_target(tls_broker.url()))
    assert "is not trusted" in reason and "set MQTT_CA_FILE" in reason
    tls_settings.MQTT_CA_FILE = str(tls_broker.ca_file)
    assert connect_failure_reason(broker_target(tls_broker.url())) == ""
