"""Reads of `a2a_message` that are more than a filter: one place for the pages and the API,
so a message's trace, its task's attempts and its replies are the same wherever shown."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import reduce
from operator import and_, or_

from django.conf import settings
from django.db.models import Count, Max, Min, Q, QuerySet, Sum
from django.utils import timezone

from messages.models import (
    OPEN_STATUSES,
    RESENDABLE_STATUSES,
    AgentLoad,
    Direction,
    Message,
    MessageKey,
    Status,
    Task,
)
from messages.partitions import history_partitioned, history_since, pk_floor, pk_time
from messages.protocol import MessageType
from reachconsole.core.errors import ConsoleError
from reachconsole.core.moments import utc_moment
from roster.models import PROFILE_NODE_ID, Dialect

# Presets of the timeline's time window, in minutes back from now.
SINCE_PRESETS = {"15": "15 min", "60": "1 h", "360": "6 h", "1440": "24 h", "10080": "7 days"}
PAGE_SIZE = 200
# A filter with OR-ed alternatives (several statuses, an agent as sender or receiver) is
# read as one index-ordered query per alternative, merged here: one query with an OR walks
# the whole timeline index past every row that matches neither. Past this many branches a
# single query costs less than the round trips.
MAX_BRANCHES = 8
# What the list shows of a row; the payload, headers and resolution (the large columns)
# stay on disk until a trace or an export asks for them.
LIST_FIELDS = ("id", "message_id", "task_id", "message_type", "direction", "status",
               "from_agent_id", "to_agent_id", "target_node_id", "conversation_id", "error",
               "attempt", "held", "created_at")
_RELATIVE = re.compile(r"^(\d{1,7})\s*([mhd]?)$")
_UNITS = {"": 1, "m": 1, "h": 60, "d": 1440}


class FilterError(ConsoleError):
    """A timeline filter that cannot be read: answered 400 with these words."""

    code = "bad_filter"
    status = 400


def _when(name: str, value: str, now: datetime) -> datetime | None:
    """`value` as a moment: minutes back from now ("60", "6h", "7d"), or a date-time in
    ISO 8601 (without an offset it is UTC, as the page shows every time)."""
    if not value:
        return None
    relative = _RELATIVE.match(value)
    try:
        if relative:
            return now - timedelta(minutes=int(relative[1]) * _UNITS[relative[2]])
        return utc_moment(value)
    except (ValueError, OverflowError):  # a span back from now can leave the calendar too
        raise FilterError(f"{name}={value[:40]!r} is neither minutes back (60, 6h, 7d) nor a "
                          "date-time such as 2026-11-30T14:00 (UTC) within the calendar"
                          ) from None


def _text(get, name: str, limit: int) -> str:
    return (get.get(name) or "").strip()[:limit]


@dataclass(frozen=True)
class MessageFilter:
    """The timeline's filters, as they come in a URL; every one narrows the set."""

    statuses: tuple[str, ...] = ()
    message_type: str = ""
    direction: str = ""
    agent: str = ""  # as sender or receiver
    node: str = ""  # the node it was sent to
    # "native" or "a2a-mqtt": every row of the A2A-over-MQTT profile is on its node
    # (roster.models.PROFILE_NODE_ID), so the dialect is told by the node column.
    dialect: str = ""
    namespace: str = ""  # of the sender or the receiver
    conversation: str = ""
    task: str = ""
    q: str = ""  # a message, task or conversation id
    error: str = ""  # words in the error text
    since: str = ""
    until: str = ""
    since_at: datetime | None = field(default=None, compare=False)
    until_at: datetime | None = field(default=None, compare=False)

    @classmethod
    def from_query(cls, get, *, now: datetime | None = None) -> MessageFilter:
        """Read a GET (or POST) QueryDict; FilterError names what cannot be read."""
        now = now or timezone.now()
        statuses = []
        for value in get.getlist("status") if hasattr(get, "getlist") else [get.get("status")]:
            for status in (value or "").split(","):
                status = status.strip().upper()
                if not status or status in statuses:
                    continue
                if status not in Status.values:
                    raise FilterError(f"There is no status {status[:40]!r}; the statuses are "
                                      f"{', '.join(Status.values)}.")
                statuses.append(status)
        message_type = _text(get, "type", 20).upper()
        if message_type and message_type not in MessageType.__members__:
            raise FilterError(f"There is no message type {message_type!r}; the types are "
                              f"{', '.join(MessageType.__members__)}.")
        direction = _text(get, "direction", 10).upper()
        if direction and direction not in Direction.values:
            raise FilterError(f"There is no direction {direction!r}; the directions are "
                              f"{', '.join(Direction.values)}.")
        dialect = _text(get, "dialect", 20).lower()
        if dialect and dialect not in Dialect.values:
            raise FilterError(f"There is no dialect {dialect!r}; the dialects are "
                              f"{', '.join(Dialect.values)}.")
        since, until = _text(get, "since", 40), _text(get, "until", 40)
        since_at, until_at = _when("since", since, now), _when("until", until, now)
        if since_at and until_at and since_at > until_at:
            raise FilterError(code="empty_window", detail=f"since ({since}) is later than "
                              f"until ({until}): nothing can "
                              "match.")
        return cls(statuses=tuple(statuses), message_type=message_type, direction=direction,
                   agent=_text(get, "agent", 265), node=_text(get, "node", 128),
                   dialect=dialect,
                   namespace=_text(get, "namespace", 100).rstrip("."),
                   conversation=_text(get, "conversation", 200), task=_text(get, "task", 200),
                   q=_text(get, "q", 200), error=_text(get, "error", 200),
                   since=since, until=until, since_at=since_at, until_at=until_at)

    def as_pairs(self) -> list[tuple[str, str]]:
        """The filters as URL parameters (a status per `status=`), empty ones left out."""
        pairs = [("status", s) for s in self.statuses]
        pairs += [(name, value) for name, value in (
            ("type", self.message_type), ("direction", self.direction), ("agent", self.agent),
            ("node", self.node), ("dialect", self.dialect), ("namespace", self.namespace),
            ("conversation", self.conversation), ("task", self.task), ("q", self.q),
            ("error", self.error), ("since", self.since), ("until", self.until)) if value]
        return pairs

    def pinned_pairs(self) -> list[tuple[str, str]]:
        """`as_pairs` with the time window as fixed moments: what a preview hands to the
        action it confirms, so "the last hour" means the same hour when it is carried out."""
        pinned = {"since": self.since_at.isoformat() if self.since_at else "",
                  "until": self.until_at.isoformat() if self.until_at else ""}
        return [(name, pinned.get(name, value)) for name, value in self.as_pairs()]

    def for_client(self) -> dict:
        """What static/js/timeline.js needs to tell whether a pushed event matches, as
        far as an event's fields can say (see `client_can_tell`)."""
        return {"statuses": list(self.statuses), "type": self.message_type,
                "direction": self.direction, "agent": self.agent, "node": self.node,
                "dialect": self.dialect, "profileNode": PROFILE_NODE_ID,
                "namespace": self.namespace, "conversation": self.conversation,
                "task": self.task, "q": self.q, "error": self.error,
                "until": self.until_at.isoformat() if self.until_at else ""}


