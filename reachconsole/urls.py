from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from reachconsole import audit_views, health, overview
from reachconsole.api import api
from reachconsole.roster_numbers import ROSTER_NUMBERS
from roster import views as roster_views
from roster.catalog import ai_catalog

urlpatterns = [
    # The roster page with the numbers it cannot read itself (roster imports no app): the
    # composition root hands them in; every other roster page, and reversing "roster:health"
    # to "/", comes from roster.urls below.
    path("", roster_views.health, {"numbers": ROSTER_NUMBERS}, name="health"),
    path("", include("roster.urls")),
    path("directory/", include("directory.urls")),
    path("messages/", include("messages.urls")),
    path("tasks/", include("messages.task_urls")),
    path("audit/", audit_views.audit_list, name="audit"),
    path("alarms/", include("alarms.urls")),
    path("overview/", overview.overview, name="overview"),
    # Throttled by django-axes like every password check (reachconsole/login.py).
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
    # Browsers ask every page's host for /favicon.ico (the admin's pages name none).
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    # The roster's agents, both dialects, as an AI Catalog (roster/catalog.py).
    path(".well-known/ai-catalog.json", ai_catalog, name="ai_catalog"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", health.metrics, name="metrics"),
]

# The console's own error pages (DEBUG off), JSON under /api/ (reachconsole/error_pages.py).
handler400 = "reachconsole.error_pages.bad_request"
handler403 = "reachconsole.error_pages.permission_denied"
handler404 = "reachconsole.error_pages.page_not_found"
handler500 = "reachconsole.error_pages.server_error"
