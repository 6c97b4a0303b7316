"""Alarms as records (alarms/): each fires once per subject from the kept numbers and the
roster, clears itself when its condition ends, stays in the history for its keep, and is
acknowledged by a person, audited. The page, the API, the overview's strip, the header's
count and /metrics read the same rows."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.test import Client
from django.utils import timezone
from django.utils.html import escape
from prometheus_client.parser import text_string_to_metric_families

from alarms import services as alarm_services
from alarms.evaluate import alarms_evaluate
from alarms.models import Alarm
from alarms.services import alarm_acknowledge
from messages.models import Change, Direction, Message, Status
from messages.state import changes_apply, messages_insert_new
from reachconsole.core import roles
from reachconsole.core.audit import AuditEntry
from roster import services
from roster.models import ClusterNode
from tests.conftest import FIN_TOKEN, ApiClient, logged_in, reader, register, run_at_once

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
K = Alarm.Kind


# --- helpers ----------------------------------------------------------------------------
def request_to(agent_id: str, *, status: str, seconds_ago: float, node_id: str = "node-a"):
    """A task request as the writers store it: counted by the ledger as it is inserted."""
    at = timezone.now() - timedelta(seconds=seconds_ago)
    message = Message(
        message_id=str(uuid.uuid4()), task_id=str(uuid.uuid4()), message_type="TASK_REQUEST",
        direction=Direction.SEND, status=status, created_at=at, updated_at=at,
        to_agent_id=agent_id, target_node_id=node_id, published_at=at)
    (stored,) = messages_insert_new([message])
    return stored


def expire(row, *, seconds_ago: float = 0) -> None:
    """The sweep's move of an open request to EXPIRED, at its deadline."""
    when = timezone.now() - timedelta(seconds=seconds_ago)
    applied = changes_apply([Change(pk=row.pk, to=Status.EXPIRED, actor="sweeper",
                                    reason="deadline", fields={"error": "no answer in time",
                                                               "finished_at": when})], now=when)
    assert applied.skipped == 0


def active(kind: str | None = None) -> list[Alarm]:
    qs = Alarm.objects.filter(cleared_at__isnull=True)
    if kind:
        qs = qs.filter(kind=kind)
    return list(qs.order_by("kind", "subject"))


def one(kind: str, subject: str) -> Alarm:
    return Alarm.objects.get(kind=kind, subject=subject, cleared_at__isnull=True)


def node_goes_silent(node_id: str, *, heartbeat_ms: int = 1000) -> None:
    """The node was heard, then fell silent for more than three heartbeat intervals; the
    sweep says it is DOWN."""
    now = timezone.now()
    services.node_seen(node_id=node_id, heartbeat_ms=heartbeat_ms,
                       now=now - timedelta(milliseconds=4 * heartbeat_ms))
    assert services.nodes_sweep(now=now) == 1
    assert ClusterNode.objects.get(node_id=node_id).status == ClusterNode.Status.DOWN


def member(username: str, group: str) -> User:
    user = reader(username, password=f"pw-{username}-123")
    user.groups.add(Group.objects.get(name=group))
    return user


@pytest.fixture
def uncovered():
    """A capability nobody can take (its only agent drains), and one that is covered."""
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.audit", "node-b", capabilities=["audit"])
    services.agent_drain(agent_id="llm.audit", actor="ops")


# --- firing and clearing ----------------------------------------------------------------
def test_it_fires_once_per_subject(uncovered):
    first = alarms_evaluate()
    assert first.fired == [(K.CAPABILITY_UNCOVERED, "audit")]
    alarm = one(K.CAPABILITY_UNCOVERED, "audit")
    assert alarm.severity == Alarm.Severity.CRITICAL and alarm.parent_id is None
    assert "llm.audit: draining: it takes no new work" in alarm.detail
    assert "Sends to capability:audit end UNDELIVERABLE" in alarm.detail

    again = alarms_evaluate()
    assert (again.fired, again.cleared, again.refreshed) == ([], [], 0)
    assert Alarm.objects.count() == 1
    assert one(K.CAPABILITY_UNCOVERED, "audit").id == alarm.id


