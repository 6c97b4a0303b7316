"""What the bridge does with a batch of MQTT messages, in PROTOCOL.md's order:

1. reject and count what is not an A2A envelope (never crash, never a half row); a request
   to us that still names itself and a valid origin node is told why (NACK);
2. drop self-originated messages (heartbeats by `originNodeId` only);
3. answer a duplicate request (same idempotency key in the window, or a messageId already
   stored) with ACK `duplicate: true`, without executing or storing it again; a copy of
   one publish that came through a second subscription is no duplicate (`Incoming.copy`);
4. store each message once (`ON CONFLICT DO NOTHING`), then act only on rows this call
   inserted: ACK/NACK/BUSY move the acknowledged send and TASK_RESPONSE completes its
   request, when they come from the node it was sent to on the requester's inbox (else
   they are refused, with the reason on their own row); HEARTBEAT renews leases and DRAIN
   drains agents through the roster; a request to a console agent runs once, and a request
   without replyNodeId not at all.

One transaction per batch; the bridge acknowledges the batch to the broker after it commits.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from messages import protocol, signing
from messages.backpressure import held_release
from messages.delivery import retry_or_give_up
from messages.events import events_on_commit, message_events
from messages.handlers import LOCAL_HANDLERS, console_agent_run
from messages.idempotency import (
    copies_stood_in,
    copies_twin_take,
    idempotency_claim,
    idempotency_release,
)
from messages.ledger import Ledger
from messages.models import Change, Direction, Heard, Message, Status
from messages.outbound import message_reroute
from messages.redact import redacted
from messages.rows import (
    ReceivedRow,
    received_row,
    rejection_reply_row,
    reply_row,
)
from messages.state import atomic_retrying, changes_apply, messages_insert_new
from roster.errors import RosterError
from roster.ids import agent_id_parse
from roster.models import NODE_ID_RE
from roster.services import (
    agents_drain_for_node,
    heartbeat_record,
    nodes_signature_refused,
)

log = logging.getLogger(__name__)
MT = protocol.MessageType
# What the console answers when it is asked (and acknowledges as a duplicate when repeated).
REQUESTS = frozenset({MT.TASK_REQUEST, MT.DRAIN, MT.CANCEL})
# What moves a request of ours or one observed on the bus.
ANSWERS = frozenset({MT.ACK, MT.NACK, MT.BUSY, MT.TASK_RESPONSE})

# An answered transmission leaves the ack-deadline index (the sweep costs what is due).
ANSWERED_FIELDS = {"ack_deadline_at": None}
_last_logged: dict[str, float] = {}


def _log_once_a_minute(reason: str, detail: str) -> None:
    now = time.monotonic()
    if now - _last_logged.get(reason, -120.0) >= 60.0:
        _last_logged[reason] = now
        log.warning("rejected an MQTT payload (%s): %s", reason, detail)


@dataclass(frozen=True, slots=True)
class Incoming:
    topic: str
    payload: bytes
    # When the bridge was handed it: a heartbeat's age is judged then, not when a batch held
    # up by a database outage is stored. Not part of its identity (copies are stored once).
    received_at: datetime | None = field(default=None, compare=False)
    # Through the plain own-inbox subscription, beside the shared group's copy of the same
    # publish (messages/subscriptions.py): a stand-in only. Stored
    # and acted on when it is the first copy to arrive; never answered, counted or refused
    # as a repeat, since the group's copy is the one that speaks for the publish.
    copy: bool = field(default=False, compare=False)


@dataclass
class IngestResult:
    to_publish: list[int] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    busy: list[int] = field(default_factory=list)  # capability sends answered BUSY

    @property
    def stored(self) -> int:
        """Messages stored new: the count itself, so a merged result (the bridge's
        one-by-one retry adds up counts) says it too."""
        return self.counts["stored"]


def _is_self(env: protocol.Envelope, node_id: str) -> bool:
    if env.message_type == MT.HEARTBEAT:
        return env.origin_node_id == node_id
    return env.from_agent_id == node_id or env.from_agent_id in LOCAL_HANDLERS


# How long a heartbeat's first copy is remembered (messages/subscriptions.py: every bridge hears
# every heartbeat): far longer than copies take to arrive, short enough to stay small.
HEARTBEAT_SEEN_S = 60


def heartbeats_first_copy(*, heartbeats: list[tuple[str, protocol.Envelope]], receiver: str,
                          counts: Counter) -> list[tuple[str, protocol.Envelope]]:
    """Every bridge of the console subscribes to the heartbeats itself, not as a share (a
    share of them would go to a bridge that stopped, and be lost: QoS 0 is not kept for an
    absent client), so each heartbeat comes once per bridge. The first bridge to claim its
    message id applies it; the others count a copy. A bridge retrying its own batch (the
    database was down) holds its claim and applies it then. In node order: two bridges
    applying heartbeats of the same nodes take their rows in one order."""
    kept = []
    for node, env in sorted(heartbeats, key=lambda item: item[0]):
        if receiver and not _heartbeat_claim(node, env.message_id, receiver, counts):
            counts["heartbeat_copies"] += 1
            continue
        kept.append((node, env))
    return kept


def _heartbeat_claim(node: str, message_id: str, receiver: str, counts: Counter) -> bool:
    # Cache keys have a length and alphabet limit; message ids are the sender's text.
    key = "hb-seen:" + hashlib.sha256(f"{node}\x00{message_id}".encode()).hexdigest()
    try:
        return (cache.add(key, receiver, timeout=HEARTBEAT_SEEN_S)
                or cache.get(key) == receiver)
    except Exception:  # the cache is down: a heartbeat applied twice does no harm
        counts["heartbeat_claims_unavailable"] += 1
        return True


def _heartbeat_verdict(env: protocol.Envelope, node: str, *, now: datetime
                       ) -> signing.Verdict:
    """A heartbeat speaks for the node of its topic; signed, it must also be fresh (it is
    not stored, so its messageId does not stop a replay for long)."""
    keyring = signing.keyring_for(settings.REACH_SIGNING_KEYS)
    if not keyring:
        return signing.UNCHECKED
    verdict = env.signature_check(node_id=node, keyring=keyring)
    if verdict.signed:
        return signing.heartbeat_age_check(timestamp=env.timestamp,
                                           now_ms=int(now.timestamp() * 1000)) or verdict
    return verdict


def _signature_judge(row: ReceivedRow, env: protocol.Envelope, *, refusals: dict[str, str],
                     counts: Counter) -> None:
    """An answer, or a request to the console, speaks for its headers.originNodeId: whether
    its signature lets it change anything (docs/protocol.md "Signatures"). A refusal is
    written on the row itself, where its trace shows it."""
    keyring = signing.keyring_for(settings.REACH_SIGNING_KEYS)
    speaker = env.origin_node_id
    if not keyring or (not speaker and env.message_type in ANSWERS):
        return  # nothing to check with; an answer without an origin is refused for that
    if speaker:
        verdict = env.signature_check(node_id=speaker, keyring=keyring)
    else:
        verdict = signing.Verdict("no_origin", "it names no headers.originNodeId, so no "
                                  "signature can say which node sent it")
    refusal = signing.signature_refusal(verdict, strict=settings.REACH_REQUIRE_SIGNED)
    if not refusal:
        return
    row.signature_refused = refusal
    if env.message_type in ANSWERS:
        row.error = f"not accepted, changed nothing: {refusal}"
    _signature_refused(refusals, node=speaker or "", what=f"a {env.message_type}",
                       verdict=verdict, words=refusal, counts=counts)


def _signature_refused(refusals: dict[str, str], *, node: str, what: str,
                       verdict: signing.Verdict, words: str, counts: Counter) -> None:
    code = verdict.code if verdict.refused else "unsigned"
    counts[f"rejected:signature_{code}"] += 1
    _log_once_a_minute(f"signature_{code}", f"{what} speaking for node {node or '(none)'}: "
                       f"{words}")
    if node:
        refusals[node] = f"{what}: {words}"[:300]


@dataclass
class _Decoded:
    """One batch, decoded and judged (step 1 and 2), before anything is stored."""
    rows: list[ReceivedRow] = field(default_factory=list)
    heartbeats: list[tuple[str, protocol.Envelope]] = field(default_factory=list)
    signed: dict[int, bool] = field(default_factory=dict)  # by id() of a heartbeat's envelope
    refusals: dict[str, str] = field(default_factory=dict)  # node → why one speaking for it
    rejected: list[protocol.Rejection] = field(default_factory=list)  # requests to us refused
    copies: set[int] = field(default_factory=set)  # id() of rows that came as a stand-in


def messages_ingest(*, batch: list[Incoming], node_id: str, prefix: str,
                    now: datetime | None = None, receiver: str = "") -> IngestResult:
    """`receiver`: the bridge storing the batch (its client id), which heartbeats are
    claimed for (heartbeats_first_copy); "" applies every heartbeat.

    One straight pass: decode and judge the batch, apply its heartbeats (and the refusals
    of what spoke for a node), its drains, then store its messages, act on them, apply the
    changes and write the answers in one transaction (`_ingest_rows`), and last move what
    BUSY sent elsewhere."""
    now = now or timezone.now()
    result = IngestResult()
    counts = result.counts
    decoded = _batch_decode(batch, node_id=node_id, prefix=prefix, now=now, counts=counts)
    _heartbeats_apply(decoded, receiver=receiver, now=now, counts=counts)
    # Before the batch, in transactions of their own: a DRAIN takes roster locks, which the
    # batch must not take while it holds message rows (messages/backpressure.py, the lock order).
    # Its answer is written by the batch, so it leaves only after the drain committed.
    drains = _drains_apply(decoded.rows, now=now, counts=counts)
    claims: list[tuple[str, str]] = []
    try:
        _ingest_rows(decoded.rows, node_id=node_id, now=now, result=result, claims=claims,
                     rejected=decoded.rejected, drains=drains, copies=decoded.copies)
    except BaseException:
        idempotency_release(node_id=node_id, claims=claims)
        raise
    for pk in result.busy:
        # Each in a transaction of its own, after the batch's: a new attempt takes its
        # task's lock first (messages/backpressure.py, the lock order), which a transaction already
        # holding message and load rows must not wait for.
        atomic_retrying(lambda pk=pk: _reroute(pk, now=now, result=result))
    return result


def _batch_decode(batch: list[Incoming], *, node_id: str, prefix: str, now: datetime,
                  counts: Counter) -> _Decoded:
    """Steps 1 and 2: each message decoded, refused with its reason or dropped as our own,
    and sorted into heartbeats and rows; nothing written."""
    out = _Decoded()
    max_bytes = settings.REACH_MAX_MESSAGE_BYTES
    store_observed = settings.REACH_STORE_OBSERVED_PAYLOADS
    for item in batch:
        match = protocol.parse_topic(prefix, item.topic)
        if match is None:
            counts["rejected:unknown_topic"] += 1
            _log_once_a_minute("unknown_topic", f"topic {item.topic[:200]!r}")
            continue
        env = protocol.decode(item.payload, max_bytes=max_bytes)
        if isinstance(env, protocol.Rejection) and item.copy:
            counts["inbox_copies"] += 1  # the group's copy counts it and answers it
            continue
        if isinstance(env, protocol.Rejection):
            counts[f"rejected:{env.reason.value}"] += 1
            _log_once_a_minute(env.reason.value, f"on {item.topic[:200]}: {env.detail}")
            # A request to us that names itself and a valid origin is told why (PROTOCOL.md:
            # a refusal is answered, not silent).
            if (match.kind == "inbox" and match.node_id == node_id
                    and env.message_type in REQUESTS and env.message_id
                    and env.origin_node_id and env.origin_node_id != node_id):
                out.rejected.append(env)
            continue
        if _is_self(env, node_id):
            counts["dropped_self"] += 1
            continue
        if match.kind == "heartbeat":
            _heartbeat_judge(env, match.node_id, item=item, now=now, out=out, counts=counts)
            continue
        direction = Direction.RECV if match.node_id == node_id else Direction.OBSERVED
        row = received_row(env, topic=item.topic, direction=direction, now=now,
                           store_observed=store_observed)
        if env.message_type in ANSWERS or (direction == Direction.RECV
                                           and env.message_type in REQUESTS):
            # A stand-in's refusal is on its row if it is stored first; counted once, by the
            # group's copy.
            _signature_judge(row, env, refusals=out.refusals,
                             counts=Counter() if item.copy else counts)
        out.rows.append(row)
        if item.copy:
            out.copies.add(id(row))
    return out


def _heartbeat_judge(env: protocol.Envelope, node: str, *, item: Incoming, now: datetime,
                     out: _Decoded, counts: Counter) -> None:
    if env.message_type != MT.HEARTBEAT:
        counts["rejected:not_a_heartbeat"] += 1
        _log_once_a_minute("not_a_heartbeat", f"{env.message_type} on {item.topic}")
        return
    if not NODE_ID_RE.fullmatch(node):
        # A topic level MQTT allows but no node can be named (the roster's rule): refused
        # here, not by the roster in the middle of the batch's heartbeats.
        counts["rejected:invalid_node_id"] += 1
        _log_once_a_minute("invalid_node_id", f"heartbeat on {item.topic[:200]}")
        return
    verdict = _heartbeat_verdict(env, node, now=item.received_at or now)
    refusal = signing.signature_refusal(verdict, strict=settings.REACH_REQUIRE_SIGNED)
    if refusal:
        _signature_refused(out.refusals, node=node, what="a heartbeat", verdict=verdict,
                           words=refusal, counts=counts)
        return
    out.heartbeats.append((node, env))
    out.signed[id(env)] = verdict.signed


def _heartbeats_apply(decoded: _Decoded, *, receiver: str, now: datetime,
                      counts: Counter) -> None:
    """The batch's heartbeats (the first copy of each: every bridge hears them all) and the
    refusals of what spoke for a node, in their own short transaction: they lock roster
    rows, which the message batch should not hold while it waits for message rows (lock
    order, no deadlocks)."""
    heartbeats = decoded.heartbeats
    if heartbeats:
        heartbeats = heartbeats_first_copy(heartbeats=heartbeats, receiver=receiver,
                                           counts=counts)
    if not heartbeats and not decoded.refusals:
        return
    with transaction.atomic():
        for hb_node, env in heartbeats:
            try:
                with transaction.atomic():  # one refused heartbeat leaves the others
                    _heartbeat(hb_node, env, now=now, counts=counts,
                               signed=decoded.signed[id(env)])
            except RosterError as exc:
                counts["rejected:heartbeat_refused"] += 1
                _log_once_a_minute("heartbeat_refused", f"from {hb_node}: {exc.detail}")
        if decoded.refusals:
            nodes_signature_refused(refused=decoded.refusals, now=now)


def _reroute(pk: int, *, now: datetime, result: IngestResult) -> None:
    busy = Message.objects.filter(pk=pk, status=Status.BUSY).first()
    if busy is None:
        return
    rerouted, publish, events = message_reroute(busy=busy, now=now)
    if rerouted is not None:
        result.counts["rerouted_after_busy"] += 1
        result.to_publish += publish
        events_on_commit(events)


def _ingest_rows(rows: list[ReceivedRow], *, node_id: str, now: datetime, result: IngestResult,
                 claims: list[tuple[str, str]], rejected: list[protocol.Rejection],
                 drains: dict[str, DrainAnswer], copies: set[int]) -> None:
    """Steps 3 and 4 in one transaction, in order: store, act, apply, answer, emit."""
    if not rows and not rejected:
        return
    counts = result.counts
    # The batch's tasks and numbers, written once at its end: task rows are locked after
    # every message and load row the batch takes (messages/backpressure.py, the lock order).
    ledger = Ledger()
    with transaction.atomic():
        fresh, replies = _store(rows, node_id=node_id, now=now, claims=claims,
                                rejected=rejected, copies=copies, counts=counts,
                                ledger=ledger)
        counts["stored"] += len(fresh)
        acts = _Acts(now=now, drains=drains)
        for row in fresh:
            _act(row, acts)
        if acts.unclaim:
            transaction.on_commit(lambda: idempotency_release(node_id=node_id,
                                                              claims=acts.unclaim))
        changed = _apply(acts, now=now, ledger=ledger, result=result)
        sent = messages_insert_new(replies + acts.replies + changed.acks, ledger=ledger)
        result.to_publish += [reply.pk for reply in sent]
        ledger.write()
        events: list[dict] = []
        for row in fresh:
            events += message_events(row, previous="")
        events += changed.events
        for reply in sent:
            events += message_events(reply, previous="")
        events_on_commit(events)


def _store(rows: list[ReceivedRow], *, node_id: str, now: datetime,
           claims: list[tuple[str, str]], rejected: list[protocol.Rejection],
           copies: set[int], counts: Counter, ledger: Ledger
           ) -> tuple[list[ReceivedRow], list[Message]]:
    """Each message stored once (rule 3). Returns the rows this call inserted, and the
    answers to what is not run: a repeated idempotency key or messageId gets ACK
    `duplicate: true`, a request the decoder refused its NACK."""
    duplicates, rows = _split_duplicates(rows, node_id=node_id, claims=claims)
    fresh = messages_insert_new(rows, ledger=ledger)
    inserted = {id(row) for row in fresh}
    # A key claimed here for a row that was stored already (a copy of a request whose
    # stored first copy was refused, and gave its key back) is not this row's to keep:
    # the sender's corrected request must still run.
    claimed = set(claims)
    again = [(r.idempotency_key, r.message_id) for r in rows if id(r) not in inserted
             and (r.idempotency_key, r.message_id) in claimed]
    if again:
        idempotency_release(node_id=node_id, claims=again)
        claims[:] = [c for c in claims if c not in set(again)]
    repeats = _repeats(rows, fresh=fresh, inserted=inserted, copies=copies,
                       node_id=node_id, counts=counts)
    counts["duplicate_message_id"] += len(repeats)
    counts["inbox_copies"] += sum(id(row) in copies for row in duplicates)
    duplicates = [row for row in duplicates if id(row) not in copies]
    counts["duplicate_idempotency_key"] += len(duplicates)
    replies: list[Message] = []
    for row in duplicates + [r for r in repeats if r.direction == Direction.RECV
                             and r.message_type in REQUESTS]:
        ack = reply_row(to=row, message_type=MT.ACK, payload={"duplicate": True}, now=now,
                        extra_headers={"ackFor": row.message_id})
        if ack:
            replies.append(ack)
    for rejection in rejected:
        nack = rejection_reply_row(rejection=rejection, now=now)
        if nack:
            counts["rejected_nacked"] += 1
            replies.append(nack)
    return fresh, replies


@dataclass
class _Applied:
    acks: list[Message]  # the ACKs of responses that were accepted
    events: list[dict]  # of the changes applied, and of work set free or given up


def _apply(acts: _Acts, *, now: datetime, ledger: Ledger, result: IngestResult) -> _Applied:
    """The changes the batch's answers make, the answers refused marked on their rows, the
    responses accepted acknowledged, and the held work a finished one set free."""
    counts = result.counts
    changes = acts.changes
    _retry_retryable_nacks(changes, now=now)
    applied = changes_apply(changes, now=now, ledger=ledger)
    refused = _answers_refused(applied.refused, acts.answers, counts=counts)
    acks = []
    for response in acts.responses:
        # A response is acknowledged as received, even a late one (its sender stops
        # resending it); one that was refused is not: it was not accepted.
        if response.pk not in refused:
            ack = reply_row(to=response, message_type=MT.ACK, payload={}, now=now,
                            extra_headers={"ackFor": response.message_id})
            if ack:
                acks.append(ack)
    events = list(applied.events)
    counts["stale_answers"] += applied.skipped
    result.busy += [m.pk for m in applied.messages
                    if m.status == Status.BUSY and m.direction == Direction.SEND]
    if applied.freed:
        publish, undeliverable = held_release(agent_ids=applied.freed, now=now)
        result.to_publish += publish
        events += changes_apply(undeliverable, now=now, ledger=ledger).events
    return _Applied(acks=acks, events=events)


def _repeats(rows: list[ReceivedRow], *, fresh: list[ReceivedRow], inserted: set[int],
             copies: set[int], node_id: str, counts: Counter) -> list[ReceivedRow]:
    """The rows not inserted that are real repeats of a stored message. A stand-in copy
    (Incoming.copy) never is; nor is the group's copy of a publish whose stand-in was stored
    first: the stand-in leaves a mark for it (messages/idempotency.py)."""
    stood_in = [row.message_id for row in fresh if id(row) in copies]
    if stood_in:
        copies_stood_in(node_id=node_id, message_ids=stood_in)
    again = [row for row in rows if id(row) not in inserted]
    if not again:
        return []
    twins = copies_twin_take(node_id=node_id, message_ids=[
        row.message_id for row in again
        if id(row) not in copies and row.direction == Direction.RECV])
    repeats = [row for row in again if id(row) not in copies and row.message_id not in twins]
    counts["inbox_copies"] += len(again) - len(repeats)
    # What the console itself sent, heard back through the inbox wildcard (monitor mode):
    # not self by rule 2 when it speaks for an agent the console does not host (a NACK for
    # an unknown one), and already stored as the send it is.
    echoes = {id(row) for row in repeats if row.direction == Direction.OBSERVED
              and row.origin_node_id == node_id}
    counts["own_echoes"] += len(echoes)
    return [row for row in repeats if id(row) not in echoes]


def _answers_refused(refused: list[tuple[Change, str, str]], answers: dict[int, ReceivedRow],
                     *, counts: Counter) -> set[int]:
    """Answers that may not move their request: counted by reason, and the reason written on
    the answer's own row, where its trace shows it. Returns their primary keys."""
    if not refused:
        return set()
    marked: list[Message] = []
    for change, code, words in refused:
        counts[f"answer_refused:{code}"] += 1
        row = answers[id(change)]
        row.error = f"not accepted, changed nothing: {words}"
        marked.append(Message(pk=row.pk, error=row.error))
    Message.objects.bulk_update(marked, ["error"])
    return {row.pk for row in marked}


