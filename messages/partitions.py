"""The history partitioned by time (PostgreSQL): made ahead, dropped whole.

`a2a_message` is partitioned by RANGE of its primary key, and the key carries its time: a
row's id is the time it was made in hundredths of a second since PK_EPOCH shifted by
SEQ_BITS, plus a sequence's low bits (`a2a_message_pk(created_at)`, drawn by the insert:
the clock's tick for a row of now, its created_at's for a row of another time). So a
partition per REACH_PARTITION_SPAN is a range of ids, the primary key stays `id` alone (it
holds the partition key), and every read or update by primary key (Django's `save()`, the
sweeps' claims, the state machine's guarded updates) finds its one partition without knowing
the time. `a2a_transition` is
partitioned by the same ranges of its `message_id`: a message's transitions live and go with
it, and a message's trace reads one partition.

The message id cannot have a unique index there (it would have to hold the partition key),
so the narrow unpartitioned `a2a_message_key` is the guard, written in the insert's own
statement (messages/state.py) and pruned behind the partitions (`message_keys_prune`).

Why the console manages its partitions itself rather than through pg_partman: what it needs
is a few statements a span (make the next, drop the expired, unlink what points into it),
on any PostgreSQL it supports, managed services included, where an extension may be missing
or older than the one tested; the beat that runs them is already there, and the guard is
one advisory lock. pg_partman would add an extension, its own background worker or a cron
to call it, and a configuration table to migrate, for the same few statements.

A database where none of this applies (SQLite, REACH_PARTITIONS=off when the migration ran)
keeps one table and the batched delete (messages/sweeps.messages_prune);
`history_partitioned()` says which runs.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Q

from messages.models import OPEN_STATUSES, Status
from messages.protocol import MessageType

log = logging.getLogger(__name__)

PK_EPOCH = datetime(2020, 1, 1, tzinfo=UTC)
TICK = timedelta(milliseconds=10)
# A row made within this many seconds of now takes the tick of the moment its id is drawn,
# so two ids can only meet if 65,536 are drawn in one tick; a row of another time (an
# import, a test's past) takes its created_at's, to land in that time's partition.
LIVE_SKEW_S = 60
# 65,536 ids a tick of 10 ms. Ids stay below 2**53 (exact as JSON numbers) until 2063.
SEQ_BITS = 16
MESSAGES, TRANSITIONS, KEYS = "a2a_message", "a2a_transition", "a2a_message_key"
# (table, its partition key): both tables are cut at the same bounds, made and dropped together.
TABLES = ((MESSAGES, "id"), (TRANSITIONS, "message_id"))
ADVISORY_KEY = 0x5245_4143_4850  # one partition maintainer at a time, whatever the beats
# A partition made or dropped waits this long for the parent's lock, then leaves it to the
# next call rather than queue every reader and writer behind it.
LOCK_TIMEOUT = "2s"
KEYS_BATCH = 5000

PK_FUNCTION_SQL = f"""
CREATE SEQUENCE IF NOT EXISTS a2a_message_pk_seq;
CREATE OR REPLACE FUNCTION a2a_message_pk(at timestamptz DEFAULT clock_timestamp())
RETURNS bigint LANGUAGE sql VOLATILE AS $$
  SELECT ((floor(extract(epoch FROM CASE
             WHEN abs(extract(epoch FROM clock_timestamp() - at)) <= {LIVE_SKEW_S}
             THEN clock_timestamp() ELSE at END) * 100)::bigint
           - {int(PK_EPOCH.timestamp() * 100)}) << {SEQ_BITS})
         | (nextval('a2a_message_pk_seq') & {(1 << SEQ_BITS) - 1})
