"""What is kept as `a2a_message` rows are written, in the same transaction as the rows:

- the **task** each request belongs to (`a2a_task`, messages.models.Task): its outcome, last
  attempt, attempts and who answered, so the task list is a keyset read;
- the **numbers** per time bucket for the console, each agent and each node (`a2a_rollup`,
  messages.models.Rollup): rows by status, retries, duplicates, and latency histograms, so
  the overview, the stats and the alarms cost the same at a thousand and at a million rows
  in their window.

Every writer of message rows reports what it wrote (`Ledger.inserted`, `Ledger.moved`) and
calls `Ledger.write()` before its transaction ends: messages.state (ingest and every status
change) and messages.outbound (sends).

A row is counted in the bucket it was created in, with the status it has now: a move takes
one from its old status and adds one to its new one, in that same bucket (a request sent at
10:01 and found EXPIRED at 10:02 is an EXPIRED of 10:01), as the overview always counted.

Lock order (messages/backpressure.py): rollup rows are only inserted, never updated by writers, so
they take no lock; task rows are upserted last in their transaction, after every message and
load row it takes, in key order (a transaction that moves rows in several steps, the
bridge's batch or a cancel, hands one ledger to each step and writes it at its end).
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar

from django.conf import settings
from django.db import connection

from messages.models import ANSWERED_STATUSES, RESPONDED_STATUSES, Direction, Rollup, Status, Task
from messages.protocol import MessageType
from messages.rows import json_text
from reachconsole.core.metrics import LATENCY_BUCKETS_S

TASK_REQUEST = MessageType.TASK_REQUEST.value
ALL, AGENT, NODE = "*", "a", "n"
# Bucket widths: the console's own numbers at 15 s (the overview's charts), every scope's at
# a minute and an hour (stats over 5 minutes to 24 hours read at most ~360 buckets a key).
STEPS_ALL = (15, 60, 3600)
STEPS_SCOPED = (60, 3600)
# Writers write each count once, at its scope's finest width; beat's fold adds it to the
# wider ones (messages/rollups.py), and a read of a wider width takes the finest rows not
# folded yet with it. Half the rows a batch inserts, on the path every row takes.
FINEST = {ALL: STEPS_ALL[0], AGENT: STEPS_SCOPED[0], NODE: STEPS_SCOPED[0]}
# sent → answered, in seconds: from a loopback round trip to a long task.
ANSWER_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Statuses a row is counted in while it has them: the ends, and the two waits an operator
# reads (ACKED: accepted, no response yet; RETRYING). SENT, PUBLISHED, RECV and OBSERVED
# last milliseconds and RETRIED closes an attempt that a newer one replaced: not counted.
COUNTED = frozenset({
    Status.ACKED, Status.RETRYING, Status.COMPLETED, Status.TASK_ERROR, Status.NACKED,
    Status.BUSY, Status.UNDELIVERABLE, Status.FAILED, Status.EXPIRED, Status.CANCELED,
    Status.LOCAL_CONSUMED,
})


_STATUS_METRICS = {status: f"s:{status}" for status in Status.values}


def status_metric(status: str) -> str:
    return _STATUS_METRICS.get(status) or f"s:{status}"


def _histogram_index(bounds: tuple[float, ...], seconds: float) -> int:
    """The bucket a value falls in: the first bound that holds it (len(bounds): +Inf)."""
    return bisect.bisect_left(bounds, seconds)


def group_member_key(task_id: str, agent_id: str) -> str:
    """The idempotency key of one member's copy of a group send: each member executes its
    own copy, and each copy is a task of its own."""
    key = f"{task_id}:{agent_id}"
    if len(key) > 200:  # the column's size; a digest keeps it unique per member
        key = f"{task_id[:100]}:{hashlib.sha256(key.encode()).hexdigest()}"
    return key


def task_key(row) -> tuple[str, str, str]:
    """(direction, task id, member) of a request row: a request without a task id is a task
    of its own, named by its message id."""
    task_id = row.task_id or row.message_id
    member = ""
    key, agent = row.idempotency_key, row.to_agent_id
    # A member's copy: its key is the task's and the member's, also after a resend that
    # asked for a new key ("{task}:re-…:{member}").
    if key and agent and (key == group_member_key(task_id, agent) or (
            key.startswith(f"{task_id}:") and key.endswith(f":{agent}"))):
        member = agent
    return row.direction, task_id, member


# Plain strings: the ledger runs for every row, and an Enum member's lookup costs more
# than the comparison.
_SEND = Direction.SEND.value
_LOCAL_CONSUMED = Status.LOCAL_CONSUMED.value
_ACKED = Status.ACKED.value
# Plain strings on the path every row takes (an Enum member's lookup costs more).
_ANSWERS = frozenset(s.value for s in RESPONDED_STATUSES)
_COUNTED_PLAIN = frozenset(str(s) for s in COUNTED) - {_LOCAL_CONSUMED}


def _counted(row) -> str | None:
    """The status a row is counted in, if any: a task request a console agent answered is
    counted by its outcome (COMPLETED, or TASK_ERROR when its handler failed), like its
    task; every other row by its status."""
    status = row.status
    if status in _COUNTED_PLAIN:
        return status
    if status == _LOCAL_CONSUMED:
        return task_status(row) if row.message_type == TASK_REQUEST else status
    return None


def task_status(row) -> str:
    """A request row's status as its task's outcome: a console agent's in-process answer is
    COMPLETED, or TASK_ERROR when its handler failed."""
    if row.status == Status.LOCAL_CONSUMED:
        return Status.TASK_ERROR if row.error else Status.COMPLETED
    return row.status


# What the ledger learns of a row, as a Counter key (Ledger.inserted, Ledger.moved):
#   (_NEW, created_at, held, duplicate, counted status, request, starts a task, a retry,
#    to agent, node, publish → ACK bucket, sent → answered bucket)
#   (_MOVED, created_at, counted status before, counted status now, request, to agent, node,
#    publish → ACK bucket, sent → answered bucket)
_NEW, _MOVED = "new", "moved"


def _subjects(request: bool, agent: str, node: str) -> list[tuple[str, str]]:
    """Whose numbers a row is in: the console's always; a request's also its agent's and
    its node's."""
    subjects = [(ALL, "")]
    if request and agent:
        subjects.append((AGENT, agent))
    if request and node:
        subjects.append((NODE, node))
    return subjects