def _retry_retryable_nacks(changes: list[Change], *, now: datetime) -> None:
    """A retryable NACK schedules the next attempt (RETRYING) instead of ending the send,
    while attempts and the task's time remain."""
    retryable = {c.message_id: c for c in changes if c.retryable}
    if not retryable:
        return
    for row in Message.objects.filter(message_id__in=list(retryable), direction=Direction.SEND):
        status, fields, why = retry_or_give_up(row, now=now)
        change = retryable[row.message_id]
        if status:
            change.to = status
            change.fields = {"error": change.fields["error"], **ANSWERED_FIELDS, **fields}
            change.reason = f"{change.reason}; {why}"
        else:
            change.reason = f"{change.reason}; no retry: {why}"


def _heartbeat(node_id: str, env: protocol.Envelope, *, now: datetime, counts: Counter,
               signed: bool) -> None:
    payload = env.payload if isinstance(env.payload, dict) else {}
    agents = payload.get("agents") if isinstance(payload.get("agents"), list) else []
    beat_ms = payload.get("heartbeatMs")
    outcome = heartbeat_record(
        node_id=node_id, agents=agents, now=now, signed=signed,
        heartbeat_ms=beat_ms if isinstance(beat_ms, int) and beat_ms > 0 else None,
    )
    counts["heartbeats"] += 1
    counts["heartbeat_conflicts"] += len(outcome.conflicts)