def test_it_clears_by_itself_and_keeps_the_history(uncovered):
    alarms_evaluate()
    fired = one(K.CAPABILITY_UNCOVERED, "audit")

    services.agent_undrain(agent_id="llm.audit", actor="ops")
    moment = timezone.now()
    result = alarms_evaluate(now=moment)

    assert result.cleared == [(K.CAPABILITY_UNCOVERED, "audit")]
    fired.refresh_from_db()
    assert fired.cleared_at == moment and fired.updated_at == moment
    assert active() == []
    # It comes back: a new record, the old one stays in the history.
    services.agent_drain(agent_id="llm.audit", actor="ops")
    alarms_evaluate()
    again = one(K.CAPABILITY_UNCOVERED, "audit")
    assert again.id != fired.id
    assert Alarm.objects.filter(kind=K.CAPABILITY_UNCOVERED, subject="audit").count() == 2


def test_the_history_is_kept_for_its_days_and_pruned_set_wise(uncovered, settings):
    settings.REACH_ALARM_RETENTION_DAYS = 30
    now = timezone.now()
    old_parent = Alarm.objects.create(kind=K.NODE_DOWN, subject="node-x", severity="critical",
                                      detail="x", fired_at=now - timedelta(days=40),
                                      cleared_at=now - timedelta(days=31))
    old_child = Alarm.objects.create(kind=K.CAPABILITY_UNCOVERED, subject="x", detail="x",
                                     severity="critical", parent=old_parent,
                                     fired_at=now - timedelta(days=40),
                                     cleared_at=now - timedelta(days=31))
    # Cleared within the keep, its parent not: it stays, unlinked.
    late_child = Alarm.objects.create(kind=K.AGENT_FAILING, subject="fin.x", detail="x",
                                      severity="warning", parent=old_parent,
                                      fired_at=now - timedelta(days=40),
                                      cleared_at=now - timedelta(days=29))
    # Fired long ago and still holding: never pruned.
    holding = Alarm.objects.create(kind=K.NODE_DOWN, subject="node-y", detail="y",
                                   severity="critical", fired_at=now - timedelta(days=60))
    ClusterNode.objects.create(node_id="node-y", status=ClusterNode.Status.DOWN)

    result = alarms_evaluate(now=now)

    assert result.pruned == 2
    assert not Alarm.objects.filter(id__in=[old_parent.id, old_child.id]).exists()
    late_child.refresh_from_db()
    assert late_child.parent_id is None and late_child.cleared_at is not None
    holding.refresh_from_db()
    assert holding.cleared_at is None
    assert {(a.kind, a.subject) for a in active()} == {
        (K.NODE_DOWN, "node-y"), (K.CAPABILITY_UNCOVERED, "audit")}


@pytest.mark.django_db(transaction=True)
def test_two_evaluations_at_once_change_nothing_twice(uncovered):
    register("web.shop", "node-c", capabilities=["shop"])
    services.agent_drain(agent_id="web.shop", actor="ops")

    results = run_at_once(alarms_evaluate)

    assert sorted(key for r in results for key in r.fired) == [
        (K.CAPABILITY_UNCOVERED, "audit"), (K.CAPABILITY_UNCOVERED, "shop")]
    assert Alarm.objects.count() == 2

    services.agent_undrain(agent_id="web.shop", actor="ops")
    results = run_at_once(alarms_evaluate)

    assert [key for r in results for key in r.cleared] == [(K.CAPABILITY_UNCOVERED, "shop")]
    assert [r.fired for r in results] == [[], []]
    assert [(a.subject, a.cleared_at is None) for a in Alarm.objects.order_by("subject")] == [
        ("audit", True), ("shop", False)]


def test_a_second_insert_of_one_alarm_gets_the_first_ones_row(uncovered):
    """The partial unique index is the guard: an active (kind, subject) exists once."""
    alarms_evaluate()
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        Alarm.objects.create(kind=K.CAPABILITY_UNCOVERED, subject="audit", severity="critical",
                             detail="a second one")
    Alarm.objects.filter(kind=K.CAPABILITY_UNCOVERED).update(cleared_at=timezone.now())
    Alarm.objects.create(kind=K.CAPABILITY_UNCOVERED, subject="audit", severity="critical",
                         detail="fires again after it cleared")