def _base(flt: MessageFilter) -> QuerySet[Message]:
    """Every filter but the OR-ed alternatives (see `_alternatives`)."""
    qs = filters_common(Message.objects.all(), flt)
    if flt.message_type:
        qs = qs.filter(message_type=flt.message_type)
    if flt.q:
        qs = qs.filter(Q(message_id=flt.q) | Q(task_id=flt.q) | Q(conversation_id=flt.q))
    # A time window reads only its partitions (messages/partitions.py).
    return history_since(qs, _task_began(flt), flt.until_at)


def _task_began(flt: MessageFilter) -> datetime | None:
    """Where the filtered rows can begin: the window's start, or on a partitioned history
    with a task filter the task's first entry when that is later, so that a task's page
    plans its own days' partitions rather than every partition (its rows are its requests
    and what answered them, none older than its first request)."""
    if not flt.task or not history_partitioned():
        return flt.since_at
    began = Task.objects.filter(task_id=flt.task).aggregate(first=Min("created_at"))["first"]
    if began is None or (flt.since_at and flt.since_at > began):
        return flt.since_at
    return began


def filters_common(qs: QuerySet, flt: MessageFilter) -> QuerySet:
    """The filters the timeline and the task list read alike (messages/taskbook.py), on
    columns both tables have under the same names; `q` and the type are each one's own."""
    if len(flt.statuses) == 1:
        qs = qs.filter(status=flt.statuses[0])
    if flt.direction:
        qs = qs.filter(direction=flt.direction)
    if flt.node:
        qs = qs.filter(target_node_id=flt.node)
    if flt.dialect == "a2a-mqtt":
        qs = qs.filter(target_node_id=PROFILE_NODE_ID)
    elif flt.dialect == "native":
        qs = qs.exclude(target_node_id=PROFILE_NODE_ID)
    if flt.namespace:
        # Not split like an agent: a namespace's prefix spans many agents, so one branch
        # would have to sort all of their rows; walking the timeline finds a page at once.
        # `fin.tax`, or an A2A-over-MQTT agent `acme/ops/echo` of org `acme`.
        dotted, slashed = flt.namespace + ".", flt.namespace + "/"
        qs = qs.filter(Q(to_agent_id__startswith=dotted) | Q(from_agent_id__startswith=dotted)
                       | Q(to_agent_id__startswith=slashed)
                       | Q(from_agent_id__startswith=slashed))
    if flt.conversation:
        qs = qs.filter(conversation_id=flt.conversation)
    if flt.task:
        qs = qs.filter(task_id=flt.task)
    if flt.error:
        # error <> '' lets PostgreSQL use the partial trigram indexes (a2a_error_trgm,
        # a2a_task_error_trgm).
        qs = qs.filter(error__icontains=flt.error).exclude(error="")
    if flt.since_at:
        qs = qs.filter(created_at__gte=flt.since_at)
    if flt.until_at:
        qs = qs.filter(created_at__lt=flt.until_at)
    return qs