def _histograms(out: Counter, subjects, at, latency, answer, n: int) -> None:
    for scope, subject in subjects:
        if latency is not None:
            out[(scope, subject, f"lat:{latency}", at)] += n
        if answer is not None:
            out[(scope, subject, f"ans:{answer}", at)] += n


def _new_counts(out: Counter, fact: tuple, n: int) -> None:
    (_, at, held, duplicate, status, request, starts, retry, agent, node, latency,
     answer) = fact
    out[(ALL, "", "messages", at)] += n
    if duplicate:
        out[(ALL, "", "duplicates", at)] += n
    if held:
        out[(ALL, "", "held", at)] += n
    if status:
        out[(ALL, "", status_metric(status), at)] += n
    if not request:
        return
    subjects = _subjects(True, agent, node)
    for scope, subject in subjects:
        out[(scope, subject, "requests", at)] += n
        if starts:
            out[(scope, subject, "tasks", at)] += n
        if retry:
            out[(scope, subject, "retries", at)] += n
        if status and scope != ALL:
            out[(scope, subject, status_metric(status), at)] += n
    _histograms(out, subjects, at, latency, answer, n)


def _moved_counts(out: Counter, fact: tuple, n: int) -> None:
    _, at, before, now, request, agent, node, latency, answer = fact
    subjects = _subjects(request, agent, node)
    for scope, subject in subjects:
        if before:
            out[(scope, subject, status_metric(before), at)] -= n
        if now:
            out[(scope, subject, status_metric(now), at)] += n
    if request:
        _histograms(out, subjects, at, latency, answer, n)


@dataclass
class TaskDelta:
    key: tuple[str, str, str]
    status: str
    message_id: str
    attempts: int  # transmissions added (0 for a status change)
    to_agent_id: str
    from_agent_id: str
    target_node_id: str
    conversation_id: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    error: str
    answered_by: str