# --- one root cause, one alarm -----------------------------------------------------------
def test_a_silent_node_raises_one_alarm_with_what_it_took_as_children_and_retiring_clears_them():
    register("fin.tax", "node-a", capabilities=["tax"])
    register("fin.vat", "node-a", capabilities=["vat", "audit"])
    register("web.vat", "node-b", capabilities=["vat"])
    register("llm.audit", "node-b", capabilities=["audit"])
    services.agent_drain(agent_id="llm.audit", actor="ops")
    for seconds_ago in (200, 100, 10):  # fin.tax's tasks expire while its node is silent
        expire(request_to("fin.tax", status=Status.ACKED, seconds_ago=seconds_ago))
    node_goes_silent("node-a")

    alarms_evaluate()

    (node,) = active(K.NODE_DOWN)
    assert node.subject == "node-a" and node.parent_id is None
    assert "Node node-a is down" in node.detail and "Its 2 agents get no new work" in node.detail
    tax = one(K.CAPABILITY_UNCOVERED, "tax")
    assert tax.parent_id == node.id  # only node-a offered it: part of node-a's alarm
    # The sweep that found the silence said STALE with it (no green OK beside DOWN).
    assert "node node-a has been silent for" in tax.detail
    # `audit` is offered on node-a and by a draining agent on node-b: not only node-a's doing.
    assert one(K.CAPABILITY_UNCOVERED, "audit").parent_id is None
    assert not Alarm.objects.filter(subject="vat").exists()  # web.vat on node-b takes it
    assert one(K.TASKS_EXPIRING, "fin.tax").parent_id == node.id
    assert {a.id for a in node.children.all()} == {tax.id, one(K.TASKS_EXPIRING, "fin.tax").id}

    services.node_retire(node_id="node-a", actor="ops")
    result = alarms_evaluate()

    assert sorted(result.cleared) == [(K.CAPABILITY_UNCOVERED, "tax"), (K.NODE_DOWN, "node-a"),
                                      (K.TASKS_EXPIRING, "fin.tax")]
    assert [(a.kind, a.subject) for a in active()] == [(K.CAPABILITY_UNCOVERED, "audit")]
    assert Alarm.objects.filter(id__in=[node.id, tax.id], cleared_at__isnull=False).count() == 2


def test_a_node_back_up_clears_its_alarm_and_its_children():
    register("fin.tax", "node-a", capabilities=["tax"])
    node_goes_silent("node-a")
    alarms_evaluate()
    assert one(K.CAPABILITY_UNCOVERED, "tax").parent == one(K.NODE_DOWN, "node-a")

    services.node_seen(node_id="node-a")
    result = alarms_evaluate()

    assert sorted(result.cleared) == [(K.CAPABILITY_UNCOVERED, "tax"), (K.NODE_DOWN, "node-a")]
    assert active() == []


# --- the numbers -------------------------------------------------------------------------
def test_a_trickle_of_expired_tasks_to_one_agent_raises_tasks_expiring(settings):
    settings.REACH_ALARM_EXPIRED_MIN = 3
    register("fin.tax", "node-a", capabilities=["tax"])
    register("fin.vat", "node-a", capabilities=["vat"])
    # One every minute and a half: never two in one second, three in five minutes.
    for seconds_ago in (270, 180, 90):
        expire(request_to("fin.tax", status=Status.ACKED, seconds_ago=seconds_ago),
               seconds_ago=seconds_ago - 30)
    for seconds_ago in (200, 100):  # two only
        expire(request_to("fin.vat", status=Status.ACKED, seconds_ago=seconds_ago))
    # Long before the window: not counted.
    expire(request_to("fin.vat", status=Status.ACKED, seconds_ago=900))

    alarms_evaluate()

    (alarm,) = active(K.TASKS_EXPIRING)
    assert alarm.subject == "fin.tax" and alarm.severity == Alarm.Severity.WARNING
    assert alarm.detail.startswith("3 task requests to fin.tax on node-a expired in the last "
                                   "5 minutes")
    assert active(K.AGENT_FAILING) == []  # 3 ended: fewer than the minimum to judge a rate


