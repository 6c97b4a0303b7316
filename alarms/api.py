"""`/api/ops/alarms`: the alarm records (PROTOCOL.md "Tasks, numbers and alarms")."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from django.http import HttpRequest
from ninja import Field, Path, Query, Router, Schema, Status

from alarms.models import Alarm
from alarms.selectors import alarms_list
from alarms.services import NOTE_MAX, alarm_acknowledge
from reachconsole.core.apidoc import BodyIn, refusals
from reachconsole.core.errors import ApiError

router = Router(tags=["ops"])

STATES = ("active", "all")
BAD_STATE = "state={value!r} is not a state of alarms: ask for active (the default) or all."
NEEDS_ALL_NAMESPACES = ("alarms span every namespace (nodes, capabilities, the console): a "
                        "token bound to namespaces cannot read or acknowledge them")


class AlarmsQuery(Schema):
    # The document names the two states; the check is ours, so anything else is a 400 with
    # words (PROTOCOL.md), not the schema's 422.
    state: str = Field("active", max_length=20, json_schema_extra={"enum": list(STATES)},
                       description="active (the default) or all: the active ones and the "
                       "history; anything else is a 400")
    limit: int = Field(500, ge=1, le=500, description="at most this many, newest first")


class AckIn(BodyIn):
    note: str = Field("", max_length=NOTE_MAX, description="what is being done about it")


class AlarmOut(Schema):
    id: int
    kind: Literal[tuple(Alarm.Kind.values)]
    subject: str
    severity: Literal[tuple(Alarm.Severity.values)]
    detail: str
    fired_at: datetime = Field(..., serialization_alias="firedAt")
    cleared_at: datetime | None = Field(..., serialization_alias="clearedAt")
    acknowledged_by: str | None = Field(..., serialization_alias="acknowledgedBy")
    acknowledged_at: datetime | None = Field(..., serialization_alias="acknowledgedAt")
    parent_id: int | None = Field(..., serialization_alias="parentId")


def alarm_out(alarm: Alarm) -> dict:
    return {"id": alarm.id, "kind": alarm.kind, "subject": alarm.subject,
            "severity": alarm.severity, "detail": alarm.detail, "fired_at": alarm.fired_at,
            "cleared_at": alarm.cleared_at, "acknowledged_by": alarm.acknowledged_by or None,
            "acknowledged_at": alarm.acknowledged_at, "parent_id": alarm.parent_id}


def _all_namespaces(request: HttpRequest) -> None:
    if request.auth.token.namespaces is not None:
        raise ApiError(403, "namespace_forbidden", NEEDS_ALL_NAMESPACES)


@router.get("", response={200: list[AlarmOut], **refusals(400)}, by_alias=True)
def alarms(request: HttpRequest, query: Query[AlarmsQuery]):
    """The active alarms (or all, with the history), newest first."""
    _all_namespaces(request)
    if query.state not in STATES:
        raise ApiError(400, "bad_state", BAD_STATE.format(value=query.state[:20]))
    rows = alarms_list(state=query.state)[:query.limit]
    return Status(200, [alarm_out(a) for a in rows])


@router.post("/{alarm_id}/ack", response={200: AlarmOut, **refusals(404, 409, body=True)},
             by_alias=True)
def alarm_ack(request: HttpRequest, alarm_id: int = Path(..., ge=1, le=2**63 - 1),
              body: AckIn | None = None):
    """Acknowledged by the caller (X-OODER-Actor, or the token): it stays listed until its
    condition clears. 409 when it is already acknowledged or already cleared. Audited."""
    _all_namespaces(request)
    alarm = alarm_acknowledge(alarm_id=alarm_id, by=request.auth.label,
                              note=(body or AckIn()).note)
    return Status(200, alarm_out(alarm))
