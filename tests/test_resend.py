"""Resend: a bound token stays inside its namespaces, a group send is resent to the group's
members, and a bulk resend is all or nothing, audited, on the page and over the API."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils.html import escape

from messages.models import Message, Status
from messages.outbound import (
    SendRefused,
    SendRequest,
    message_send,
    messages_resend,
    messages_send_group,
)
from messages.selectors import newest_message_id
from reachconsole.core.audit import AuditEntry
from roster.models import Agent, Namespace
from tests.conftest import FIN_TOKEN, ApiClient, logged_in, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


@pytest.fixture
def operator() -> Client:
    return logged_in(staff_user("olga", "resend_message"))


@pytest.fixture
def fin() -> ApiClient:
    """A token bound to the namespaces fin and llm."""
    return ApiClient(token=FIN_TOKEN)


def _open(name: str) -> None:
    Namespace.objects.update_or_create(name=name, defaults={"open_to_other_namespaces": True})


# --- one tenant per token ---------------------------------------------------------------------

def test_a_bound_token_cannot_resend_a_capability_send_into_another_namespace(fin):
    # fin.me asked for `tax` while no agent offered it: UNDELIVERABLE, no toAgentId.
    register("fin.me", "node-a")
    sent = fin.post("/api/a2a/send", {"to": "capability:tax", "from": "fin.me"})
    assert sent.status_code == 200 and sent.json()["status"] == "UNDELIVERABLE"
    # Now only hr.tax, in an open namespace, offers it.
    _open("hr")
    register("hr.tax", "node-h", capabilities=["tax"])
    r = fin.post(f"/api/a2a/messages/{sent.json()['messageId']}/resend")
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "UNDELIVERABLE"
    assert r.json()["toAgentId"] != "hr.tax" and "hr." not in r.content.decode()
    assert not Message.objects.filter(to_agent_id="hr.tax").exists()
    # Once fin has its own, the resend goes there.
    register("fin.tax", "node-a", capabilities=["tax"])
    again = fin.post(f"/api/a2a/messages/{sent.json()['messageId']}/resend")
    assert again.status_code == 202 and again.json()["toAgentId"] == "fin.tax"


def test_an_unbound_caller_routes_a_capability_into_open_namespaces(api):
    """The same send without a bound token: the open namespace is in reach (the control)."""
    register("fin.me", "node-a")
    _open("hr")
    register("hr.tax", "node-h", capabilities=["tax"])
    r = api.post("/api/a2a/send", {"to": "capability:tax", "from": "fin.me"})
    assert r.status_code == 202 and r.json()["toAgentId"] == "hr.tax"


def test_a_bound_tokens_retry_stays_inside_its_namespaces(fin):
    """The restriction travels with the task: an automatic retry or an operator's resend of a
    bound token's send is kept inside it too."""
    register("fin.me", "node-a")
    sent = fin.post("/api/a2a/send", {"to": "capability:tax", "from": "fin.me"}).json()
    row = Message.objects.get(message_id=sent["messageId"])
    assert row.resolution["within"] == ["fin", "llm"]
    _open("hr")
    register("hr.tax", "node-h", capabilities=["tax"])
    by_operator = messages_resend(message_ids=[row.message_id], by="ops")[0]
    assert by_operator.status == Status.UNDELIVERABLE and by_operator.to_agent_id != "hr.tax"


def test_a_bound_token_cannot_resend_another_namespaces_message(fin):
    register("hr.me", "node-h")
    row = message_send(request=SendRequest(to="hr.payroll", from_agent_id="hr.me"))
    assert row.status == Status.UNDELIVERABLE
    register("hr.payroll", "node-h")
    r = fin.post(f"/api/a2a/messages/{row.message_id}/resend")
    assert r.status_code == 403 and r.json()["error"] == "namespace_forbidden"
    assert "hr.payroll" not in r.json()["detail"]
    assert Message.objects.count() == 1
    assert AuditEntry.objects.get(action="resend").result == "refused"


def test_a_bound_token_cannot_reach_outside_by_mention(fin):
    register("fin.me", "node-a")
    register("hr.payroll", "node-h", capabilities=["payroll"])
    for mention in ("@hr.payroll", "@payroll"):
        r = fin.post("/api/a2a/send", {"to": mention, "from": "fin.me"})
        assert r.status_code == 200 and r.json()["status"] == "UNDELIVERABLE"
        assert r.json()["candidates"] == [] and "node-h" not in r.content.decode()
    assert not Message.objects.filter(to_agent_id="hr.payroll").exists()


# --- a group send that reached nobody ----------------------------------------------------------

