"""A bridge's MQTT client id, and the ids it had under earlier versions, whose persistent
sessions it ends once at start (left alone, each keeps its subscriptions and a share of the
console's messages queued where nobody reads them).
"""

from __future__ import annotations

import hashlib
import logging
import threading

import paho.mqtt.client as mqtt
from django.conf import settings
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from messages.mqtt_client import BrokerTarget, mqtt_client
from reachconsole.core import identity

log = logging.getLogger(__name__)


def client_id_for(node_id: str, instance: str, console_id: str = "") -> str:
    """One fixed id per bridge of one console: a persistent session, and two bridges with one
    id kick each other off the broker for as long as both run. The console's identity
    (reachconsole/core/identity.py, read from its database) is in it: two consoles on one
    broker with the default node id were both `reach-console-1`. Kept within 64 characters
    without cutting the instance off."""
    console = console_id or identity.console_id()
    node = node_id or "anon"
    client_id = f"{console}-{node}-{instance}"
    if len(client_id) > 64:
        digest = hashlib.sha256(node.encode()).hexdigest()[:10]
        client_id = f"{console[:64 - len(instance) - 12]}-{digest}-{instance}"
    return client_id[:64]


def legacy_client_ids(node_id: str, instance: str) -> list[str]:
    """The ids this bridge had under earlier versions: before the console's identity was in
    it, and while that identity was a hash of how the database's address was spelled."""
    return [f"reach-{node_id or 'anon'}-{instance}"[:64],
            client_id_for(node_id, instance,
                          identity.address_identity(settings.DATABASES["default"]))]


def legacy_sessions_end(*, target: BrokerTarget, node_id: str, instance: str,
                        current: str) -> None:
    """End the persistent sessions an earlier version left under the ids it used then
    (`legacy_client_ids`). Connecting once with a clean start ends one; a broker that cannot
    be reached now is tried again at the next start."""
    for legacy in dict.fromkeys(legacy_client_ids(node_id, instance)):
        if legacy != current:
            _session_end(target=target, client_id=legacy, current=current)


def _session_end(*, target: BrokerTarget, client_id: str, current: str) -> None:
    client = mqtt_client(target=target, client_id=client_id, clean_session=True)
    answered = threading.Event()
    client.on_connect = lambda *args: answered.set()
    try:
        if target.v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 0
            client.connect(target.host, target.port, keepalive=10, clean_start=True,
                           properties=props)
        else:
            client.connect(target.host, target.port, keepalive=10)
        client.loop_start()
        if answered.wait(5):
            log.info("ended any MQTT session left under the earlier client id %s "
                     "(this bridge is %s now)", client_id, current)
        client.disconnect()
        client.loop_stop()
    except (OSError, ValueError, mqtt.WebsocketConnectionError) as exc:
        log.debug("could not end the session of %s now: %s", client_id, exc)