@dataclass
class Ledger:
    """The counts and task changes of the rows one transaction writes.

    Counting is on the ingest path of every row, so a row costs one key in a Counter: what
    was learned about it (`_NewRow`, `_MovedRow`, as plain tuples). The metrics each key
    stands for are spelled out once per distinct key, at write: a batch of hundreds of rows
    to a few agents is a few dozen keys."""

    # What is kept: switched off only by bench/ingest.py, to measure what each costs.
    keep_numbers: ClassVar[bool] = True
    keep_tasks: ClassVar[bool] = True

    facts: Counter = field(default_factory=Counter)
    tasks: list[TaskDelta] = field(default_factory=list)

    # --- what happened ------------------------------------------------------------------
    def inserted(self, rows, *, tasks: bool = True, rebuilt: bool = False) -> None:
        """New rows, in the status they were stored with (a send already routed); `tasks`:
        whether they make or move tasks. `rebuilt`: rows counted again long after they were
        written (messages.rollups.rollups_rebuild), which leaves tasks alone, counts the
        publish → ACK time of every row that has one whatever its status now, and cannot
        tell whether a row was held."""
        numbers = self.keep_numbers
        tasks = tasks and self.keep_tasks and not rebuilt
        facts = self.facts
        for row in rows:
            request = row.message_type == TASK_REQUEST
            if numbers:
                duplicate = False
                if row.message_type == MessageType.ACK:
                    payload = getattr(row, "wire_payload", None) or row.payload
                    duplicate = isinstance(payload, dict) and payload.get("duplicate") is True
                held = bool(row.held) and not rebuilt
                status = _counted(row)
                if request:
                    send = row.direction == _SEND
                    latency = answer = None
                    if send or row.status in _ANSWERS:  # else neither histogram has it
                        latency, answer = self._latencies(row, previous="", rebuilt=rebuilt)
                    attempt = row.attempt
                    facts[(_NEW, row.created_at, held, duplicate, status, True,
                           attempt == 1 and row.resend_of_id is None, send and attempt > 1,
                           row.to_agent_id, row.target_node_id, latency, answer)] += 1
                else:
                    facts[(_NEW, row.created_at, held, duplicate, status, False,
                           False, False, "", "", None, None)] += 1
            if request and tasks:
                self._task(row, attempts=1, answered_by=self._answerer(row, ""))

    def moved(self, row, *, previous: str, answered_by: str = "") -> None:
        """`row` (with its new values) moved from `previous`."""
        request = row.message_type == TASK_REQUEST
        if self.keep_numbers:
            now_counted = _counted(row)
            was_counted = previous if previous in COUNTED else None
            if request:
                latency, answer = self._latencies(row, previous=previous)
                self.facts[(_MOVED, row.created_at, was_counted, now_counted, True,
                            row.to_agent_id, row.target_node_id, latency, answer)] += 1
            elif was_counted or now_counted:
                self.facts[(_MOVED, row.created_at, was_counted, now_counted, False,
                            "", "", None, None)] += 1
        if request and self.keep_tasks and row.status != Status.RETRIED:
            # RETRIED: the new attempt carries the task on.
            self._task(row, attempts=0, answered_by=self._answerer(row, answered_by))

    def reworded(self, rows) -> None:
        """Request rows whose words changed but not their status (a late PUBACK's): their
        tasks show the same words."""
        if not self.keep_tasks:
            return
        for row in rows:
            if row.message_type == TASK_REQUEST:
                self._task(row, attempts=0, answered_by="")

    @staticmethod
    def _latencies(row, *, previous: str, rebuilt: bool = False
                   ) -> tuple[int | None, int | None]:
        """The histogram buckets this change of a request adds to, if any: publish → ACK
        (once per transmission, as reach_delivery_latency_seconds has it) and sent (or
        first seen) → answered."""
        latency = answer = None
        first_ack = rebuilt or (row.status == _ACKED
                                and previous not in ANSWERED_STATUSES)
        if (row.direction == _SEND and first_ack and row.published_at
                and row.acked_at):
            seconds = max(0.0, (row.acked_at - row.published_at).total_seconds())
            latency = _histogram_index(LATENCY_BUCKETS_S, seconds)
        if row.status in _ANSWERS and previous not in _ANSWERS:
            finished = row.finished_at or row.updated_at
            seconds = max(0.0, (finished - row.created_at).total_seconds())
            answer = _histogram_index(ANSWER_BUCKETS_S, seconds)
        return latency, answer

    def counts(self) -> Counter:
        """(scope, subject, metric, moment) → n: what the facts collected so far add up to."""
        out: Counter = Counter()
        for fact, n in self.facts.items():
            if fact[0] == _NEW:
                _new_counts(out, fact, n)
            else:
                _moved_counts(out, fact, n)
        return out

    # --- kept ---------------------------------------------------------------------------
    def write(self) -> None:
        """Write what was collected, inside the caller's transaction, and start afresh.

        On PostgreSQL the numbers ride in the tasks' statement (a data-modifying WITH): one
        round trip less at the end of every batch. Under load that round trip, not the
        insert, was most of what the numbers cost (bench/ingest.py --ledger: 2.4 ms a
        batch waiting for a 21-row insert that takes 0.2 ms on an idle box)."""
        numbers = _rollups_statement(self.counts()) if self.facts else None
        self.facts = Counter()
        if self.tasks:
            _tasks_upsert(self.tasks, lead=numbers)
            self.tasks = []
        elif numbers:
            with connection.cursor() as cursor:
                cursor.execute(*numbers)

    # --- helpers ------------------------------------------------------------------------
    @staticmethod
    def _answerer(row, heard_from: str) -> str:
        if row.status == Status.LOCAL_CONSUMED:
            return settings.REACH_NODE_ID
        if row.status in (Status.COMPLETED, Status.TASK_ERROR):
            return heard_from or row.target_node_id
        return ""

    def _task(self, row, *, attempts: int, answered_by: str) -> None:
        self.tasks.append(TaskDelta(
            key=task_key(row), status=task_status(row), message_id=row.message_id,
            attempts=attempts, to_agent_id=row.to_agent_id, from_agent_id=row.from_agent_id,
            target_node_id=row.target_node_id, conversation_id=row.conversation_id,
            created_at=row.created_at, updated_at=row.updated_at,
            finished_at=row.finished_at, error=row.error or "", answered_by=answered_by))


