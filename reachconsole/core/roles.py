"""The console's two roles, as Django groups that `migrate` creates (core/migrations/0002_roles.py).

A viewer sees every page and may act on nothing; an operator may also resend, drain, undrain,
deregister, reconcile, and drain or retire nodes. The pages hide an action a person may not
take and say why (templates/_not_allowed.html); a direct POST is refused with the same words
(reachconsole/error_pages.py). Superusers hold every permission and need no group.
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
    ("roster", "drain_agent"),
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
