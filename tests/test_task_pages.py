"""The task list (/tasks/), its exports, and cancel from the pages: one task or a filtered
set, with a confirmation that says what is open and where, for operators only."""

from __future__ import annotations

import csv
import io
import json

import pytest
from django.contrib.auth.models import Group
from django.test import Client

from messages.models import Message, Status, Task
from messages.outbound import SendRequest, message_send
from reachconsole.core import roles
from reachconsole.core.models import AuditEntry
from roster.models import Agent
from tests.conftest import published, reader, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


def member(username: str, group: str) -> Client:
    user = reader(username, password=f"pw-{username}-123")
    user.groups.add(Group.objects.get(name=group))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer() -> Client:
    return member("vera", roles.VIEWER)


@pytest.fixture
def operator() -> Client:
    return member("otto", roles.OPERATOR)


@pytest.fixture
def traffic(now):
    register("fin.tax", "node-b")
    open_task = message_send(request=SendRequest(to="fin.tax", task_id="t-open",
                                                 timeout_ms=600_000))
    published(open_task, now)
    Agent.objects.filter(agent_id="fin.vat").delete()
    lost = message_send(request=SendRequest(to="fin.vat", task_id="t-lost"))
    return open_task, lost


def test_the_list_shows_one_row_per_task_with_its_outcome(viewer, traffic):
    open_task, lost = traffic
    response = viewer.get("/tasks/")
    assert response.status_code == 200
    html = response.content.decode()
    assert html.index('data-task="t-lost"') < html.index('data-task="t-open"')  # newest first
    row = html[html.index('data-task="t-lost"'):]
    row = row[:row.index("</tr>")]
    assert 'data-status="UNDELIVERABLE"' in row and "no agent fin.vat is on the roster" in row
    assert 'href="/tasks/t-lost/"' in row  # which leads to its trace: the task's story
    assert 'id="to-timeline"' in html and 'data-stream="/ws/timeline/"' in html
    # A viewer reads, and is told why there is no Cancel.
    assert "data-cancel=" not in html and 'data-not-allowed="cancel tasks"' in html


def test_the_filters_narrow_the_list_and_a_live_refresh_gets_the_partial(viewer, traffic):
    html = viewer.get("/tasks/", {"status": "UNDELIVERABLE"}).content.decode()
    assert 'data-task="t-lost"' in html and 'data-task="t-open"' not in html
    live = viewer.get("/tasks/?agent=fin.tax", headers={"HX-Request": "true",
                                                        "HX-Target": "tasks-live"})
    body = live.content.decode()
    assert "<html" not in body and 'data-task="t-open"' in body and "t-lost" not in body
    bad = viewer.get("/tasks/", {"since": "last tuesday"})
    assert bad.status_code == 400 and "is neither minutes back" in bad.content.decode()


def test_the_exports_carry_the_filtered_tasks(viewer, traffic):
    response = viewer.get("/tasks/export.csv", {"status": "UNDELIVERABLE"})
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [(r["taskId"], r["status"]) for r in rows] == [("t-lost", "UNDELIVERABLE")]
    response = viewer.get("/tasks/export.jsonl")
    lines = [json.loads(line) for line in
             b"".join(response.streaming_content).decode().splitlines()]
    assert [line["taskId"] for line in lines] == ["t-lost", "t-open"]


def test_an_operator_cancels_after_a_confirmation_that_says_what_is_open(operator, traffic):
    open_task, _ = traffic
    preview = operator.get("/tasks/t-open/cancel", headers={
        "HX-Request": "true", "HX-Current-URL": "http://testserver/tasks/?agent=fin.tax"})
    html = preview.content.decode()
    assert preview.status_code == 200
    assert f'data-open="{open_task.message_id}"' in html
    assert "on node-b" in html and "node-b is sent CANCEL" in html
    assert 'value="/tasks/?agent=fin.tax"' in html  # back where it was opened

    response = operator.post("/tasks/t-open/cancel/confirm",
                             {"reason": "customer withdrew", "next": "/tasks/?agent=fin.tax"})

    assert response.status_code == 302 and response["Location"] == "/tasks/?agent=fin.tax"
    open_task.refresh_from_db()
    assert open_task.status == Status.CANCELED and "customer withdrew" in open_task.error
    assert Message.objects.filter(message_type="CANCEL", target_node_id="node-b").count() == 1
    audit = AuditEntry.objects.get(action="cancel")
    assert (audit.actor, audit.target, audit.result) == ("otto", "t-open", "ok")
    # Nothing left to cancel: the confirmation says so (409), and a second POST is refused.
    assert operator.get("/tasks/t-open/cancel").status_code == 409
    operator.post("/tasks/t-open/cancel/confirm", {"reason": "again"})
    assert AuditEntry.objects.filter(action="cancel", result="refused").count() == 1


