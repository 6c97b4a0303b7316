"""What holds now, and the alarm table made to say so (beat: alarms/tasks.py).

`alarms_evaluate` reads the conditions from what each part owns, never from message rows:
readiness (reachconsole.health: the bus heard, deliveries answered), the roster (nodes down,
where agents live), the directory's capability coverage, the numbers kept per bucket
(messages.rollups: the last 5 minutes of each agent and of the whole console), and the
bridge's broker-drops note in the cache. Then, in one transaction, it fires what newly
holds, refreshes what still holds and clears what ended.

One root cause, one alarm: a capability whose every agent sits on down nodes, and the
alarms of an agent on a down node, are children (`parent`) of that node's node_down alarm;
an agent's tasks_expiring is a child of its agent_failing when both hold. Subjects that live
only on retired nodes raise nothing: an operator took them out of service on purpose (and
retiring a node clears its alarm and its children at the next evaluation).

Concurrency (two beats, or a beat and a manual run): each evaluation's writes take a
transaction-scoped advisory lock first (PostgreSQL; SQLite serializes writers anyway), so a
second evaluation waits for the first and then reads the rows it left, and the active
alarms are read FOR UPDATE under it. The conditions are read before the lock, so the later
of two evaluations may apply a view a moment older: the next one, seconds later, corrects
it, and no alarm is ever two active rows. An alarm is inserted
through the partial unique index on (kind, subject) WHERE cleared_at IS NULL with
get-or-create semantics, so two inserts of one alarm make one row; clears are updates
guarded on cleared_at IS NULL. Lock order: only alarm rows are locked here (the active ones
in id order, then new ones in (kind, subject) order), and nothing else locks them but
`alarm_acknowledge` (one row); the reads of other tables happen before the transaction.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Q
from django.utils import timezone

from alarms.models import CONSOLE, Alarm
from directory.coverage import Coverage, capability_coverage
from messages.ledger import AGENT, ALL
from messages.models import Status
from messages.rollups import FAILED_OUTCOMES, SubjectStats, subject_stats, subjects_stats
from messages.selectors import retention_behind_s
from reachconsole import health
from reachconsole.core.broker_drops import broker_drops_read
from roster.models import Agent, ClusterNode

log = logging.getLogger(__name__)

Kind, Severity = Alarm.Kind, Alarm.Severity
# The numbers are judged over this window (messages.rollups.WINDOWS): a trickle counts.
WINDOW = "5m"
WINDOW_WORDS = "the last 5 minutes"
Key = tuple[str, str]  # (kind, subject): one active alarm each


@dataclass(frozen=True)
class Condition:
    kind: str
    subject: str
    severity: str
    detail: str
    parent: Key | None = None  # (kind, subject) of the alarm this one is part of

    @property
    def key(self) -> Key:
        return (self.kind, self.subject)


@dataclass
class Found:
    conditions: dict[Key, Condition] = field(default_factory=dict)
    # Kinds whose source could not be read this time (the cache down): their active alarms
    # are left as they are, neither cleared nor refreshed.
    unknown: set[str] = field(default_factory=set)

    def add(self, condition: Condition) -> None:
        self.conditions[condition.key] = condition


@dataclass
class EvaluateResult:
    fired: list[Key] = field(default_factory=list)
    cleared: list[Key] = field(default_factory=list)
    refreshed: int = 0
    pruned: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"fired": len(self.fired), "cleared": len(self.cleared),
                "refreshed": self.refreshed, "pruned": self.pruned}


def _s(n: int) -> str:
    return "" if n == 1 else "s"


# --- the conditions ---------------------------------------------------------------------
def _bus(found: Found) -> None:
    ok, detail = health.broker_check()
    if not ok:
        found.add(Condition(
            Kind.BUS_NOT_HEARD, CONSOLE, Severity.CRITICAL,
            f"The console does not hear the bus: {detail}. While it does not, no lease runs "
            "out and no node is judged down; nothing it sends is published."))


def _nodes(found: Found) -> set[str]:
    """node_down for every node DOWN and in service; returns their ids."""
    down = list(ClusterNode.objects.filter(status=ClusterNode.Status.DOWN, retired=False)
                .values_list("node_id", "last_seen_at"))
    if not down:
        return set()
    agents = dict(Agent.objects.filter(node__node_id__in=[n for n, _ in down]).order_by()
                  .values_list("node__node_id").annotate(n=Count("id")))
    for node_id, last_seen in down:
        n = agents.get(node_id, 0)
        # Words that stay the same while it stays down: the row is not rewritten each time.
        heard = ("never heard" if last_seen is None else
                 f"not heard since {last_seen:%Y-%m-%d %H:%M:%S} UTC")
        found.add(Condition(
            Kind.NODE_DOWN, node_id, Severity.CRITICAL,
            f"Node {node_id} is down: {heard}, three heartbeat intervals or more. Its {n} "
            f"agent{_s(n)} {'gets' if n == 1 else 'get'} no new work. Check the "
            "node's process and its connection to the broker; if it is gone for good, retire "
            "it on the cluster page."))
    return {node_id for node_id, _ in down}


def _capability_words(cover: Coverage) -> str:
    named = "; ".join(f"{agent_id}: {why}" for agent_id, why in cover.unroutable)
    more = cover.total - cover.routable - len(cover.unroutable)
    if more > 0:
        named += f"; and {more} more"
    return (f"{cover.total} agent{_s(cover.total)} offer{'s' if cover.total == 1 else ''} it, "
            f"none routable ({named}). Sends to capability:{cover.capability} end "
            "UNDELIVERABLE until one comes back.")


def _capabilities(found: Found, *, now: datetime, down_nodes: set[str]) -> None:
    uncovered = {c.capability: c for c in capability_coverage(now=now) if c.uncovered}
    if not uncovered:
        return
    # Where the offering agents sit, for those on nodes down or retired only: compared with
    # the coverage's total, it says whether the node(s) took the capability with them.
    retired: Counter = Counter()
    on_down: dict[str, Counter] = defaultdict(Counter)
    for capabilities, node_id, node_retired in (
            Agent.objects.filter(Q(node__status=ClusterNode.Status.DOWN) | Q(node__retired=True))
            .values_list("capabilities", "node__node_id", "node__retired")):
        if not isinstance(capabilities, list):
            continue
        # The same reading of the list as directory/coverage.py, so the counts compare.
        for capability in {c for c in capabilities if isinstance(c, str) and c} & set(uncovered):
            if node_retired:
                retired[capability] += 1
            else:
                on_down[capability][node_id] += 1
    for capability, cover in uncovered.items():
        if retired[capability] >= cover.total:
            continue  # offered only on retired nodes: out of service on purpose
        parent = None
        down = on_down.get(capability)
        if down and retired[capability] + sum(down.values()) >= cover.total:
            # Every agent offering it is on a down (or retired) node: part of that node's
            # alarm; of several, the one holding most of them (then by id).
            node_id = min(down, key=lambda n: (-down[n], n))
            if node_id in down_nodes:
                parent = (Kind.NODE_DOWN, node_id)
        found.add(Condition(Kind.CAPABILITY_UNCOVERED, capability, Severity.CRITICAL,
                            _capability_words(cover), parent=parent))


def _failing(stats: SubjectStats, *, active: bool) -> bool:
    """Below the setting, with the minimum count; one already firing holds until the rate is
    back above the setting by REACH_ALARM_CLEAR_MARGIN, so a rate that hovers around the
    setting raises one alarm, not one a minute."""
    rate = stats.success_rate
    limit = settings.REACH_ALARM_SUCCESS_MIN + (settings.REACH_ALARM_CLEAR_MARGIN if active
                                                else 0.0)
    return stats.finished >= settings.REACH_ALARM_MIN_TASKS and rate is not None and rate < limit


def _rate_words(stats: SubjectStats) -> str:
    """"(67%, below 80%)", or, for one held by the margin, what it is back to and where it
    clears."""
    low = settings.REACH_ALARM_SUCCESS_MIN
    if stats.success_rate < low:
        return f"({stats.success_rate:.0%}, below {low:.0%})"
    return (f"({stats.success_rate:.0%}: back above {low:.0%}, not yet above "
            f"{low + settings.REACH_ALARM_CLEAR_MARGIN:.0%}, where this clears)")


def _outcomes(stats: SubjectStats) -> str:
    parts = [f"{stats.n(s)} {s}" for s in FAILED_OUTCOMES if stats.n(s)]
    return ", ".join(parts) or "none failed"


def _delivery(found: Found, *, now: datetime, active: set[Key]) -> None:
    check, _ = health.delivery_check()
    console = subject_stats(scope=ALL, subject="", window=WINDOW, now=now)
    words = []
    if not check["ok"]:
        words.append(f"Readiness: {check['detail']}.")
    if _failing(console, active=(Kind.DELIVERY_FAILING, CONSOLE) in active):
        words.append(
            f"Of the {console.finished} task requests that ended in {WINDOW_WORDS}, only "
            f"{console.completed} completed {_rate_words(console)}: {_outcomes(console)}.")
    if words:
        found.add(Condition(Kind.DELIVERY_FAILING, CONSOLE, Severity.CRITICAL,
                            " ".join(words) + " See which agents fail on the roster and the "
                            "messages pages."))
    elif "published" not in check:
        found.unknown.add(Kind.DELIVERY_FAILING)  # the cache is down: readiness cannot tell


def _drops(found: Found) -> None:
    try:
        drops = broker_drops_read()
    except Exception as exc:  # the cache (Redis) is down: its own alarms say so
        log.warning("alarms: the broker-drops note could not be read (%s)", exc)
        found.unknown.add(Kind.BROKER_DROPS)
        return
    if drops:
        dropped = drops.get("dropped", 0)
        found.add(Condition(
            Kind.BROKER_DROPS, CONSOLE, Severity.WARNING,
            f"The MQTT broker dropped {dropped} message{_s(dropped)} (last at "
            f"{drops.get('at', '?')}; {drops.get('total', '?')} since it started): raise its "
            "max_queued_messages and max_inflight_messages (docs/performance.md). Clears an "
            "hour after the last drop."))


def _retention(found: Found, *, now: datetime) -> None:
    """One read of the timeline index's first entry (messages.selectors.retention_behind_s)."""
    if retention_behind_s(now=now) <= settings.REACH_ALARM_RETENTION_BEHIND_S:
        return
    # Words that stay the same while it holds: how far behind is the gauge's to say.
    found.add(Condition(
        Kind.RETENTION_BEHIND, CONSOLE, Severity.WARNING,
        f"Messages older than REACH_RETENTION_DAYS={settings.REACH_RETENTION_DAYS:g} are still "
        f"stored, more than {settings.REACH_ALARM_RETENTION_BEHIND_S // 60} minutes past it: "
        "the retention prune (each minute, up to 20 s) deletes fewer messages than arrive, or "
        "beat does not run it. reach_retention_behind_seconds says by how much; the database's "
        "disk fills while it holds (docs/scaling.md: where deletes stop keeping up)."))


