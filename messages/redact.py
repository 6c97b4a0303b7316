"""Secrets in payloads and headers are masked wherever a message is shown or exported: the
trace page, the API's message detail, anything that renders a payload. What is stored is
never changed: a resend needs the real payload.

The keys are REACH_REDACT_KEYS (default `password,token,secret,authorization`), matched
without regard to case, at any depth of nested objects and lists.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

MASK = "[redacted]"


def redacted(value: Any, *, keys: frozenset[str] | None = None) -> Any:
    """A copy of `value` (JSON: dicts, lists, scalars) whose values under the redacted keys
    are MASK; `value` itself is left as it is."""
    keys = settings.REACH_REDACT_KEYS if keys is None else keys
    if not keys or not isinstance(value, dict | list):
        return value
    folded = frozenset(k.casefold() for k in keys)
    # A loop, not recursion: a stored payload may be nested about as deep as the JSON parser
    # allows, and a page renders it deeper in the stack than the parser ran.
    root = _empty(value)
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        source, copy = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, item in items:
            if isinstance(source, dict) and isinstance(key, str) and key.casefold() in folded:
                masked: Any = MASK
            elif isinstance(item, dict | list):
                masked = _empty(item)
                stack.append((item, masked))
            else:
                masked = item
            if isinstance(copy, dict):
                copy[key] = masked
            else:
                copy.append(masked)
    return root


def _empty(value: dict | list) -> dict | list:
    return {} if isinstance(value, dict) else []
