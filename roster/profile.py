"""The A2A-over-MQTT profile's agents on the roster (PROTOCOL.md, "The A2A-over-MQTT
profile"): what a retained Agent Card on `$a2a/v1/discovery/{org}/{unit}/{agent}` makes of
an agent.

- A card registers the agent `{org}/{unit}/{agent}` (that text, case kept) in namespace
  `{org}`, dialect `a2a-mqtt`, with the card's `skills[].id` as its capabilities and the card
  kept verbatim; a changed card updates it, and the change is written to its history.
- The user property `a2a-status=offline` (the agent's Last Will, or its graceful goodbye)
  makes it OFFLINE at once; `online`, or a card without the property, brings it back. The
  presence is the broker's word, shown with its source (`a2a-status-source`: agent, lwt or
  broker) and since when: such an agent has no heartbeat and no lease, and the lease sweep
  and the reconciliation leave it alone.
- An empty retained message (the profile's unregister) removes it.
- A card that cannot be read (over REACH_A2A_CARD_MAX_BYTES, not JSON, without the fields an
  A2A Agent Card requires, an identifier outside the profile's alphabet) is refused whole:
  counted by reason (`reach_profile_cards_rejected_total{reason}`), logged once a reason and
  minute, and when it was about a known agent, kept on that agent for its page.

Every bridge hears every card (retained messages reach plain subscriptions only), so the
same card arrives once per bridge and again on each reconnect: a card the roster already
holds, with the same presence, writes nothing.

Profile agents sit on one node row of their own, `a2a-mqtt` (`PROFILE_NODE_ID`): the broker
delivers to them, no node of the cluster does. The directory does not route native sends
to them (directory/resolver.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, transaction
from django.utils import timezone

from roster.generation import roster_changed
from roster.ids import PROFILE_ID_RE
from roster.models import PROFILE_NODE_ID, Agent, ClusterNode, Consistency, Dialect, Namespace
from roster.models import RosterEvent as Event

log = logging.getLogger(__name__)

DIALECT = Dialect.A2A_MQTT
STATUS_PROPERTY, SOURCE_PROPERTY = "a2a-status", "a2a-status-source"
SOURCES = ("agent", "lwt", "broker")
# What an A2A (v1.0) Agent Card must carry, as the profile's cards do (the SDK's build_card);
# `url` stands in for `supportedInterfaces` on cards of the A2A versions before 1.0.
CARD_TEXT_FIELDS = ("name", "description", "version")
CARD_LIST_FIELDS = ("defaultInputModes", "defaultOutputModes", "skills")
MAX_SKILLS = 64


class CardRefused(ValueError):
    """A card the roster does not take: `reason` is the metric's label, the text says why
    in words an agent's author can act on."""

    def __init__(self, reason: str, words: str):
        super().__init__(words)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class CardFrame:
    """One message on the discovery tree, as the bridge heard it."""
    topic: str
    payload: bytes
    status: str = ""  # the a2a-status user property, "" when absent
    source: str = ""  # a2a-status-source
    # When paho handed it over (None: now). Every bridge applies every card, a lagging one
    # later than the others: a card heard before the one the roster holds is not applied.
    heard_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CardIdentity:
    org: str
    unit: str
    agent: str

    @property
    def agent_id(self) -> str:
        return f"{self.org}/{self.unit}/{self.agent}"