def _agents(found: Found, *, now: datetime, down_nodes: set[str], active: set[Key]) -> None:
    stats = subjects_stats(scope=AGENT, window=WINDOW, now=now)
    failing = {a for a, s in stats.items()
               if _failing(s, active=(Kind.AGENT_FAILING, a) in active)}
    expiring = {a for a, s in stats.items()
                if s.n(Status.EXPIRED) >= settings.REACH_ALARM_EXPIRED_MIN}
    if not failing and not expiring:
        return
    placed = {agent_id: (node_id, retired) for agent_id, node_id, retired in
              Agent.objects.filter(agent_id__in=sorted(failing | expiring))
              .values_list("agent_id", "node__node_id", "node__retired")}
    for agent_id in sorted(failing | expiring):
        node_id, retired = placed.get(agent_id, ("", False))
        if retired:
            continue  # its node is out of service on purpose
        s = stats[agent_id]
        on_node = f" on {node_id}" if node_id else " (no longer on the roster)"
        node_parent = (Kind.NODE_DOWN, node_id) if node_id in down_nodes else None
        if agent_id in failing:
            found.add(Condition(
                Kind.AGENT_FAILING, agent_id, Severity.WARNING,
                f"Only {s.completed} of the {s.finished} task requests to {agent_id}{on_node} "
                f"that ended in {WINDOW_WORDS} completed {_rate_words(s)}: {_outcomes(s)}. "
                "Read its errors on the messages page; drain it if it keeps failing.",
                parent=node_parent))
        if agent_id in expiring:
            expired = s.n(Status.EXPIRED)
            parent = node_parent or ((Kind.AGENT_FAILING, agent_id)
                                     if agent_id in failing else None)
            found.add(Condition(
                Kind.TASKS_EXPIRING, agent_id, Severity.WARNING,
                f"{expired} task request{_s(expired)} to {agent_id}{on_node} expired in "
                f"{WINDOW_WORDS}: no answer within their timeoutMs. Is it alive and answering, "
                "or is its timeoutMs too short for the work?",
                parent=parent))


