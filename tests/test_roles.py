"""Roles: the groups `viewer` and `operator` exist after migrate with the right permissions; a
viewer sees every page, reads why an action is not offered, and is refused every action
(403, with words, nothing changed); an operator acts."""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from messages.models import Message, Status
from messages.outbound import SendRequest, message_send
from reachconsole.core import roles
from reachconsole.core.audit import AuditEntry
from roster.models import Agent, ClusterNode
from tests.conftest import logged_in, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

# Every migration that grants the roles their permissions, in the order migrate runs them:
# (app label, migration, its forward function, its backward function).
MIGRATIONS = [
    ("core", "0002_roles", "roles_create", "roles_remove"),
    ("a2a", "0007_operators_cancel", "operators_may_cancel", "operators_may_not_cancel"),
    ("alarms", "0002_roles", "roles_grant", "roles_revoke"),
    ("roster", "0011_no_drain_permission", "drain_permission_drop", "drain_permission_restore"),
]


def roles_migrate(direction: str = "forward") -> None:
    """Run the roles migrations' own code again, on the models as each migration sees them
    (a flush by a transactional test also empties the groups they made); backward in the
    reverse order, as migrate would."""
    loader = MigrationLoader(connection)
    # RunPython hands its functions a schema editor; they use only its connection.
    editor = SimpleNamespace(connection=connection)
    steps = MIGRATIONS if direction == "forward" else MIGRATIONS[::-1]
    for app_label, name, forward, backward in steps:
        migration_step(loader, editor, app_label, name,
                       forward if direction == "forward" else backward, direction)


def migration_step(loader, editor, app_label: str, name: str, function: str,
                   direction: str) -> None:
    """One migration's function, on the models as migrate hands them to it: its own state
    going forward, its predecessor's going back (each of these is a lone or first RunPython)."""
    module = importlib.import_module(loader.get_migration(app_label, name).__module__)
    state_apps = loader.project_state((app_label, name), at_end=direction == "forward").apps
    getattr(module, function)(state_apps, editor)


def member(username: str, group: str) -> User:
    user = User.objects.create_user(username, password=f"pw-{username}-123")
    user.groups.add(Group.objects.get(name=group))
    return user


def granted(name: str) -> set[tuple[str, str]]:
    return {(p.content_type.app_label, p.codename)
            for p in Group.objects.get(name=name).permissions.select_related("content_type")}


@pytest.fixture
def viewer() -> Client:
    return logged_in(member("vera", roles.VIEWER))


@pytest.fixture
def operator() -> Client:
    return logged_in(member("otto", roles.OPERATOR))


@pytest.fixture
def world():
    """An agent on a node, and a failed task request that could be resent."""
    agent = register("fin.tax", "node-a", capabilities=["tax"])
    failed = message_send(request=SendRequest(to="fin.nobody", task_id="job-1"))
    assert failed.status == Status.UNDELIVERABLE
    return SimpleNamespace(agent=agent, failed=failed, node=agent.node)


# --- the groups ---------------------------------------------------------------------------------

def test_it_creates_both_groups_with_their_permissions():
    assert granted(roles.VIEWER) == set(roles.VIEWER_PERMISSIONS)
    assert granted(roles.OPERATOR) == set(roles.OPERATOR_PERMISSIONS)
    for action in ("resend_message", "change_agent", "reconcile_cluster", "manage_node"):
        assert not any(codename == action for _, codename in roles.VIEWER_PERMISSIONS)
    # One permission per action: the one nothing checked is gone (roster 0011).
    assert not Permission.objects.filter(codename="drain_agent").exists()


def test_the_migration_runs_again_changing_nothing_and_reverses():
    before = {name: granted(name) for name in (roles.VIEWER, roles.OPERATOR)}
    roles_migrate()
    assert Group.objects.filter(name__in=[roles.VIEWER, roles.OPERATOR]).count() == 2
    assert {name: granted(name) for name in before} == before

    Group.objects.create(name="auditors")
    roles_migrate("backward")
    assert list(Group.objects.values_list("name", flat=True)) == ["auditors"]
    roles_migrate()
    assert {name: granted(name) for name in before} == before