def _memberless_group_send() -> Message:
    rows = messages_send_group(group="#night", request=SendRequest(to="#night", task_id="job-n"))
    assert len(rows) == 1 and rows[0].status == Status.UNDELIVERABLE
    assert rows[0].to_agent_id == "#night"
    return rows[0]


def test_resending_a_memberless_group_send_from_the_trace_is_refused_in_words(operator):
    row = _memberless_group_send()
    r = operator.post(f"/messages/{row.message_id}/resend", follow=True)
    assert r.status_code == 200
    assert "still has no member that can take work" in r.content.decode()
    assert Message.objects.count() == 1
    assert AuditEntry.objects.get(action="resend").result == "refused"


def test_resending_a_memberless_group_send_reaches_the_members_it_has_now(operator, api):
    row = _memberless_group_send()
    register("ops.a", "node-a", groups=["#night"])
    register("ops.b", "node-b", groups=["#night"])
    r = api.post(f"/api/a2a/messages/{row.message_id}/resend")
    assert r.status_code == 202, r.content
    assert r.json()["status"] == "FANNED_OUT"
    again = Message.objects.filter(resend_of=row)
    assert sorted(again.values_list("to_agent_id", flat=True)) == ["ops.a", "ops.b"]
    assert {m.task_id for m in again} == {"job-n"}
    assert len({m.idempotency_key for m in again}) == 2  # each member runs its own copy
    assert set(again.values_list("status", flat=True)) == {Status.SENT}


# --- bulk: all or nothing ------------------------------------------------------------------------

FILTERS = {"status": "UNDELIVERABLE", "since": "60", "direction": "", "q": "", "agent": ""}


def test_a_bulk_resend_with_one_refusal_resends_nothing_and_says_which(operator):
    plain = [message_send(request=SendRequest(to="fin.tax")) for _ in range(3)]
    group = _memberless_group_send()
    register("fin.tax", "node-b")
    r = operator.post("/messages/bulk-resend", {**FILTERS, "expected": "4",
                                                "up_to": newest_message_id()}, follow=True)
    html = r.content.decode()
    assert r.status_code == 200
    assert "nothing was resent" in html and group.message_id in html
    assert Message.objects.filter(resend_of__isnull=False).count() == 0
    assert all(Message.objects.get(pk=p.pk).status == Status.UNDELIVERABLE for p in plain)
    refused = AuditEntry.objects.get(action="resend-bulk")
    assert refused.result == "refused" and group.message_id in refused.detail


def test_a_bulk_resend_that_can_go_resends_all_and_audits_each(operator):
    plain = [message_send(request=SendRequest(to="fin.tax")) for _ in range(3)]
    group = _memberless_group_send()
    register("fin.tax", "node-b")
    register("ops.a", "node-a", groups=["#night"])
    r = operator.post("/messages/bulk-resend", {**FILTERS, "expected": "4",
                                                "up_to": newest_message_id()}, follow=True)
    assert "Resent 4 messages as 4 new transmissions" in r.content.decode()
    assert Message.objects.filter(resend_of__in=plain, status=Status.SENT).count() == 3
    assert Message.objects.get(resend_of=group).to_agent_id == "ops.a"
    assert AuditEntry.objects.filter(action="resend", result="ok").count() == 4
    bulk = AuditEntry.objects.get(action="resend-bulk")
    assert bulk.result == "ok" and "UNDELIVERABLE" in bulk.detail  # the filters are recorded


def test_a_storm_refusal_in_a_bulk_resend_leaves_everything_as_it_was(settings):
    # Two transmissions of job-s to fin.tax are on record: one more is allowed, not two.
    settings.REACH_TASK_MAX_SENDS = 3
    register("fin.tax", "node-b")
    Agent.objects.filter(agent_id="fin.tax").update(status=Agent.Status.DRAINING)
    first = message_send(request=SendRequest(to="fin.tax", task_id="job-s"))
    second = message_send(request=SendRequest(to="fin.tax", task_id="job-s"))
    assert first.status == second.status == Status.UNDELIVERABLE
    Agent.objects.filter(agent_id="fin.tax").update(status=Agent.Status.ONLINE)
    with pytest.raises(SendRefused) as refused:
        messages_resend(message_ids=[first.message_id, second.message_id], by="ops")
    assert refused.value.code == "retry_storm"
    assert refused.value.detail.startswith("nothing was resent")
    assert Message.objects.count() == 2