def _split_duplicates(rows: list[ReceivedRow], *, node_id: str, claims: list[tuple[str, str]]
                      ) -> tuple[list[ReceivedRow], list[ReceivedRow]]:
    """TASK_REQUESTs to this node whose work another transmission already claimed in the
    idempotency window (messages/idempotency.py). Keys claimed here are added to `claims`
    so the caller can give them back if the batch does not commit, or if the row turns out
    to be stored already."""
    duplicates, keep = [], []
    for row in rows:
        if row.direction == Direction.RECV and row.message_type == MT.TASK_REQUEST:
            claim = idempotency_claim(node_id=node_id, key=row.idempotency_key,
                                      message_id=row.message_id)
            if not claim:
                duplicates.append(row)
                continue
            if claim == "added":  # a redelivery's key stays its original's
                claims.append((row.idempotency_key, row.message_id))
        keep.append(row)
    return duplicates, keep


@dataclass
class _Acts:
    """What acting on a batch's fresh rows produces: status changes, our replies, responses
    to acknowledge once their fate is known, and which stored answer each answer change
    came from."""

    now: datetime
    drains: dict[str, DrainAnswer]
    changes: list[Change] = field(default_factory=list)
    replies: list[Message] = field(default_factory=list)
    responses: list[ReceivedRow] = field(default_factory=list)
    answers: dict[int, ReceivedRow] = field(default_factory=dict)
    # Idempotency keys of refused requests, given back once the refusal is committed: the
    # sender's corrected request (same key, now with a replyNodeId) must run, not be taken
    # for a duplicate of work that never ran.
    unclaim: list[tuple[str, str]] = field(default_factory=list)

    def answer(self, row: ReceivedRow, change: Change) -> None:
        change.heard = Heard(origin_node_id=row.origin_node_id,
                             heard_on=protocol.inbox_node_of(row.topic), direction=row.direction)
        self.answers[id(change)] = row
        self.changes.append(change)