def test_an_agent_failing_its_tasks_raises_agent_failing_and_fewer_than_the_minimum_do_not(
        settings):
    settings.REACH_ALARM_SUCCESS_MIN = 0.8
    settings.REACH_ALARM_MIN_TASKS = 5
    register("fin.tax", "node-a", capabilities=["tax"])
    register("fin.vat", "node-a", capabilities=["vat"])
    register("fin.fee", "node-a", capabilities=["fee"])
    for i in range(6):  # 4 of 6 completed: 67 %
        request_to("fin.tax", status=Status.COMPLETED if i < 4 else Status.TASK_ERROR,
                   seconds_ago=30 + i * 40)
    for i in range(4):  # 1 of 4: worse, but too few to judge
        request_to("fin.vat", status=Status.COMPLETED if i < 1 else Status.TASK_ERROR,
                   seconds_ago=30 + i * 40)
    for i in range(5):  # 4 of 5 completed: 80 %, not below
        request_to("fin.fee", status=Status.COMPLETED if i < 4 else Status.BUSY,
                   seconds_ago=30 + i * 40)

    alarms_evaluate()

    (alarm,) = active(K.AGENT_FAILING)
    assert alarm.subject == "fin.tax"
    assert alarm.detail.startswith("Only 4 of the 6 task requests to fin.tax on node-a that "
                                   "ended in the last 5 minutes completed (67%, below 80%): "
                                   "2 TASK_ERROR.")
    # The console as a whole: 9 of 15 ended completed.
    assert "only 9 completed (60%, below 80%)" in one(K.DELIVERY_FAILING, "console").detail


def test_a_rate_hovering_around_the_setting_raises_one_alarm_that_clears_past_a_margin(
        settings):
    settings.REACH_ALARM_SUCCESS_MIN = 0.8
    settings.REACH_ALARM_CLEAR_MARGIN = 0.05
    settings.REACH_ALARM_MIN_TASKS = 5
    register("fin.tax", "node-a", capabilities=["tax"])
    for i in range(10):  # 7 of 10: 70 %, below 80 %
        request_to("fin.tax", status=Status.COMPLETED if i < 7 else Status.TASK_ERROR,
                   seconds_ago=30 + i * 20)
    alarms_evaluate()
    (first,) = active(K.AGENT_FAILING)

    for _ in range(7):  # 14 of 17: 82 %, above 80 % but not above 85 %
        request_to("fin.tax", status=Status.COMPLETED, seconds_ago=10)
    alarms_evaluate()
    (held,) = active(K.AGENT_FAILING)
    assert held.pk == first.pk  # the same alarm, not cleared and fired again
    assert "(82%: back above 80%, not yet above 85%, where this clears)" in held.detail

    for _ in range(10):  # 24 of 27: 89 %
        request_to("fin.tax", status=Status.COMPLETED, seconds_ago=10)
    alarms_evaluate()
    assert active(K.AGENT_FAILING) == []
    first.refresh_from_db()
    assert first.cleared_at is not None
    assert Alarm.objects.filter(kind=K.AGENT_FAILING).count() == 1


def test_an_agent_both_failing_and_expiring_raises_its_expiries_under_its_failing():
    register("fin.tax", "node-a", capabilities=["tax"])
    for seconds_ago in (250, 200, 150, 100, 50):
        expire(request_to("fin.tax", status=Status.ACKED, seconds_ago=seconds_ago))

    alarms_evaluate()

    assert one(K.TASKS_EXPIRING, "fin.tax").parent == one(K.AGENT_FAILING, "fin.tax")


def test_the_bus_not_heard_and_the_brokers_drops_fire_and_clear(settings):
    from reachconsole.core.broker_drops import broker_drops_forget, broker_drops_note
    from roster.models import BusHearing

    BusHearing.objects.update(hearing_since=None)
    broker_drops_note(dropped=12, total=40, now=timezone.now())
    try:
        alarms_evaluate()
        bus = one(K.BUS_NOT_HEARD, "console")
        assert "no MQTT bridge hears the bus" in bus.detail
        assert "dropped 12 messages" in one(K.BROKER_DROPS, "console").detail
    finally:
        broker_drops_forget()
    BusHearing.objects.update(hearing_since=timezone.now() - timedelta(hours=1))
    result = alarms_evaluate()
    assert sorted(result.cleared) == [(K.BROKER_DROPS, "console"), (K.BUS_NOT_HEARD, "console")]


