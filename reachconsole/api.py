"""The northbound JSON API: one NinjaAPI, service-token auth (reachconsole/core/auth.py),
and one error shape.

Every error is `{"error": "<code>", "detail": "<words a person can act on>"}` with a 4xx
status (503 while a dependency is down); bad input never becomes a 500.
"""

from __future__ import annotations

import json
import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI, Swagger
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser

from reachconsole.core import jsonsafe
from reachconsole.core.auth import ServiceAuth
from reachconsole.core.errors import ApiError, ConsoleError
from reachconsole.core.jsonsafe import WORDS, unstorable
from reachconsole.core.outages import UNAVAILABLE_ERRORS
from reachconsole.unavailable import unavailable_response

log = logging.getLogger(__name__)

BODY_TOO_LARGE = ("the request body is over the console's limit of {limit:,} bytes "
                  "(DATA_UPLOAD_MAX_MEMORY_SIZE); send less: a message payload may be at most "
                  "{payload:,} bytes (REACH_MAX_MESSAGE_BYTES)")
REFUSE = ", which the console neither stores nor sends on; remove it"
NUL_CHARACTER = WORDS[jsonsafe.NUL_CHARACTER] + REFUSE


class StrictParser(Parser):
    """JSON bodies with what the console cannot store (a NUL, a lone surrogate, a number
    beyond 64 bits: reachconsole/core/jsonsafe.py) and query strings with a NUL are refused
    with a 422: a half-handled request must not become a 500."""

    def parse_body(self, request: HttpRequest) -> dict:
        data = super().parse_body(request)
        bad = unstorable(data, "body")
        if bad:
            code, where = bad
            raise ApiError(422, code, WORDS[code].format(where=where) + REFUSE)
        return data

    def parse_querydict(self, data, list_fields, request: HttpRequest) -> dict:
        for key, values in data.lists():
            if "\x00" in key or any("\x00" in value for value in values):
                raise ApiError(422, "nul_character",
                               NUL_CHARACTER.format(where=f"the query parameter {key[:50]!r}"))
        return super().parse_querydict(data, list_fields, request)


SOURCE_SCHEME = "SourceHeader"


class ConsoleAPI(NinjaAPI):
    """Every call needs the token and `X-OODER-Source` (reachconsole/core/auth.py): the
    document says so, as a second security scheme required with the token, so that the
    docs page's Authorize asks for both and "Try it out" works."""

    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        trusted = ", ".join(sorted(settings.REACH_TRUSTED_SOURCES))
        schemes[SOURCE_SCHEME] = {
            "type": "apiKey", "in": "header", "name": "X-OODER-Source",
            "description": f"the calling system, one of: {trusted} (REACH_TRUSTED_SOURCES)"}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                for requirement in operation.get("security") or []:
                    if "ServiceAuth" in requirement:
                        requirement[SOURCE_SCHEME] = []  # with the token, not instead
        return schema


api = ConsoleAPI(
    title="reachconsole",
    version="1.0",
    description="Lifecycle API of the A2A console (see docs/protocol.md, Northbound HTTP). "
                "Authorize with a service token and the calling system's X-OODER-Source.",
    auth=ServiceAuth(),
    urls_namespace="api",
    parser=StrictParser(),
    # Swagger UI from the console's own static files ("ninja" in INSTALLED_APPS); without a
    # validator its page asks nothing of the internet (the default posts the document to
    # validator.swagger.io for a badge).
    docs=Swagger(settings={"validatorUrl": None}),
)


def error_response(request: HttpRequest, status: int, code: str, detail: str) -> HttpResponse:
    return api.create_response(request, {"error": code, "detail": detail}, status=status)


@api.exception_handler(ConsoleError)
def _console_error(request: HttpRequest, exc: ConsoleError) -> HttpResponse:
    # Every refusal of every app (the API's own, the roster's, a send's) has one base.
    return error_response(request, exc.status, exc.code, exc.detail)


@api.exception_handler(RequestDataTooBig)
def _too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return error_response(request, 413, "body_too_large", BODY_TOO_LARGE.format(
        limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE, payload=settings.REACH_MAX_MESSAGE_BYTES))


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
    # Ninja turns any error of the body parser into a 400; one of ours keeps its words.
    if isinstance(exc.__cause__, ConsoleError):
        return _console_error(request, exc.__cause__)
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
api.add_router("/ops/alarms", "alarms.api.router")
api.add_router("/a2a", "messages.api.router")
api.add_router("/ops", "messages.api.ops_router")
api.add_router("/directory", "directory.api.router")
