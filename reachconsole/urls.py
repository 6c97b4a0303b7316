from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from reachconsole import health
from reachconsole.api import api
from reachconsole.login import ThrottledLoginView

urlpatterns = [
    path("", include("roster.urls")),
    path("directory/", include("directory.urls")),
    path("messages/", include("messages.urls")),
    path("accounts/login/", ThrottledLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", health.metrics, name="metrics"),
]
