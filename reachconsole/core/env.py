"""Typed readers for settings that come from the environment.

Each reader fails loudly (ImproperlyConfigured naming the variable) on a value it cannot
use, so a typo in a deployment stops the process at start instead of running on a default.
A secret may also come from a file: `NAME_FILE=/run/secrets/x` is read when `NAME` is unset.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is not None:
        return value
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={path} cannot be read: {exc}") from exc
    return default


def env_bool(name: str, default: bool) -> bool:
    value = env_str(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = env_str(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} is below the minimum of {minimum}")
    return number


def env_float(name: str, default: float, *, minimum: float = 0.0) -> float:
    value = env_str(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = float(value.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if number < minimum:
        raise ImproperlyConfigured(f"{name}={number} is below the minimum of {minimum}")
    return number


def env_list(name: str, default: str = "") -> list[str]:
    value = env_str(name, default) or ""
    return [item.strip() for item in value.split(",") if item.strip()]


_SPAN_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def env_span(name: str, default: str, *, minimum_s: int = 1) -> int:
    """A length of time written as a count and a unit (`1d`, `6h`, `1m`, `30s`): seconds."""
    text = (env_str(name) or "").strip() or default
    count, unit = text[:-1], text[-1:].lower()
    if unit not in _SPAN_UNITS or not count.isdigit() or int(count) <= 0:
        raise ImproperlyConfigured(
            f"{name}={text!r} is not a span: write a whole count and a unit, s, m, h or d "
            f"(1d, 6h, 1m)")
    seconds = int(count) * _SPAN_UNITS[unit]
    if seconds < minimum_s:
        raise ImproperlyConfigured(f"{name}={text} is shorter than {minimum_s} s")
    return seconds
