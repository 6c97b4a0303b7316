"""Reads of tasks (`a2a_task`, kept by messages/ledger.py): the task list for the page, the
API and exports, with the timeline's filters, and one task's entry with all its rows.

The list is the timeline's twin: the same filters (messages.selectors.MessageFilter), read
by keyset on (created_at, id) through an index per filter, so page 5,000 costs what page 1
does at any number of tasks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet

from messages.ledger import task_key
from messages.models import CANCELABLE_STATUSES, Direction, Message, Task
from messages.partitions import history_since
from messages.protocol import MessageType
from messages.selectors import (
    MessageFilter,
    MessagePage,
    filter_branches,
    filters_common,
    keyset_page,
)

PAGE_SIZE = 100
MAX_PAGE = 500
# The rows one task's entry shows at most (a peer may reuse one task id for thousands).
TASK_MESSAGES_MAX = 500
# The tasks one conversation id may name in a search.
Q_TASKS_MAX = 500


def _base(flt: MessageFilter) -> QuerySet[Task]:
    qs = filters_common(Task.objects.all(), flt)
    if flt.q:
        # A task, conversation or message id: the messages' indexes name their tasks (an OR
        # over the task table's columns would read all of it).
        named = (Message.objects.filter(Q(message_id=flt.q) | Q(conversation_id=flt.q))
                 .exclude(task_id="").values_list("task_id", flat=True).distinct()
                 [:Q_TASKS_MAX])
        qs = qs.filter(task_id__in={flt.q, *named})
    return qs


def within_namespaces(qs: QuerySet[Task], namespaces: frozenset[str] | None) -> QuerySet[Task]:
    """Only the tasks a caller bound to `namespaces` may see: one of its agents sent or
    does the work."""
    if namespaces is None:
        return qs
    touched = Q(pk__in=[])
    for namespace in namespaces:
        # `fin.tax`, or an A2A-over-MQTT agent `acme/ops/echo` of org `acme`.
        for prefix in (namespace + ".", namespace + "/"):
            touched |= Q(to_agent_id__startswith=prefix) | Q(from_agent_id__startswith=prefix)
    return qs.filter(touched)


def tasks_page(flt: MessageFilter, *, before: int | None = None, limit: int = PAGE_SIZE,
               namespaces: frozenset[str] | None = None) -> MessagePage:
    """One page of the filtered task list, newest first (by when the task was first sent),
    older than the task `before` (its cursor)."""
    return keyset_page(Task, within_namespaces(_base(flt), namespaces), filter_branches(flt),
                       before=before, limit=min(limit, MAX_PAGE), fields=None)


def tasks_filter(flt: MessageFilter) -> QuerySet[Task]:
    """The filtered set as one query, newest first (counts, bulk cancel)."""
    qs = _base(flt)
    branches = filter_branches(flt)
    if branches != [Q()]:
        combined = Q()
        for branch in branches:
            combined |= branch
        qs = qs.filter(combined)
    return qs.order_by("-created_at", "-id")


def tasks_pages(flt: MessageFilter, *, limit: int, chunk: int = 1000) -> Iterator[list[Task]]:
    """The filtered tasks, newest first, `chunk` at a time (a keyset page each: no
    transaction or cursor stays open between them, as exports need)."""
    before, sent = None, 0
    while sent < limit:
        page = tasks_page(flt, before=before, limit=min(chunk, limit - sent))
        if page.rows:
            yield page.rows
        sent += len(page.rows)
        if page.older is None:
            return
        before = page.older


def cancelable_tasks(flt: MessageFilter, *, up_to: int, cap: int) -> list[Task]:
    """Open tasks of ours in the filtered set, among those stored up to task id `up_to`
    (what the operator previewed), newest first, at most `cap` + 1."""
    return list(tasks_filter(flt).filter(direction=Direction.SEND, id__lte=up_to,
                                         status__in=sorted(CANCELABLE_STATUSES))[:cap + 1])


def task_is_cancelable(task: Task) -> bool:
    return task.direction == Direction.SEND and task.status in CANCELABLE_STATUSES


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def task_out(task: Task) -> dict[str, Any]:
    """A task as the API, the exports and the live page show it."""
    return {
        "taskId": task.task_id, "status": task.status, "toAgentId": task.to_agent_id or None,
        "fromAgentId": task.from_agent_id or None,
        "targetNodeId": task.target_node_id or None, "direction": task.direction,
        "member": task.member or None, "attempts": task.attempts,
        "firstSentAt": _iso(task.created_at), "finishedAt": _iso(task.finished_at),
        "durationMs": task.duration_ms, "answeredBy": task.answered_by or None,
        "error": task.error or None, "lastMessageId": task.last_message_id or None,
        "conversationId": task.conversation_id or None, "cursor": task.pk,
    }


def task_entries(task_id: str, *, namespaces: frozenset[str] | None = None) -> list[Task]:
    """Every entry of one task id: the console's own first, then received, then observed;
    a group send's members in order."""
    order = {Direction.SEND: 0, Direction.RECV: 1, Direction.OBSERVED: 2}
    found = list(within_namespaces(Task.objects.filter(task_id=task_id), namespaces))
    return sorted(found, key=lambda t: (order.get(t.direction, 9), t.member, t.pk))


@dataclass
class TaskStory:
    task: Task
    messages: list[Message]  # its requests and every answer to them, oldest first
    more: bool  # past TASK_MESSAGES_MAX


def task_story(task: Task) -> TaskStory:
    """The task's rows: its transmissions (in its direction, and for a group member that
    member's), every answer to them, and the CANCELs the console sent for it."""
    # From the task's first row on: the plan reads the partitions of its days only.
    rows = list(history_since(Message.objects.filter(task_id=task.task_id), task.created_at)
                .defer("payload").order_by("created_at", "id")[:TASK_MESSAGES_MAX + 1])
    more = len(rows) > TASK_MESSAGES_MAX
    rows = rows[:TASK_MESSAGES_MAX]
    key = (task.direction, task.task_id, task.member)
    requests = {r.message_id for r in rows
                if r.message_type == MessageType.TASK_REQUEST and task_key(r) == key}
    mine = [r for r in rows if r.message_id in requests or r.in_reply_to in requests
            or (r.message_type == MessageType.CANCEL and task.direction == Direction.SEND
                and r.direction == Direction.SEND
                and (not task.member or r.to_agent_id == task.member))]
    return TaskStory(task=task, messages=mine, more=more)