def _act(row: ReceivedRow, acts: _Acts) -> None:
    kind = row.message_type
    now = acts.now
    if row.signature_refused:
        # Recorded with its reason (the answer's own error, a request's NACK), counted, and
        # nothing else: an unsigned answer is not acknowledged either (it was not accepted).
        if row.direction == Direction.RECV and kind in REQUESTS and kind != MT.DRAIN:
            _refuse(row, f"not run: {row.signature_refused}", acts)
        if kind != MT.DRAIN:
            return
    headers = row.headers or {}
    payload = row.wire_payload if isinstance(row.wire_payload, dict) else {}
    ack_for = headers.get("ackFor") if isinstance(headers.get("ackFor"), str) else None
    if kind == MT.ACK and ack_for:
        acts.answer(row, Change(message_id=ack_for, to=Status.ACKED,
                                reason="ACK" + (" (duplicate)" if payload.get("duplicate")
                                                else ""),
                                actor="bridge", fields={"acked_at": now, **ANSWERED_FIELDS}))
    elif kind == MT.NACK and ack_for:
        reason = str(payload.get("reason") or "refused by the receiver")[:2000]
        retry = "retryable" if payload.get("retryable") is True else "not retryable"
        error = f"{row.from_agent_id or 'the receiver'} refused it ({retry}): {reason}"
        nacked = Change(message_id=ack_for, to=Status.NACKED,
                        reason=f"NACK ({retry}): {reason}", actor="bridge",
                        fields={"error": error, "finished_at": now, **ANSWERED_FIELDS})
        nacked.retryable = retry == "retryable"
        acts.answer(row, nacked)
    elif kind == MT.BUSY and ack_for:
        acts.answer(row, Change(message_id=ack_for, to=Status.BUSY,
                                reason="BUSY: the receiver's queue is full", actor="bridge",
                                fields={"error": "the receiver's queue was full (BUSY)",
                                        **ANSWERED_FIELDS}))
    elif kind == MT.TASK_RESPONSE and row.in_reply_to:
        ok = payload.get("ok", True) is not False
        error = "" if ok else f"the task failed: {str(redacted(payload.get('error')))[:2000]}"
        acts.answer(row, Change(message_id=row.in_reply_to,
                                to=Status.COMPLETED if ok else Status.TASK_ERROR,
                                reason="TASK_RESPONSE", actor="bridge",
                                fields={"finished_at": now, "error": error, **ANSWERED_FIELDS}))
        if row.direction == Direction.RECV:
            acts.responses.append(row)
    elif kind in REQUESTS and row.direction == Direction.RECV:
        if not row.reply_node_id:
            _refuse(row, NO_REPLY_NODE, acts)
        elif kind == MT.TASK_REQUEST:
            _request_to_console(row, acts)
        elif kind == MT.CANCEL:
            _cancel_to_console(row, acts)
        else:
            _drain_answer(row, acts)


