"""The resolver page: the page an operator opens when a message went to the wrong place."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET
from django.views.decorators.vary import vary_on_headers

from directory.models import Alias, ProcessDefinitionBinding, SceneBinding
from directory.resolver import resolve
from roster.models import ClusterNode, Namespace


@require_GET
@login_required
@vary_on_headers("HX-Request")
def resolver(request: HttpRequest) -> HttpResponse:
    q = {key: request.GET.get(key, "").strip()[:200]
         for key in ("mention", "node", "pid", "scene", "namespace")}
    asked = any(q[key] for key in ("mention", "pid", "scene"))
    result = resolve(mention=q["mention"] or None, target_node_id=q["node"] or None,
                     pid=q["pid"] or None, scene_id=q["scene"] or None,
                     namespace=q["namespace"] or None) if asked else None
    context = {"q": q, "asked": asked, "result": result,
               "nodes": ClusterNode.objects.values_list("node_id", flat=True),
               "namespaces": Namespace.objects.values_list("name", flat=True)}
    if request.htmx and request.htmx.target == "resolution":
        return render(request, "directory/_resolution.html", context)
    return render(request, "directory/resolver.html", context)


@require_GET
@login_required
def agent_names(request: HttpRequest, agent_id: str) -> HttpResponse:
    """The aliases and bindings that lead to one agent (a fragment of the agent page)."""
    return render(request, "directory/_agent_names.html", {
        "agent_id": agent_id,
        "aliases": Alias.objects.select_related("namespace").filter(agent_id=agent_id),
        "scenes": SceneBinding.objects.filter(agent_id=agent_id),
        "definitions": ProcessDefinitionBinding.objects.filter(agent_id=agent_id),
        "related": Alias.objects.filter(~Q(agent_id=agent_id), alias__in=Alias.objects.filter(
            agent_id=agent_id).values("alias")),
    })
