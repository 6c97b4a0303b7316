"""Login, throttled: after a few failed attempts for one user name or from one address, the
next attempts are refused for a while, whatever the password."""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from reachconsole.core.audit import audit_record


def failure_keys(username: str, address: str) -> list[str]:
    username = username.strip().lower()[:150]
    return ["login-fail:" + hashlib.sha256(f"{kind}:{value}".encode()).hexdigest()
            for kind, value in (("user", username), ("ip", address))]


class ThrottledLoginView(auth_views.LoginView):
    def post(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        keys = failure_keys(request.POST.get("username", ""), request.META.get("REMOTE_ADDR", ""))
        failures = max(cache.get_many(keys).values(), default=0)
        if failures >= settings.REACH_LOGIN_MAX_FAILURES:
            minutes = max(1, settings.REACH_LOGIN_LOCKOUT_S // 60)
            audit_record(actor=request.POST.get("username", "")[:150] or "anonymous",
                         action="login", target=request.META.get("REMOTE_ADDR", ""),
                         result="refused", detail="throttled")
            return render(request, "registration/login.html", {
                "form": self.get_form(), "throttled": minutes,
            }, status=429)
        response = super().post(request, *args, **kwargs)
        if response.status_code == 200:  # the form came back: wrong user name or password
            for key in keys:
                cache.add(key, 0, timeout=settings.REACH_LOGIN_LOCKOUT_S)
                try:
                    cache.incr(key)
                except ValueError:  # expired between add and incr
                    cache.set(key, 1, timeout=settings.REACH_LOGIN_LOCKOUT_S)
        return response