def conditions_find(*, now: datetime) -> Found:
    """Everything that holds now. Reads only; no lock is held while reading."""
    found = Found()
    # What fires now holds by a margin (_failing): read without a lock, as every condition.
    active = set(Alarm.objects.filter(cleared_at__isnull=True).values_list("kind", "subject"))
    _bus(found)
    down_nodes = _nodes(found)
    _capabilities(found, now=now, down_nodes=down_nodes)
    _delivery(found, now=now, active=active)
    _drops(found)
    _agents(found, now=now, down_nodes=down_nodes, active=active)
    _retention(found, now=now)
    for key, condition in list(found.conditions.items()):
        if condition.parent is not None and condition.parent not in found.conditions:
            found.conditions[key] = Condition(condition.kind, condition.subject,
                                              condition.severity, condition.detail)
    return found


# --- the table --------------------------------------------------------------------------
def alarms_evaluate(*, now: datetime | None = None) -> EvaluateResult:
    """Make the alarm table say what holds now, and prune the history past its keep.
    Two at once are serialized (see the module's docstring): never two active rows of one
    alarm, never a clear or a fire done twice."""
    now = now or timezone.now()
    found = conditions_find(now=now)
    result = _apply(found, now=now)
    result.pruned = alarms_prune(now=now)
    if result.fired or result.cleared:
        log.info("alarms: fired %s, cleared %s", result.fired, result.cleared)
    return result


