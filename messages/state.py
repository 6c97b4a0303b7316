"""Writes to `a2a_message`: inserting rows exactly once and moving them between statuses.

Every status change is claimed under a row lock (or SQLite's write lock), recorded as a
Transition, and announced with events after commit. Callers own the transaction.
"""

from __future__ import annotations

import functools
import logging
import operator
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from django.db import OperationalError, connection, models, transaction

from messages.backpressure import Deltas, slot_of
from messages.events import events_on_commit, message_events, publisher
from messages.ledger import Ledger
from messages.models import (
    ANSWERED_STATUSES,
    APPLY_ORDER,
    TRANSITIONS,
    Change,
    Message,
    MessageKey,
    Status,
    Transition,
)
from messages.outbox import outbox_wake
from messages.partitions import history_partitioned, partitions_cover
from messages.protocol import MessageType
from messages.rows import cancel_row, json_text
from messages.tally import DeliveryTally

T = TypeVar("T")
log = logging.getLogger(__name__)
INSERT_CHUNK = 400  # 24 columns × 400 rows stays under SQLite's 32,766 parameters


def messages_insert_new(rows: list[Message], *, ledger: Ledger | None = None
                        ) -> list[Message]:
    """Insert rows whose message id is new; return just those, with their primary keys.
    Their tasks and numbers go to `ledger` when given (the caller writes it once, last in
    its transaction: the lock order), else are written here.

    `INSERT … ON CONFLICT (message_id) DO NOTHING RETURNING` (PostgreSQL, SQLite ≥ 3.35):
    a message delivered twice, or by 16 writers at once, becomes one row, and only the
    writer that inserted it acts on it.
    """
    if not rows:
        return []
    # Duplicates inside one batch would make the statement touch a row twice.
    unique: dict[str, Message] = {}
    for row in rows:
        unique.setdefault(row.message_id, row)
    fields = _insert_fields()
    if connection.vendor == "postgresql":
        partitioned = history_partitioned()
        if partitioned:
            partitions_cover(now=max(row.created_at for row in unique.values()))
        inserted = _insert_by_json(list(unique.values()), fields, partitioned=partitioned)
    else:
        inserted = _insert_by_values(list(unique.values()), fields)
    fresh = []
    for message_id, pk in inserted.items():
        row = unique[message_id]
        row.pk = pk
        if hasattr(row, "_state"):  # a model instance, not a ReceivedRow
            row._state.adding = False
        fresh.append(row)
    # Only the rows this call inserted are counted and make tasks: a repeat changes nothing.
    kept = ledger or Ledger()
    kept.inserted(fresh)
    if ledger is None:
        kept.write()
    return fresh


def _insert_fields() -> list:
    return [f for f in Message._meta.concrete_fields if not f.primary_key]


# Characters of JSON in one statement: a batch of large payloads is split (PostgreSQL takes
# at most 1 GB in one value); a batch of ordinary messages is far below this.
JSON_STATEMENT_MAX_CHARS = 32 * 1024 * 1024


def _insert_by_json(rows: list, fields: list, *, partitioned: bool) -> dict[str, int]:
    """PostgreSQL: the batch as one JSON document, turned into rows by the database:
    `INSERT … SELECT … FROM json_to_recordset(%s) … ON CONFLICT DO NOTHING RETURNING`. One
    parameter and one round trip a batch: binding ~30 parameters a row (even pipelined) cost
    more Python than the whole rest of ingest, and a COPY through a staging table took four
    round trips, which a small batch at a steady rate pays in latency."""
    inserted: dict[str, int] = {}
    with connection.cursor() as cursor:
        for document in _json_documents(_json_rows(rows, fields)):
            cursor.execute(_json_insert_sql(partitioned), [document])
            inserted.update({message_id: pk for pk, message_id in cursor.fetchall()})
    return inserted


def _json_documents(docs: list[dict]) -> list[str]:
    """The rows as JSON text, in as few documents as fit JSON_STATEMENT_MAX_CHARS (halved
    until they do; one row is never split). Non-ASCII stays as it is: escaped, text of
    emoji would take three times the space."""
    text = json_text(docs)
    if len(text) <= JSON_STATEMENT_MAX_CHARS or len(docs) == 1:
        return [text]
    half = len(docs) // 2
    return _json_documents(docs[:half]) + _json_documents(docs[half:])