NO_REPLY_NODE = ("not run: the request has no headers.replyNodeId, so no answer could reach "
                 "its sender; set replyNodeId to the node that should hear the answer")


def _refuse(row: ReceivedRow, reason: str, acts: _Acts) -> None:
    """Refuse a request to the console: NACK, not retryable, to its reply node (or, when it
    named none, its origin node), and the refusal recorded on its row either way."""
    to_node = row.reply_node_id or row.origin_node_id
    nack = reply_row(to=row, message_type=MT.NACK, now=acts.now, to_node=to_node,
                     extra_headers={"ackFor": row.message_id},
                     payload={"reason": reason, "retryable": False})
    if nack:
        acts.replies.append(nack)
    if row.message_type == MT.TASK_REQUEST and row.idempotency_key:
        acts.unclaim.append((row.idempotency_key, row.message_id))
    error = reason if nack else f"{reason} (no NACK sent: it named no reply or origin node)"
    acts.changes.append(Change(pk=row.pk, to=Status.NACKED, allowed=frozenset({Status.RECV}),
                               reason=f"refused: {error}", actor="bridge",
                               fields={"error": error, "finished_at": acts.now}))


def _request_to_console(row: ReceivedRow, acts: _Acts) -> None:
    if row.to_agent_id not in LOCAL_HANDLERS:
        _refuse(row, f"node {settings.REACH_NODE_ID} hosts no agent "
                f"{row.to_agent_id or '(none named)'}", acts)
        return
    now = acts.now
    ack = reply_row(to=row, message_type=MT.ACK, payload={}, now=now,
                    extra_headers={"ackFor": row.message_id})
    answer = console_agent_run(agent_id=row.to_agent_id, payload=row.wire_payload, request=row)
    fields: dict = {"finished_at": now, **({"error": answer.error} if answer.error else {})}
    # Consumed here and only here: this row was just inserted, so no other path has it.
    acts.changes.append(Change(pk=row.pk, to=Status.LOCAL_CONSUMED,
                               allowed=frozenset({Status.RECV}), reason="handled by the console",
                               actor="bridge", fields=fields))
    # The response waits in the outbox until the broker has taken the ACK (the bridge makes
    # it due then): the requester hears ACK, then TASK_RESPONSE, whichever bridge publishes
    # which (PROTOCOL.md: ACK when accepted, then TASK_RESPONSE).
    response = reply_row(to=row, message_type=MT.TASK_RESPONSE, payload=answer.payload,
                         now=now, extra_headers={"inReplyTo": row.message_id}, due=ack is None)
    acts.replies += [r for r in (ack, response) if r]


