from django.urls import path

from messages import task_views

app_name = "tasks"
urlpatterns = [
    path("", task_views.task_list, name="list"),
    path("export.csv", task_views.task_export, {"kind": "csv"}, name="export_csv"),
    path("export.jsonl", task_views.task_export, {"kind": "jsonl"}, name="export_jsonl"),
    path("cancelable", task_views.task_cancelable, name="cancelable"),
    path("bulk-cancel", task_views.task_cancel_bulk, name="cancel_bulk"),
    # A task id is any text a sender chose, "/" included (the A2A-over-MQTT ids have them).
    path("<path:task_id>/cancel/confirm", task_views.task_cancel_view, name="cancel"),
    path("<path:task_id>/cancel", task_views.task_cancel_preview, name="cancel_preview"),
    path("<path:task_id>/", task_views.task_detail, name="detail"),
]