def test_a_viewer_is_refused_every_cancel(viewer, traffic):
    assert viewer.get("/tasks/t-open/cancel").status_code == 403
    assert viewer.post("/tasks/t-open/cancel/confirm", {"reason": "x"}).status_code == 403
    assert viewer.post("/tasks/bulk-cancel", {"up_to": "99"}).status_code == 403
    assert Message.objects.get(task_id="t-open").status == Status.PUBLISHED


def test_bulk_cancel_counts_first_and_cancels_what_it_counted(operator, now):
    register("fin.tax", "node-b", max_inflight=1)
    for i in range(3):
        message_send(request=SendRequest(to="fin.tax", task_id=f"t-b{i}", timeout_ms=600_000))
    preview = operator.get("/tasks/cancelable", {"agent": "fin.tax"}).content.decode()
    assert 'data-cancelable="3"' in preview
    up_to = preview.split('name="up_to" value="')[1].split('"')[0]
    message_send(request=SendRequest(to="fin.tax", task_id="t-later", timeout_ms=600_000))

    response = operator.post("/tasks/bulk-cancel", {"agent": "fin.tax", "up_to": up_to,
                                                    "reason": "drill"})

    assert response.status_code == 302
    statuses = dict(Message.objects.filter(message_type="TASK_REQUEST")
                    .values_list("task_id", "status"))
    assert [statuses[f"t-b{i}"] for i in range(3)] == [Status.CANCELED] * 3
    assert statuses["t-later"] == Status.SENT  # stored after the preview: not in it
    assert AuditEntry.objects.filter(action="cancel").count() == 3
    assert AuditEntry.objects.filter(action="cancel-bulk").count() == 1


def test_the_trace_offers_cancel_while_the_task_is_open(operator, viewer, traffic):
    open_task, lost = traffic
    html = operator.get(f"/messages/{open_task.message_id}/").content.decode()
    assert 'id="cancel"' in html and 'id="task-cancel-panel"' in html
    assert 'id="cancel"' not in operator.get(f"/messages/{lost.message_id}/").content.decode()
    seen = viewer.get(f"/messages/{open_task.message_id}/").content.decode()
    assert 'id="cancel"' not in seen and 'data-not-allowed="cancel"' in seen


def test_a_task_page_leads_to_its_trace_and_an_unknown_one_is_a_404(viewer, traffic):
    open_task, _ = traffic
    response = viewer.get("/tasks/t-open/")
    assert response.status_code == 302
    assert response["Location"] == f"/messages/{open_task.message_id}/"
    assert viewer.get("/tasks/t-none/").status_code == 404
    assert viewer.get("/tasks/t%00x/").status_code == 400  # a NUL: reachconsole/error_pages.py


def test_ids_with_a_slash_are_listed_and_never_break_the_pages(viewer, operator):
    # Task and message ids are the sender's text: "/" included (A2A-over-MQTT style).
    register("fin.tax", "node-b")
    row = message_send(request=SendRequest(to="fin.tax", task_id="org/unit/t-1",
                                           timeout_ms=600_000))
    Message.objects.filter(pk=row.pk).update(message_id="m/with/slash")
    Task.objects.filter(task_id="org/unit/t-1").update(last_message_id="m/with/slash")
    html = viewer.get("/tasks/").content.decode()
    assert 'href="/tasks/org/unit/t-1/"' in html
    page = viewer.get("/tasks/org/unit/t-1/")
    assert page.status_code == 404 and "/messages/?q=org/unit/t-1" in page.content.decode()
    assert 'data-cancel="org/unit/t-1"' in operator.get("/tasks/").content.decode()
    assert operator.get("/tasks/org/unit/t-1/cancel").status_code == 200
    response = operator.post("/tasks/org/unit/t-1/cancel/confirm", {"reason": "slash"})
    assert response.status_code == 302
    assert Message.objects.get(pk=row.pk).status == Status.CANCELED


def test_the_nav_and_the_overview_lead_to_the_task_list(viewer):
    html = viewer.get("/overview/").content.decode()
    assert '<a href="/tasks/"' in html
    assert 'href="/tasks/?status=EXPIRED&amp;since=15" data-tile-link' in html
    assert 'href="/tasks/?status=TASK_ERROR&amp;since=15" data-tile-link' in html