def test_reversing_the_drain_permission_migration_gives_it_back_to_operators():
    loader = MigrationLoader(connection)
    editor = SimpleNamespace(connection=connection)
    migration_step(loader, editor, "roster", "0011_no_drain_permission",
                   "drain_permission_restore", "backward")
    assert ("roster", "drain_agent") in granted(roles.OPERATOR)
    assert ("roster", "drain_agent") not in granted(roles.VIEWER)
    migration_step(loader, editor, "roster", "0011_no_drain_permission",
                   "drain_permission_drop", "forward")
    assert ("roster", "drain_agent") not in granted(roles.OPERATOR)
    assert not Permission.objects.filter(codename="drain_agent").exists()


def test_group_members_hold_exactly_their_roles_permissions():
    vera, otto = member("vera", roles.VIEWER), member("otto", roles.OPERATOR)
    for perm in ("a2a.resend_message", "roster.change_agent", "roster.reconcile_cluster",
                 "roster.manage_node"):
        assert not vera.has_perm(perm)
        assert User.objects.get(pk=otto.pk).has_perm(perm)
    assert vera.has_perm("core.view_auditentry")


# --- a viewer -----------------------------------------------------------------------------------

def pages(world) -> list[str]:
    return [
        "/", "/overview/", "/cluster/", "/messages/", "/audit/", "/directory/resolve/",
        "/alarms/", "/tasks/", "/tasks/export.csv",
        f"/agents/{world.agent.agent_id}/",
        f"/messages/agents/{world.agent.agent_id}/stats/",
        f"/messages/{world.failed.message_id}/",
        f"/messages/agents/{world.agent.agent_id}/load/",
    ]


def actions(world) -> list[tuple[str, dict]]:
    agent_id, node_id = world.agent.agent_id, world.node.node_id
    return [
        (reverse("a2a:resend", args=[world.failed.message_id]), {}),
        (reverse("a2a:resend_bulk"), {"status": "UNDELIVERABLE", "expected": "1"}),
        (reverse("roster:drain", args=[agent_id]), {}),
        (reverse("roster:undrain", args=[agent_id]), {}),
        (reverse("roster:deregister", args=[agent_id]), {}),
        (reverse("roster:reconcile"), {}),
        (reverse("roster:node_drain", args=[node_id]), {}),
        (reverse("roster:node_retire", args=[node_id]), {"retired": "1"}),
        (reverse("tasks:cancel", args=[world.failed.task_id]), {"reason": "x"}),
        (reverse("tasks:cancel_bulk"), {"status": "SENT", "up_to": "1", "reason": "x"}),
        (reverse("alarms:ack", args=[1]), {"note": "x"}),
    ]


def test_a_viewer_sees_every_page(viewer, world):
    for path in pages(world):
        response = viewer.get(path)
        assert response.status_code == 200, (path, response.status_code)


def test_a_viewer_is_refused_every_action_with_words_and_nothing_changes(viewer, world):
    rows, audit = Message.objects.count(), AuditEntry.objects.count()
    words = escape(roles.action_refused_words("vera"))
    for path, form in actions(world):
        response = viewer.post(path, form)
        assert response.status_code == 403, (path, response.status_code)
        assert words in response.content.decode(), path
    agent = Agent.objects.get(agent_id=world.agent.agent_id)
    assert agent.status == Agent.Status.ONLINE
    assert not ClusterNode.objects.get(node_id=world.node.node_id).retired
    assert Message.objects.count() == rows
    assert AuditEntry.objects.count() == audit  # a refused permission changed nothing to audit


def test_a_viewer_reads_why_each_action_is_missing(viewer, world):
    trace = viewer.get(f"/messages/{world.failed.message_id}/").content.decode()
    assert 'id="resend"' not in trace
    assert 'data-not-allowed="resend"' in trace
    assert "Only operators can resend; you are signed in as vera" in trace
    assert "add you to the operator group" in trace

    listing = viewer.get("/messages/").content.decode()
    assert 'id="bulk-resend"' not in listing and "data-not-allowed=" in listing

    agent = viewer.get(f"/agents/{world.agent.agent_id}/").content.decode()
    assert 'id="deregister"' not in agent
    load = viewer.get(f"/messages/agents/{world.agent.agent_id}/load/").content.decode()
    assert 'id="drain"' not in load
    assert "Only operators can drain, undrain or deregister an agent" in agent

    cluster = viewer.get("/cluster/").content.decode()
    assert 'id="reconcile"' not in cluster and "data-drain-node" not in cluster
    assert "Only operators can reconcile, drain or retire nodes" in cluster