def _alternatives(flt: MessageFilter) -> list[list[Q]]:
    groups = []
    if len(flt.statuses) > 1:
        groups.append([Q(status=s) for s in flt.statuses])
    if flt.agent:
        groups.append([Q(to_agent_id=flt.agent), Q(from_agent_id=flt.agent)])
    return groups


def filter_branches(flt: MessageFilter) -> list[Q]:
    """The filter as alternatives whose union is the set: one per combination of the OR-ed
    choices, each a plain AND that one index can serve in timeline order."""
    groups = _alternatives(flt)
    if not groups:
        return [Q()]
    if reduce(lambda n, g: n * len(g), groups, 1) > MAX_BRANCHES:
        return [reduce(and_, (reduce(or_, g) for g in groups))]
    return [reduce(and_, combo) for combo in itertools.product(*groups)]


def messages_filter(flt: MessageFilter) -> QuerySet[Message]:
    """The filtered set as one query, newest first (counts, bulk resend)."""
    qs = _base(flt)
    for group in _alternatives(flt):
        qs = qs.filter(reduce(or_, group))
    return qs.order_by("-created_at", "-id")


@dataclass
class MessagePage:
    rows: list[Message]
    older: int | None  # the `before` cursor of the next page, None on the last


def messages_page(flt: MessageFilter, *, before: int | None = None, limit: int = PAGE_SIZE,
                  fields: tuple[str, ...] | None = LIST_FIELDS) -> MessagePage:
    """One page of the filtered timeline, newest first, older than the row `before` (a row
    id): keyset paging on (created_at, id), so page 5,000 costs what page 1 does and no
    COUNT is needed. `fields=None` loads whole rows (exports)."""
    return keyset_page(Message, _base(flt), filter_branches(flt), before=before, limit=limit,
                       fields=fields)


