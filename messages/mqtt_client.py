"""Every MQTT connection of the console is built here, from the settings.

The bridge, the simulator, management commands, bench/ and the tests' helpers all take their
paho client from `mqtt_client()`, so TLS (`mqtts://`, MQTT_CA_FILE) and credentials
(user:password in MQTT_URL, or MQTT_USERNAME / MQTT_PASSWORD) apply to all of them or to
none. The password never reaches a log line: `url_redacted()` is what may be printed.

When a connection fails, paho says little (a TLS error is swallowed by its reconnect loop,
a refused CONNECT is a bare reason code): `connect_failure_reason()` and `refusal_reason()`
turn both into words a person can act on.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import paho.mqtt.client as mqtt
from django.conf import settings
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

SCHEMES = {"mqtt", "tcp", "mqtts"}


@dataclass(frozen=True)
class BrokerTarget:
    """Where and how to connect: one broker URL with the settings that go with it."""

    host: str
    port: int
    tls: bool
    username: str | None
    password: str | None
    ca_file: str | None
    protocol: str  # "5" or "3.1.1"

    @property
    def v5(self) -> bool:
        return self.protocol == "5"

    @property
    def display(self) -> str:
        """The URL without the password: what logs, pages and errors may show."""
        scheme = "mqtts" if self.tls else "mqtt"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{self.host}:{self.port}"


def url_redacted(url: str | None) -> str:
    """`url` with its password replaced by ***, for logs."""
    if not url:
        return ""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    netloc = f"{parsed.username}:***@{parsed.hostname}"
    if parsed.port:
        netloc += f":{parsed.port}"
    return parsed._replace(netloc=netloc).geturl()


def broker_target(url: str | None = None, *, protocol: str | None = None) -> BrokerTarget:
    """The broker `url` (default MQTT_URL) with the TLS and credential settings.

    Credentials in the URL win over MQTT_USERNAME / MQTT_PASSWORD (percent-encode a `@` or
    `:` in them). `mqtts://` verifies the broker's certificate against MQTT_CA_FILE, or the
    system's CAs when that is unset."""
    url = url or settings.MQTT_URL
    parsed = urlparse(url or "")
    if parsed.scheme not in SCHEMES or not parsed.hostname:
        raise ValueError(f"MQTT URL {url_redacted(url)!r}: use mqtt://host:port or "
                         "mqtts://user:password@host:port")
    tls = parsed.scheme == "mqtts"
    username = unquote(parsed.username) if parsed.username else settings.MQTT_USERNAME
    password = (unquote(parsed.password) if parsed.password is not None
                else settings.MQTT_PASSWORD)
    return BrokerTarget(
        host=parsed.hostname, port=parsed.port or (8883 if tls else 1883), tls=tls,
        username=username or None, password=password if username else None,
        ca_file=settings.MQTT_CA_FILE, protocol=protocol or settings.MQTT_PROTOCOL,
    )


def tls_context(target: BrokerTarget) -> ssl.SSLContext:
    # Always verified: a console that trusts any certificate would hand its credentials to
    # whoever answers on the port. A self-signed broker is trusted through MQTT_CA_FILE.
    return ssl.create_default_context(cafile=target.ca_file)


def mqtt_client(*, target: BrokerTarget | None = None, client_id: str = "",
                clean_session: bool | None = None, manual_ack: bool = False,
                lean: bool = False) -> mqtt.Client:
    """A paho 2.x client for `target` (default: the settings), not yet connected.

    `clean_session` applies to MQTT 3.1.1 only (MQTT 5 says clean_start on connect).
    `lean`: a LeanClient, for the bridge's high-rate subscription."""
    target = target or broker_target()
    kind = LeanClient if lean else mqtt.Client
    if target.v5:
        client = kind(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                      protocol=mqtt.MQTTv5, manual_ack=manual_ack)
    else:
        client = kind(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                      protocol=mqtt.MQTTv311, manual_ack=manual_ack,
                      clean_session=True if clean_session is None else clean_session)
    if target.username:
        client.username_pw_set(target.username, target.password)
    if target.tls:
        client.tls_set_context(tls_context(target))
    return client


