"""Writes to alarms by people: acknowledging one. (Firing and clearing: alarms/evaluate.py.)"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from alarms.models import Alarm
from reachconsole.core.audit import audit_record
from reachconsole.core.errors import ConsoleError

NOTE_MAX = 1000
ALARM_NOT_FOUND = ("There is no alarm {alarm_id}: check the number, or find it on the alarms "
                   "page (cleared alarms are kept {days} days).")
ALREADY_ACKNOWLEDGED = ("Alarm {alarm_id} ({kind} {subject}) was already acknowledged by {by} "
                        "at {at:%Y-%m-%d %H:%M:%S} UTC; it stays listed until its condition "
                        "clears.")
ALREADY_CLEARED = ("Alarm {alarm_id} ({kind} {subject}) cleared at {at:%Y-%m-%d %H:%M:%S} UTC: "
                   "its condition ended, so there is nothing left to acknowledge.")
NOTE_TOO_LONG = ("The note is {n} characters long; at most {limit} are kept. Say it shorter, "
                 "and link to a ticket for the rest.")


class AlarmError(ConsoleError):
    code = "alarm_error"


class AlarmNotFound(AlarmError):
    code = "alarm_not_found"
    status = 404


class AlarmConflict(AlarmError):
    code = "alarm_conflict"
    status = 409


class NoteTooLong(AlarmError):
    code = "note_too_long"
    status = 422


def alarm_acknowledge(*, alarm_id: int, by: str, note: str = "",
                      now: datetime | None = None) -> Alarm:
    """`by` has seen the alarm and is on it. It stays listed (and counted by /metrics) until
    its condition clears; only the header's count of unacknowledged alarms drops. Audited in
    the same transaction."""
    note = (note or "").strip()
    if len(note) > NOTE_MAX:
        raise NoteTooLong(NOTE_TOO_LONG.format(n=len(note), limit=NOTE_MAX))
    if not 0 < alarm_id < 2**63:  # no row can have it; the database would refuse the number
        raise AlarmNotFound(ALARM_NOT_FOUND.format(
            alarm_id=alarm_id, days=settings.REACH_ALARM_RETENTION_DAYS))
    now = now or timezone.now()
    with transaction.atomic():
        # Locked: the evaluation may be clearing it right now; whichever comes second sees
        # what the first did.
        alarm = Alarm.objects.select_for_update().filter(id=alarm_id).first()
        if alarm is None:
            raise AlarmNotFound(ALARM_NOT_FOUND.format(
                alarm_id=alarm_id, days=settings.REACH_ALARM_RETENTION_DAYS))
        if alarm.cleared_at is not None:
            raise AlarmConflict(ALREADY_CLEARED.format(
                alarm_id=alarm.id, kind=alarm.kind, subject=alarm.subject, at=alarm.cleared_at),
                code="already_cleared")
        if alarm.acknowledged_at is not None:
            raise AlarmConflict(ALREADY_ACKNOWLEDGED.format(
                alarm_id=alarm.id, kind=alarm.kind, subject=alarm.subject,
                by=alarm.acknowledged_by, at=alarm.acknowledged_at),
                code="already_acknowledged")
        taken = Alarm.objects.filter(id=alarm.id, cleared_at__isnull=True,
                                     acknowledged_at__isnull=True).update(
            acknowledged_by=by[:150], acknowledged_at=now, ack_note=note, updated_at=now)
        if taken != 1:  # the row is locked: only a write around this service gets here
            raise AlarmConflict(f"Alarm {alarm.id} changed while it was being acknowledged: "
                                "reload the page and look again.", code="alarm_changed")
        audit_record(actor=by, action="acknowledge-alarm",
                     target=f"alarm {alarm.id}: {alarm.kind} {alarm.subject}", detail=note)
    alarm.refresh_from_db()
    return alarm