def keyset_page(model, qs: QuerySet, branches: list[Q], *, before: int | None, limit: int,
                fields: tuple[str, ...] | None) -> MessagePage:
    """A page of `qs` (rows of `model`, ordered by (created_at, id)), newest first, older
    than the row `before`; each of `branches` is read in that order by its own index and
    the pages merged (the timeline and the task list alike)."""
    if before is not None:
        edge = model.objects.filter(pk=before).values_list("created_at", flat=True).first()
        if edge is None:  # pruned since the page was shown: nothing older is left either
            return MessagePage(rows=[], older=None)
        # created_at <= edge bounds the index range; the OR only breaks ties within it.
        qs = qs.filter(Q(created_at__lt=edge) | Q(id__lt=before), created_at__lte=edge)
    order = ("-created_at", "-id")
    if len(branches) == 1:
        found = qs.filter(branches[0]).order_by(*order)
        rows = list((found.only(*fields) if fields else found)[:limit + 1])
    else:
        keys: set[tuple[datetime, int]] = set()
        for branch in branches:
            keys.update(qs.filter(branch).order_by(*order)
                        .values_list("created_at", "id")[:limit + 1])
        top = sorted(keys, reverse=True)[:limit + 1]
        loader = model.objects.only(*fields) if fields else model.objects
        by_id = loader.in_bulk([pk for _, pk in top])
        rows = [by_id[pk] for _, pk in top if pk in by_id]
    older = rows[limit - 1].pk if len(rows) > limit else None
    return MessagePage(rows=rows[:limit], older=older)


def messages_pages(flt: MessageFilter, *, limit: int, chunk: int = 1000
                   ) -> Iterator[list[Message]]:
    """Whole rows of the filtered set, newest first, `chunk` at a time, at most `limit`:
    each chunk is one keyset page, so no transaction or cursor stays open between them
    (a streamed export may take minutes)."""
    before, sent = None, 0
    while sent < limit:
        page = messages_page(flt, before=before, limit=min(chunk, limit - sent), fields=None)
        if page.rows:
            yield page.rows
        sent += len(page.rows)
        if page.older is None:
            return
        before = page.older


def newest_message_id() -> int:
    """The id of the newest row: what a page has seen when it shows its rows (a pushed
    event with a higher id is news). A max() over the primary key: one index probe.

    On a partitioned history the same number is read from the key table, which holds every
    row's id in one unpartitioned index: a max() over the partitioned table would plan a
    probe of every partition, a millisecond on each page at a dozen partitions."""
    if history_partitioned():
        return MessageKey.objects.aggregate(newest=Max("message_pk"))["newest"] or 0
    return Message.objects.aggregate(newest=Max("id"))["newest"] or 0


# The most rows a "N new" count looks at: a page paused for an hour at 1,000 msg/s behind
# a rare filter must not walk 3.6 million rows on every poll.
NEW_COUNT_SCAN = 100_000
NEW_COUNT_WINDOW = timedelta(seconds=100)


def new_count_floor(up_to: int) -> int:
    """The lowest id a "N new" count up to `up_to` looks at: NEW_COUNT_SCAN ids back, or
    where ids carry their time (a partitioned history, messages/partitions.py) the newest
    NEW_COUNT_WINDOW, which at 1,000 msg/s is as many rows."""
    if history_partitioned():
        return pk_floor(pk_time(up_to) - NEW_COUNT_WINDOW)
    return up_to - NEW_COUNT_SCAN


