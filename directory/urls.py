from django.urls import path

from directory import views

app_name = "directory"
urlpatterns = [
    path("resolve/", views.resolver, name="resolver"),
    path("agents/<agent:agent_id>/names/", views.agent_names, name="agent_names"),
]
