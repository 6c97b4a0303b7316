"""`/practice/`: make things go wrong on purpose in `make run`'s simulated cluster, while it
runs: stop and start one node, make one agent slow, failing or silent.

Only the one-process console serves it (runconsole mounts reachconsole/dev/urls.py): the
cluster it acts on is a thread of that process. Production has no simulated cluster and no
such page. Operators only, and every change is audited like any other action.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from reachconsole.core.audit import audit_record
from reachconsole.dev.simulator import FAULTS, SimulatedCluster

_cluster: SimulatedCluster | None = None


def practice_offer(cluster: SimulatedCluster | None) -> None:
    """The cluster /practice/ acts on (runconsole's own), or None."""
    global _cluster
    _cluster = cluster


def _refused(request: HttpRequest, status: int, title: str, detail: str) -> HttpResponse:
    return render(request, "errors/error.html",
                  {"status": status, "title": title, "detail": detail}, status=status)


def _partial(request: HttpRequest) -> bool:
    return bool(request.headers.get("HX-Request") and not request.headers.get("HX-Boosted"))


def _page(request: HttpRequest, done: str = "") -> HttpResponse:
    if _cluster is None:
        return _refused(request, 404, "No simulated cluster",
                        "This console runs no simulated cluster (make run --simulate-nodes 0?): "
                        "there is nothing to stop or slow down here. manage.py simulate has "
                        "the same faults as flags.")
    nodes = [{"node_id": n.node_id, "alive": n.alive,
              "agents": [{"agent_id": a.agent_id, "fault": a.fault} for a in n.agents]}
             for n in _cluster.nodes]
    template = "practice/_cluster.html" if _partial(request) else "practice/page.html"
    return render(request, template, {"nodes": nodes, "faults": FAULTS, "done": done})


@require_GET
@login_required
def practice(request: HttpRequest) -> HttpResponse:
    return _page(request)


def _done(request: HttpRequest, *, action: str, target: str, words: str) -> HttpResponse:
    audit_record(actor=request.user.get_username(), action=action, target=target,
                 detail=words)
    if _partial(request):
        return _page(request, done=words)
    messages.success(request, words)
    return redirect("practice:page")


@require_POST
@login_required
@permission_required("roster.manage_node", raise_exception=True)
def node_switch(request: HttpRequest, node_id: str, to: str) -> HttpResponse:
    if _cluster is None:
        return _page(request)
    try:
        (_cluster.node_start if to == "start" else _cluster.node_stop)(node_id)
    except KeyError as exc:
        return _refused(request, 404, "No such simulated node", exc.args[0])
    words = (f"{node_id} started again: it connects and heartbeats." if to == "start" else
             f"{node_id} stopped: no heartbeats, no answers. Its agents go STALE within two "
             "heartbeats, then OFFLINE when their lease runs out; work sent to them fails.")
    return _done(request, action=f"practice_node_{to}", target=node_id, words=words)


@require_POST
@login_required
@permission_required("roster.manage_node", raise_exception=True)
def agent_fault(request: HttpRequest, agent_id: str) -> HttpResponse:
    if _cluster is None:
        return _page(request)
    fault = request.POST.get("fault", "")
    try:
        _cluster.agent_fault(agent_id, fault)
    except (KeyError, ValueError) as exc:
        return _refused(request, 404 if isinstance(exc, KeyError) else 400, "Not changed",
                        exc.args[0])
    words = f"{agent_id} now {FAULTS[fault]}."
    return _done(request, action="practice_agent_fault", target=agent_id, words=words)