def card_identity(topic: str) -> CardIdentity:
    """`$a2a/v1/discovery/{org}/{unit}/{agent}` → its identity, or CardRefused."""
    prefix = f"{settings.REACH_A2A_ROOT}/discovery/"
    parts = topic[len(prefix):].split("/") if topic.startswith(prefix) else []
    if len(parts) != 3:
        raise CardRefused("topic", f"{topic[:200]!r} is not a discovery topic "
                                   f"({prefix}{{org}}/{{unit}}/{{agent}})")
    for what, value in zip(("org", "unit", "agent"), parts, strict=True):
        if not PROFILE_ID_RE.fullmatch(value) or not value.strip("."):
            raise CardRefused("identifier", f"the {what} id {value[:80]!r} is not of the "
                                            "profile's alphabet [A-Za-z0-9_.-]")
    identity = CardIdentity(*parts)
    if len(identity.org) > Namespace._meta.get_field("name").max_length:
        raise CardRefused("identifier", f"the org id {identity.org[:80]!r} is longer than "
                                        "the 64 characters a namespace holds")
    if len(identity.agent_id) > Agent._meta.get_field("agent_id").max_length:
        raise CardRefused("identifier", f"the agent id {identity.agent_id[:80]}… is longer "
                                        "than the 265 characters an agent id holds")
    return identity


def card_read(payload: bytes) -> tuple[str, dict[str, Any]]:
    """The card as stored (its text, verbatim) and as read, or CardRefused."""
    limit = settings.REACH_A2A_CARD_MAX_BYTES
    if len(payload) > limit:
        raise CardRefused("too_large", f"the card is {len(payload):,} bytes; the console "
                                       f"takes cards of at most {limit:,} "
                                       "(REACH_A2A_CARD_MAX_BYTES)")
    try:
        text = payload.decode("utf-8")
        card = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CardRefused("bad_json", f"the card is not JSON: {str(exc)[:120]}") from None
    except RecursionError:
        raise CardRefused("bad_json", "the card nests deeper than a JSON reader goes") from None
    if not isinstance(card, dict):
        raise CardRefused("bad_card", "the card is JSON but not an object")
    missing = [f for f in CARD_TEXT_FIELDS if not isinstance(card.get(f), str)]
    missing += [f for f in CARD_LIST_FIELDS if not isinstance(card.get(f), list)]
    if not isinstance(card.get("capabilities"), dict):
        missing.append("capabilities")
    interfaces = card.get("supportedInterfaces")
    if not (isinstance(interfaces, list) and interfaces) and not isinstance(card.get("url"),
                                                                            str):
        missing.append("supportedInterfaces")
    if missing:
        raise CardRefused("missing_fields", "the card lacks what an A2A Agent Card requires: "
                                            + ", ".join(missing))
    skills = card["skills"]
    if len(skills) > MAX_SKILLS:
        raise CardRefused("bad_card", f"the card lists {len(skills)} skills; the console "
                                      f"takes at most {MAX_SKILLS}")
    for index, skill in enumerate(skills):
        if not isinstance(skill, dict) or not isinstance(skill.get("id"), str) or not (
                0 < len(skill["id"]) <= 64):
            raise CardRefused("bad_card", f"skill {index} has no id of 1 to 64 characters")
    return text, card