def test_history_past_its_retention_raises_retention_behind_until_the_prune_catches_up(
        settings, viewer):
    from messages.outbound import SendRequest, message_send
    from messages.sweeps import messages_prune

    settings.REACH_RETENTION_DAYS = 1
    now = timezone.now()
    # Past the retention, but by less than the alarm's margin: the prune's next call takes it.
    message_send(request=SendRequest(to="fin.nobody"),
                 now=now - timedelta(days=1, minutes=5))
    alarms_evaluate(now=now)
    assert not Alarm.objects.filter(kind=K.RETENTION_BEHIND).exists()

    message_send(request=SendRequest(to="fin.nobody"), now=now - timedelta(days=3))
    alarms_evaluate(now=now)
    alarm = one(K.RETENTION_BEHIND, "console")
    assert "older than REACH_RETENTION_DAYS=1 are still stored" in alarm.detail
    html = viewer.get("/alarms/").content.decode()
    assert "The message history outgrows its retention" in html
    assert escape("/messages/?until=1440") in html  # the rows past the retention

    assert messages_prune(now=now) == 2
    assert alarms_evaluate(now=now).cleared == [(K.RETENTION_BEHIND, "console")]


# --- acknowledging -----------------------------------------------------------------------
def test_an_acknowledgement_is_audited_and_the_alarm_stays_until_it_clears(uncovered):
    alarms_evaluate()
    alarm = one(K.CAPABILITY_UNCOVERED, "audit")

    done = alarm_acknowledge(alarm_id=alarm.id, by="otto", note="draining on purpose until 4pm")

    assert (done.acknowledged_by, done.ack_note) == ("otto", "draining on purpose until 4pm")
    assert done.acknowledged_at is not None and done.cleared_at is None
    entry = AuditEntry.objects.get(action="acknowledge-alarm")
    assert (entry.actor, entry.result, entry.detail) == ("otto", "ok",
                                                         "draining on purpose until 4pm")
    assert entry.target == f"alarm {alarm.id}: capability_uncovered audit"
    alarms_evaluate()  # still holds: still listed, still acknowledged
    assert one(K.CAPABILITY_UNCOVERED, "audit").acknowledged_by == "otto"

    with pytest.raises(alarm_services.AlarmConflict) as twice:
        alarm_acknowledge(alarm_id=alarm.id, by="olga", note="")
    assert twice.value.status == 409 and twice.value.code == "already_acknowledged"
    assert "already acknowledged by otto" in twice.value.detail
    with pytest.raises(alarm_services.NoteTooLong) as long_note:
        alarm_acknowledge(alarm_id=alarm.id, by="olga", note="x" * 1001)
    assert long_note.value.status == 422
    with pytest.raises(alarm_services.AlarmNotFound) as missing:
        alarm_acknowledge(alarm_id=alarm.id + 1000, by="olga")
    assert missing.value.status == 404
    assert AuditEntry.objects.filter(action="acknowledge-alarm").count() == 1


def test_a_cleared_alarm_cannot_be_acknowledged(uncovered):
    alarms_evaluate()
    alarm = one(K.CAPABILITY_UNCOVERED, "audit")
    services.agent_undrain(agent_id="llm.audit", actor="ops")
    alarms_evaluate()
    with pytest.raises(alarm_services.AlarmConflict) as late:
        alarm_acknowledge(alarm_id=alarm.id, by="otto", note="on it")
    assert late.value.code == "already_cleared" and "its condition ended" in late.value.detail
    alarm.refresh_from_db()
    assert alarm.acknowledged_at is None


# --- the page ------------------------------------------------------------------------------
@pytest.fixture
def viewer() -> Client:
    return logged_in(member("vera", roles.VIEWER))


@pytest.fixture
def operator() -> Client:
    return logged_in(member("otto", roles.OPERATOR))


def test_the_roles_hold_the_alarm_permissions():
    vera, otto = member("vera", roles.VIEWER), member("otto", roles.OPERATOR)
    assert vera.has_perm("alarms.view_alarm") and not vera.has_perm("alarms.acknowledge_alarm")
    assert otto.has_perm("alarms.view_alarm") and otto.has_perm("alarms.acknowledge_alarm")