def messages_new_count(flt: MessageFilter, *, after: int, up_to: int,
                       cap: int = 1000) -> tuple[int, bool]:
    """How many rows of the filtered set have an id in (`after`, `up_to`], counted up to
    `cap` (cap + 1 means "more than cap"): what a paused page has not shown yet; and whether
    every row since `after` was looked at. The primary key bounds the scan to the newest
    NEW_COUNT_SCAN rows stored since the page was shown; past that the count is a floor."""
    lowest = max(after, new_count_floor(up_to))
    found = (messages_filter(flt).filter(id__gt=lowest, id__lte=up_to).order_by()
             .values("id")[:cap + 1].count())
    return found, lowest == after


def resendable(qs: QuerySet[Message]) -> QuerySet[Message]:
    """The task requests of ours in `qs` that an operator may send again: failed, and still
    holding the payload a resend sends (messages/sweeps.payloads_drop)."""
    return qs.filter(direction=Direction.SEND, message_type=MessageType.TASK_REQUEST,
                     status__in=list(RESENDABLE_STATUSES), payload_dropped_at__isnull=True)


def resendable_selected(flt: MessageFilter, *, up_to: int) -> QuerySet[Message]:
    """The rows of the filtered set that may be resent, among those stored up to row id
    `up_to` (the newest when the operator previewed them): rows stored since do not join
    a selection the operator has not seen. Newest first."""
    return resendable(messages_filter(flt)).filter(id__lte=up_to)


def resendable_count(flt: MessageFilter, *, cap: int, up_to: int) -> int:
    """How many of `resendable_selected` there are, counted up to `cap` + 1: a COUNT of a
    LIMITed subquery, so a page over millions of failed rows stops counting at the cap."""
    return resendable_selected(flt, up_to=up_to).order_by().values("id")[:cap + 1].count()


def message_is_resendable(row: Message) -> bool:
    return (row.direction == Direction.SEND and row.message_type == MessageType.TASK_REQUEST
            and row.status in RESENDABLE_STATUSES and row.payload_dropped_at is None)


def task_attempts(row: Message) -> QuerySet[Message]:
    """Every transmission of `row`'s task (its task id, direction and message type), oldest
    first: the attempts the trace page draws (its newest TRACE_MAX_ATTEMPTS) and the API's
    message detail lists, so the two agree. A CANCEL or an answer is no attempt. For what
    one send made of itself (its retries and resends, not another caller's work under the
    same task id), see `send_chain`."""
    if not row.task_id:
        return Message.objects.none()
    same = Message.objects.filter(task_id=row.task_id, direction=row.direction,
                                  message_type=row.message_type)
    if history_partitioned():
        # From the task's first row on (its entry says when): the plan reads those days'
        # partitions only (messages/partitions.py).
        began = (Task.objects.filter(task_id=row.task_id, direction=row.direction)
                 .aggregate(first=Min("created_at"))["first"])
        same = history_since(same, min(began, row.created_at) if began else row.created_at)
    return same.order_by("created_at", "id")


def send_chain(*, message_id: str) -> list[Message]:
    """The transmissions of one send, oldest first: the row itself and the retries and
    resends that follow from it, not another caller's work that happens to use the same task
    id. What `wait` and the send's outcome are decided by."""
    root = (Message.objects.filter(message_id=message_id)
            .values_list("task_id", "pk", "created_at").first())
    if root is None:
        return []
    chain, ours = {root[1]}, []
    # Oldest first from the row on: a retry or a resend comes after what it follows.
    for row in task_requests(root[0], since=root[2]):
        if row.pk in chain or row.resend_of_id in chain:
            chain.add(row.pk)
            ours.append(row)
    return ours


def message_replies(row: Message) -> QuerySet[Message]:
    """What answered `row`: ACK, NACK, BUSY, TASK_RESPONSE, in order (made after it: the
    plan reads the partitions from its day on)."""
    return history_since(Message.objects.filter(in_reply_to=row.message_id),
                         row.created_at).order_by("created_at", "id")


def task_requests(task_id: str, *, since: datetime | None = None) -> list[Message]:
    """Our transmissions of one task, oldest first (from `since` on, when given)."""
    qs = Message.objects.filter(task_id=task_id, direction=Direction.SEND,
                                message_type=MessageType.TASK_REQUEST)
    return list(history_since(qs, since).select_related("resend_of")
                .order_by("created_at", "id"))