def card_capabilities(card: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for skill in card["skills"]:
        if skill["id"] not in out:
            out.append(skill["id"])
    return out


def card_shown(text: str) -> dict[str, Any] | None:
    """A stored card as its page shows it (the text itself is shown too): the fields a page
    reads made safe to read, whatever else the card holds."""
    try:
        card = json.loads(text)
    except ValueError:
        return None
    if not isinstance(card, dict):
        return None

    def texts(value: Any) -> list[str]:
        return [str(v) for v in value] if isinstance(value, list) else []

    return {**card,
            "skills": [{"id": str(s.get("id", "")), "name": str(s.get("name", "")),
                        "description": str(s.get("description", "")),
                        "tags": texts(s.get("tags"))}
                       for s in card.get("skills") or [] if isinstance(s, dict)],
            "supportedInterfaces": [i for i in card.get("supportedInterfaces") or []
                                    if isinstance(i, dict)],
            "defaultInputModes": texts(card.get("defaultInputModes")),
            "defaultOutputModes": texts(card.get("defaultOutputModes")),
            "provider": card["provider"] if isinstance(card.get("provider"), dict) else None}


_last_logged: dict[str, float] = {}


def _log_refusal(reason: str, topic: str, words: str) -> None:
    now = time.monotonic()
    if now - _last_logged.get(reason, -120.0) >= 60.0:
        _last_logged[reason] = now
        log.warning("refused an Agent Card on %s (%s): %s", topic[:200], reason, words)


def profile_node() -> ClusterNode:
    """The one node row profile agents sit on: always consistent (the broker's word is
    their presence), never swept down (roster/services.nodes_sweep skips it)."""
    node, _ = ClusterNode.objects.get_or_create(
        node_id=PROFILE_NODE_ID,
        defaults={"status": ClusterNode.Status.ONLINE, "consistency": Consistency.OK,
                  "consistency_reason": "A2A-over-MQTT agents: the broker delivers to them"})
    return node


def _presence(frame: CardFrame) -> tuple[str, str]:
    """(the status the card says, its source): OFFLINE only on `a2a-status=offline`."""
    source = frame.source if frame.source in SOURCES else "agent"
    if frame.status.lower() == "offline":
        return Agent.Status.OFFLINE, source
    return Agent.Status.ONLINE, source


def _skills_change(old: list[str], new: list[str]) -> str:
    added, gone = [s for s in new if s not in old], [s for s in old if s not in new]
    parts = ([f"skills added: {', '.join(added)}"] if added else []) + (
        [f"skills gone: {', '.join(gone)}"] if gone else [])
    return "; ".join(parts) or "skills unchanged"


def card_apply(frame: CardFrame, *, now: datetime | None = None) -> str:
    """What one discovery message does to the roster; returns the outcome counted
    (registered, updated, offline, online, unchanged, removed, absent, stale: heard
    before what the roster holds) or raises
    CardRefused (after keeping the refusal on the agent it names, if known)."""
    now = now or timezone.now()
    heard_at = frame.heard_at or now
    identity = card_identity(frame.topic)
    if not frame.payload:
        return _card_remove(identity, now=now, heard_at=heard_at)
    try:
        text, card = card_read(frame.payload)
    except CardRefused as exc:
        Agent.objects.filter(agent_id=identity.agent_id, dialect=DIALECT).exclude(
            card_heard_at__gt=heard_at).update(card_refused=str(exc)[:300], card_refused_at=now)
        raise
    status, source = _presence(frame)
    capabilities = card_capabilities(card)
    fields = {"version": str(card["version"])[:64],
              "endpoint": f"{settings.REACH_A2A_ROOT}/request/{identity.org}/{identity.unit}/"
                          f"{identity.agent}"[:500],
              "capabilities": capabilities, "card": text, "card_refused": "",
              "card_refused_at": None, "card_heard_at": heard_at}
    with transaction.atomic():
        agent = (Agent.objects.select_for_update(of=("self",))
                 .filter(agent_id=identity.agent_id).first())
        if agent is None:
            if Event.objects.filter(agent_id=identity.agent_id, kind=Event.Kind.DEREGISTERED,
                                    at__gt=heard_at).exists():
                return "stale"  # removed after this card was heard (by another bridge)
            namespace, _ = Namespace.objects.get_or_create(name=identity.org)
            try:
                with transaction.atomic():
                    agent = Agent.objects.create(
                        namespace=namespace, name=f"{identity.unit}/{identity.agent}",
                        agent_id=identity.agent_id, node=profile_node(),
                        segment=identity.agent[:64], dialect=DIALECT, status=status,
                        presence_source=source, presence_since=now, lease_expires_at=now,
                        registered_at=now, **fields)
            except IntegrityError:
                return "unchanged"  # another bridge stored the same card a moment ago
            Event.objects.create(agent_id=agent.agent_id, node_id=PROFILE_NODE_ID,
                                 kind=Event.Kind.REGISTERED, actor=f"card ({source})", at=now,
                                 detail=f"Agent Card {card['name'][:100]!r} "
                                        f"v{fields['version']}, {status.lower()}")
            roster_changed()
            return "registered"
        if agent.card_heard_at and agent.card_heard_at > heard_at:
            return "stale"  # another bridge applied a card heard after this one
        outcome = "unchanged"
        # A drain is an operator's decision: a card saying "online" does not undo it.
        new_status = status if not (agent.status == Agent.Status.DRAINING
                                    and status == Agent.Status.ONLINE) else agent.status
        if agent.card != text:
            old = list(agent.capabilities or [])
            busy = f"; it held {agent.inflight} tasks" if agent.inflight else ""
            Event.objects.create(agent_id=agent.agent_id, node_id=PROFILE_NODE_ID,
                                 kind=Event.Kind.CARD, actor=f"card ({source})", at=now,
                                 detail=f"card changed (v{agent.version} → "
                                        f"v{fields['version']}; "
                                        f"{_skills_change(old, capabilities)}){busy}")
            outcome = "updated"
        if new_status != agent.status or source != agent.presence_source:
            kind = (Event.Kind.OFFLINE if new_status == Agent.Status.OFFLINE
                    else Event.Kind.REVIVED)
            if new_status != agent.status:
                Event.objects.create(agent_id=agent.agent_id, node_id=PROFILE_NODE_ID,
                                     kind=kind, actor=f"card ({source})", at=now,
                                     detail=f"a2a-status={frame.status or 'absent'}, "
                                            f"source {source}")
                outcome = "offline" if new_status == Agent.Status.OFFLINE else "online"
            fields["presence_since"] = now
        if outcome == "unchanged" and not agent.card_refused:
            return outcome
        fields.update(status=new_status, presence_source=source)
        Agent.objects.filter(pk=agent.pk).update(updated_at=now, **fields)
        roster_changed()
        return outcome


def _card_remove(identity: CardIdentity, *, now: datetime, heard_at: datetime) -> str:
    with transaction.atomic():
        agent = (Agent.objects.select_for_update(of=("self",))
                 .filter(agent_id=identity.agent_id, dialect=DIALECT).first())
        if agent is None:
            return "absent"
        if agent.card_heard_at and agent.card_heard_at > heard_at:
            return "stale"  # the card came back after this removal was heard
        agent.delete()
        # At the moment it was heard: a card heard before it, applied late by another bridge,
        # is known for older (card_apply).
        Event.objects.create(agent_id=identity.agent_id, node_id=PROFILE_NODE_ID,
                             kind=Event.Kind.DEREGISTERED, actor="card", at=heard_at,
                             detail="its retained Agent Card was cleared")
        roster_changed()
        return "removed"


def card_counted(frame: CardFrame, *, now: datetime | None = None) -> str:
    """`card_apply` for the bridge: the counter its outcome adds to (`cards:<outcome>`,
    `profile_cards_rejected:<reason>`). A card is one agent's: one that cannot be stored
    takes nothing else with it, and never stops the bridge. The database being away
    (OperationalError, InterfaceError) is raised: the bridge waits and tries the card
    again."""
    try:
        return f"cards:{card_apply(frame, now=now)}"
    except CardRefused as exc:
        _log_refusal(exc.reason, frame.topic, str(exc))
        return f"profile_cards_rejected:{exc.reason}"
    except (OperationalError, InterfaceError):
        raise
    except Exception as exc:  # noqa: BLE001 - one agent's card, whatever it breaks
        # What the checks let through and the database would not hold (its transaction
        # rolled back whole): refused like any bad card, with the error in the log.
        _log_refusal("unstorable", frame.topic, f"{type(exc).__name__}: {str(exc)[:200]}")
        return "profile_cards_rejected:unstorable"


def cards_apply(frames: list[CardFrame], *, now: datetime | None = None) -> Counter:
    """Each frame in turn (`card_counted`); the counts."""
    return Counter(card_counted(frame, now=now) for frame in frames)