@functools.cache
def _json_insert_sql(partitioned: bool) -> str:
    """Built once: the columns' types took a twelfth of the bridge's time at 1,000 msg/s.

    A partitioned history has no unique index on the message id (messages/partitions.py):
    the statement first claims each id in the key table, `ON CONFLICT DO NOTHING` there,
    and inserts only the rows whose claim it made, with the primary key the claim drew. Still
    one statement a batch, and the same outcome under 16 writers of one id: the second
    waits for the first's claim and skips the row once it commits."""
    qn = connection.ops.quote_name
    fields = _insert_fields()
    columns = ", ".join(qn(f.column) for f in fields)
    typed = ", ".join(f"{qn(f.column)} {f.cast_db_type(connection)}" for f in fields)
    table = qn(Message._meta.db_table)
    returning = f"RETURNING {qn('id')}, {qn('message_id')}"
    # Only quoted column names and their types are interpolated; the rows are one parameter.
    if not partitioned:
        return (f"INSERT INTO {table} ({columns}) "  # noqa: S608
                f"SELECT {columns} FROM json_to_recordset(%s::json) AS r({typed}) "
                f"ON CONFLICT ({qn('message_id')}) DO NOTHING {returning}")
    keys = qn(MessageKey._meta.db_table)
    return (f"WITH r AS MATERIALIZED (SELECT * FROM json_to_recordset(%s::json) AS r({typed})), "  # noqa: S608
            f"k AS (INSERT INTO {keys} (message_id, message_pk) "
            f"SELECT message_id, a2a_message_pk(created_at) FROM r "
            f"ON CONFLICT (message_id) DO NOTHING RETURNING message_id, message_pk) "
            f"INSERT INTO {table} (id, {columns}) "
            f"SELECT k.message_pk, {', '.join('r.' + qn(f.column) for f in fields)} "
            f"FROM r JOIN k ON k.message_id = r.message_id ORDER BY k.message_pk {returning}")


def _json_rows(rows: list, fields: list) -> list[dict]:
    """Each row as {column: value}. A missing key is NULL, so None is left out. JSON
    columns nest as they are (these fields have no custom encoder), times are encoded by
    json_text."""
    columns, values_of = _row_reader(tuple(fields))
    return [{column: value for column, value in zip(columns, values_of(row), strict=True)
             if value is not None} for row in rows]


@functools.cache
def _row_reader(fields: tuple) -> tuple[tuple[str, ...], Callable[[Any], tuple]]:
    """The columns, and one C call that reads every value of a row in their order."""
    return (tuple(f.column for f in fields),
            operator.attrgetter(*(f.attname for f in fields)))


def _insert_by_values(rows: list, fields: list) -> dict[str, int]:
    """SQLite: multi-row VALUES, in chunks under its parameter limit."""
    qn = connection.ops.quote_name
    columns = ", ".join(qn(f.column) for f in fields)
    one = "(" + ", ".join(["%s"] * len(fields)) + ")"
    # Only quoted column names and placeholders are interpolated; values are parameters.
    head = f"INSERT INTO {qn(Message._meta.db_table)} ({columns}) VALUES "  # noqa: S608
    tail = (f" ON CONFLICT ({qn('message_id')}) DO NOTHING "
            f"RETURNING {qn('id')}, {qn('message_id')}")
    batch = _params(rows, fields)
    inserted: dict[str, int] = {}
    with connection.cursor() as cursor:
        for start in range(0, len(batch), INSERT_CHUNK):
            chunk = batch[start : start + INSERT_CHUNK]
            cursor.execute(head + ", ".join([one] * len(chunk)) + tail,
                           [value for values in chunk for value in values])
            inserted.update({message_id: pk for pk, message_id in cursor.fetchall()})
    return inserted


def _params(rows: list[Message], fields: list) -> list[tuple]:
    """Each row's values for the database. Text and numbers go as they are; JSON and times
    through their fields, and a time shared by the batch (its `now`) only once."""
    converting = [isinstance(f, models.JSONField | models.DateTimeField) for f in fields]
    seen: dict[int, Any] = {}
    out = []
    for row in rows:
        values = []
        for f, convert in zip(fields, converting, strict=True):
            value = getattr(row, f.attname)
            if value is None or not convert:
                values.append(value)
            elif isinstance(value, datetime):
                key = id(value)
                if key not in seen:
                    seen[key] = f.get_db_prep_save(value, connection)
                values.append(seen[key])
            else:
                values.append(f.get_db_prep_save(value, connection))
        out.append(tuple(values))
    return out


