from django.urls import path

from messages import views

app_name = "a2a"
urlpatterns = [
    path("", views.message_list, name="list"),
    path("new-count", views.message_new_count, name="new_count"),
    path("resendable", views.message_resendable, name="resendable"),
    path("export.csv", views.message_export, {"kind": "csv"}, name="export_csv"),
    path("export.jsonl", views.message_export, {"kind": "jsonl"}, name="export_jsonl"),
    path("bulk-resend", views.message_resend_bulk, name="resend_bulk"),
    path("agents/<agent:agent_id>/load/", views.agent_load, name="agent_load"),
    path("agents/<agent:agent_id>/stats/", views.agent_stats, name="agent_stats"),
    path("nodes/stats/", views.nodes_stats, name="nodes_stats"),
    path("nodes/<str:node_id>/stats/", views.node_stats, name="node_stats"),
    path("<str:message_id>/", views.message_trace, name="trace"),
    path("<str:message_id>/resend", views.message_resend_view, name="resend"),
]