def _cancel_to_console(row: ReceivedRow, acts: _Acts) -> None:
    """A CANCEL for a task of the console's own agents: they answer in-process as a request
    arrives, so nothing of it is still running to stop. Answered ACK, saying so
    (PROTOCOL.md: a receiver that knows the type answers ACK)."""
    headers = row.headers or {}
    task_id = headers.get("cancelFor") if isinstance(headers.get("cancelFor"), str) else ""
    words = (f"nothing to stop: the console's agents answer at once, so no work of task "
             f"{task_id[:200] or '(none named)'} is running here")
    ack = reply_row(to=row, message_type=MT.ACK, now=acts.now,
                    extra_headers={"ackFor": row.message_id},
                    payload={"cancelFor": task_id or None, "stopped": False, "detail": words})
    if ack:
        acts.replies.append(ack)
    acts.changes.append(Change(pk=row.pk, to=Status.LOCAL_CONSUMED,
                               allowed=frozenset({Status.RECV}), actor="bridge",
                               reason=f"CANCEL: {words}", fields={"finished_at": acts.now}))


# --- DRAIN: a node asks the console to drain agents it hosts -------------------------------

MAX_DRAIN_AGENTS = 1000
DRAIN_AGENT_IDS = ('payload.agentIds must be a list of 1 to {limit} agent ids, e.g. '
                   '["fin.tax"]; got {got}')