def task_response(row: Message) -> Message | None:
    return Message.objects.filter(in_reply_to=row.message_id,
                                  message_type=MessageType.TASK_RESPONSE).first()


def open_counts() -> dict[str, int]:
    """How many of the console's own rows have not ended yet, by status (the backlog, for
    /metrics): rows of the partial index `a2a_open_deadline` (an open row keeps its deadline;
    an answer of ours leaves it once the broker has it, PUBLISHED being its end), less the
    requests it only observes between other nodes, which it does not work on: a scrape costs
    what is open, not what is stored."""
    found = dict(Message.objects.filter(status__in=sorted(OPEN_STATUSES),
                                        deadline_at__isnull=False)
                 .exclude(direction=Direction.OBSERVED).order_by()
                 .values_list("status").annotate(n=Count("id")))
    return {status: found.get(status, 0) for status in sorted(OPEN_STATUSES)}


def load_totals() -> tuple[int, int]:
    """Task requests in flight and held, over all agents: the kept counts
    (messages/backpressure.py), one row per agent rather than one per message."""
    totals = AgentLoad.objects.aggregate(inflight=Sum("inflight"), held=Sum("held"))
    return totals["inflight"] or 0, totals["held"] or 0


# --- one message's trace (/messages/{id}/) -------------------------------------------------
TRACE_MAX_ATTEMPTS = 50


@dataclass(frozen=True, slots=True)
class Span:
    """One stretch of time on the trace's axis: a state (from the transitions) or a hop."""

    label: str  # a status, or "sent → published" and the like
    start: datetime
    end: datetime
    open: bool = False  # still running now
    left: float = 0.0  # percent of the axis
    width: float = 0.0

    @property
    def ms(self) -> int:
        return max(0, round((self.end - self.start).total_seconds() * 1000))


@dataclass
class AttemptTrace:
    row: Message
    transitions: list = field(default_factory=list)
    states: list[Span] = field(default_factory=list)  # time spent in each status
    hops: list[Span] = field(default_factory=list)  # sent → published → acked → response
    replies: list[Message] = field(default_factory=list)
    response: Message | None = None
    notes: list[str] = field(default_factory=list)  # what reconciles odd-looking facts


@dataclass
class TaskTrace:
    attempts: list[AttemptTrace]
    start: datetime
    end: datetime
    more: int = 0  # attempts left out past TRACE_MAX_ATTEMPTS

    @property
    def total_ms(self) -> int:
        return max(0, round((self.end - self.start).total_seconds() * 1000))


def _hops(row: Message, response: Message | None, now: datetime) -> list[tuple[str, datetime,
                                                                                 datetime]]:
    """sent → published → acked → response, as far as the row got; a step it never took is
    skipped, so a reply without a recorded PUBACK measures from the send."""
    steps = [("sent", row.created_at), ("published", row.published_at),
             ("acked", row.acked_at), ("response", response.created_at if response else None)]
    known = [(name, at) for name, at in steps if at is not None]
    return [(f"{a} → {b}", start, end) for (a, start), (b, end) in itertools.pairwise(known)]


