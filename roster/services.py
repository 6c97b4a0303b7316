"""Every write to the roster. Views, the API, tasks and the bridge call these; nothing else
writes roster models.

Each function owns its transaction and is keyword-only, and an action a person or a service
asks for (drain, deregister) writes its audit row inside that transaction. Times come in as
arguments where a caller (a test, a sweep) needs to control them.

Lock order in the roster: a cluster node, then agents in agent id order. No roster
transaction takes a lock of the messages app (messages/backpressure.py has the console-wide order).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, connections, transaction
from django.db.models import Case, F, Value, When
from django.utils import timezone

from reachconsole.core.audit import audit_record
from roster import errors
from roster.errors import (
    AgentHeldElsewhere,
    AgentNotFound,
    ConsoleAgent,
    InvalidField,
    NodeNotFound,
    NotOwner,
    WrongNode,
)
from roster.generation import roster_changed
from roster.hearing import bus_hearing, node_down_after, silence_words
from roster.ids import (
    MAX_INFLIGHT_RANGE,
    MAX_LABELS,
    agent_id_parse,
    node_id_check,
    stored_agent_id,
)
from roster.models import (
    NAME_RE,
    PROFILE_NODE_ID,
    Agent,
    ClusterNode,
    Consistency,
    Dialect,
    LeaseDeadline,
    Namespace,
    lapse_cutoff,
)
from roster.models import RosterEvent as Event

log = logging.getLogger(__name__)

CAPABILITY_RE = NAME_RE


@dataclass(frozen=True, slots=True)
class Lease:
    agent: Agent
    created: bool
    lease_ttl_ms: int
    heartbeat_ms: int
    max_message_bytes: int

    @property
    def expires_at(self) -> datetime:
        return self.agent.lease_expires_at


def _labels_check(values: Any, *, field: str, prefix: str = "") -> list[str]:
    if values is None:
        return []
    if not isinstance(values, list) or len(values) > MAX_LABELS:
        raise InvalidField(errors.LABELS_NOT_A_LIST.format(field=field, limit=MAX_LABELS))
    clean: list[str] = []
    for value in values:
        name = value[len(prefix) :] if prefix and isinstance(value, str) and value.startswith(
            prefix
        ) else value
        if not isinstance(name, str) or not CAPABILITY_RE.fullmatch(name):
            raise InvalidField(errors.LABEL_INVALID.format(field=field, raw=str(value)[:60]))
        label = f"{prefix}{name}"
        if label not in clean:
            clean.append(label)
    return clean


def _metadata_check(metadata: Any) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidField(errors.METADATA_NOT_AN_OBJECT)
    size = len(json.dumps(metadata, ensure_ascii=False).encode())
    limit = settings.REACH_MAX_METADATA_BYTES
    if size > limit:
        raise InvalidField(errors.METADATA_TOO_LARGE.format(size=size, limit=limit))
    return metadata


def _lease_ttl() -> timedelta:
    return timedelta(milliseconds=settings.REACH_LEASE_TTL_MS)


def _deadlines_set(agents: list[Agent]) -> None:
    """The sweep's deadline of each agent, set to its lease's end. Called under the agents'
    row locks, after their lease was written, for a registration and a revival. An agent of
    the A2A-over-MQTT profile has no lease (roster/profile.py) and gets no deadline."""
    agents = [a for a in agents if a.dialect == Dialect.NATIVE]
    if agents:
        LeaseDeadline.objects.bulk_create(
            [LeaseDeadline(agent_id=agent.pk, expires_at=agent.lease_expires_at)
             for agent in agents],
            update_conflicts=True, unique_fields=["agent"], update_fields=["expires_at"])


def lease_deadlines_repair() -> int:
    """Give every live agent that has none its deadline (its lease's end). The services
    write deadlines as they go; this catches agents written around them (a bulk import, a
    hand-made fix in SQL), which the sweep would otherwise never reach. Returns how many.

    The agents are locked first, as every service that writes a deadline locks its agent
    first; one held right now (a registration, a deregistration) is left for the next run."""
    with transaction.atomic():
        missing = list(
            Agent.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(status__in=[Agent.Status.ONLINE, Agent.Status.DRAINING],
                    lease_deadline__isnull=True, dialect=Dialect.NATIVE)
            .order_by().values_list("pk", "lease_expires_at"))
        LeaseDeadline.objects.bulk_create(
            [LeaseDeadline(agent_id=pk, expires_at=at) for pk, at in missing], batch_size=5000)
    return len(missing)


def _lease(agent: Agent, *, created: bool) -> Lease:
    return Lease(
        agent=agent,
        created=created,
        lease_ttl_ms=settings.REACH_LEASE_TTL_MS,
        heartbeat_ms=settings.REACH_HEARTBEAT_MS,
        max_message_bytes=settings.REACH_MAX_MESSAGE_BYTES,
    )


def _node_get_or_create(node_id: str, url: str = "") -> ClusterNode:
    node, _ = ClusterNode.objects.get_or_create(node_id=node_id, defaults={"url": url})
    return node


def agent_register(
    *,
    agent_id: Any,
    node_id: Any,
    version: str = "",
    capabilities: Any = None,
    groups: Any = None,
    endpoint: str = "",
    max_inflight: int | None = None,
    metadata: Any = None,
    owner: str = "",
    actor: str = "",
    acting_for: str = "",
    now: datetime | None = None,
    _retried: bool = False,
) -> Lease:
    """Register an agent on a node, or refresh the registration of the same identity.

    Idempotent: the same agent registering again from the same node keeps its row and gets a
    new lease. From another node it moves only when the old lease has lapsed; while the old
    holder's lease runs the call is refused with the holder named, because two nodes both
    believing they host an agent is how messages get executed twice.

    `acting_for` is the person the caller acts for (X-OODER-Actor): an agent owned by someone
    else is refused, checked under the row's lock so two callers cannot both pass. Without
    it (an operator's or the console's own call) the owner is not checked.
    """
    ref = agent_id_parse(agent_id)
    node_id = node_id_check(node_id)
    if node_id == PROFILE_NODE_ID:
        raise InvalidField(errors.PROFILE_NODE_REGISTER.format(node_id=node_id))
    caps = _labels_check(capabilities, field="capabilities")
    grps = _labels_check(groups, field="groups", prefix="#")
    meta = _metadata_check(metadata)
    if max_inflight is not None and not (
        MAX_INFLIGHT_RANGE[0] <= max_inflight <= MAX_INFLIGHT_RANGE[1]
    ):
        raise InvalidField(errors.MAX_INFLIGHT_OUT_OF_RANGE)
    now = now or timezone.now()
    fields = {
        "version": (version or "")[:64],
        "endpoint": (endpoint or "")[:500],
        "capabilities": caps or [ref.name.rsplit(".", 1)[-1]],
        "groups": grps,
        "metadata": meta,
        "lease_expires_at": now + _lease_ttl(),
    }
    if owner:
        fields["owner"] = owner[:128]
    if max_inflight is not None:
        fields["max_inflight"] = max_inflight

    try:
        with transaction.atomic():
            namespace, _ = Namespace.objects.get_or_create(name=ref.namespace)
            node = _node_get_or_create(node_id)
            agent = (
                # of=self: a FOR UPDATE over the join would lock the node row too, after
                # the agent, where heartbeats lock the node first.
                Agent.objects.select_for_update(of=("self",))
                .select_related("node")
                .filter(agent_id=ref.agent_id)
                .first()
            )
            if agent is None:
                agent = Agent.objects.create(
                    namespace=namespace, name=ref.name, agent_id=ref.agent_id, node=node,
                    segment=ref.name.rsplit(".", 1)[-1],
                    status=Agent.Status.ONLINE, registered_at=now, last_heartbeat_at=now,
                    **fields,
                )
                _deadlines_set([agent])
                Event.objects.create(
                    agent_id=agent.agent_id, node_id=node_id, kind=Event.Kind.REGISTERED,
                    actor=actor, at=now,
                )
                roster_changed()
                return _lease(agent, created=True)

            if acting_for and agent.owner and agent.owner != acting_for:
                raise NotOwner(errors.NOT_OWNER.format(
                    agent_id=agent.agent_id, owner=agent.owner, actor=acting_for,
                    action="re-register",
                ))
            kind = Event.Kind.REGISTERED
            if agent.node_id != node.pk:
                holder = agent.node.node_id
                if agent.status != Agent.Status.OFFLINE and agent.lease_expires_at > now:
                    raise AgentHeldElsewhere(errors.AGENT_HELD_ELSEWHERE.format(
                        agent_id=agent.agent_id, holder=holder,
                        until=agent.lease_expires_at.isoformat(),
                    ))
                kind = Event.Kind.MOVED
                agent.node = node
            for key, value in fields.items():
                setattr(agent, key, value)
            agent.last_heartbeat_at = now
            agent.expired_at = None
            # A drain is an operator's decision: a re-registration does not undo it.
            if agent.status == Agent.Status.OFFLINE:
                agent.status = Agent.Status.ONLINE
            agent.save()
            # Always, not only on a revival: the lease may now end earlier than the deadline
            # (a shorter REACH_LEASE_TTL_MS since the last registration).
            _deadlines_set([agent])
            detail = f"from {holder}" if kind == Event.Kind.MOVED else "re-registered"
            Event.objects.create(
                agent_id=agent.agent_id, node_id=node_id, kind=kind, actor=actor, at=now,
                detail=detail,
            )
            return _lease(agent, created=False)
    except IntegrityError:
        if _retried:
            raise
        # Two first registrations of one id raced; the loser runs again as a re-registration.
        return agent_register(
            agent_id=agent_id, node_id=node_id, version=version, capabilities=capabilities,
            groups=groups, endpoint=endpoint, max_inflight=max_inflight, metadata=metadata,
            owner=owner, actor=actor, acting_for=acting_for, now=now, _retried=True,
        )


def agent_renew(
    *,
    agent_id: str,
    node_id: str | None = None,
    inflight: int | None = None,
    queue_depth: int | None = None,
    now: datetime | None = None,
) -> Lease:
    """Renew one agent's lease (an HTTP heartbeat). It never registers an agent.

    An OFFLINE agent that renews comes back ONLINE: it is still on the roster, and a
    heartbeat proves it is alive. A DRAINING one stays DRAINING.
    """
    ref = agent_id_parse(agent_id)
    now = now or timezone.now()
    lease = None
    with transaction.atomic():
        agent = (
            Agent.objects.select_for_update(of=("self",)).select_related("node")
            .filter(agent_id=ref.agent_id).first()
        )
        if agent is None:
            raise AgentNotFound(
                errors.AGENT_NOT_FOUND_ON_HEARTBEAT.format(agent_id=ref.agent_id)
            )
        holder = agent.node.node_id
        if node_id is not None and holder != node_id:
            Event.objects.create(
                agent_id=agent.agent_id, node_id=node_id, kind=Event.Kind.CONFLICT, at=now,
                detail=f"heartbeat from {node_id}, but the roster places it on {holder}",
            )
        else:
            lease_end = now + _lease_ttl()
            earlier = lease_end < agent.lease_expires_at
            agent.lease_expires_at = lease_end
            agent.last_heartbeat_at = now
            if inflight is not None:
                agent.inflight = max(0, int(inflight))
            if queue_depth is not None:
                agent.queue_depth = max(0, int(queue_depth))
            update = ["lease_expires_at", "last_heartbeat_at", "inflight", "queue_depth",
                      "updated_at"]
            if agent.status == Agent.Status.OFFLINE:
                agent.status = Agent.Status.ONLINE
                agent.expired_at = None
                update += ["status", "expired_at"]
                earlier = True  # live again: it needs a deadline
                Event.objects.create(
                    agent_id=agent.agent_id, node_id=holder, kind=Event.Kind.REVIVED, at=now,
                    detail="heartbeat after the lease lapsed",
                )
            agent.save(update_fields=update)
            if earlier:  # the deadline may now be later than the lease's end
                _deadlines_set([agent])
            lease = _lease(agent, created=False)
    if lease is not None:
        # A heartbeat over HTTP has the same effect as one over MQTT: the node is alive.
        # After the agent's transaction: the roster locks a node before its agents
        # (heartbeat_record, agent_register), never the other way round.
        node_seen(node_id=agent.node.node_id, now=now)
        return lease
    # Raised after the commit so the recorded conflict stays for operators to see.
    raise WrongNode(
        errors.WRONG_NODE.format(agent_id=agent.agent_id, holder=holder, node_id=node_id)
    )


def _agent_for_update(agent_id: str) -> Agent:
    stored = stored_agent_id(agent_id)
    agent = (
        Agent.objects.select_for_update(of=("self",)).select_related("node")
        .filter(agent_id=stored).first()
    )
    if agent is None:
        raise AgentNotFound(errors.AGENT_NOT_FOUND.format(agent_id=stored))
    return agent


def agent_drain(*, agent_id: str, actor: str = "", now: datetime | None = None) -> Agent:
    """Phase 1 of leaving: from this moment no new work is routed to the agent.

    Its lease keeps running so work already accepted for it can finish on it: in flight,
    held behind its maxInflight, and retries of attempts it was sent (the directory's
    `accepted` resolution); when the lease lapses the sweeper removes it, and what is
    still held or retrying for it then ends UNDELIVERABLE with words. Draining twice changes
    nothing, but is audited all the same: the request was made and accepted.
    """
    now = now or timezone.now()
    with transaction.atomic():
        agent = _agent_for_update(agent_id)
        _drain(agent, actor=actor, now=now)
    return agent


def _drain(agent: Agent, *, actor: str, now: datetime) -> None:
    """Drain one agent locked by the caller, and audit it, in the caller's transaction."""
    if agent.status != Agent.Status.DRAINING:
        was_offline = agent.status == Agent.Status.OFFLINE
        agent.status = Agent.Status.DRAINING
        agent.drained_at = now
        agent.save(update_fields=["status", "drained_at", "updated_at"])
        if was_offline:  # live again: the sweep removes it once its lease has lapsed
            _deadlines_set([agent])
        Event.objects.create(
            agent_id=agent.agent_id, node_id=agent.node.node_id, kind=Event.Kind.DRAINED,
            actor=actor, at=now,
        )
    audit_record(actor=actor, action="drain", target=agent.agent_id)


def agent_undrain(*, agent_id: str, actor: str = "", now: datetime | None = None) -> Agent:
    """Undo phase 1: the agent takes new work again. Its lease is not renewed here (only the
    agent's own heartbeat proves it is alive).

    An agent whose lease lapsed while draining is leaving (phase 2): refused with words, even
    before the sweeper has removed it, so an undrain never revives a silent agent. An agent
    that is not draining is left as it is, audited all the same (as a repeated drain is)."""
    now = now or timezone.now()
    with transaction.atomic():
        agent = _agent_for_update(agent_id)
        if agent.status == Agent.Status.DRAINING:
            if agent.lease_lapsed(hearing=bus_hearing(now=now)):
                raise errors.LeaseLapsed(errors.LEASE_LAPSED_UNDRAIN.format(
                    agent_id=agent.agent_id, at=agent.lease_expires_at.isoformat()))
            agent.status = Agent.Status.ONLINE
            agent.drained_at = None
            agent.save(update_fields=["status", "drained_at", "updated_at"])
            Event.objects.create(
                agent_id=agent.agent_id, node_id=agent.node.node_id, kind=Event.Kind.UNDRAINED,
                actor=actor, at=now,
            )
            detail = "takes new work again"
        else:
            detail = f"was {agent.status}, not draining: nothing changed"
        audit_record(actor=actor, action="undrain", target=agent.agent_id, detail=detail)
    return agent


@dataclass(frozen=True, slots=True)
class NodeDrain:
    drained: list[str]  # draining now (or already), in agent id order
    unknown: list[str]  # not in the roster
    elsewhere: dict[str, str]  # agent id → the node the roster places it on


def agents_drain_for_node(*, node_id: str, agent_ids: list[str], actor: str,
                          now: datetime | None = None) -> NodeDrain:
    """A node's own request (a DRAIN on the bus) to drain agents it hosts: for each agent
    the roster places on `node_id`, what agent_drain does, audited; an agent the roster does
    not know, or places on another node, is left as it is, and the refusal audited too (as
    a heartbeat does not move an agent, a node does not drain another node's agents).
    `agent_ids` are normalized agent ids (agent_id_parse)."""
    now = now or timezone.now()
    wanted = sorted(set(agent_ids))
    with transaction.atomic():
        # In agent id order: the roster's lock order.
        agents = list(Agent.objects.select_for_update(of=("self",)).select_related("node")
                      .filter(agent_id__in=wanted).order_by("agent_id"))
        found = {agent.agent_id for agent in agents}
        drained, elsewhere = [], {}
        for agent in agents:
            if agent.node.node_id != node_id:
                elsewhere[agent.agent_id] = agent.node.node_id
                audit_record(actor=actor, action="drain", target=agent.agent_id,
                             result="refused", detail=f"the roster places it on node "
                             f"{agent.node.node_id}, not on {node_id}")
                continue
            _drain(agent, actor=actor, now=now)
            drained.append(agent.agent_id)
        unknown = [agent_id for agent_id in wanted if agent_id not in found]
        for agent_id in unknown:
            audit_record(actor=actor, action="drain", target=agent_id, result="refused",
                         detail="not in the roster")
    return NodeDrain(drained=drained, unknown=unknown, elsewhere=elsewhere)


def node_drain(*, node_id: str, actor: str, now: datetime | None = None) -> list[str]:
    """Phase 1 for every agent the roster places on `node_id`: no new work from now on; work
    in flight finishes. One transaction, set-wise, audited with the change; returns the
    agents that are draining now (those already draining are left as they are)."""
    now = now or timezone.now()
    with transaction.atomic():
        node = ClusterNode.objects.filter(node_id=node_id).first()
        if node is None:
            raise NodeNotFound(errors.NODE_NOT_FOUND.format(node_id=node_id))
        if node_id == settings.REACH_NODE_ID:
            raise ConsoleAgent(errors.CONSOLE_NODE_DRAIN.format(node_id=node_id))
        if node_id == PROFILE_NODE_ID:
            raise ConsoleAgent(errors.PROFILE_NODE.format(node_id=node_id, action="drained"))
        # Locked in agent id order, like every multi-agent lock (the roster's lock order).
        rows = list(Agent.objects.select_for_update().filter(node=node)
                    .exclude(status=Agent.Status.DRAINING).order_by("agent_id")
                    .only("pk", "agent_id", "status", "lease_expires_at", "dialect"))
        Agent.objects.filter(pk__in=[agent.pk for agent in rows]).update(
            status=Agent.Status.DRAINING, drained_at=now, updated_at=now)
        # The OFFLINE ones are live again: the sweep removes them once their leases lapsed.
        _deadlines_set([agent for agent in rows if agent.status == Agent.Status.OFFLINE])
        Event.objects.bulk_create([
            Event(agent_id=agent.agent_id, node_id=node_id, kind=Event.Kind.DRAINED,
                  actor=actor, at=now, detail="the whole node is draining")
            for agent in rows])
        audit_record(actor=actor, action="drain-node", target=node_id,
                     detail=f"{len(rows)} agent(s) draining")
    return [agent.agent_id for agent in rows]


def agent_deregister(*, agent_id: str, actor: str = "", now: datetime | None = None) -> str:
    """Phase 2 of leaving: the agent is taken off the roster. Returns the node it was on."""
    now = now or timezone.now()
    with transaction.atomic():
        agent = _agent_for_update(agent_id)
        node_id = agent.node.node_id
        agent.delete()
        roster_changed()
        Event.objects.create(
            agent_id=agent.agent_id, node_id=node_id, kind=Event.Kind.DEREGISTERED,
            actor=actor, at=now,
        )
        audit_record(actor=actor, action="deregister", target=agent.agent_id,
                     detail=f"from {node_id}")
    return node_id


@dataclass(frozen=True, slots=True)
class ExpiryCounts:
    offline: int
    removed: int


def leases_expire(*, now: datetime | None = None, batch: int = 20_000,
                  max_batches: int = 50, workers: int | None = None) -> ExpiryCounts:
    """Set-wise sweep of lapsed leases: ONLINE → OFFLINE, DRAINING → removed, each with its
    history row. Batch after batch (each its own short transaction) until none is left.

    It reads the deadlines (LeaseDeadline) that have passed, never the whole roster. Both
    the deadlines and their agents are claimed with `skip_locked`: two sweepers never count,
    log or remove an agent twice, and an agent a registration or heartbeat holds right now
    waits for the next batch. So when more than a batch is due (a node that died with its
    agents, a console back from an outage), `workers` connections sweep at once
    (REACH_LEASE_SWEEP_WORKERS; PostgreSQL outside a transaction only).
    Nothing lapses until the console has heard the bus for a full TTL
    (roster.models.lapse_cutoff)."""
    now = now or timezone.now()
    cutoff = lapse_cutoff(bus_hearing(now=now))
    if cutoff is None:
        return ExpiryCounts(offline=0, removed=0)
    # Judged, and stamped, at the moment up to which the console has proof it heard the bus:
    # a lease that ended after it may only look lapsed because the console fell deaf.
    now = min(now, cutoff)
    spread = workers or settings.REACH_LEASE_SWEEP_WORKERS
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        spread = 1  # SQLite has one writer; threads would not see this transaction
    elif spread > 1 and not LeaseDeadline.objects.filter(expires_at__lt=now)[batch:batch + 1]:
        spread = 1  # one batch holds all that is due: the common case, every second
    if spread == 1:
        runs = [_batches_run(now=now, batch=batch, max_batches=max_batches)]
    else:
        # The threads borrow from this process's pool: give this thread's connection back
        # first, and never ask for more than the pool holds.
        connection.close()
        db_pool = connection.settings_dict["OPTIONS"].get("pool")
        if isinstance(db_pool, dict) and db_pool.get("max_size"):
            spread = min(spread, db_pool["max_size"])
        with ThreadPoolExecutor(spread, thread_name_prefix="lease-sweep") as threads:
            runs = list(threads.map(lambda _: _batches_run_apart(
                now=now, batch=batch, max_batches=max_batches), range(spread)))
    return ExpiryCounts(offline=sum(run[0] for run in runs),
                        removed=sum(run[1] for run in runs))


def _batches_run(*, now: datetime, batch: int, max_batches: int) -> tuple[int, int]:
    """Batches on this thread's connection until one is not full. Returns the agents taken
    OFFLINE and those removed."""
    sweep = _expire_batch_pg if connection.vendor == "postgresql" else _expire_batch
    offline = removed = 0
    for _ in range(max_batches):
        with transaction.atomic():
            due, seen, batch_offline, batch_removed = sweep(now=now, batch=batch)
        offline, removed = offline + batch_offline, removed + batch_removed
        if batch_removed:
            roster_changed()
        if due < batch or not seen:  # all done, or the rest is held by others right now
            break
    return offline, removed


def _batches_run_apart(*, now: datetime, batch: int, max_batches: int) -> tuple[int, int]:
    """_batches_run on a thread of its own, which closes the connection it opened."""
    try:
        return _batches_run(now=now, batch=batch, max_batches=max_batches)
    finally:
        connections.close_all()


# One statement a batch, with no per-row parameters: claim the passed deadlines and their
# agents, take the lapsed ONLINE ones OFFLINE and remove the lapsed DRAINING ones, move the
# deadline of an agent renewed since to its lease's end, drop the deadlines of the agents
# it changed and of those no longer live, and write the history. The update of roster_agent
# changes no indexed column, so it is HOT (Agent.Meta); rows are found by key (= ANY), so a
# batch costs the same on a roster of millions.
#
# The changes re-check the old state (status, lease) and are not addressed by the ctid the
# claim locked: a row changed by a transaction that committed after this statement's
# snapshot but before its lock is locked in its newest version, which the statement's own
# UPDATE or DELETE cannot see by ctid; by key, PostgreSQL re-checks the newest version. An
# agent drained in that moment is then neither taken OFFLINE nor removed, and its deadline
# stays for the next batch. Its deadline goes only with what was actually changed.
_EXPIRE_SQL = """
WITH due AS (
    SELECT agent_id FROM roster_leasedeadline
    WHERE expires_at < %(now)s
    ORDER BY expires_at LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), seen AS MATERIALIZED (
    SELECT a.id, a.status IN ('ONLINE', 'DRAINING') AS live,
           a.lease_expires_at < %(now)s AS lapsed, a.status, a.lease_expires_at
    FROM roster_agent a
    WHERE a.id = ANY (ARRAY(SELECT agent_id FROM due)) AND a.dialect = 'native'
    FOR UPDATE SKIP LOCKED
), went_offline AS (
    UPDATE roster_agent a SET status = 'OFFLINE', expired_at = %(now)s, inflight = 0,
                              updated_at = %(now)s
    WHERE a.id = ANY (ARRAY(SELECT id FROM seen WHERE lapsed AND status = 'ONLINE'))
      AND a.status = 'ONLINE' AND a.lease_expires_at < %(now)s
    RETURNING a.id, a.agent_id, a.node_id, 'EXPIRED'::text AS kind, ''::text AS detail
), removed AS (
    DELETE FROM roster_agent a
    WHERE a.id = ANY (ARRAY(SELECT id FROM seen WHERE lapsed AND status = 'DRAINING'))
      AND a.status = 'DRAINING' AND a.lease_expires_at < %(now)s
    RETURNING a.id, a.agent_id, a.node_id, 'REMOVED'::text AS kind,
              'lease lapsed while draining'::text AS detail
), moved AS (
    UPDATE roster_leasedeadline d SET expires_at = s.lease_expires_at
    FROM seen s
    WHERE d.agent_id = s.id AND s.live AND NOT s.lapsed
), dropped AS (
    DELETE FROM roster_leasedeadline d
    WHERE d.agent_id = ANY (ARRAY(SELECT id FROM went_offline UNION ALL
                                  SELECT id FROM removed UNION ALL
                                  SELECT id FROM seen WHERE NOT live))
), history AS (
    INSERT INTO roster_rosterevent (at, agent_id, node_id, kind, actor, detail)
    SELECT %(now)s, c.agent_id, n.node_id, c.kind, 'sweeper', c.detail
    FROM (TABLE went_offline UNION ALL TABLE removed) c
    JOIN roster_clusternode n ON n.id = c.node_id
    RETURNING kind
)
SELECT (SELECT count(*) FROM due), (SELECT count(*) FROM seen),
       count(*) FILTER (WHERE kind = 'EXPIRED'), count(*) FILTER (WHERE kind = 'REMOVED')
FROM history
"""


def _expire_batch_pg(*, now: datetime, batch: int) -> tuple[int, int, int, int]:
    with connection.cursor() as cursor:
        cursor.execute(_EXPIRE_SQL, {"now": now, "batch": batch})
        due, seen, offline, removed = cursor.fetchone()
    return due, seen, offline, removed


def _expire_batch(*, now: datetime, batch: int) -> tuple[int, int, int, int]:
    """The same batch for SQLite (the embedded mode), which has no data-modifying CTEs:
    a few statements, still set-wise."""
    due = list(LeaseDeadline.objects.select_for_update(skip_locked=True)
               .filter(expires_at__lt=now).order_by("expires_at")
               .values_list("agent_id", flat=True)[:batch])
    seen = []
    for chunk in _chunks(due):  # SQLite's bound-parameter limit
        seen += (Agent.objects.select_for_update(skip_locked=True, of=("self",))
                 .filter(pk__in=chunk, dialect=Dialect.NATIVE)
                 .values_list("id", "agent_id", "status", "lease_expires_at", "node__node_id"))
    live = {Agent.Status.ONLINE, Agent.Status.DRAINING}
    lapsed = [row for row in seen if row[2] in live and row[3] < now]
    online = [row for row in lapsed if row[2] == Agent.Status.ONLINE]
    draining = [row for row in lapsed if row[2] == Agent.Status.DRAINING]
    offline = removed = 0
    for chunk in _chunks([row[0] for row in online]):
        offline += Agent.objects.filter(id__in=chunk, status=Agent.Status.ONLINE).update(
            status=Agent.Status.OFFLINE, expired_at=now, inflight=0, updated_at=now)
    for chunk in _chunks([row[0] for row in draining]):
        # delete() counts the deadlines it cascades to as well: only the agents count.
        removed += Agent.objects.filter(id__in=chunk, status=Agent.Status.DRAINING).delete(
        )[1].get(Agent._meta.label, 0)
    LeaseDeadline.objects.bulk_update(
        [LeaseDeadline(agent_id=row[0], expires_at=row[3]) for row in seen
         if row[2] in live and row[3] >= now], ["expires_at"], batch_size=2000)
    for chunk in _chunks([row[0] for row in seen if row[2] not in live or row[3] < now]):
        LeaseDeadline.objects.filter(agent_id__in=chunk).delete()
    Event.objects.bulk_create([
        Event(agent_id=row[1], node_id=row[4], kind=Event.Kind.EXPIRED, actor="sweeper", at=now)
        for row in online
    ] + [
        Event(agent_id=row[1], node_id=row[4], kind=Event.Kind.REMOVED, actor="sweeper", at=now,
              detail="lease lapsed while draining")
        for row in draining
    ], batch_size=2000)
    return len(due), len(seen), offline, removed


def _chunks(ids: list[int], size: int = 2000) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def node_seen(
    *,
    node_id: str,
    url: str | None = None,
    heartbeat_ms: int | None = None,
    now: datetime | None = None,
    signed: bool | None = None,
) -> ClusterNode:
    """Record that a node spoke on the bus (a heartbeat): last seen now, status ONLINE (from
    REGISTERED, DOWN or ONLINE). `signed`: whether the heartbeat carried a signature that
    checks (None: not known, nothing recorded of it).

    Without a node authority (REACH_CLUSTER_NODES_URL) the heartbeat is the node's proof of
    life, so a node that was STALE or UNKNOWN for its silence is OK again at once; with
    one, the next reconciliation decides (the authority may no longer list it)."""
    node_id = node_id_check(node_id)
    now = now or timezone.now()
    changes: dict[str, Any] = {"last_seen_at": now, "status": ClusterNode.Status.ONLINE}
    if url is not None:
        changes["url"] = url[:500]
    if heartbeat_ms is not None:
        changes["heartbeat_ms"] = heartbeat_ms
    if signed is not None:
        changes["signed_at" if signed else "unsigned_at"] = now
    live = {} if settings.REACH_CLUSTER_NODES_URL else {
        "consistency": Consistency.OK, "consistency_reason": f"node {node_id} is live"}
    with transaction.atomic():
        updated = ClusterNode.objects.filter(node_id=node_id).update(**changes, **{
            # A retired node stays STALE whatever it sends.
            field: Case(When(retired=True, then=F(field)), default=Value(value))
            for field, value in live.items()})
        if not updated:
            try:
                with transaction.atomic():
                    ClusterNode.objects.create(node_id=node_id, **changes, **live)
            except IntegrityError:  # created by a concurrent caller in between
                ClusterNode.objects.filter(node_id=node_id).update(**changes)
    return ClusterNode.objects.get(node_id=node_id)


def nodes_signature_refused(*, refused: dict[str, str], now: datetime | None = None) -> None:
    """Messages speaking for these nodes were refused for their signature (node → why): the
    node's page says so. Only nodes the roster knows: a forged node id creates nothing."""
    now = now or timezone.now()
    for node_id in sorted(refused):  # the order every node lock is taken in
        ClusterNode.objects.filter(node_id=node_id).update(
            signature_refused_at=now, signature_refused=refused[node_id][:300])


def nodes_sweep(*, now: datetime | None = None) -> int:
    """Nodes silent for three heartbeat intervals become DOWN, judged only over time the
    console itself heard the bus (its own deafness is no node's silence). A node never heard
    (REGISTERED) is silent since it was registered: a registration alone does not prove it
    runs. A heartbeat makes a node ONLINE again (node_seen). Returns how many changed.

    A heard node that goes DOWN is STALE at once, with the words reconciliation would give
    (roster/reconcile.py `node_verdict`): its card must not show DOWN beside an OK that only
    the next reconciliation would take back. UNKNOWN stays UNKNOWN until then."""
    now = now or timezone.now()
    hearing = bus_hearing(now=now)
    if hearing is None:
        return 0
    live = [ClusterNode.Status.ONLINE, ClusterNode.Status.REGISTERED]
    # Nodes are few (one row a machine or process): judged here, each by its own interval,
    # then changed in guarded statements. The A2A-over-MQTT profile's node sends no
    # heartbeat: its agents' presence is their cards' (roster/profile.py).
    down: list[int] = []
    stale: dict[int, str] = {}
    for pk, node_id, last_seen, created, beat_ms, consistency in (
            ClusterNode.objects.filter(status__in=live).exclude(
                node_id=PROFILE_NODE_ID).values_list(
                "pk", "node_id", "last_seen_at", "created_at", "heartbeat_ms",
                "consistency")):
        window = node_down_after(beat_ms)
        cutoff = hearing.cutoff(window)
        if cutoff is not None and (last_seen or created) < cutoff:
            down.append(pk)
            if last_seen is not None and consistency == Consistency.OK:
                stale[pk] = silence_words(node_id, last_seen, now=hearing.through,
                                          window=window)
    if not down:
        return 0
    with transaction.atomic():
        changed = ClusterNode.objects.filter(pk__in=down, status__in=live).update(
            status=ClusterNode.Status.DOWN)
        for pk, reason in stale.items():
            ClusterNode.objects.filter(pk=pk, status=ClusterNode.Status.DOWN,
                                       consistency=Consistency.OK).update(
                consistency=Consistency.STALE, consistency_reason=reason[:300])
    return changed


def node_retire(*, node_id: str, retired: bool = True, actor: str = "") -> ClusterNode:
    """Take a node out of service (its agents are STALE at once: no new work), or put it back
    (UNKNOWN until its next heartbeat or reconciliation says more). Audited with the
    change."""
    verdict = ((Consistency.STALE, f"node {node_id} is retired") if retired else
               (Consistency.UNKNOWN, f"node {node_id} was put back in service; not judged yet"))
    if node_id == PROFILE_NODE_ID:
        raise ConsoleAgent(errors.PROFILE_NODE.format(node_id=node_id, action="retired"))
    with transaction.atomic():
        if not ClusterNode.objects.filter(node_id=node_id).update(
                retired=retired, consistency=verdict[0], consistency_reason=verdict[1][:300]):
            raise NodeNotFound(errors.NODE_NOT_FOUND.format(node_id=node_id))
        audit_record(actor=actor, action="retire-node" if retired else "unretire-node",
                     target=node_id)
    return ClusterNode.objects.get(node_id=node_id)


@dataclass(frozen=True, slots=True)
class HeartbeatOutcome:
    renewed: list[str]
    conflicts: list[str]  # listed by this node, placed elsewhere by the roster
    unknown: list[str]  # listed, but never registered


def heartbeat_record(
    *,
    node_id: str,
    agents: list[dict[str, Any]],
    heartbeat_ms: int | None = None,
    now: datetime | None = None,
    signed: bool | None = None,
) -> HeartbeatOutcome:
    """A node's heartbeat (PROTOCOL.md "Heartbeat"): the node is alive, and every listed
    agent the roster places on it gets a new lease and its reported load.

    It never registers an agent, and an agent listed by a node the roster places elsewhere
    is recorded as a conflict, not moved.
    """
    now = now or timezone.now()
    loads: dict[str, dict[str, Any]] = {}
    for item in agents:
        agent_id = item.get("agentId") if isinstance(item, dict) else None
        if isinstance(agent_id, str) and agent_id:
            loads[agent_id.replace("/", ".", 1)] = item
    with transaction.atomic():
        node = node_seen(node_id=node_id, heartbeat_ms=heartbeat_ms, now=now, signed=signed)
        # Locked in agent id order, like every multi-agent lock, so they cannot deadlock.
        rows = list(
            Agent.objects.select_for_update(of=("self",))
            .filter(agent_id__in=list(loads))
            .select_related("node")
            .order_by("agent_id")
        )
        renewed, conflicts, revived, events = [], [], [], []
        earlier: dict[int, Agent] = {}  # by primary key: once each
        lease_end = now + _lease_ttl()
        for agent in rows:
            if agent.node_id != node.pk:
                conflicts.append(agent.agent_id)
                events.append(Event(
                    agent_id=agent.agent_id, node_id=node_id, kind=Event.Kind.CONFLICT, at=now,
                    detail=f"listed in a heartbeat of {node_id}, but the roster places it on "
                    f"{agent.node.node_id}",
                ))
                continue
            load = loads[agent.agent_id]
            if lease_end < agent.lease_expires_at:
                earlier[agent.pk] = agent  # the deadline may now be later than the lease's end
            agent.lease_expires_at = lease_end
            agent.last_heartbeat_at = now
            agent.inflight = _non_negative(load.get("inflight"), agent.inflight)
            agent.queue_depth = _non_negative(load.get("queueDepth"), agent.queue_depth)
            max_inflight = _non_negative(load.get("maxInflight"), agent.max_inflight)
            agent.max_inflight = max_inflight or agent.max_inflight
            if agent.status == Agent.Status.OFFLINE:
                agent.status = Agent.Status.ONLINE
                agent.expired_at = None
                revived.append(agent.agent_id)
                earlier[agent.pk] = agent
                events.append(Event(
                    agent_id=agent.agent_id, node_id=node_id, kind=Event.Kind.REVIVED, at=now,
                    detail="heartbeat after the lease lapsed",
                ))
            renewed.append(agent)
        Agent.objects.bulk_update(
            renewed,
            ["lease_expires_at", "last_heartbeat_at", "inflight", "queue_depth", "max_inflight",
             "status", "expired_at"],
        )
        # Only these need their deadline written: a live agent's stays early (LeaseDeadline).
        _deadlines_set(list(earlier.values()))
        Event.objects.bulk_create(events)
    known = {agent.agent_id for agent in rows}
    return HeartbeatOutcome(
        renewed=[agent.agent_id for agent in renewed], conflicts=conflicts,
        unknown=sorted(set(loads) - known),
    )


def _non_negative(value: Any, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 10_000_000:
        return value
    return default