@dataclass
class Applied:
    messages: list[Message] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    skipped: int = 0
    freed: set[str] = field(default_factory=set)  # agents with a slot more than before
    # Answers that may not move their request: (change, code, words).
    refused: list[tuple[Change, str, str]] = field(default_factory=list)


def changes_apply(changes: Iterable[Change], *, now: datetime,
                  ledger: Ledger | None = None) -> Applied:
    """Apply status changes set-wise: one locked read and one update per kind of change.

    A change whose row is not (or no longer) in an allowed status is skipped: a late ACK
    never turns a COMPLETED request back into ACKED, and two workers never both act. An
    answer from the wrong node or on the wrong inbox is refused (`Applied.refused`), whatever
    the row's status: judged on the rows the locked read fetches anyway, at no query more. The
    agents' kept in-flight and held counts move with the rows (messages/backpressure.py), after the
    rows are locked: the lock order; then the tasks and numbers (messages/ledger.py), here or,
    with `ledger`, by the caller at the end of its transaction.
    """
    result = Applied()
    deltas = Deltas()
    tally = DeliveryTally()
    kept = ledger or Ledger()
    groups: dict[tuple[str, frozenset[str], tuple[str, ...]], list[Change]] = defaultdict(list)
    for change in changes:
        allowed = TRANSITIONS[change.to]
        if change.allowed is not None:
            if not change.allowed <= allowed:
                # A caller's mistake, said loudly; but a sweep that raises here would stop
                # every other row of its batch from ending, so the change is left out.
                log.error("%s → %s is not a transition of messages.models.TRANSITIONS; "
                          "change left out", sorted(change.allowed - allowed), change.to)
                result.skipped += 1
                continue
            allowed = change.allowed
        groups[(change.to, allowed, tuple(sorted(change.fields)))].append(change)
    transitions: list[Transition] = []
    # In the order of the state machine: when one batch holds a request's ACK and its
    # response, the ACK is applied first and the record keeps both.
    def order(item) -> int:
        return APPLY_ORDER.get(item[0][0], 9)

    for (to, allowed, field_names), group in sorted(groups.items(), key=order):
        by_id: dict[str, list[Change]] = defaultdict(list)
        for c in group:
            if c.message_id is not None:
                by_id[c.message_id].append(c)
        by_pk = {c.pk: c for c in group if c.pk is not None}
        qs = Message.objects.select_for_update()
        if not any(c.heard for c in group):
            qs = qs.filter(status__in=allowed)
        found: list[Message] = []
        if by_id:
            found += list(qs.filter(message_id__in=list(by_id)))
        if by_pk:
            found += [r for r in qs.filter(pk__in=list(by_pk)) if r.message_id not in by_id]
        moves: list[tuple[Message, Change]] = []
        refused = 0
        for row in found:
            # Several answers to one request in a batch: the first one it may take moves it,
            # so a refused answer never hides a good one behind it.
            for change in by_id.get(row.message_id) or [by_pk[row.pk]]:
                refusal = change.heard and row.answer_refusal(
                    origin_node_id=change.heard.origin_node_id, heard_on=change.heard.heard_on,
                    direction=change.heard.direction)
                if refusal:
                    result.refused.append((change, *refusal))
                    refused += 1
                elif row.status in allowed and (not moves or moves[-1][0] is not row):
                    moves.append((row, change))
        result.skipped += len(group) - len(moves) - refused
        rows = [row for row, _ in moves]
        corrected = False
        for row, change in moves:
            previous, slot = row.status, slot_of(row)
            row.status = to
            row.updated_at = now
            if previous == Status.FAILED:
                # The receiver answered, so the broker did take it: the FAILED words ("not
                # published", "the broker did not take it") and its end time are no longer
                # true, and a row must not say them beside its answer. The change's own
                # fields (a NACK's reason, a response's end) are set just below.
                row.error, row.finished_at = "", None
                corrected = True
            for name, value in change.fields.items():
                setattr(row, name, value)
            deltas.move(row.to_agent_id, slot, slot_of(row))
            tally.moved(row, previous=previous, answer=to in ANSWERED_STATUSES or change.retryable)
            kept.moved(row, previous=previous,
                       answered_by=change.heard.origin_node_id if change.heard else "")
            transitions.append(Transition(
                message=row, from_status=previous, to_status=to, at=now, reason=change.reason,
                actor=change.actor, by=change.by,
            ))
            result.events += message_events(row, previous=previous, reason=change.reason)
            result.messages.append(row)
        if rows:
            also = [f for f in ("error", "finished_at") if corrected and f not in field_names]
            Message.objects.bulk_update(rows, ["status", "updated_at", *field_names, *also])
    Transition.objects.bulk_create(transitions)
    deltas.write()
    # After the load rows: the lock order (messages/backpressure.py). A caller that goes on to lock
    # more message rows passes its own ledger and writes it last.
    if ledger is None:
        kept.write()
    tally.on_commit()
    result.freed = deltas.freed()
    return result


