"""Only a person who may read the console sees its pages (reachconsole/core/roles.py).

Every page checks that someone is signed in; this checks that the account may read at all,
before any view runs, so no page, export or live fragment can forget it. Anonymous requests
pass on to the views' own sign-in redirect; the API has its tokens, the admin its staff check,
and the sign-in pages, health probes and static files are for everyone.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.contrib.auth import get_user_model
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse

from reachconsole.core.roles import may_read, no_role_words
from reachconsole.error_pages import error_response

OPEN_PREFIXES = ("/api/", "/admin/", "/accounts/", "/static/", "/favicon.ico", "/healthz",
                 "/readyz", "/metrics")
ADMINISTRATORS_NAMED = 3


def refusal(request: HttpRequest) -> HttpResponse | None:
    """The 403 for a signed-in account that may not read, else None."""
    if request.path_info.startswith(OPEN_PREFIXES):
        return None
    try:
        user = request.user
        if not user.is_authenticated or may_read(user):
            return None
    except DatabaseError:
        # An outage: the view meets it too, and the 503 with Retry-After is said there
        # (reachconsole/unavailable.py), with the same words as for every page.
        return None
    administrators = list(get_user_model().objects.filter(is_superuser=True, is_active=True)
                          .order_by("pk").values_list("username", flat=True)
                          [:ADMINISTRATORS_NAMED])
    return error_response(request, 403, "No role in this console",
                          no_role_words(user.get_username(), administrators), "no_role")


class ReadersOnlyMiddleware:
    # Both: a sync-only middleware puts every request below it on a thread for its whole
    # life under ASGI (reachconsole/core/idle.py).
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.async_mode:
            return self.__acall__(request)
        return refusal(request) or self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        if request.path_info.startswith(OPEN_PREFIXES):
            return await self.get_response(request)
        # The session's user is read from the database: on a thread, as the page views are.
        refused = await sync_to_async(refusal)(request)
        return refused or await self.get_response(request)
