"""The admin edits namespaces and aliases through the same checks and audit as the services,
and leaves to registration what only registration may set."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.utils.html import escape

from directory import errors as directory_errors
from directory.models import Alias
from reachconsole.core.audit import AuditEntry
from roster import errors as roster_errors
from roster.models import Agent, ClusterNode, Namespace, RosterEvent
from tests.conftest import reader, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


@pytest.fixture
def staff() -> Client:
    """A staff member with the model permissions of the roster and the directory (not a
    superuser: what the admin offers is what permissions and the model admins allow)."""
    user = reader("sam", password="pw-sam-123", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(
        content_type__app_label__in=["roster", "directory"]))
    client = Client()
    client.force_login(user)
    return client


def audit_rows(action: str) -> list[tuple]:
    return list(AuditEntry.objects.filter(action=action).order_by("id")
                .values_list("actor", "target", "result", "detail"))


def test_a_namespace_is_added_with_its_name_checked_and_audited(staff):
    r = staff.post("/admin/roster/namespace/add/", {"name": "Fin Team", "description": ""})
    assert r.status_code == 200  # the form again, with the error
    assert escape(roster_errors.NAMESPACE_INVALID.format(raw="Fin Team")) in r.content.decode()
    assert not Namespace.objects.exists() and not AuditEntry.objects.exists()

    r = staff.post("/admin/roster/namespace/add/", {"name": "fin", "description": "finance"})
    assert r.status_code == 302
    assert Namespace.objects.get().name == "fin"
    assert audit_rows("namespace_create") == [
        ("sam", "fin", "ok", "open_to_other_namespaces=False")]


def test_a_namespace_keeps_its_name(staff):
    register("fin.tax")
    ns = Namespace.objects.get(name="fin")
    r = staff.post(f"/admin/roster/namespace/{ns.pk}/change/",
                   {"name": "finance", "description": "renamed?"})
    assert r.status_code == 302
    ns.refresh_from_db()
    # Agent ids begin with the namespace: a rename would orphan every agent in it.
    assert ns.name == "fin" and ns.description == "renamed?"
    assert audit_rows("namespace_update") == [("sam", "fin", "ok", "description changed")]


def test_isolation_flips_in_the_list_are_audited(staff):
    fin = Namespace.objects.create(name="fin")
    llm = Namespace.objects.create(name="llm")
    r = staff.post("/admin/roster/namespace/", {
        "form-TOTAL_FORMS": "2", "form-INITIAL_FORMS": "2",
        "form-0-id": fin.pk, "form-0-open_to_other_namespaces": "on",
        "form-1-id": llm.pk,
        "_save": "Save",
    })
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Namespace.objects.get(name="fin").open_to_other_namespaces is True
    assert audit_rows("namespace_update") == [
        ("sam", "fin", "ok", "open_to_other_namespaces False → True")]


def test_isolation_flips_by_bulk_action_are_audited(staff):
    fin = Namespace.objects.create(name="fin")
    llm = Namespace.objects.create(name="llm", open_to_other_namespaces=True)
    r = staff.post("/admin/roster/namespace/", {
        "action": "open_selected", "_selected_action": [fin.pk, llm.pk],
    })
    assert r.status_code == 302
    assert set(Namespace.objects.values_list("name", "open_to_other_namespaces")) == {
        ("fin", True), ("llm", True)}
    # llm was open already: nothing changed, nothing to audit for it.
    assert audit_rows("namespace_update") == [
        ("sam", "fin", "ok", "open_to_other_namespaces False → True")]
    staff.post("/admin/roster/namespace/", {
        "action": "close_selected", "_selected_action": [fin.pk, llm.pk]})
    assert not Namespace.objects.filter(open_to_other_namespaces=True).exists()
    assert len(audit_rows("namespace_update")) == 3


def test_deleting_a_namespace_is_audited(staff):
    ns = Namespace.objects.create(name="old")
    r = staff.post("/admin/roster/namespace/", {
        "action": "delete_selected", "_selected_action": [ns.pk], "post": "yes"})
    assert r.status_code == 302
    assert not Namespace.objects.exists()
    assert audit_rows("namespace_delete") == [("sam", "old", "ok", "")]


def test_an_invalid_alias_is_refused_with_the_form_error(staff):
    ns = Namespace.objects.create(name="fin")
    Namespace.objects.create(name="ops")
    cases = [
        ({"alias": "@", "agent_id": "fin.tax"}, directory_errors.ALIAS_EMPTY),
        ({"alias": "tax\nday", "agent_id": "fin.tax"}, directory_errors.ALIAS_CONTROL),
        ({"alias": "税", "agent_id": "fin tax"},
         roster_errors.AGENT_ID_INVALID.format(raw="fin tax", help=roster_errors.AGENT_ID_HELP)),
        ({"alias": "税", "agent_id": "hr.tax"},
         directory_errors.ALIAS_NO_NAMESPACE.format(agent_id="hr.tax", namespace="hr")),
    ]
    for fields, words in cases:
        r = staff.post("/admin/directory/alias/add/", {**fields, "namespace": ns.pk})
        assert r.status_code == 200, fields
        assert escape(words) in r.content.decode(), fields
    assert not Alias.objects.exists() and not AuditEntry.objects.exists()


def test_a_duplicate_alias_is_refused_with_words(staff):
    ns = Namespace.objects.create(name="fin")
    staff.post("/admin/directory/alias/add/", {"alias": "税", "agent_id": "fin.tax",
                                                "namespace": ns.pk})
    r = staff.post("/admin/directory/alias/add/", {"alias": "@税", "agent_id": "fin.vat",
                                                    "namespace": ns.pk})
    assert r.status_code == 200
    assert escape(directory_errors.ALIAS_TAKEN.format(
        alias="税", namespace="fin", agent_id="fin.tax")) in r.content.decode()
    assert Alias.objects.count() == 1


def test_a_valid_alias_edit_is_audited(staff):
    register("fin.tax", "node-a")
    register("fin.bank-statement", "node-a")
    ns = Namespace.objects.get(name="fin")
    r = staff.post("/admin/directory/alias/add/", {"alias": "@资金日报", "agent_id": "fin/tax",
                                                    "namespace": ns.pk})
    assert r.status_code == 302
    alias = Alias.objects.get()
    assert (alias.alias, alias.agent_id) == ("资金日报", "fin.tax")  # normalized
    r = staff.post(f"/admin/directory/alias/{alias.pk}/change/", {
        "alias": "资金日报", "agent_id": "fin.bank-statement", "namespace": ns.pk})
    assert r.status_code == 302
    assert Alias.objects.get().agent_id == "fin.bank-statement"
    staff.post("/admin/directory/alias/", {
        "action": "delete_selected", "_selected_action": [alias.pk], "post": "yes"})
    assert not Alias.objects.exists()
    assert [row[:3] for row in audit_rows("alias_create") + audit_rows("alias_update")
            + audit_rows("alias_delete")] == [
        ("sam", "fin:资金日报", "ok"), ("sam", "fin:资金日报", "ok"), ("sam", "fin:资金日报", "ok")]
    assert audit_rows("alias_update")[0][3] == "agent_id fin.tax → fin.bank-statement"


def test_an_alias_takes_its_agents_namespace_and_says_when_the_agent_is_not_registered(
        staff):
    """The admin saved `nobody → fin.nosuchagent` without a word and the audit said ok; its
    Namespace field was required although it can only be the agent's."""
    Namespace.objects.create(name="fin")
    form = staff.get("/admin/directory/alias/add/").content.decode()
    assert 'name="namespace"' not in form
    r = staff.post("/admin/directory/alias/add/", {"alias": "nobody",
                                                    "agent_id": "fin.nosuchagent"},
                   follow=True)
    assert r.status_code == 200
    assert escape(directory_errors.ALIAS_NOT_REGISTERED.format(
        agent_id="fin.nosuchagent", alias="nobody")) in r.content.decode()
    alias = Alias.objects.get()
    assert (alias.alias, alias.agent_id, alias.namespace.name) == (
        "nobody", "fin.nosuchagent", "fin")
    assert audit_rows("alias_create") == [
        ("sam", "fin:nobody", "ok", "→ fin.nosuchagent (not on the roster)")]
    register("fin.tax", "node-a")
    r = staff.post("/admin/directory/alias/add/", {"alias": "税", "agent_id": "fin.tax"},
                   follow=True)
    assert "is on the roster" not in r.content.decode() and "resolves to nothing" not in \
        r.content.decode()
    assert audit_rows("alias_create")[-1][3] == "→ fin.tax"