LATE_PUBACK = ("the broker took it at {at:%H:%M:%S} UTC, after the console had already "
               "ended it as not published (its deadline passed first); the receiver may "
               "still run it, and an answer from it corrects this row")


LATE_PUBACK_CANCELED = ("the broker took it at {at:%H:%M:%S} UTC, after it was canceled: "
                        "its node may run it, and was sent CANCEL; an answer is recorded and "
                        "changes nothing")


def late_pubacks_record(*, pks: list[int], now: datetime) -> None:
    """PUBACKs for rows that had moved on before the PUBACK was recorded. One that an ACK
    overtook keeps the time the broker took it. One that the deadline sweep had already
    ended FAILED ("not published …") gets the time too, and words that say what happened
    instead of the ones the PUBACK proved wrong: a row never says "the broker did not take
    it" beside a published time. One canceled meanwhile reached its node after all: the node
    is told with a CANCEL now (messages/cancel.py sends one only for what it saw on the
    bus)."""
    words = LATE_PUBACK.format(at=now)
    with transaction.atomic():
        pending = Message.objects.filter(pk__in=pks, published_at__isnull=True)
        late = list(pending.filter(status__in=[Status.FAILED, Status.CANCELED])
                    .select_for_update())
        pending.exclude(status__in=[Status.FAILED, Status.CANCELED]).update(published_at=now)
        if not late:
            return
        failed = [r for r in late if r.status == Status.FAILED]
        canceled = [r for r in late if r.status == Status.CANCELED]
        if failed:
            Message.objects.filter(pk__in=[r.pk for r in failed], status=Status.FAILED).update(
                published_at=now, error=words, updated_at=now)
            for r in failed:
                r.published_at, r.error, r.updated_at = now, words, now
        if canceled:
            Message.objects.filter(pk__in=[r.pk for r in canceled]).update(published_at=now)
        # The trace keeps what was believed and then what the PUBACK showed: a step in place
        # (the status stays; only an answer may move a final row, and none a canceled one).
        told = LATE_PUBACK_CANCELED.format(at=now)
        Transition.objects.bulk_create([
            Transition(message=r, from_status=r.status, to_status=r.status, at=now,
                       reason=f"late PUBACK: {words if r.status == Status.FAILED else told}",
                       actor="bridge") for r in late])
        events = []
        for r in late:
            events += message_events(r, previous=r.status, reason="late PUBACK")
        ledger = Ledger()
        ledger.reworded(failed)
        tell = {}
        for r in canceled:
            r.published_at = now
            if r.message_type == MessageType.TASK_REQUEST and r.target_node_id:
                tell.setdefault((r.task_id, r.target_node_id), cancel_row(request=r, now=now))
        sent = messages_insert_new(list(tell.values()), ledger=ledger)
        ledger.write()
        fresh = []
        for row in sent:
            fresh += message_events(row, previous="")
        if sent:
            outbox_wake()
        # Pushed, not counted: the rows' statuses did not change (reach_messages_total
        # counted them already); the CANCELs are new rows, counted.
        transaction.on_commit(lambda: publisher.publish(events))
        events_on_commit(fresh)


def _transient(exc: BaseException) -> bool:
    """A deadlock or serialization failure (PostgreSQL), or a busy database (SQLite): the
    transaction was rolled back whole and may simply run again."""
    cause = exc.__cause__
    name = type(cause).__name__ if cause is not None else ""
    return name in {"DeadlockDetected", "SerializationFailure"} or "database is locked" in str(exc)


def atomic_retrying(work: Callable[[], T], *, attempts: int = 4) -> T:
    """Run `work` in a transaction, again (a few times, with a short jittered pause) when the
    database aborted it as a deadlock victim. Only at the outermost level: inside another
    transaction there is nothing to retry from."""
    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic():
                return work()
        except OperationalError as exc:
            if connection.in_atomic_block or attempt == attempts or not _transient(exc):
                raise
            time.sleep(0.01 * attempt + random.random() * 0.02)  # noqa: S311
    raise AssertionError("unreachable")