def test_a_bound_tokens_retry_never_resolves_outside_and_the_sweep_goes_on(fin, now, settings):
    """A mention retried after its agent left: the directory looks only inside the token's
    namespaces, so the attempt ends UNDELIVERABLE with words, and the sweep carries on."""
    from datetime import timedelta

    from messages.sweeps import deliveries_sweep
    from tests.conftest import published

    register("fin.me", "node-a")
    register("fin.tax", "node-a", capabilities=["tax"])
    sent = fin.post("/api/a2a/send", {"to": "@tax", "from": "fin.me", "timeoutMs": 600_000})
    row = Message.objects.get(message_id=sent.json()["messageId"])
    assert row.to_agent_id == "fin.tax"
    published(row, now)
    # Gone (its lease lapsed), not draining: a draining agent still takes the retries of work
    # accepted for it (tests/test_drain.py).
    Agent.objects.filter(agent_id="fin.tax").update(status=Agent.Status.OFFLINE)
    _open("ops")
    register("ops.tax", "node-b", capabilities=["tax"])  # live, but not the token's
    moment = now + timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS + 1)
    deliveries_sweep(now=moment)
    deliveries_sweep(now=moment + timedelta(seconds=5))
    attempts = Message.objects.filter(task_id=row.task_id).order_by("id")
    assert not attempts.filter(to_agent_id="ops.tax").exists()
    assert attempts.last().status in (Status.UNDELIVERABLE, Status.RETRIED)
    assert Message.objects.get(pk=row.pk).status == Status.UNDELIVERABLE


def test_wait_answers_with_this_sends_own_task_not_another_callers(fin, api):
    """A task id is the caller's to choose: waiting on it must not hand back the response
    of someone else's task that happens to carry the same id."""
    theirs = api.post("/api/a2a/send", {"to": "ops.probe", "taskId": "job-shared", "wait": True})
    assert theirs.status_code == 200 and theirs.json()["response"]["ok"] is True
    register("fin.x", "node-a")
    mine = fin.post("/api/a2a/send", {"to": "fin.x", "taskId": "job-shared", "wait": True,
                                      "timeoutMs": 100})
    assert mine.status_code == 202, mine.content
    assert mine.json()["toAgentId"] == "fin.x" and "response" not in mine.json()
    assert "ops.probe" not in mine.content.decode()


def test_a_bound_token_reads_no_other_namespace_in_a_message_routed_for_someone_else(fin, api):
    register("fin.me", "node-a")
    _open("hr")
    register("hr.tax", "node-h", capabilities=["tax"])
    Agent.objects.filter(agent_id="hr.tax").update(status=Agent.Status.DRAINING)
    sent = api.post("/api/a2a/send", {"to": "capability:tax", "from": "fin.me"}).json()
    assert sent["status"] == "UNDELIVERABLE" and "hr.tax" in api.get(
        f"/api/a2a/messages/{sent['messageId']}").content.decode()  # the operator sees all
    r = fin.get(f"/api/a2a/messages/{sent['messageId']}")
    assert r.status_code == 200
    assert "hr.tax" not in r.content.decode() and "node-h" not in r.content.decode()
    assert "(an agent of another namespace)" in r.json()["error"]


def test_a_bulk_resend_that_fails_again_says_so_and_why(operator):
    """All of them to an agent that still cannot take work: the result said "Resent 3 …"
    as a success, although every new transmission ended UNDELIVERABLE at once."""
    plain = [message_send(request=SendRequest(to="fin.gone")) for _ in range(3)]
    assert {p.status for p in plain} == {Status.UNDELIVERABLE}
    r = operator.post("/messages/bulk-resend", {**FILTERS, "expected": "3",
                                                "up_to": newest_message_id()}, follow=True)
    html = r.content.decode()
    again = Message.objects.filter(resend_of__in=plain)
    assert again.count() == 3 and {m.status for m in again} == {Status.UNDELIVERABLE}
    assert '<li class="error">' in html
    assert "Resent 3 messages as 3 new transmissions: 3 ended UNDELIVERABLE at once" in html
    assert f"3 × {escape(again.first().error)}" in html and "none went out" in html


def test_a_bulk_resend_that_partly_fails_says_how_many_went(operator):
    register("fin.tax", "node-b")
    gone = message_send(request=SendRequest(to="fin.gone"))
    away = message_send(request=SendRequest(to="fin.away"))
    register("fin.away", "node-c")  # back now: its resend goes out
    r = operator.post("/messages/bulk-resend", {**FILTERS, "expected": "2",
                                                "up_to": newest_message_id()}, follow=True)
    html = r.content.decode()
    assert Message.objects.get(resend_of=away).status == Status.SENT
    assert Message.objects.get(resend_of=gone).status == Status.UNDELIVERABLE
    assert '<li class="warning">' in html
    assert "1 ended UNDELIVERABLE at once" in html and "; 1 went out." in html
