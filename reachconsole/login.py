"""Login throttling: after a few failed logins for one user name from one address, that pair
is refused for a while on every path that checks a password, whatever the password.

django-axes counts (settings.py, AXES_*): its backend runs first in every `authenticate()`
call, so the console's login, the admin's and any other view are throttled alike. This
module is the console's side of it: which address and user name count, the limit and the
cool-off (REACH_LOGIN_MAX_FAILURES, REACH_LOGIN_LOCKOUT_S, read on every attempt), and the
lockout page (429, in the audit trail).
"""

from __future__ import annotations

import ipaddress
import math
from datetime import timedelta

from axes.handlers.database import AxesDatabaseHandler
from axes.handlers.proxy import AxesProxyHandler
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from reachconsole.core.audit import audit_record

# Django's own limit for user names; a longer one names no account.
USERNAME_MAX = 150

LOCKED_AUDIT = (
    "throttled at {path}: {limit} failed logins for this user name from this address; "
    "refused for {duration} after the last one"
)
ADDRESS_LOCKED_AUDIT = (
    "throttled at {path}: {limit} failed logins from this address, whatever the user name; "
    "every user name from it refused for {duration} after the last one"
)


def client_address(request: HttpRequest) -> str | None:
    """The address of the peer, as the server saw it (REMOTE_ADDR).

    Never X-Forwarded-For or the like: a client can write any address there and so step out
    of its own lock. Behind a reverse proxy, Daphne's --proxy-headers sets REMOTE_ADDR from
    the proxy's X-Forwarded-For (docs/deployment.md); without it every client behind the
    proxy has the proxy's address, and since failures count per user name and address, one
    user's failures still lock out no one else.
    """
    raw = request.META.get("REMOTE_ADDR") or ""
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:  # a unix socket, a test double: no address to tell clients apart
        return None


def attempt_username(request: HttpRequest, credentials: dict | None = None) -> str | None:
    """The user name an attempt was for, as stored and counted: no NUL (PostgreSQL text
    holds none), no longer than any user name can be."""
    field = get_user_model().USERNAME_FIELD
    raw = credentials.get(field) if credentials else request.POST.get(field)
    if raw is None:
        return None
    return str(raw).replace("\x00", "")[:USERNAME_MAX]


class LoginAttempts(AxesDatabaseHandler):
    """django-axes' database handler, with two additions:

    - the request's header text made storable first: a NUL in a User-Agent or Accept header
      would otherwise make PostgreSQL refuse the attempt's row, and a failed login would
      become a 500 instead of being counted;
    - a limit per address across user names (REACH_LOGIN_MAX_FAILURES_PER_ADDRESS), higher
      than the pair's, so that one address trying many user names (password spraying) is
      stopped too, while one person's mistyping behind a shared address locks no one else.
    """

    def user_login_failed(self, sender, credentials: dict, request=None, **kwargs):
        if request is not None:
            AxesProxyHandler.update_request(request)
            for attr in ("axes_user_agent", "axes_http_accept", "axes_path_info"):
                value = getattr(request, attr, None)
                if isinstance(value, str):
                    setattr(request, attr, value.replace("\x00", ""))
        out = super().user_login_failed(sender, credentials, request, **kwargs)
        if request is not None and address_locked(request):
            request.axes_locked_out = True  # this failure reached the address's limit
        return out

    def is_locked(self, request, credentials: dict | None = None) -> bool:
        return super().is_locked(request, credentials) or address_locked(request)


def address_failures(request: HttpRequest) -> int:
    """Failed logins from the request's address within the cool-off, whatever user name."""
    address = client_address(request)
    if address is None:
        return 0
    since = timezone.now() - cool_off(request)
    total = (AccessAttempt.objects.filter(ip_address=address, attempt_time__gte=since)
             .aggregate(n=Sum("failures_since_start"))["n"])
    return total or 0


def address_locked(request: HttpRequest) -> bool:
    return address_failures(request) >= settings.REACH_LOGIN_MAX_FAILURES_PER_ADDRESS


def failure_limit(request: HttpRequest, credentials: dict | None = None) -> int:
    return settings.REACH_LOGIN_MAX_FAILURES


def cool_off(request: HttpRequest | None = None) -> timedelta:
    return timedelta(seconds=settings.REACH_LOGIN_LOCKOUT_S)


def duration_words(seconds: int) -> str:
    if seconds < 60:
        return f"{seconds} second{'s' if seconds != 1 else ''}"
    minutes = math.ceil(seconds / 60)
    return f"{minutes} minute{'s' if minutes != 1 else ''}"


def lockout_response(request: HttpRequest, original_response=None,
                     credentials: dict | None = None) -> HttpResponse:
    """The console's lockout page, for whichever login path was refused, and its audit row.

    Called by django-axes' middleware for the failure that reaches the limit and for every
    attempt while the lock holds.
    """
    if credentials is None and isinstance(original_response, dict):
        # axes' async middleware passes (request, credentials).
        credentials = original_response
    username = attempt_username(request, credentials) or ""
    seconds = settings.REACH_LOGIN_LOCKOUT_S
    duration = duration_words(seconds)
    by_address = address_locked(request)
    words = ADDRESS_LOCKED_AUDIT if by_address else LOCKED_AUDIT
    limit = (settings.REACH_LOGIN_MAX_FAILURES_PER_ADDRESS if by_address
             else failure_limit(request))
    audit_record(
        actor=username or "anonymous", action="login",
        target=client_address(request) or "unknown address", result="refused",
        detail=words.format(path=request.path[:200], limit=limit, duration=duration),
    )
    next_url = request.POST.get("next") or request.GET.get("next") or ""
    response = render(request, "registration/login.html", {
        "form": AuthenticationForm(request), "throttled": duration, "next": next_url,
        "throttled_by_address": by_address,
    }, status=429)
    response["Retry-After"] = str(seconds)
    return response