def test_registration_only_fields_of_an_agent_are_read_only(staff):
    register("fin.tax", "node-a", capabilities=["tax"], groups=["finance"], max_inflight=4,
             metadata={"region": "eu"}, owner="alice")
    agent = Agent.objects.get()
    before = {f: getattr(agent, f) for f in ("capabilities", "groups", "metadata",
                                             "max_inflight", "owner", "node_id",
                                             "lease_expires_at", "status")}
    other = ClusterNode.objects.create(node_id="node-z")
    page = staff.get(f"/admin/roster/agent/{agent.pk}/change/")
    assert page.status_code == 200
    assert 'name="capabilities"' not in page.content.decode()
    r = staff.post(f"/admin/roster/agent/{agent.pk}/change/", {
        "capabilities": '["tax", "everything"]', "groups": '["#root"]', "metadata": "{}",
        "max_inflight": "100000", "owner": "mallory", "node": other.pk,
        "status": "ONLINE", "lease_expires_at_0": "2099-01-01", "lease_expires_at_1": "00:00",
    })
    assert r.status_code == 403
    agent.refresh_from_db()
    assert {f: getattr(agent, f) for f in before} == before
    assert staff.get("/admin/roster/agent/add/").status_code == 403


def test_removing_an_agent_in_the_admin_is_a_deregistration(staff):
    register("fin.tax", "node-a")
    agent = Agent.objects.get()
    r = staff.post("/admin/roster/agent/", {
        "action": "delete_selected", "_selected_action": [agent.pk], "post": "yes"})
    assert r.status_code == 302
    assert not Agent.objects.exists()
    assert RosterEvent.objects.filter(agent_id="fin.tax", kind="DEREGISTERED",
                                      actor="sam").exists()
    assert audit_rows("deregister") == [("sam", "fin.tax", "ok", "from node-a")]


def test_the_favicon_browsers_ask_every_page_for_is_there(staff):
    """The admin's pages name no icon, so the browser asks for /favicon.ico: not a 404."""
    page = staff.get("/admin/")
    assert page.status_code == 200 and b'rel="icon"' not in page.content
    icon = staff.get("/favicon.ico", follow=True)
    assert icon.status_code == 200, icon.redirect_chain
    assert icon["Content-Type"] == "image/svg+xml"
    assert b"<svg" in b"".join(icon.streaming_content)