DRAIN_CONSOLE_NODE = ("nothing drained: node {node_id} is the console's own node; its agents "
                      "are the console's and are not drained over the bus")
DRAIN_NO_ORIGIN = ("not done: a DRAIN needs headers.originNodeId, the node whose agents to "
                   "drain (a node drains only the agents it hosts)")


@dataclass(frozen=True, slots=True)
class DrainAnswer:
    """How a DRAIN was answered: ACK when at least one agent is draining now, else NACK."""

    message_type: str
    payload: dict
    words: str


def _drains_apply(rows: list[ReceivedRow], *, now: datetime, counts: Counter
                  ) -> dict[str, DrainAnswer]:
    """Do what the batch's DRAINs to the console ask, each in the roster's own transaction,
    and return how to answer each (by message id). A DRAIN already stored was done when it
    first came: it is not done again, and is answered as a duplicate."""
    asked = [r for r in rows if r.direction == Direction.RECV and r.message_type == MT.DRAIN
             and r.reply_node_id]
    if not asked:
        return {}
    seen = set(Message.objects.filter(message_id__in=[r.message_id for r in asked])
               .values_list("message_id", flat=True))
    answers: dict[str, DrainAnswer] = {}
    for row in asked:
        if row.message_id not in seen and row.message_id not in answers:
            answers[row.message_id] = (
                _drain_refused(f"nothing drained: {row.signature_refused}")
                if row.signature_refused else _drain(row, now=now))
            counts[f"drains:{answers[row.message_id].message_type.lower()}"] += 1
    return answers