$$;
"""  # noqa: S608 - constants only


def pk_floor(at: datetime) -> int:
    """The smallest id a row made at `at` can have: the bound of a partition starting then."""
    return ((at - PK_EPOCH) // TICK) << SEQ_BITS


def pk_time(pk: int) -> datetime:
    return PK_EPOCH + TICK * (pk >> SEQ_BITS)


def span_start(at: datetime) -> datetime:
    """The start of the span holding `at`, on a grid from PK_EPOCH."""
    span = timedelta(seconds=settings.REACH_PARTITION_SPAN_S)
    return PK_EPOCH + ((at - PK_EPOCH) // span) * span


_mode: dict[str, tuple[bool, float]] = {}
# How long a process trusts its answer: the history changes kind only by a migration or
# `manage.py history_partition`, run with the writers stopped (docs/scaling.md); a process
# left running notices within this.
MODE_TTL_S = 30.0


def history_partitioned() -> bool:
    """Whether this database's history is partitioned (asked of the catalog at most every
    MODE_TTL_S a process; the migrations forget the answer)."""
    if connection.vendor != "postgresql":
        return False
    name = connection.settings_dict["NAME"]
    known = _mode.get(name)
    if known is None or time.monotonic() - known[1] > MODE_TTL_S:
        with connection.cursor() as cursor:
            cursor.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)",
                           [MESSAGES])
            found = cursor.fetchone()
        known = (bool(found and found[0]), time.monotonic())
        _mode[name] = known
    return known[0]


def partitioned_forget() -> None:
    _mode.clear()
    _horizon.clear()
    _first_hi.clear()


# How much earlier than the moment a read is bounded by a row's id may carry: a row's id
# takes the tick it was drawn at, a moment after its created_at.
SINCE_SLACK = timedelta(hours=1)
_first_hi: dict[str, tuple[int | None, float]] = {}


def legacy_end() -> int | None:
    """The upper bound of the table the migration found (the first partition, from
    MINVALUE: its ids are sequence numbers and carry no time), or None once it is dropped.
    Read from the catalog at most every MODE_TTL_S a process, so a process other than the
    one that dropped it learns so too."""
    name = connection.settings_dict["NAME"]
    known = _first_hi.get(name)
    if known is None or time.monotonic() - known[1] > MODE_TTL_S:
        first = partitions_list(MESSAGES)[:1]
        known = (first[0].hi if first and first[0].lo is None else None, time.monotonic())
        _first_hi[name] = known
    return known[0]


def history_since(queryset, at: datetime | None, until: datetime | None = None):
    """`queryset` (of messages) bounded by primary key to the rows made from `at` (and
    before `until`), so that its plan reads only those spans' partitions. Unchanged where the
    history is one table, and from a moment the table the migration found may hold (its ids
    carry no time)."""
    if not history_partitioned() or (at is None and until is None):
        return queryset
    legacy = legacy_end()
    if at is not None:
        bound = pk_floor(at - SINCE_SLACK)
        if legacy is None:
            queryset = queryset.filter(pk__gte=bound)
        elif bound >= legacy:
            # The migration's table holds rows of any time up to the migration (its ids are
            # sequence numbers): it is read too, with the partitions from `at` on.
            queryset = queryset.filter(Q(pk__lt=legacy) | Q(pk__gte=bound))
    if until is not None:
        queryset = queryset.filter(pk__lt=pk_floor(until + SINCE_SLACK))
    return queryset


@dataclass(frozen=True)
class Partition:
    name: str
    lo: int | None  # None: from MINVALUE (the table the migration found)
    hi: int

    @property
    def label(self) -> str:
        start = "the beginning" if self.lo is None else f"{pk_time(self.lo):%Y-%m-%d %H:%M:%S}"
        return f"{self.name} ({start} to {pk_time(self.hi):%Y-%m-%d %H:%M:%S} UTC)"


@dataclass(frozen=True)
class Dropped:
    """A partition `partitions_drop` removed, and how long its transaction took (the
    figure the drop's goal is stated in: under a second whatever the partition held)."""
    partition: Partition
    seconds: float

    @property
    def name(self) -> str:
        return self.partition.name


_BOUND = re.compile(r"FROM \((MINVALUE|'?(-?\d+)'?)\) TO \('?(-?\d+)'?\)")


def partitions_list(table: str = MESSAGES) -> list[Partition]:
    """The partitions of `table`, oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s) "
            "AND c.relispartition", [table])
        rows = cursor.fetchall()
    found = []
    for name, bound in rows:
        # A partition being attached or dropped by another transaction as this reads may
        # show no bound yet: it is not one to write to or to drop.
        match = _BOUND.search(bound or "")
        if match is None:  # a DEFAULT partition: none is made here
            continue
        lo = None if match.group(1) == "MINVALUE" else int(match.group(2))
        found.append(Partition(name, lo, int(match.group(3))))
    return sorted(found, key=lambda p: (p.lo is not None, p.lo or 0))


def _name(table: str, lo: int) -> str:
    return f"{table}_p{pk_time(lo):%Y%m%d_%H%M%S}"


def partitions_ensure(*, now: datetime) -> list[str]:
    """Make the partitions up to REACH_PARTITIONS_AHEAD spans past the one holding `now`,
    both tables at the same bounds, each following the last made (a changed span starts
    on the next bound of its grid). Guarded: two beats at once make each partition once."""
    span = timedelta(seconds=settings.REACH_PARTITION_SPAN_S)
    target = pk_floor(span_start(now) + span * (settings.REACH_PARTITIONS_AHEAD + 1))
    made: list[str] = []
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADVISORY_KEY])
        # Made apart and attached: ATTACH takes the parent's SHARE UPDATE EXCLUSIVE lock,
        # which waits for no reader or writer, where CREATE … PARTITION OF takes its ACCESS
        # EXCLUSIVE one and would queue every query behind a long transaction. Bounded all
        # the same: a call that waits longer is left to the next (spans are made ahead).
        cursor.execute("SELECT current_setting('lock_timeout')")
        before = cursor.fetchone()[0]
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        existing = partitions_list(MESSAGES)
        hi = existing[-1].hi if existing else pk_floor(span_start(now))
        while hi < target:
            lo, hi = hi, pk_floor(span_start(pk_time(hi)) + span)
            for table, _key in TABLES:
                name = _name(table, lo)
                cursor.execute(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS "
                               f"INCLUDING CONSTRAINTS)")
                cursor.execute(f"ALTER TABLE {table} ATTACH PARTITION {name} "
                               f"FOR VALUES FROM ({lo}) TO ({hi})")
                made.append(name)
        # Called on a write path, in the writer's transaction: its own timeout again.
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [before])
    if made:
        _horizon.clear()
        log.info("partitions made: %s", ", ".join(made))
    return made


_horizon: dict[str, int] = {}


def partitions_cover(*, now: datetime) -> None:
    """Before an insert: make sure a partition holds `now` and the span after it. Free while
    the beat keeps ahead (one comparison with the horizon this process last read); else
    reads the catalog and, if the beat has stopped for REACH_PARTITIONS_AHEAD spans, makes
    them here rather than lose the write."""
    name = connection.settings_dict["NAME"]
    needed = pk_floor(now + timedelta(seconds=settings.REACH_PARTITION_SPAN_S))
    if _horizon.get(name, 0) > needed:
        return
    existing = partitions_list(MESSAGES)
    if not existing or existing[-1].hi <= needed:
        log.warning("no partition ahead of the clock: the beat's partitions-maintain is not "
                    "running; making them on the write path")
        partitions_ensure(now=now)
        existing = partitions_list(MESSAGES)
    _horizon[name] = existing[-1].hi if existing else 0


def message_pk_claim(*, message_id: str, created_at: datetime) -> int | None:
    """The primary key of a new row saved through the ORM, its message id claimed in the
    key table (IntegrityError when already stored, as a unique index would raise); None
    where the history is one table and the database draws the key."""
    if not history_partitioned():
        return None
    partitions_cover(now=created_at)
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {KEYS} (message_id, message_pk) "  # noqa: S608 - a constant
                       "VALUES (%s, a2a_message_pk(%s)) RETURNING message_pk",
                       [message_id, created_at])
        return cursor.fetchone()[0]


def _held(part: Partition, *, now: datetime, cutoff_at: datetime) -> str:
    """Why a partition past its bound must stay, or "": it holds a row still under way (the
    outbox's, SENT, or a request still open before its deadline, which the delivery sweep
    ends then), as the prune's rows do; or it is the migration's table, whose ids carry no
    time, and its newest row is not yet past the retention. An open row with no deadline
    (one the console will never end) does not hold its partition."""
    open_statuses = [str(s) for s in OPEN_STATUSES]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT EXISTS (SELECT 1 FROM {part.name} WHERE status = %s "  # noqa: S608 - a catalog name
            f"OR (message_type = %s AND status = ANY(%s) AND deadline_at > %s))",
            [str(Status.SENT), str(MessageType.TASK_REQUEST), open_statuses, now])
        if cursor.fetchone()[0]:
            return "it holds a message still under way"
        if part.lo is None:
            cursor.execute(f"SELECT max(created_at) FROM {part.name}")  # noqa: S608
            newest = cursor.fetchone()[0]
            if newest is not None and newest >= cutoff_at:
                return "the table the migration found holds rows within the retention"
    return ""


def partitions_drop(*, now: datetime) -> list[Dropped]:
    """Drop, oldest first, the partitions whose every row is past REACH_RETENTION_DAYS: the
    transitions' then the messages', after unlinking the resends that point into them. O(1)
    in their rows: no delete, no dead tuples. A partition still holding a row under way
    waits (and everything after it: the oldest goes first); one whose lock is not granted
    within LOCK_TIMEOUT is left to the next call."""
    days = settings.REACH_RETENTION_DAYS
    if days <= 0:
        return []
    cutoff_at = now - timedelta(days=days)
    cutoff = pk_floor(cutoff_at)
    dropped: list[Dropped] = []
    for part in partitions_list(MESSAGES):
        if part.hi > cutoff:
            break
        started = time.monotonic()
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADVISORY_KEY])
                # Under the lock: another maintainer may have dropped it meanwhile.
                cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [part.name])
                if not cursor.fetchone()[0]:
                    continue
                held = _held(part, now=now, cutoff_at=cutoff_at)
                if held:
                    log.warning("partition %s is past the retention but %s; it is dropped "
                                "once that changes", part.label, held)
                    break
                # Both parents in the order writers take them (messages, then transitions),
                # before anything else: the drop needs them whole, and taking them out of
                # that order could deadlock with an insert.
                cursor.execute(f"LOCK TABLE {MESSAGES}, {TRANSITIONS} IN ACCESS EXCLUSIVE MODE")
                lo = part.lo if part.lo is not None else -(2 ** 63)
                # A resend's link to its original is unlinked when the original goes (the
                # prune does the same); along the resend_of index, a probe a partition.
                cursor.execute(f"UPDATE {MESSAGES} SET resend_of_id = NULL "  # noqa: S608
                               f"WHERE resend_of_id >= %s AND resend_of_id < %s "
                               f"AND NOT (id >= %s AND id < %s)", [lo, part.hi, lo, part.hi])
                cursor.execute(f"DROP TABLE IF EXISTS {_sibling(part.name)}, {part.name}")
        except DatabaseError as exc:
            log.warning("partition %s not dropped (%s); the next call tries again",
                        part.label, str(exc).strip())
            break
        dropped.append(Dropped(part, time.monotonic() - started))
        _first_hi.clear()
        log.info("partition %s dropped in %.3f s", part.label, dropped[-1].seconds)
    return dropped


def _sibling(message_partition: str) -> str:
    """The transitions' partition cut at the same bounds as a messages' one."""
    return TRANSITIONS + message_partition[len(MESSAGES):]


def message_keys_prune(*, stop_at: float) -> int:
    """Delete the message keys of rows no partition holds any more (below the oldest
    partition's lower bound), a batch a statement, until none is left or the clock passes
    `stop_at`. The one delete a partitioned history keeps: narrow rows, two indexes."""
    if legacy_end() is not None:
        return 0  # the migration's table is still there: its ids carry no time
    existing = partitions_list(MESSAGES)
    floor = existing[0].lo if existing else 2 ** 63 - 1
    deleted = 0
    with connection.cursor() as cursor:
        while True:
            cursor.execute(
                f"DELETE FROM {KEYS} WHERE message_id IN (SELECT message_id FROM {KEYS} "  # noqa: S608
                f"WHERE message_pk < %s ORDER BY message_pk LIMIT {KEYS_BATCH})", [floor])
            deleted += cursor.rowcount
            if cursor.rowcount < KEYS_BATCH or time.monotonic() >= stop_at:
                return deleted


def partitions_maintain(*, now: datetime, budget_s: float = 20.0) -> dict[str, int]:
    """The beat's call: make the partitions ahead, drop the expired, prune their keys."""
    if not history_partitioned():
        return {}
    stop_at = time.monotonic() + budget_s
    made = partitions_ensure(now=now)
    dropped = partitions_drop(now=now)
    keys = message_keys_prune(stop_at=stop_at)
    return {"made": len(made) // len(TABLES), "dropped": len(dropped), "keys": keys}


# --- the migration: one table to partitions, and back --------------------------------------

def history_partition(cursor, *, now: datetime) -> None:
    """Turn the history's two tables into partitioned ones in place, in the caller's
    transaction. The rows stay where they are: each table becomes the first partition
    (FROM MINVALUE to the start of the current span; its ids are smaller than any id the
    clock gives), attached after a CHECK that lets the attach skip its scan. What is built
    is the message ids' key table (one row a message) and a message-id index on the old
    table (its unique one cannot serve the partitioned parent); writers wait meanwhile
    (measured in docs/scaling.md)."""
    cursor.execute(f"LOCK TABLE {MESSAGES}, {TRANSITIONS} IN ACCESS EXCLUSIVE MODE")
    # Above every id the tables hold: ids drawn by a partitioned history that was put back
    # into one table carry their time, and may reach past today.
    cursor.execute(f"SELECT greatest((SELECT max(id) FROM {MESSAGES}), "  # noqa: S608 - constants
                   f"(SELECT max(message_id) FROM {TRANSITIONS}))")
    highest = cursor.fetchone()[0]
    bound = pk_floor(span_start(now))
    if highest is not None and highest >= bound:
        bound = pk_floor(span_start(pk_time(highest)) + timedelta(
            seconds=settings.REACH_PARTITION_SPAN_S))
    cursor.execute(PK_FUNCTION_SQL)
    cursor.execute("CREATE SEQUENCE IF NOT EXISTS a2a_transition_pk_seq")
    for table, key in TABLES:
        old = f"{table}_p0"
        indexes = _indexes(cursor, table)
        cursor.execute(f"ALTER TABLE {table} RENAME TO {old}")
        for name, *_ in indexes:
            cursor.execute(f"ALTER INDEX {name} RENAME TO {_suffixed(name, '_p0')}")
        cursor.execute(f"ALTER TABLE {old} ALTER COLUMN id DROP IDENTITY IF EXISTS")
        cursor.execute(f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS "
                       f"INCLUDING CONSTRAINTS) PARTITION BY RANGE ({key})")
        for name, definition, primary, unique in indexes:
            if primary:
                # The messages' primary key holds the partition key; the transitions' would
                # not, and nothing reads transitions by their own id (docs/performance.md).
                if key == "id":
                    cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} PRIMARY KEY (id)")
            elif unique:  # the message id: its guard is the key table
                cursor.execute(f"CREATE INDEX a2a_message_message_id ON {table} (message_id)")
            else:
                cursor.execute(definition)
        cursor.execute(f"ALTER TABLE {old} ADD CONSTRAINT {old}_bound "
                       f"CHECK ({key} IS NOT NULL AND {key} < {bound})")
        cursor.execute(f"ALTER TABLE {table} ATTACH PARTITION {old} "
                       f"FOR VALUES FROM (MINVALUE) TO ({bound})")
    cursor.execute(f"ALTER TABLE {MESSAGES} ALTER COLUMN id SET DEFAULT a2a_message_pk()")
    cursor.execute(f"ALTER TABLE {TRANSITIONS} ALTER COLUMN id "
                   f"SET DEFAULT nextval('a2a_transition_pk_seq')")
    # Names below are this module's constants.
    cursor.execute("SELECT setval('a2a_transition_pk_seq', "  # noqa: S608
                   f"coalesce((SELECT max(id) FROM {TRANSITIONS}), 0) + 1, false)")
    cursor.execute(f"INSERT INTO {KEYS} (message_id, message_pk) "  # noqa: S608
                   f"SELECT message_id, id FROM {MESSAGES}_p0 ON CONFLICT DO NOTHING")
    _drop_like_index(cursor)
    # In the same transaction: a writer waiting on the locks writes, once they go, a row of
    # now, which needs its partition already there.
    partitions_ensure(now=now)


def _indexes(cursor, table: str) -> list[tuple[str, str, bool, bool]]:
    """Each index of `table`: its name, its definition, whether it is the primary key and
    whether it is unique."""
    cursor.execute("SELECT i.relname, pg_get_indexdef(i.oid), x.indisprimary, x.indisunique "
                   "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
                   "WHERE x.indrelid = to_regclass(%s)", [table])
    return cursor.fetchall()


def _drop_like_index(cursor) -> None:
    """Django gives a varchar primary key a `_like` twin for LIKE queries; none is asked of
    the key table."""
    cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s "
                   "AND indexname LIKE %s", [KEYS, "%\\_like"])
    for (name,) in cursor.fetchall():
        cursor.execute(f"DROP INDEX {name}")


def history_unpartition(cursor) -> None:
    """The way back: one table each again, with the unique message id and the identity
    column. Copies every row, so it takes as long as the history is big."""
    cursor.execute(f"LOCK TABLE {MESSAGES}, {TRANSITIONS} IN ACCESS EXCLUSIVE MODE")
    for table, _key in TABLES:
        indexes = _indexes(cursor, table)
        flat = f"{table}_flat"
        cursor.execute(f"CREATE TABLE {flat} (LIKE {table} INCLUDING DEFAULTS "
                       f"INCLUDING CONSTRAINTS)")
        cursor.execute(f"INSERT INTO {flat} SELECT * FROM {table}")  # noqa: S608
        cursor.execute(f"DROP TABLE {table}")
        cursor.execute(f"ALTER TABLE {flat} RENAME TO {table}")
        cursor.execute(f"ALTER TABLE {table} ALTER COLUMN id DROP DEFAULT")
        cursor.execute(f"ALTER TABLE {table} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY")
        cursor.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "  # noqa: S608
                       f"coalesce((SELECT max(id) FROM {table}), 0) + 1, false)")
        cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id)")
        for name, definition, primary, _unique in indexes:
            if primary:
                continue
            if name == "a2a_message_message_id":
                cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT a2a_message_message_id_key "
                               f"UNIQUE (message_id)")
            else:
                cursor.execute(definition.replace(" ON ONLY ", " ON "))
    cursor.execute("DROP FUNCTION IF EXISTS a2a_message_pk(timestamptz)")
    cursor.execute("DROP SEQUENCE IF EXISTS a2a_message_pk_seq, a2a_transition_pk_seq")
    cursor.execute(f"TRUNCATE {KEYS}")


def _suffixed(name: str, suffix: str) -> str:
    return name[: 63 - len(suffix)] + suffix
