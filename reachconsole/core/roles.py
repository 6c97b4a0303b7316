"""The console's two roles, as Django groups that `migrate` creates (core/migrations/0002_roles.py).

Reading the console is the viewer's permission: an account with neither role (nor one of
their permissions of its own) sees one page that says whom to ask (reachconsole/readers.py), and
the exports and the streams refuse it. A viewer sees every page and may act on nothing; an
operator may also resend, drain, undrain, deregister, reconcile, and drain or retire nodes.
The pages hide an action a person may not take and say why (templates/_not_allowed.html); a
direct POST is refused with the same words (reachconsole/error_pages.py). Superusers hold
every permission and need no group.
"""

from __future__ import annotations

VIEWER = "viewer"
OPERATOR = "operator"

# (app label, codename). The migration keeps its own frozen copy of these lists, as
# migrations must; tests/test_roles.py holds the two together.
VIEWER_PERMISSIONS = [
    ("core", "view_auditentry"),
    ("roster", "view_agent"),
    ("roster", "view_clusternode"),
    ("a2a", "view_message"),
    ("alarms", "view_alarm"),         # alarms/migrations/0002_roles.py
]
OPERATOR_PERMISSIONS = VIEWER_PERMISSIONS + [
    ("a2a", "resend_message"),
    ("a2a", "cancel_task"),           # cancel a task, or a filtered set of open tasks
    ("roster", "change_agent"),       # drain, undrain, deregister one agent
    ("roster", "reconcile_cluster"),
    ("roster", "manage_node"),        # drain or retire a whole node
    ("alarms", "acknowledge_alarm"),
]

ACTION_REFUSED = (
    "Only operators can act on the console (resend, drain, undrain, deregister, reconcile, "
    "drain or retire nodes, acknowledge alarms). You are signed in as {user}, who may look "
    "but not act: an operator or an admin can add you to the operator group."
)


def action_refused_words(username: str) -> str:
    """Why a signed-in person was refused an action: the words of a 403 on a page's POST."""
    return ACTION_REFUSED.format(user=username or "an account without a name")


NO_ROLE = (
    "You are signed in as {user}, an account with no role in this console: it may neither "
    "look nor act. Ask {whom} to add you to the viewer group (to look) or the operator group "
    "(to look and act)."
)
# Any of a role's permissions: one granted a permission to act was meant to see what it acts on.
_READ_PERMISSIONS = frozenset(f"{app}.{codename}" for app, codename in OPERATOR_PERMISSIONS)


def may_read(user) -> bool:
    """Whether a signed-in person may read the console: a superuser, or an account that holds
    one of the roles' permissions (through a role, or granted itself)."""
    if not user.is_active:
        return False
    if user.is_superuser:
        return True
    return not _READ_PERMISSIONS.isdisjoint(user.get_all_permissions())


def no_role_words(username: str, administrators: list[str]) -> str:
    whom = ("an administrator" if not administrators else
            "an administrator (" + ", ".join(administrators) + ")")
    return NO_ROLE.format(user=username or "an account without a name", whom=whom)
