"""Roles in a real browser: a viewer reads why an action is not offered and is refused one
posted anyway, with words on the page; an operator acts."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from playwright.sync_api import expect

from reachconsole.core import roles
from roster.models import Agent, ClusterNode
from tests.browser import chromium_page, sign_in
from tests.conftest import reader, register
from tests.test_roles import roles_migrate


def member(username: str, group: str) -> User:
    # A transactional test's flush empties the groups the migration made: make them again.
    if not Group.objects.filter(name=group).exists():
        roles_migrate()
    user = reader(username, password=f"pw-{username}-123")
    user.groups.add(Group.objects.get(name=group))
    return user


@pytest.mark.django_db(transaction=True)
def test_a_viewer_reads_why_and_is_refused_an_operator_is_not(live_server, async_unsafe,
                                                               settings, console_hears):
    settings.DEBUG = False
    member("vera", roles.VIEWER)
    member("otto", roles.OPERATOR)
    register("fin.tax", "node-a", capabilities=["tax"])

    with chromium_page() as page:
        sign_in(page, live_server.url, "vera", "pw-vera-123", "/agents/fin.tax/")
        why = page.locator("[data-not-allowed]")
        expect(why).to_contain_text("Only operators can drain, undrain or deregister an agent")
        expect(why).to_contain_text("add you to the operator group")
        expect(page.locator("#deregister")).to_have_count(0)

        page.goto(f"{live_server.url}/cluster/")
        expect(page.locator("[data-not-allowed]")).to_contain_text(
            "Only operators can reconcile, drain or retire nodes")
        expect(page.locator("#reconcile")).to_have_count(0)

        # A form posted anyway (an old tab, a crafted request) is refused with the words.
        page.goto(f"{live_server.url}/agents/fin.tax/")
        page.evaluate("""() => {
            const form = document.createElement('form');
            form.method = 'post';
            form.action = '/agents/fin.tax/drain';
            const token = document.createElement('input');
            token.name = 'csrfmiddlewaretoken';
            token.value = document.cookie.match(/csrftoken=([^;]+)/)[1];
            form.appendChild(token);
            document.body.appendChild(form);
            form.submit();
        }""")
        expect(page.locator("[data-error-status='403']")).to_be_visible()
        expect(page.locator("[data-error-detail]")).to_contain_text(
            roles.action_refused_words("vera"))
        assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE

        page.goto(f"{live_server.url}/audit/")
        expect(page.locator("h1")).to_have_text("Audit")  # viewers read the audit trail

    with chromium_page() as page:
        sign_in(page, live_server.url, "otto", "pw-otto-123", "/cluster/")
        expect(page.locator("#reconcile")).to_be_visible()
        expect(page.locator("[data-not-allowed]")).to_have_count(0)
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("[data-retire-node='node-a']")
        expect(page.locator("[data-retire-node='node-a']")).to_have_text("Put back in service")

        page.goto(f"{live_server.url}/audit/?actor=otto")
        expect(page.locator("#audit tbody tr[data-audit]")).to_have_count(1)
        expect(page.locator("#audit tbody")).to_contain_text("retire-node")

    assert ClusterNode.objects.get(node_id="node-a").retired