def test_a_viewer_sees_the_alarms_and_cannot_acknowledge(viewer):
    register("fin.tax", "node-a", capabilities=["tax"])
    node_goes_silent("node-a")
    alarms_evaluate()
    node, tax = one(K.NODE_DOWN, "node-a"), one(K.CAPABILITY_UNCOVERED, "tax")

    page = viewer.get("/alarms/")

    assert page.status_code == 200
    html = page.content.decode()
    assert f'id="alarm-{node.id}"' in html and "Node node-a is down" in html
    # The capability sits under its node's alarm, not beside it.
    children = html[html.index('class="alarm-children"'):]
    assert f'id="alarm-{tax.id}"' in children[:children.index("</ul>")]
    assert "data-ack=" not in html and 'data-not-allowed="acknowledge alarms"' in html
    assert "/cluster/#node-node-a" in html and "/?capability=tax" in html

    refused = viewer.post(f"/alarms/{node.id}/ack", {"note": "mine"})

    assert refused.status_code == 403
    assert escape(roles.action_refused_words("vera")) in refused.content.decode()
    node.refresh_from_db()
    assert node.acknowledged_at is None
    assert not AuditEntry.objects.filter(action="acknowledge-alarm").exists()


def test_an_operator_acknowledges_from_the_page(operator, uncovered):
    alarms_evaluate()
    alarm = one(K.CAPABILITY_UNCOVERED, "audit")
    html = operator.get("/alarms/").content.decode()
    assert f'data-ack="{alarm.id}"' in html and "data-not-allowed" not in html

    done = operator.post(f"/alarms/{alarm.id}/ack", {"note": "on it"})

    assert done.status_code == 302 and done["Location"] == "/alarms/"
    alarm.refresh_from_db()
    assert (alarm.acknowledged_by, alarm.ack_note) == ("otto", "on it")
    after = operator.get("/alarms/").content.decode()
    assert 'data-acknowledged-by="otto"' in after and f'data-ack="{alarm.id}"' not in after
    assert "is acknowledged by you" in after

    again = operator.post(f"/alarms/{alarm.id}/ack", {"note": "me too"}, follow=True)
    assert "already acknowledged by otto" in again.content.decode()
    assert AuditEntry.objects.filter(action="acknowledge-alarm", result="refused").count() == 1


def test_the_history_pages_newest_first(viewer, monkeypatch):
    from alarms import views

    monkeypatch.setattr(views, "PAGE_SIZE", 2)
    now = timezone.now()
    for i in range(3):
        Alarm.objects.create(kind=K.NODE_DOWN, subject=f"node-{i}", severity="critical",
                             detail=f"gone {i}", fired_at=now - timedelta(hours=3 - i),
                             cleared_at=now - timedelta(hours=2 - i))
    first = viewer.get("/alarms/")
    assert [a.subject for a in first.context["history"]] == ["node-2", "node-1"]
    older = viewer.get("/alarms/", {"before": first.context["older"]})
    assert [a.subject for a in older.context["history"]] == ["node-0"]
    assert older.context["older"] == ""
    assert viewer.get("/alarms/", {"before": "yesterday"}).status_code == 400


# --- the API -------------------------------------------------------------------------------
KEYS = {"id", "kind", "subject", "severity", "detail", "firedAt", "clearedAt", "acknowledgedBy",
        "acknowledgedAt", "parentId"}


def test_the_api_lists_and_acknowledges_alarms(uncovered):
    register("fin.vat", "node-c", capabilities=["vat"])
    node_goes_silent("node-c")
    alarms_evaluate()
    services.agent_undrain(agent_id="llm.audit", actor="ops")
    alarms_evaluate()  # audit is covered again: its alarm is history
    api = ApiClient(actor="otto")

    listed = api.get("/api/ops/alarms")

    assert listed.status_code == 200
    body = listed.json()
    assert [(a["kind"], a["subject"]) for a in body] == [("capability_uncovered", "vat"),
                                                         ("node_down", "node-c")]
    assert all(set(a) == KEYS for a in body)
    vat, node = body
    assert vat["parentId"] == node["id"] and node["parentId"] is None
    assert (vat["clearedAt"], vat["acknowledgedBy"], vat["acknowledgedAt"]) == (None, None, None)
    every = api.get("/api/ops/alarms", {"state": "all"}).json()
    assert {a["subject"] for a in every} == {"vat", "node-c", "audit"}
    assert [a for a in every if a["subject"] == "audit"][0]["clearedAt"] is not None
    fired = [a["firedAt"] for a in every]
    assert fired == sorted(fired, reverse=True)

    acked = api.post(f"/api/ops/alarms/{node['id']}/ack", {"note": "paged the owner"})

    assert acked.status_code == 200
    assert acked.json()["acknowledgedBy"] == "studio:otto" and acked.json()["clearedAt"] is None
    assert Alarm.objects.get(id=node["id"]).ack_note == "paged the owner"
    assert AuditEntry.objects.get(action="acknowledge-alarm").actor == "studio:otto"
    assert node["id"] in [a["id"] for a in api.get("/api/ops/alarms").json()]  # still listed