def task_trace(row: Message, *, now: datetime | None = None) -> TaskTrace:
    """Every transmission of `row`'s task on one time axis: for each, the time spent in each
    status (from its transitions), the hops sent → published → acked → response, its answers,
    and notes where facts recorded at different moments need reading together. Three reads,
    however many attempts."""
    now = now or timezone.now()
    attempts: list[Message] = []
    more = 0
    if row.task_id:
        # The newest ones, read by the task index with a limit: a peer that reuses one task
        # id for thousands of messages must not make every refresh of this page read them.
        same = task_attempts(row)
        newest = list(same.defer("payload").order_by("-created_at", "-id")
                      [:TRACE_MAX_ATTEMPTS + 1])
        if len(newest) > TRACE_MAX_ATTEMPTS:
            more = same.count() - TRACE_MAX_ATTEMPTS
            newest = newest[:TRACE_MAX_ATTEMPTS]
        attempts = newest[::-1]
    if row.pk not in {a.pk for a in attempts}:  # always this row
        attempts = [row, *attempts[1:]] if more else [row, *attempts]
        attempts.sort(key=lambda a: (a.created_at, a.pk))
    by_pk = {a.pk: AttemptTrace(row=a) for a in attempts}
    from messages.models import Transition  # the selectors' imports stay as they are

    for t in Transition.objects.filter(message_id__in=list(by_pk)).order_by("at", "id"):
        by_pk[t.message_id].transitions.append(t)
    replies: dict[str, list[Message]] = {}
    for reply in (Message.objects.filter(in_reply_to__in=[a.message_id for a in attempts])
                  .order_by("created_at", "id")):
        replies.setdefault(reply.in_reply_to, []).append(reply)
    start = min(a.created_at for a in attempts)
    end = start
    for trace in by_pk.values():
        a = trace.row
        trace.replies = replies.get(a.message_id, [])
        trace.response = next((r for r in trace.replies
                               if r.message_type == MessageType.TASK_RESPONSE), None)
        steps = trace.transitions or []
        for this, following in itertools.zip_longest(steps, steps[1:]):
            if this is None:
                continue
            if following is not None:
                trace.states.append(Span(this.to_status, this.at, following.at))
            elif a.status in OPEN_STATUSES:
                trace.states.append(Span(this.to_status, this.at, now, open=True))
            else:  # a final status: a point on the axis, not a stretch
                trace.states.append(Span(this.to_status, this.at, this.at))
        trace.hops = [Span(label, s, e) for label, s, e in _hops(a, trace.response, now)]
        if a.status == Status.FAILED and a.published_at:
            trace.notes.append(
                f"The broker took it at {a.published_at:%H:%M:%S.%f} UTC (its PUBACK came after "
                "the console had ended it FAILED): it was published, late. The receiver may "
                "still run it; an answer from it corrects this row.")
        # Only our own sends get a PUBACK; a row seen between other nodes never has one.
        if a.direction == Direction.SEND and a.published_at is None and a.acked_at is not None:
            trace.notes.append("No PUBACK was recorded, but the receiver acknowledged it: the "
                               "broker did take it.")
        end = max([end, *(s.end for s in trace.states), *(h.end for h in trace.hops),
                   *(r.created_at for r in trace.replies)])
    axis = max((end - start).total_seconds(), 0.001)

    def placed(span: Span) -> Span:
        left = (span.start - start).total_seconds() / axis * 100
        width = (span.end - span.start).total_seconds() / axis * 100
        return Span(span.label, span.start, span.end, span.open, round(left, 3),
                    round(max(width, 0.4), 3))

    for trace in by_pk.values():
        trace.states = [placed(s) for s in trace.states]
        trace.hops = [placed(h) for h in trace.hops]
    return TaskTrace(attempts=[by_pk[a.pk] for a in attempts], start=start, end=end, more=more)


def retention_behind_s(*, now: datetime | None = None) -> float:
    """How far the oldest message is past the retention, in seconds (0 when the prune keeps
    up or keeps everything): one read of the created_at index's first entry."""
    days = settings.REACH_RETENTION_DAYS
    if days <= 0:
        return 0.0
    oldest = Message.objects.order_by("created_at", "id").values_list("created_at",
                                                                      flat=True).first()
    cutoff = (now or timezone.now()) - timedelta(days=days)
    if history_partitioned():
        # Rows wait for their partition to expire whole: up to a span past the retention,
        # and up to the maintenance call after it, is on time.
        cutoff -= timedelta(seconds=settings.REACH_PARTITION_SPAN_S + 60)
    return max(0.0, (cutoff - oldest).total_seconds()) if oldest else 0.0
