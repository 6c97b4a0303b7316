"""What the console counts about its messages, for /metrics and /readyz
(reachconsole.core.metrics keeps the numbers, shared by every process).

Counted where rows change and handed over only after the commit (a rolled-back change
counts nothing), in batches:
- every change of a row is an `a2a_message` event (PROTOCOL.md, "Events"), so the events
  of a commit are counted by the row's new status and type: `reach_messages_total`; a new
  attempt of a task (attempt 2 and later) is a retry;
- the transmissions of our task requests that the broker took, and of those the ones the
  receiver answered (ACK, NACK, BUSY or TASK_RESPONSE), by the second the broker took them:
  the delivery rate of readiness; and each publish → ACK time: the latency histogram.
"""

from __future__ import annotations

from collections import Counter

from django.db import transaction

from messages.models import ANSWERED_STATUSES, Direction, Status
from messages.protocol import MessageType
from reachconsole.core.metrics import counters_add_later, delivery_add_later, histogram_counts

EVENT_MESSAGE = "a2a_message"  # messages.events.EVENT_MESSAGE (which imports this module)
LATENCY = "delivery_latency"
TASK_REQUEST = MessageType.TASK_REQUEST.value


def events_count(events: list[dict]) -> None:
    """Count the changes the events of one commit announce."""
    counts: Counter = Counter()
    for event in events:
        if event.get("event") != EVENT_MESSAGE:
            continue
        counts[f"messages:{event['status']}:{event['messageType']}"] += 1
        if (event.get("previousStatus") is None and event.get("direction") == Direction.SEND
                and event["messageType"] == TASK_REQUEST and (event.get("attempt") or 1) > 1):
            counts["retries"] += 1
    counters_add_later(counts)


class DeliveryTally:
    """Transmissions taken and answered, and publish → ACK times, of the rows one
    transaction moves (messages.state.changes_apply)."""

    def __init__(self) -> None:
        self.published: Counter = Counter()
        self.answered: Counter = Counter()
        self.latencies: list[float] = []

    def moved(self, row, *, previous: str, answer: bool) -> None:
        """`row` (its new values) moved from `previous`; `answer`: the receiver answered it
        (a retryable NACK too, though it leaves the row RETRYING)."""
        if (row.direction != Direction.SEND or row.message_type != TASK_REQUEST
                or row.published_at is None):
            # Not ours, or an answer that overtook the broker's PUBACK: that transmission
            # is left out of both counts, so the share stays honest.
            return
        second = int(row.published_at.timestamp())
        if row.status == Status.PUBLISHED and previous == Status.SENT:
            self.published[second] += 1
        elif answer and previous not in ANSWERED_STATUSES and (row.status == Status.ACKED
                                                      or row.acked_at is None):
            # The first answer only: a response after ACKED → EXPIRED was answered already.
            self.answered[second] += 1
            if row.status == Status.ACKED and row.acked_at is not None:
                self.latencies.append(
                    max(0.0, (row.acked_at - row.published_at).total_seconds()))

    def on_commit(self) -> None:
        if not (self.published or self.answered or self.latencies):
            return
        published, answered = dict(self.published), dict(self.answered)
        latencies = histogram_counts(LATENCY, self.latencies)

        def record() -> None:
            delivery_add_later(published=published, answered=answered)
            counters_add_later(latencies)

        transaction.on_commit(record)
