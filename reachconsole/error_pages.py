"""The console's own error pages.

A person gets the console's layout, words that say what went wrong and what to do, and a way
back (the overview, and the page they came from); an htmx request gets a small fragment that
static/js/console.js shows on the page (htmx swaps no 4xx/5xx answer by itself); the API
keeps its JSON shape `{"error", "detail"}` (reachconsole/api.py).
"""

from __future__ import annotations

import logging

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.cache import patch_vary_headers
from django.utils.html import escape
from django.utils.http import url_has_allowed_host_and_scheme

from reachconsole.core.roles import action_refused_words

# (title, words, API error code) by status; CSRF failures have their own.
WORDS = {
    400: ("Bad request",
          "The console could not make sense of this request (a malformed or oversized form, "
          "or an address it does not serve). Go back and try again.",
          "bad_request"),
    403: ("Not allowed",
          "Your account may not do this. Ask an administrator for the permission if your work "
          "needs it.",
          "forbidden"),
    404: ("Not found",
          "There is nothing at {path}. An agent that left the roster or a message that was "
          "pruned has no page any more; check the address, or find it from the overview.",
          "not_found"),
    500: ("Something went wrong",
          "The console failed to handle this request. It has been logged; try again, and tell "
          "the console's operators if it keeps happening.",
          "internal_error"),
}
API_NOT_FOUND = "there is no API endpoint at {path}; the endpoints are listed in /api/openapi.json"
CSRF = ("Form expired",
        "The console refused this form because its security token was missing or out of "
        "date ({reason}). Reload the page and try again; if it keeps happening, allow cookies "
        "for this site.",
        "csrf_failed")

log = logging.getLogger(__name__)

# When the page itself cannot be rendered (the template or the database failing too).
PLAIN = ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
         "</head><body><h1 data-error-status=\"{status}\">{title}</h1><p data-error-detail>"
         "{detail}</p><p><a href=\"/overview/\">Back to the overview</a></p></body></html>")


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith("/api/")


def _is_htmx(request: HttpRequest) -> bool:
    # The header itself: a 400 can come before HtmxMiddleware has run.
    return request.headers.get("HX-Request") == "true"


def _previous_page(request: HttpRequest) -> str | None:
    """The page the person came from, if it is one of the console's own."""
    referer = request.headers.get("Referer", "")
    try:
        host = request.get_host()
    except DisallowedHost:
        return None
    if referer and url_has_allowed_host_and_scheme(referer, allowed_hosts={host},
                                                   require_https=request.is_secure()):
        return referer
    return None


def error_response(request: HttpRequest, status: int, title: str, detail: str,
                   code: str) -> HttpResponse:
    if _is_api(request):
        return JsonResponse({"error": code, "detail": detail}, status=status)
    template = "errors/_error.html" if _is_htmx(request) else "errors/error.html"
    context = {"status": status, "title": title, "detail": detail,
               "previous": _previous_page(request)}
    try:
        response = render(request, template, context, status=status)
    except Exception:
        log.exception("the %s page for %s could not be rendered", status, request.path)
        response = HttpResponse(PLAIN.format(status=status, title=escape(title),
                                             detail=escape(detail)),
                                status=status, content_type="text/html; charset=utf-8")
    patch_vary_headers(response, ["HX-Request"])
    return response


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    title, detail, code = WORDS[400]
    return error_response(request, 400, title, detail, code)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    title, detail, code = WORDS[403]
    user = getattr(request, "user", None)
    if exception is not None and str(exception):
        detail = str(exception)  # a view that says why in its own words
    elif request.method == "POST" and user is not None and user.is_authenticated:
        # A page action (resend, drain, …) refused by its permission check: the person is
        # signed in, so the missing piece is the operator role (reachconsole/core/roles.py).
        detail = action_refused_words(user.get_username())
    return error_response(request, 403, title, detail, code)


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    title, detail, code = WORDS[404]
    if _is_api(request):
        detail = API_NOT_FOUND
    return error_response(request, 404, title, detail.format(path=request.path[:300]), code)


def server_error(request: HttpRequest) -> HttpResponse:
    title, detail, code = WORDS[500]
    return error_response(request, 500, title, detail, code)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    title, detail, code = CSRF
    return error_response(request, 403, title, detail.format(reason=reason or "no reason given"),
                          code)


NUL_IN_QUERY = ("The address holds a NUL character (%00), which no filter, search or page of "
                "the console can contain. Remove it and try again.")
NUL_IN_API_PATH = ("the path contains a NUL character (\\u0000, %00), which no id the console "
                   "stores contains; remove it")


class NulQueryMiddleware:
    """A NUL in a page's address is refused with words (400), before a filter, a cursor or
    an id takes it to PostgreSQL, which cannot store or compare it (a 500 otherwise). In an
    API path it is a 422 in the API's shape; the API refuses one in a query or a body
    itself (reachconsole/api.py)."""

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
        if self._nul(request):
            return self._refusal(request)
        return self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        if self._nul(request):
            # The page's context processors read the database: on a thread.
            return await sync_to_async(self._refusal)(request)
        return await self.get_response(request)

    @staticmethod
    def _nul(request: HttpRequest) -> bool:
        if "\x00" in request.path_info:
            return True
        return not _is_api(request) and "\x00" in "".join(
            key + "".join(values) for key, values in request.GET.lists())

    @staticmethod
    def _refusal(request: HttpRequest) -> HttpResponse:
        if _is_api(request):
            return JsonResponse({"error": "nul_character", "detail": NUL_IN_API_PATH},
                                status=422)
        return error_response(request, 400, WORDS[400][0], NUL_IN_QUERY, WORDS[400][2])
