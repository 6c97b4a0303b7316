"""Reads of `a2a_message` that are more than a filter: one place for the pages and the API,
so a message's trace, its task's attempts and its replies are the same wherever shown."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from messages.models import (
    OPEN_STATUSES,
    RESENDABLE_STATUSES,
    AgentLoad,
    Direction,
    Message,
    Status,
)

SINCE_CHOICES = {"15": 15, "60": 60, "360": 360, "1440": 1440}


@dataclass(frozen=True)
class MessageFilter:
    """The timeline's filters, as they come in a URL."""

    status: str = ""
    agent: str = ""
    direction: str = ""
    since: str = "60"
    q: str = ""

    @classmethod
    def from_query(cls, get) -> MessageFilter:
        return cls(status=get.get("status", ""), agent=get.get("agent", "").strip()[:265],
                   direction=get.get("direction", ""), since=get.get("since", "60"),
                   q=get.get("q", "").strip()[:200])


def messages_filter(flt: MessageFilter) -> QuerySet[Message]:
    qs = Message.objects.all()
    if flt.status in Status.values:
        qs = qs.filter(status=flt.status)
    if flt.direction in Direction.values:
        qs = qs.filter(direction=flt.direction)
    if flt.agent:
        qs = qs.filter(Q(to_agent_id=flt.agent) | Q(from_agent_id=flt.agent))
    minutes = SINCE_CHOICES.get(flt.since, 60)
    qs = qs.filter(created_at__gte=timezone.now() - timedelta(minutes=minutes))
    if flt.q:
        qs = qs.filter(Q(message_id=flt.q) | Q(task_id=flt.q) | Q(conversation_id=flt.q))
    return qs.order_by("-created_at", "-id")


def resendable(qs: QuerySet[Message]) -> QuerySet[Message]:
    """The task requests of ours in `qs` that an operator may send again."""
    return qs.filter(direction=Direction.SEND, message_type="TASK_REQUEST",
                     status__in=list(RESENDABLE_STATUSES))


def message_is_resendable(row: Message) -> bool:
    return (row.direction == Direction.SEND and row.message_type == "TASK_REQUEST"
            and row.status in RESENDABLE_STATUSES)


def task_attempts(row: Message) -> QuerySet[Message] | list[Message]:
    """Every transmission of `row`'s task, in the order they were made."""
    if not row.task_id:
        return []
    return (Message.objects.filter(task_id=row.task_id, direction=row.direction)
            .order_by("created_at", "id"))


def message_replies(row: Message) -> QuerySet[Message]:
    """What answered `row`: ACK, NACK, BUSY, TASK_RESPONSE, in order."""
    return Message.objects.filter(in_reply_to=row.message_id).order_by("created_at", "id")


def task_requests(task_id: str) -> list[Message]:
    """Our transmissions of one task, oldest first."""
    return list(Message.objects.filter(task_id=task_id, direction=Direction.SEND,
                                       message_type="TASK_REQUEST")
                .select_related("resend_of").order_by("created_at", "id"))


def task_response(row: Message) -> Message | None:
    return Message.objects.filter(in_reply_to=row.message_id,
                                  message_type="TASK_RESPONSE").first()


def open_counts() -> dict[str, int]:
    """How many rows have not ended yet, by status (the backlog, for /metrics). Exactly the
    rows of the partial index `a2a_open_deadline` (an open row keeps its deadline; an answer
    of ours leaves it once the broker has it, PUBLISHED being its end): a scrape costs what
    is open, not what is stored."""
    found = dict(Message.objects.filter(status__in=sorted(OPEN_STATUSES),
                                        deadline_at__isnull=False).order_by()
                 .values_list("status").annotate(n=Count("id")))
    return {status: found.get(status, 0) for status in sorted(OPEN_STATUSES)}


def load_totals() -> tuple[int, int]:
    """Task requests in flight and held, over all agents: the kept counts
    (messages/load.py), one row per agent rather than one per message."""
    totals = AgentLoad.objects.aggregate(inflight=Sum("inflight"), held=Sum("held"))
    return totals["inflight"] or 0, totals["held"] or 0
