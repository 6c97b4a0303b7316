from django.urls import path

from roster import views

app_name = "roster"
urlpatterns = [
    path("", views.health, name="health"),
    path("agents/<agent:agent_id>/", views.agent_detail, name="agent"),
    path("agents/<agent:agent_id>/drain", views.agent_drain, name="drain"),
    path("agents/<agent:agent_id>/undrain", views.agent_undrain, name="undrain"),
    path("agents/<agent:agent_id>/deregister", views.agent_deregister, name="deregister"),
    path("cluster/", views.nodes, name="nodes"),
    path("cluster/reconcile", views.cluster_reconcile_now, name="reconcile"),
    path("cluster/nodes/<str:node_id>/drain", views.node_drain, name="node_drain"),
    path("cluster/nodes/<str:node_id>/retire", views.node_retire, name="node_retire"),
]