# --- the writes -----------------------------------------------------------------------------
# On PostgreSQL a batch goes as one JSON document, turned into rows by the database (as
# messages.state inserts messages): binding 15 parameters a row cost more than the upsert.
_ROLLUP_COLUMNS = ("step", "bucket", "scope", "subject", "metric", "n", "folded")


def _in_buckets(counts: Counter) -> Counter:
    """(scope, subject, metric, moment) → n, as (step, bucket, scope, subject, metric) → n
    at the finest width of its scope."""
    out: Counter = Counter()
    epochs: dict[int, int] = {}
    for (scope, subject, metric, at), n in counts.items():
        if not n:
            continue
        epoch = epochs.get(id(at))
        if epoch is None:
            epoch = epochs[id(at)] = int(at.timestamp())
        step = FINEST[scope]
        out[(step, epoch // step, scope, subject, metric)] += n
    return out


def _rollups_statement(counts: Counter) -> tuple[str, list] | None:
    """The insert of these counts as (sql, params), for the caller to send on PostgreSQL
    (alone or leading another statement); elsewhere they are inserted here and None is
    returned."""
    rows = [(step, bucket, scope, subject, metric, n, False)
            for (step, bucket, scope, subject, metric), n in sorted(_in_buckets(counts).items())
            if n]
    if not rows:
        return None
    if connection.vendor != "postgresql":
        Rollup.objects.bulk_create([Rollup(**dict(zip(_ROLLUP_COLUMNS, r, strict=True)))
                                    for r in rows])
        return None
    t = Rollup._meta.db_table
    columns = ", ".join(_ROLLUP_COLUMNS)
    # Only fixed column names are interpolated; the rows are one parameter.
    return (f"INSERT INTO {t} ({columns}) SELECT {columns} FROM json_to_recordset(%s::json) "  # noqa: S608
            "AS r(step integer, bucket bigint, scope text, subject text, metric text, n bigint, "
            "folded boolean)",
            [json_text([dict(zip(_ROLLUP_COLUMNS, r, strict=True)) for r in rows])])


# --- the task upsert ------------------------------------------------------------------------
_TASK_COLUMNS = ("task_id", "direction", "member", "status", "last_message_id", "attempts",
                 "to_agent_id", "from_agent_id", "target_node_id", "conversation_id",
                 "created_at", "updated_at", "finished_at", "error", "answered_by")
# 15 parameters a row: SQLite takes 32,766 in one statement.
_TASK_CHUNK = 1000


def _task_upsert_sql(rows: int) -> str:
    """One statement for many tasks. The incoming change (`excluded`) gives the task its
    outcome when it is an answer, or when it is (or concerns) the task's newest attempt.
    A task COMPLETED keeps that. One CANCELED keeps it against anything but a new attempt
    (a resend after the cancel): a late answer changes nothing. One that ended TASK_ERROR
    keeps it until a new attempt, or a response that completes another of its attempts."""
    t = Task._meta.db_table
    keep = (f"{t}.status = 'COMPLETED' OR (excluded.attempts = 0 AND ({t}.status = 'CANCELED' "
            f"OR ({t}.status = 'TASK_ERROR' AND excluded.status <> 'COMPLETED')))")
    take = (f"excluded.status IN ('COMPLETED', 'TASK_ERROR') OR excluded.attempts > 0 "
            f"OR excluded.last_message_id = {t}.last_message_id")

    def outcome(column: str) -> str:
        return (f"{column} = CASE WHEN {keep} THEN {t}.{column} WHEN {take} "
                f"THEN excluded.{column} ELSE {t}.{column} END")

    taken = ["status", "last_message_id", "to_agent_id", "target_node_id", "finished_at",
             "error", "answered_by"]
    sets = [outcome(c) for c in taken] + [
        f"attempts = {t}.attempts + excluded.attempts",
        f"created_at = CASE WHEN excluded.created_at < {t}.created_at THEN excluded.created_at "
        f"ELSE {t}.created_at END",
        "updated_at = excluded.updated_at",
    ]
    conflict = " ON CONFLICT (task_id, direction, member) DO UPDATE SET " + ", ".join(sets)
    columns = ", ".join(_TASK_COLUMNS)
    if rows == 0:  # PostgreSQL: the rows as one JSON document
        typed = ", ".join(f"{c} {_TASK_TYPES.get(c, 'text')}" for c in _TASK_COLUMNS)
        # Only fixed column names are interpolated; the rows are one parameter.
        return (f"INSERT INTO {t} ({columns}) SELECT {columns} "  # noqa: S608
                f"FROM json_to_recordset(%s::json) AS r({typed})" + conflict)
    one = "(" + ", ".join(["%s"] * len(_TASK_COLUMNS)) + ")"
    # Only fixed column names are interpolated; every value is a parameter.
    return (f"INSERT INTO {t} ({columns}) VALUES "  # noqa: S608
            + ", ".join([one] * rows) + conflict)


_TASK_TYPES = {"attempts": "integer", "created_at": "timestamptz", "updated_at": "timestamptz",
               "finished_at": "timestamptz"}


def _tasks_upsert(deltas: list[TaskDelta], *, lead: tuple[str, list] | None = None) -> None:
    """Apply the changes in the order they happened: a task changed twice in one
    transaction (sent, then refused) gets two statements, so each sees the one before.
    Within one statement every task appears once, in key order (the lock order).

    `lead`: a PostgreSQL statement (sql, params) sent as a WITH of the first one: it runs
    once, whether or not anything reads it, and touches no table the upsert does."""
    waves: list[dict[tuple, TaskDelta]] = []
    for delta in deltas:
        for wave in waves:
            if delta.key not in wave:
                wave[delta.key] = delta
                break
        else:
            waves.append({delta.key: delta})
    # Times through the field, as Django stores them on each backend.
    time_field = Task._meta.get_field("created_at")
    prep = time_field.get_db_prep_save
    with connection.cursor() as cursor:
        for wave in waves:
            ordered = [wave[key] for key in sorted(wave)]
            if connection.vendor == "postgresql":
                sql, params = _task_upsert_sql(0), []
                if lead is not None:
                    sql, params = f"WITH numbers AS ({lead[0]}) {sql}", list(lead[1])
                    lead = None
                # Times as they are: json_text writes them as PostgreSQL reads them.
                cursor.execute(sql, [*params, json_text([
                    {"task_id": d.key[1], "direction": d.key[0], "member": d.key[2],
                     "status": d.status, "last_message_id": d.message_id,
                     "attempts": d.attempts, "to_agent_id": d.to_agent_id,
                     "from_agent_id": d.from_agent_id, "target_node_id": d.target_node_id,
                     "conversation_id": d.conversation_id, "created_at": d.created_at,
                     "updated_at": d.updated_at, "finished_at": d.finished_at,
                     "error": d.error, "answered_by": d.answered_by} for d in ordered])])
                continue
            for start in range(0, len(ordered), _TASK_CHUNK):
                chunk = ordered[start:start + _TASK_CHUNK]
                params: list = []
                for d in chunk:
                    params += [d.key[1], d.key[0], d.key[2], d.status, d.message_id,
                               d.attempts, d.to_agent_id,
                               d.from_agent_id, d.target_node_id, d.conversation_id,
                               prep(d.created_at, connection), prep(d.updated_at, connection),
                               prep(d.finished_at, connection) if d.finished_at else None,
                               d.error, d.answered_by]
                cursor.execute(_task_upsert_sql(len(chunk)), params)


def tasks_rebuild(*, rows) -> int:
    """Tasks for request rows written before tasks were kept (the migration), oldest
    first. Returns how many rows were read."""
    ledger = Ledger()
    n = 0
    for row in rows:
        ledger._task(row, attempts=1, answered_by=Ledger._answerer(row, ""))
        n += 1
        if len(ledger.tasks) >= 2000:
            ledger.write()
    ledger.write()
    return n