def _drain(row: ReceivedRow, *, now: datetime) -> DrainAnswer:
    if not row.origin_node_id:
        return _drain_refused(DRAIN_NO_ORIGIN)
    if row.origin_node_id == settings.REACH_NODE_ID:
        # The console sends no DRAIN: one naming its node as origin is forged, and its
        # agents are the console's, stopped with it and never drained over the bus.
        return _drain_refused(DRAIN_CONSOLE_NODE.format(node_id=row.origin_node_id))
    payload = row.wire_payload if isinstance(row.wire_payload, dict) else {}
    raw = payload.get("agentIds")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_DRAIN_AGENTS:
        got = protocol.describe(raw) if "agentIds" in payload else "none"
        return _drain_refused(DRAIN_AGENT_IDS.format(limit=MAX_DRAIN_AGENTS, got=got))
    agent_ids = []
    for index, value in enumerate(raw):
        try:
            agent_ids.append(agent_id_parse(value).agent_id)
        except RosterError as exc:
            return _drain_refused(f"payload.agentIds[{index}]: {exc.detail}")
    done = agents_drain_for_node(node_id=row.origin_node_id, agent_ids=agent_ids,
                                 actor=f"node:{row.origin_node_id}", now=now)
    left: dict[str, Any] = {}
    if done.unknown:
        left["unknown"] = done.unknown
    if done.elsewhere:
        left["elsewhere"] = done.elsewhere
    why = "; ".join(filter(None, [
        done.unknown and f"not in the roster: {', '.join(done.unknown)}",
        done.elsewhere and "on another node: " + ", ".join(
            f"{a} (on {n})" for a, n in done.elsewhere.items()),
    ]))
    if not done.drained:
        return _drain_refused(f"nothing drained: {why}", **left)
    words = f"draining {', '.join(done.drained)}" + (f"; left alone, {why}" if why else "")
    return DrainAnswer(MT.ACK, {"drained": done.drained, **left}, words)


def _drain_refused(reason: str, **extra: Any) -> DrainAnswer:
    return DrainAnswer(MT.NACK, {"reason": reason, "retryable": False, **extra}, reason)


def _drain_answer(row: ReceivedRow, acts: _Acts) -> None:
    answer = acts.drains.get(row.message_id)
    if answer is None:  # stored meanwhile by another bridge, which answers it
        return
    reply = reply_row(to=row, message_type=answer.message_type, payload=answer.payload,
                      now=acts.now, extra_headers={"ackFor": row.message_id})
    if reply:
        acts.replies.append(reply)
    if answer.message_type == MT.ACK:
        acts.changes.append(Change(pk=row.pk, to=Status.LOCAL_CONSUMED,
                                   allowed=frozenset({Status.RECV}), actor="bridge",
                                   reason=answer.words, fields={"finished_at": acts.now}))
    else:
        acts.changes.append(Change(pk=row.pk, to=Status.NACKED, allowed=frozenset({Status.RECV}),
                                   actor="bridge", reason=f"refused: {answer.words}",
                                   fields={"error": answer.words, "finished_at": acts.now}))
