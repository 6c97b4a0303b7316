"""What the broker's answer to a publish means: the outbox's other half.

A bridge claims due rows (messages/outbox.py `outbox_claim`), hands them to paho, and reports
here what became of each: the broker took it (PUBACK), refused it, or it never reached the
broker (it could not be encoded). `pubacks_apply` writes what that means in one transaction,
with its events after the commit; the bridge only carries the answers to it, and retries
through a database outage.

Not in messages/outbox.py itself: the status machine (messages/state.py) wakes the outbox, so
the outbox cannot depend on the status machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError, transaction

from messages.delivery import ack_deadline
from messages.events import events_on_commit
from messages.models import Change, Status
from messages.outbox import outbox_release_responses
from messages.state import changes_apply, late_pubacks_record

log = logging.getLogger(__name__)
_SENT = frozenset({Status.SENT})


@dataclass(frozen=True, slots=True)
class Puback:
    """The broker's answer for one row the bridge published (or could not)."""

    pk: int
    request: bool  # a request: its receiver's time to acknowledge runs from `at`
    at: datetime  # when the answer came: the row's published_at
    broker_refused: str = ""  # the broker's reason code, when it refused the publish
    not_sent: str = ""  # why it never reached the broker (it could not be encoded)
    # A request's time to be answered from `at`, when not REACH_ACK_TIMEOUT_MS (the
    # A2A-over-MQTT profile's first-reply timeout: messages/delivery.py ack_window_ms).
    ack_ms: int = 0

    @property
    def refused(self) -> str:
        """The row's words when it was not published; "" when the broker took it."""
        if self.broker_refused:
            return f"the broker refused it: {self.broker_refused}"
        return self.not_sent


@dataclass
class PubackResult:
    released: int = 0  # responses made due (they waited for an ACK the broker now has)
    skipped: int = 0  # answers for rows that had moved on meanwhile


def pubacks_apply(*, pubacks: list[Puback], release: list[str], now: datetime) -> PubackResult:
    """Taken: PUBLISHED; a request's receiver has `REACH_ACK_TIMEOUT_MS` from now to
    acknowledge it, and an answer of ours is done once the broker has it (it leaves the
    deadlines). Refused or never sent: FAILED, with the words why. `release`: the requests
    whose console-agent responses waited for these ACKs, made due in the same transaction,
    so a response never waits for an ACK whose PUBACK was recorded.

    A row that moved on before its PUBACK was recorded (an ACK overtook it, the deadline
    sweep ended it, an operator canceled it) still gets the time the broker took it, after
    the commit (messages.state.late_pubacks_record)."""
    changes = []
    for answer in pubacks:
        if answer.refused:
            changes.append(Change(pk=answer.pk, to=Status.FAILED, allowed=_SENT, actor="bridge",
                                  reason=answer.refused,
                                  fields={"error": answer.refused, "finished_at": now}))
        elif answer.request:
            changes.append(Change(pk=answer.pk, to=Status.PUBLISHED, allowed=_SENT,
                                  actor="bridge", reason="PUBACK",
                                  fields={"published_at": answer.at, "publish_at": None,
                                          "ack_deadline_at": ack_deadline(
                                              answer.at, ack_ms=answer.ack_ms)}))
        else:
            changes.append(Change(pk=answer.pk, to=Status.PUBLISHED, allowed=_SENT,
                                  actor="bridge", reason="PUBACK",
                                  fields={"published_at": answer.at, "publish_at": None,
                                          "deadline_at": None}))
    result = PubackResult()
    if not changes and not release:
        return result
    with transaction.atomic():
        # Before changes_apply, which may take agents' load rows: message rows first
        # (messages/backpressure.py, the lock order).
        result.released = outbox_release_responses(request_ids=release, now=now)
        applied = changes_apply(changes, now=now)
        events_on_commit(applied.events)
    result.skipped = applied.skipped
    taken = [a.pk for a in pubacks if not a.refused]
    if taken and applied.skipped:
        # Its own transaction, after the one above committed: a failure here is logged, not
        # raised, so that a caller's retry does not redo (and misreport) what is recorded.
        try:
            late_pubacks_record(pks=taken, now=now)
        except DatabaseError as exc:
            log.warning("could not record when the broker took %d messages: %s",
                        len(taken), exc)
    return result