def _apply(found: Found, *, now: datetime) -> EvaluateResult:
    result = EvaluateResult()
    with transaction.atomic():
        # A second evaluation waits here until the first commits, then reads what it did
        # (FOR UPDATE alone locks nothing when no alarm is active).
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(hashtext('alarms_evaluate'))")
        active: dict[Key, Alarm] = {
            (a.kind, a.subject): a for a in
            Alarm.objects.select_for_update().filter(cleared_at__isnull=True).order_by("id")}

        ended = [a for key, a in active.items()
                 if key not in found.conditions and a.kind not in found.unknown]
        if ended:
            ids = [a.id for a in ended]
            cleared = Alarm.objects.filter(id__in=ids, cleared_at__isnull=True).update(
                cleared_at=now, updated_at=now)
            if cleared != len(ids):
                # The rows are locked: only a write around this module can get here.
                log.warning("alarms: %d of %d ended alarms were already cleared",
                            len(ids) - cleared, len(ids))
            for alarm in ended:
                del active[(alarm.kind, alarm.subject)]
                result.cleared.append((alarm.kind, alarm.subject))

        # Roots first, so their children can name them; each in (kind, subject) order, so two
        # evaluations inserting at once take the index entries in the same order.
        fresh = sorted((c for key, c in found.conditions.items() if key not in active),
                       key=lambda c: (c.parent is not None, c.kind, c.subject))
        for condition in fresh:
            parent = active.get(condition.parent) if condition.parent else None
            alarm, created = Alarm.objects.get_or_create(
                kind=condition.kind, subject=condition.subject, cleared_at=None,
                defaults={"severity": condition.severity, "detail": condition.detail,
                          "parent": parent, "fired_at": now, "updated_at": now})
            active[condition.key] = alarm
            if created:
                result.fired.append(condition.key)

        for key, condition in found.conditions.items():
            alarm = active[key]
            parent = active.get(condition.parent) if condition.parent else None
            parent_id = parent.id if parent else None
            if (alarm.severity, alarm.detail, alarm.parent_id) == (
                    condition.severity, condition.detail, parent_id):
                continue
            result.refreshed += Alarm.objects.filter(id=alarm.id, cleared_at__isnull=True).update(
                severity=condition.severity, detail=condition.detail, parent_id=parent_id,
                updated_at=now)
    return result


def alarms_prune(*, now: datetime | None = None) -> int:
    """Drop alarms cleared longer than REACH_ALARM_RETENTION_DAYS ago, set-wise: children
    are unlinked from them first, then they go in one statement. Returns how many."""
    days = settings.REACH_ALARM_RETENTION_DAYS
    if not days:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    # fired_at bounds the scan by the history index (an alarm clears after it fires).
    doomed = Alarm.objects.filter(fired_at__lt=cutoff, cleared_at__lt=cutoff)
    if not doomed.exists():  # the usual case: a read, no write lock taken
        return 0
    with transaction.atomic():
        Alarm.objects.filter(parent__in=doomed.values("id")).update(parent=None)
        deleted, _ = doomed.delete()
    return deleted