def test_a_person_in_no_group_reads_nothing_and_is_told_whom_to_ask(world):
    """An account in no group read every page and exported every row."""
    User.objects.create_superuser("ada", password="pw-ada-12345")
    nobody = logged_in(User.objects.create_user("nora", password="pw-nora-123"))
    words = escape(roles.no_role_words("nora", ["ada"]))
    assert "Ask an administrator (ada) to add you to the viewer group" in roles.no_role_words(
        "nora", ["ada"])
    for path in [*pages(world), "/messages/export.jsonl", "/messages/export.csv",
                 "/tasks/export.jsonl"]:
        response = nobody.get(path)
        assert response.status_code == 403, (path, response.status_code)
        body = response.content.decode()
        assert words in body, path
        assert world.failed.message_id not in body, path
    fragment = nobody.get("/overview/", headers={"HX-Request": "true",
                                                 "HX-Target": "overview-live"})
    assert fragment.status_code == 403 and "<html" not in fragment.content.decode()
    drain = nobody.post(reverse("roster:drain", args=[world.agent.agent_id]))
    assert drain.status_code == 403 and words in drain.content.decode()
    assert Agent.objects.get(agent_id=world.agent.agent_id).status == Agent.Status.ONLINE
    # Signing in and out stays open to it; an anonymous visitor is still sent to sign in.
    assert nobody.get("/accounts/login/").status_code == 200
    assert Client().get("/overview/").status_code == 302


def test_a_refusal_to_htmx_is_a_fragment_with_the_words(viewer, world):
    response = viewer.post(reverse("roster:reconcile"), headers={"HX-Request": "true"})
    assert response.status_code == 403
    html = response.content.decode()
    assert "<html" not in html and escape(roles.action_refused_words("vera")) in html


# --- an operator --------------------------------------------------------------------------------

def test_an_operator_sees_the_actions_and_no_refusal(operator, world):
    trace = operator.get(f"/messages/{world.failed.message_id}/").content.decode()
    assert 'id="resend"' in trace and "data-not-allowed" not in trace
    agent = operator.get(f"/agents/{world.agent.agent_id}/").content.decode()
    assert 'id="deregister"' in agent and "data-not-allowed" not in agent
    # Drain sits beside its preview, in the fragment the agent page loads.
    load = operator.get(f"/messages/agents/{world.agent.agent_id}/load/").content.decode()
    assert 'id="drain"' in load
    cluster = operator.get("/cluster/").content.decode()
    assert 'id="reconcile"' in cluster and "data-not-allowed" not in cluster


def test_an_operator_acts(operator, world):
    register("fin.nobody", "node-b")
    agent_id, node_id = world.agent.agent_id, world.node.node_id
    assert operator.post(reverse("a2a:resend", args=[world.failed.message_id])).status_code == 302
    assert Message.objects.filter(resend_of=world.failed).exists()

    assert operator.post(reverse("roster:drain", args=[agent_id])).status_code == 302
    assert Agent.objects.get(agent_id=agent_id).status == Agent.Status.DRAINING
    assert operator.post(reverse("roster:undrain", args=[agent_id])).status_code == 302
    assert Agent.objects.get(agent_id=agent_id).status == Agent.Status.ONLINE

    assert operator.post(reverse("roster:reconcile")).status_code == 302
    assert operator.post(reverse("roster:node_retire", args=[node_id]),
                         {"retired": "1"}).status_code == 302
    assert ClusterNode.objects.get(node_id=node_id).retired
    assert operator.post(reverse("roster:deregister", args=[agent_id])).status_code == 302
    assert not Agent.objects.filter(agent_id=agent_id).exists()

    done = set(AuditEntry.objects.filter(actor="otto").values_list("action", "result"))
    assert {("resend", "ok"), ("drain", "ok"), ("deregister", "ok"),
            ("retire-node", "ok")} <= done


def test_a_refused_action_is_one_log_line_without_a_traceback(viewer, world, caplog):
    with caplog.at_level(logging.WARNING, logger="django.request"):
        response = viewer.post(reverse("roster:drain", args=[world.agent.agent_id]))
    assert response.status_code == 403
    refusals = [r for r in caplog.records if r.name == "django.request"]
    assert [r.getMessage() for r in refusals] == [
        f"Forbidden (Permission denied): /agents/{world.agent.agent_id}/drain"]
    assert refusals[0].exc_info is None and "Traceback" not in caplog.text
