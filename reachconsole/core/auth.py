"""Service auth of the JSON API: who is calling (a service token, a trusted source, an
acting person) and what that caller may touch."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.http import HttpRequest
from ninja.security import HttpBearer

from reachconsole.core.errors import ApiError
from reachconsole.core.tokens import ServiceToken, token_match


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
