"""The bridge's LeanClient reads an MQTT 5 PUBLISH as paho's own client does
(messages/mqtt_client.py): the same packets through both give the same message to on_message,
whatever the topic, payload, QoS, flags and properties; what it does not read itself
(properties present, QoS 2, a malformed packet) it leaves to paho."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from messages.mqtt_client import LeanClient


def publish_packet(*, topic: bytes, payload: bytes, qos: int, mid: int, dup: bool,
                   retain: bool, properties: Properties | None) -> tuple[int, bytes]:
    """(first header byte, the rest after the remaining length) of a PUBLISH, MQTT 5."""
    header = 0x30 | (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    body = len(topic).to_bytes(2, "big") + topic
    if qos:
        body += mid.to_bytes(2, "big")
    body += properties.pack() if properties is not None else b"\x00"
    return header, body + payload


def read(kind: type[mqtt.Client], header: int, body: bytes, *, manual_ack: bool
         ) -> tuple[mqtt.MQTTMessage | None, object, list[int]]:
    """What on_message got, what the handler returned, and the PUBACKs it sent."""
    client = kind(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5,
                  manual_ack=manual_ack)
    got: list[mqtt.MQTTMessage] = []
    pubacks: list[int] = []
    client.on_message = lambda _c, _u, message: got.append(message)
    client._send_puback = lambda mid: pubacks.append(mid) or mqtt.MQTT_ERR_SUCCESS
    client._in_packet = {"command": header, "have_remaining": 1, "remaining_count": [],
                         "remaining_mult": 1, "remaining_length": len(body),
                         "packet": body, "to_process": 0, "pos": 0}
    returned = client._handle_publish()
    return (got[0] if got else None), returned, pubacks


def seen(message: mqtt.MQTTMessage) -> tuple:
    props = message.properties
    return (message.topic, type(message.payload), message.payload, message.qos, message.mid,
            message.dup, message.retain, props.json() if props is not None else None)


properties = st.one_of(
    st.none(),
    st.builds(lambda sid: _props(SubscriptionIdentifier=[sid]),
              st.integers(min_value=1, max_value=268_435_455)),
    st.builds(lambda topic, data: _props(ResponseTopic=topic, CorrelationData=data),
              st.text(min_size=1, max_size=20).filter(lambda t: "\x00" not in t),
              st.binary(max_size=16)),
)


def _props(**values) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    for name, value in values.items():
        setattr(props, name, value)
    return props


@settings(max_examples=300, deadline=None)
@given(topic=st.text(min_size=1, max_size=40).filter(lambda t: "\x00" not in t),
       payload=st.binary(max_size=300), qos=st.integers(0, 2),
       mid=st.integers(1, 65535), dup=st.booleans(), retain=st.booleans(),
       props=properties, manual_ack=st.booleans())
def test_the_lean_client_reads_every_publish_as_paho_does(topic, payload, qos, mid, dup,
                                                          retain, props, manual_ack):
    header, body = publish_packet(topic=topic.encode(), payload=payload, qos=qos, mid=mid,
                                  dup=dup, retain=retain, properties=props)
    ours, ours_rc, ours_acks = read(LeanClient, header, body, manual_ack=manual_ack)
    paho, paho_rc, paho_acks = read(mqtt.Client, header, body, manual_ack=manual_ack)
    assert (ours_rc, ours_acks) == (paho_rc, paho_acks)  # the same PUBACK, or none
    if qos == 2:  # handed on at its PUBREL, by paho in both
        assert ours is None and paho is None
        return
    assert ours is not None and paho is not None
    assert seen(ours) == seen(paho) and type(ours.payload) is bytes


def test_it_reads_a_plain_publish_itself_and_leaves_the_rest_to_paho(monkeypatch):
    handled: list[str] = []
    paho_handler = mqtt.Client._handle_publish

    def counted(self):
        handled.append("paho")
        return paho_handler(self)

    monkeypatch.setattr(mqtt.Client, "_handle_publish", counted)
    plain = publish_packet(topic=b"p/node/a/inbox", payload=b"{}", qos=1, mid=7, dup=False,
                           retain=False, properties=None)
    message = read(LeanClient, *plain, manual_ack=True)[0]
    assert message.payload == b"{}" and handled == []  # no Properties built
    with pytest.raises(AttributeError, match="read-only"):
        message.properties.SubscriptionIdentifier = [1]  # shared by every lean message
    with_props = publish_packet(topic=b"p/node/a/inbox", payload=b"{}", qos=1, mid=7,
                                dup=False, retain=False,
                                properties=_props(SubscriptionIdentifier=[3]))
    message = read(LeanClient, *with_props, manual_ack=True)[0]
    assert message.properties.SubscriptionIdentifier == [3] and handled == ["paho"]


@pytest.mark.parametrize("body", [b"", b"\x00", b"\x00\x05ab", b"\x00\x01t\x00",
                                  b"\x00\x00\x00\x07\x00{}"])
def test_a_packet_it_cannot_read_is_left_to_paho(body):
    """Short packets, and an empty topic (a topic alias): not read by LeanClient itself."""
    client = LeanClient(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client._in_packet = {"command": 0x32, "packet": body}  # PUBLISH, QoS 1
    assert client._lean_publish() is None