def test_the_api_refuses_with_words(uncovered):
    alarms_evaluate()
    alarm = one(K.CAPABILITY_UNCOVERED, "audit")
    api = ApiClient()

    bad = api.get("/api/ops/alarms", {"state": "open"})
    assert bad.status_code == 400 and bad.json() == {
        "error": "bad_state",
        "detail": "state='open' is not a state of alarms: ask for active (the default) or all."}
    missing = api.post("/api/ops/alarms/999999/ack", {"note": ""})
    assert missing.status_code == 404 and missing.json()["error"] == "alarm_not_found"
    assert "There is no alarm 999999" in missing.json()["detail"]
    long_note = api.post(f"/api/ops/alarms/{alarm.id}/ack", {"note": "x" * 1001})
    assert long_note.status_code == 422 and long_note.json()["error"] == "invalid_request"
    assert api.post(f"/api/ops/alarms/{alarm.id}/ack").status_code == 200  # no body: no note
    twice = api.post(f"/api/ops/alarms/{alarm.id}/ack", {"note": "again"})
    assert twice.status_code == 409 and twice.json()["error"] == "already_acknowledged"
    assert "already acknowledged by studio:" in twice.json()["detail"]
    bound = ApiClient(token=FIN_TOKEN).get("/api/ops/alarms")
    assert bound.status_code == 403 and bound.json()["error"] == "namespace_forbidden"
    assert Client().get("/api/ops/alarms").status_code == 401


# --- /metrics, the header, the overview --------------------------------------------------
def test_metrics_show_the_active_alarms_of_every_kind(client, uncovered):
    alarms_evaluate()
    text = client.get("/metrics").content.decode()
    samples = {s.labels["kind"]: s.value for family in text_string_to_metric_families(text)
               if family.name == "reach_alarms_active" for s in family.samples}
    assert samples == {**dict.fromkeys(Alarm.Kind.values, 0.0), "capability_uncovered": 1.0}
    assert 'reach_alarms_active{kind="capability_uncovered"} 1.0' in text


def test_every_page_header_counts_the_unacknowledged_alarms(viewer, uncovered):
    assert "data-alarm-count" not in viewer.get("/cluster/").content.decode()
    register("web.shop", "node-c", capabilities=["shop"])
    services.agent_drain(agent_id="web.shop", actor="ops")
    alarms_evaluate()

    html = viewer.get("/cluster/").content.decode()
    nav = html[html.index("<nav>"):html.index("</nav>")]
    assert 'href="/alarms/" data-nav-alarms' in nav and 'data-alarm-count="2"' in nav

    alarm_acknowledge(alarm_id=one(K.CAPABILITY_UNCOVERED, "shop").id, by="otto")
    assert 'data-alarm-count="1"' in viewer.get("/messages/").content.decode()


def test_a_database_hiccup_leaves_the_page_without_the_count(viewer, uncovered):
    alarms_evaluate()
    with connection.cursor() as cursor:  # undone with the test's transaction
        cursor.execute("ALTER TABLE alarms_alarm RENAME TO alarms_alarm_away")
    page = viewer.get("/cluster/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "data-nav-alarms" in html and "data-alarm-count" not in html


def test_the_overview_strip_reads_the_alarm_records(viewer):
    register("fin.tax", "node-a", capabilities=["tax"])
    node_goes_silent("node-a")
    assert "ov-alarms" not in viewer.get("/overview/").content.decode()  # not evaluated yet

    alarms_evaluate()
    html = viewer.get("/overview/").content.decode()

    strip = html[html.index('class="ov-alarms"'):html.index('class="ov-grid"')]
    assert strip.index('data-node-down="node-a"') < strip.index('data-uncovered="tax"')
    assert 'class="ov-alarm ov-alarm-child"' in strip
    assert 'href="/cluster/#node-node-a"' in strip and 'href="/?capability=tax"' in strip
