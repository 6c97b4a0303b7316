"""The northbound JSON API: one NinjaAPI, service-token auth, and one error shape.

Every error is `{"error": "<code>", "detail": "<words a person can act on>"}` with a 4xx
status; bad input never becomes a 500.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer

from reachconsole.tokens import ServiceToken, token_match
from reachconsole.unavailable import UNAVAILABLE_ERRORS, unavailable_response
from roster.errors import RosterError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the token that matched, the source system, the acting person."""

    token: ServiceToken
    source: str
    actor: str

    @property
    def label(self) -> str:
        return f"{self.source}:{self.actor or self.token.label}"

    def require_namespace(self, namespace: str) -> None:
        if not self.token.allows(namespace):
            allowed = ", ".join(sorted(self.token.namespaces or ()))
            raise ApiError(
                403, "namespace_forbidden",
                f"this service token is bound to the namespaces {allowed}; "
                f"it cannot act on agents of namespace `{namespace}`",
            )

    def require_owner(self, owner: str) -> None:
        """X-OODER-Actor, when sent, must be the owner the request names."""
        if self.actor and owner and self.actor != owner:
            raise ApiError(
                403, "actor_mismatch",
                f"X-OODER-Actor `{self.actor}` is not the owner `{owner}` this request names",
            )


class ServiceAuth(HttpBearer):
    def __call__(self, request: HttpRequest) -> Caller:
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise ApiError(
                401, "unauthorized",
                "send `Authorization: Bearer <service token>`; tokens are set in "
                "REACH_SERVICE_TOKENS on the console",
            )
        token = token_match(presented.strip(), settings.REACH_SERVICE_TOKENS)
        if token is None:
            raise ApiError(
                401, "unauthorized",
                "the service token is not valid (it may have been rotated out); "
                "ask the console's operators for a current one",
            )
        source = request.headers.get("X-OODER-Source", "").strip()
        if source not in settings.REACH_TRUSTED_SOURCES:
            trusted = ", ".join(sorted(settings.REACH_TRUSTED_SOURCES))
            shown = f"`{source[:60]}`" if source else "missing"
            raise ApiError(
                403, "untrusted_source",
                f"X-OODER-Source is {shown}; it must be one of: {trusted} "
                "(REACH_TRUSTED_SOURCES)",
            )
        actor = request.headers.get("X-OODER-Actor", "").strip()[:150]
        return Caller(token=token, source=source, actor=actor)

    def authenticate(self, request: HttpRequest, token: str) -> Caller | None:  # pragma: no cover
        raise NotImplementedError("ServiceAuth.__call__ does the work")


api = NinjaAPI(
    title="reachconsole",
    version="1.0",
    description="Lifecycle API of the A2A console (see PROTOCOL.md, Northbound HTTP)",
    auth=ServiceAuth(),
    urls_namespace="api",
)


def error_response(request: HttpRequest, status: int, code: str, detail: str) -> HttpResponse:
    return api.create_response(request, {"error": code, "detail": detail}, status=status)


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return error_response(request, exc.status, exc.code, exc.detail)


@api.exception_handler(RosterError)
def _roster_error(request: HttpRequest, exc: RosterError) -> HttpResponse:
    return error_response(request, exc.status, exc.code, exc.detail)


@api.exception_handler(AuthenticationError)
def _auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return error_response(request, 401, "unauthorized", "send `Authorization: Bearer <token>`")


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    if request.method in ("POST", "PUT", "PATCH") and request.body:
        try:
            parsed = json.loads(request.body)
        except ValueError:
            parsed = {}
        if not isinstance(parsed, dict):
            return error_response(
                request, 422, "invalid_request", "the request body must be a JSON object"
            )
    problems = []
    for error in exc.errors[:10]:
        where = ".".join(str(part) for part in error.get("loc", ()) if part not in ("body",))
        problems.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return error_response(request, 422, "invalid_request", "; ".join(problems))


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if exc.status_code == 400:
        return error_response(
            request, 400, "bad_json", "the request body is not valid JSON (send a JSON object "
            "with Content-Type: application/json)",
        )
    return error_response(request, exc.status_code, "error", str(exc))


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    log.exception("unexpected API error on %s %s", request.method, request.path)
    return error_response(
        request, 500, "internal_error",
        "the console failed to handle this request; it has been logged — retry later",
    )


def _unavailable(request: HttpRequest, exc: Exception) -> HttpResponse:
    # Ninja answers every error itself, so the 503 of reachconsole/unavailable.py for a
    # database or Redis that is down has to be given here too; other errors of these
    # classes (an SQL mistake) stay 500s.
    return unavailable_response(request, exc) or _unexpected(request, exc)


for _error_class in UNAVAILABLE_ERRORS:
    api.add_exception_handler(_error_class, _unavailable)


api.add_router("/roster", "roster.api.router")
api.add_router("/cluster", "roster.api.cluster_router")
api.add_router("/ops", "roster.api.ops_router")
api.add_router("/a2a", "messages.api.router")
api.add_router("/directory", "directory.api.router")
