"""Service tokens: `secret` or `secret@ns1+ns2` (bound to those namespaces).

Several tokens may be valid at once so a token can be rotated without downtime.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured

_NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
MIN_SECRET_LENGTH = 16


@dataclass(frozen=True, slots=True)
class ServiceToken:
    secret: str
    namespaces: frozenset[str] | None  # None: any namespace

    def allows(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    @property
    def label(self) -> str:
        """A name safe to log: the first characters only."""
        return f"{self.secret[:4]}…"


def tokens_parse(raw: list[str], *, variable: str = "REACH_SERVICE_TOKENS") -> list[ServiceToken]:
    tokens = []
    for item in raw:
        secret, _, scope = item.partition("@")
        if len(secret) < MIN_SECRET_LENGTH:
            raise ImproperlyConfigured(
                f"{variable}: a token is shorter than {MIN_SECRET_LENGTH} characters; "
                "use a long random string (e.g. `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'`)"
            )
        namespaces = None
        if scope:
            names = [n for n in scope.split("+") if n]
            bad = [n for n in names if not _NAMESPACE.match(n)]
            if bad or not names:
                raise ImproperlyConfigured(
                    f"{variable}: `@{scope}` is not a list of namespaces joined by '+'"
                )
            namespaces = frozenset(names)
        tokens.append(ServiceToken(secret=secret, namespaces=namespaces))
    return tokens


def token_match(presented: str, tokens: list[ServiceToken]) -> ServiceToken | None:
    """Constant-time comparison against every configured token.

    Every token is compared even after a match so the time taken does not reveal which
    (or whether an early) token matched.
    """
    found = None
    candidate = presented.encode()
    for token in tokens:
        if hmac.compare_digest(candidate, token.secret.encode()):
            found = token
    return found
