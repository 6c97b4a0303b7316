"""The one-process console's URLs (runconsole): the console's own, and /practice/."""

from django.urls import include, path

from reachconsole.dev import practice
from reachconsole.urls import urlpatterns as console_urlpatterns

practice_patterns = ([
    path("", practice.practice, name="page"),
    path("nodes/<str:node_id>/stop/", practice.node_switch, {"to": "stop"}, name="node-stop"),
    path("nodes/<str:node_id>/start/", practice.node_switch, {"to": "start"},
         name="node-start"),
    path("agents/<agent:agent_id>/fault/", practice.agent_fault, name="fault"),
], "practice")

urlpatterns = [path("practice/", include(practice_patterns)), *console_urlpatterns]