class LeanClient(mqtt.Client):
    """paho's client, reading an MQTT 5 PUBLISH without properties without paho's Properties.

    paho builds a Properties object for every MQTT 5 PUBLISH it reads, and clears and sets
    about 30 attributes of it in Python: a third of the bridge's network thread in a burst
    (docs/performance.md), for the one byte that says "no properties" on nearly every
    message. This reads such a PUBLISH itself and hands on the same MQTTMessage, with
    `properties` one shared, empty Properties (read it, never write it). Anything else
    (properties present, QoS 2, MQTT 3.1.1, a packet it cannot read) goes to paho's own
    handler, which also refuses what is malformed as it always has.
    tests/test_mqtt_client.py compares both on the same packets; it was checked against
    paho-mqtt 2.2, and pyproject.toml caps paho-mqtt below 2.3 until it passes on a newer
    one. (paho's debug line for each PUBLISH is not written for these: no logger of ours
    is attached to paho.)"""

    def _handle_publish(self) -> mqtt.MQTTErrorCode:
        message = self._lean_publish() if self._protocol == mqtt.MQTTv5 else None
        if message is None:
            return super()._handle_publish()
        self._handle_on_message(message)
        if message.qos == 1 and not self._manual_ack:
            return self._send_puback(message.mid)
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _lean_publish(self) -> mqtt.MQTTMessage | None:
        try:
            header = self._in_packet["command"]
            packet = self._in_packet["packet"]
            qos = (header & 0x06) >> 1
            topic_end = 2 + int.from_bytes(packet[0:2], "big")
            at = topic_end + (2 if qos else 0)
            if qos > 1 or at >= len(packet) or packet[at] != 0 or topic_end == 2:
                return None  # QoS 2, properties, a topic alias, a short packet: paho's
            message = mqtt.MQTTMessage(
                mid=int.from_bytes(packet[topic_end:at], "big") if qos else 0,
                topic=bytes(packet[2:topic_end]))
        except (KeyError, TypeError, IndexError, ValueError):
            return None
        message.dup = bool(header & 0x08)
        message.qos = qos
        message.retain = bool(header & 0x01)
        message.properties = _NO_PROPERTIES
        message.payload = bytes(packet[at + 1:])
        message.timestamp = time.monotonic()
        return message


class _NoProperties(Properties):
    """The one empty property block every lean PUBLISH shares: read-only, so that a write
    to one message's properties cannot reach every later message."""

    def __init__(self) -> None:
        super().__init__(PacketTypes.PUBLISH)
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError("the shared empty MQTT properties are read-only")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError("the shared empty MQTT properties are read-only")
        super().__delattr__(name)


_NO_PROPERTIES = _NoProperties()


def refusal_reason(reason_code, target: BrokerTarget) -> str:
    """Words for a CONNACK that refused us (paho 2 maps 3.1.1 return codes to these too)."""
    value = getattr(reason_code, "value", reason_code)
    if value in (134, 4, 135, 5):  # Bad user name or password; Not authorized
        # Mosquitto answers a wrong password with "Not authorized": the same advice fits both.
        who = f"user {target.username!r}" if target.username else "no user name"
        return (f"the broker {target.display} refused the credentials ({who}: {reason_code}):"
                " check MQTT_USERNAME / MQTT_PASSWORD or the user:password in MQTT_URL, and "
                "the broker's access rules")
    if value in (132, 1):  # Unsupported protocol version
        return (f"the broker {target.display} does not speak MQTT {target.protocol}: set "
                "MQTT_PROTOCOL=3.1.1")
    if value in (133, 2):  # Client identifier not valid
        return f"the broker {target.display} refused the client id"
    return f"the broker {target.display} refused the connection: {reason_code}"


def connect_failure_reason(target: BrokerTarget, *, timeout: float = 3.0) -> str:
    """Why a connection to `target` cannot be opened (TCP, then the TLS handshake), in words;
    "" when both succeed (then the broker refused or dropped the MQTT CONNECT itself).

    paho's reconnect loop catches the error and reports only that it failed: this opens the
    same connection once more to learn why."""
    where = f"{target.host}:{target.port}"
    try:
        sock = socket.create_connection((target.host, target.port), timeout=timeout)
    except OSError as exc:
        return f"cannot reach the MQTT broker at {where}: {exc.strerror or exc}"
    try:
        if target.tls:
            try:
                with tls_context(target).wrap_socket(sock, server_hostname=target.host):
                    pass
            except ssl.SSLCertVerificationError as exc:
                trust = (f"MQTT_CA_FILE={target.ca_file}" if target.ca_file
                         else "the system's CAs (set MQTT_CA_FILE)")
                return (f"TLS: the certificate of {where} is not trusted: "
                        f"{exc.verify_message or exc.reason}; checked against {trust}")
            except ssl.SSLError as exc:
                return (f"TLS handshake with {where} failed ({exc.reason or exc}): is it an "
                        "mqtts:// listener?")
            except OSError as exc:
                return f"TLS handshake with {where} failed: {exc}"
    finally:
        sock.close()
    return ""
