"""What the broker can and cannot do, as each bridge found it, for the log and the pages.

Brokers differ in what the console relies on: MQTT 5 shared subscriptions (several bridges
sharing the inbound load), `$SYS` drop counters (the only place Mosquitto says it dropped
messages), and session expiry (how long the broker keeps a bridge's unacknowledged messages).
Nothing is assumed: the bridge records what the CONNACK, the SUBACK and the `$SYS` tree
told it, and why it could not connect. Each limitation is logged once per bridge, and the
overview and readiness read the record back.

The record lives in the cache (Redis in production), beside the broker-drops alarm: the
bridge runs in a worker, the pages in Daphne. One entry per bridge instance; a bridge
refreshes its entry while it runs, so an entry lost to a concurrent write comes back, and
one left by a bridge that is gone ages out.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

log = logging.getLogger(__name__)

CAPS_KEY = "broker-caps"
# A bridge refreshes its entry every REFRESH_S; one not refreshed for STALE_S is gone.
REFRESH_S = 10.0
STALE_S = 60
# How long a bridge waits for the `$SYS` drop counter after subscribing. Mosquitto keeps it
# retained (it arrives at once); a broker without `$SYS` never sends it.
SYS_WAIT_S = 15.0

# What each missing capability costs, in the words the log and the overview use.
LIMITS = {
    "shared_subscriptions": ("no shared subscriptions: bridges cannot share the inbound load "
                             "(one bridge ingests, the others stand by)"),
    "sys_drops": ("no $SYS drop counter: messages the broker drops for a slow console are "
                  "not seen here; watch the broker's own log"),
    "session_expiry": ("no session expiry (MQTT 3.1.1): how long the broker keeps a stopped "
                       "bridge's messages is the broker's own setting"),
    "subscription_identifiers": (
        "no subscription identifiers: the console's own inbox is heard through the shared "
        "group only, so an answer published while a restarted broker has not yet restored "
        "the group is lost"),
}

# What the embedded broker of `make run` lacks, in one line (said once, as information).
EMBEDDED_WORDS = ("MQTT 3.1.1 only, so no shared subscriptions and no session expiry, and no "
                  "$SYS drop counter")

_lock = threading.Lock()
_said: dict[str, set[str]] = {}  # instance → limitations already logged by this process
_errors: dict[str, str] = {}  # instance → the connection error last logged


def connack_caps(*, v5: bool, properties, requested_expiry_s: int) -> dict:
    """The capabilities a CONNACK tells: shared subscriptions, subscription identifiers and
    the session expiry the broker granted. MQTT 5 says "available" by leaving the property
    out; MQTT 3.1.1 has none of them."""
    if not v5:
        # No subscription identifiers either, but nothing needs them without shares.
        return {"mqtt5": False, "shared_subscriptions": False, "session_expiry": None,
                "subscription_identifiers": None}
    shared = getattr(properties, "SharedSubscriptionAvailable", 1)
    # A broker may lower the expiry we asked for; it says so in the CONNACK.
    expiry = getattr(properties, "SessionExpiryInterval", requested_expiry_s)
    identifiers = getattr(properties, "SubscriptionIdentifierAvailable", 1)
    return {"mqtt5": True, "shared_subscriptions": bool(shared), "session_expiry": expiry,
            # Only a broker that shares needs them (messages/subscriptions.py, the own inbox).
            "subscription_identifiers": bool(identifiers) if shared else None}


def limitations(entry: dict) -> list[str]:
    """What this broker cannot do, in words (only what was found out, never a guess)."""
    said = []
    for key, words in LIMITS.items():
        value = entry.get(key)
        if key == "session_expiry":
            if entry.get("mqtt5") is False:
                said.append(words)
            elif value == 0:
                said.append("the broker grants no session expiry: a stopped bridge's "
                            "messages are not kept")
        elif value is False:
            said.append(words)
    return said


def broker_caps_record(*, instance: str, now: datetime | None = None, **facts) -> None:
    """Merge `facts` into this bridge's entry (url, protocol, connected, error,
    mqtt5, shared_subscriptions, sys_drops, session_expiry), and log each newly found
    limitation or connection error once. Never raises: a cache outage must not stop a
    bridge (the pages then say they cannot tell)."""
    now = now or timezone.now()
    with _lock:
        said = _said.setdefault(instance, set())
        try:
            entries = cache.get(CAPS_KEY) or {}
            entry = {**entries.get(instance, {}), **facts, "instance": instance,
                     "at": now.isoformat(), "embedded": settings.REACH_EMBEDDED_BROKER}
            entries[instance] = entry
            cutoff = now - timedelta(seconds=STALE_S)
            entries = {k: v for k, v in entries.items()
                       if datetime.fromisoformat(v["at"]) >= cutoff}
            cache.set(CAPS_KEY, entries, timeout=STALE_S * 10)
        except Exception as exc:
            entry = {**facts, "embedded": settings.REACH_EMBEDDED_BROKER}
            log.warning("could not record what the broker can do (%s)", exc)
        found = [words for words in limitations(entry) if words not in said]
        if found and entry.get("embedded"):
            # make run's own broker: its limits are known and harmless in one process. Said
            # once, as information, not as warnings a newcomer would take for trouble.
            said.update(LIMITS.values())
            log.info("MQTT broker %s is make run's embedded one: %s. Expected here; "
                     "production runs Mosquitto or EMQX (deploy/README.md)",
                     entry.get("url", ""), EMBEDDED_WORDS)
            found = []
        for words in found:
            said.add(words)
            log.warning("MQTT broker %s: %s", entry.get("url", ""), words)
        error = facts.get("error")
        if error and _errors.get(instance) != error:
            # Once per reason, not once per reconnect attempt: no wall of repeated lines.
            _errors[instance] = error
            log.error("MQTT bridge %s cannot connect: %s", instance, error)
        if facts.get("connected"):
            _errors.pop(instance, None)  # a later failure is news again


def broker_caps_read(*, now: datetime | None = None) -> list[dict]:
    """Every live bridge's entry, by instance (raises when the cache is down)."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=STALE_S)
    entries = cache.get(CAPS_KEY) or {}
    fresh = [dict(v, limits=limitations(v)) for _, v in sorted(entries.items())
             if datetime.fromisoformat(v["at"]) >= cutoff]
    return fresh


def connect_errors(*, now: datetime | None = None) -> list[str]:
    """Why bridges that are not connected cannot connect, for readiness ("" entries left out)."""
    try:
        entries = broker_caps_read(now=now)
    except Exception:
        return []
    return [f"{e['instance']}: {e['error']}" for e in entries
            if not e.get("connected") and e.get("error")]
