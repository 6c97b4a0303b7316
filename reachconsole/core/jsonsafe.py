"""What the console cannot store of a parsed JSON value: a NUL character (PostgreSQL text
has none), a lone surrogate (not Unicode: it cannot be written as UTF-8), an integer beyond
64 bits. The API and the bus decoder refuse such input with where it is, before anything is
written, instead of failing half way."""

from __future__ import annotations

from typing import Any

NUL_CHARACTER = "nul_character"
LONE_SURROGATE = "lone_surrogate"
NUMBER_OUT_OF_RANGE = "number_out_of_range"
WORDS = {
    NUL_CHARACTER: "{where} contains a NUL character (\\u0000)",
    LONE_SURROGATE: "{where} contains a lone surrogate (not Unicode text)",
    NUMBER_OUT_OF_RANGE: "{where} is a number beyond 64 bits",
}
_INT_LIMIT = 2**63


def unstorable(value: Any, path: str) -> tuple[str, str] | None:
    """(code, where) of the first value the console cannot store, or None."""
    if isinstance(value, str):
        return _bad_text(value, path)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -_INT_LIMIT <= value < _INT_LIMIT else (NUMBER_OUT_OF_RANGE, path)
    if isinstance(value, dict):
        for key, item in value.items():
            bad = _bad_text(key, f"{path}: a key") or unstorable(item, f"{path}.{key[:40]}")
            if bad:
                return bad
    elif isinstance(value, list):
        for index, item in enumerate(value):
            bad = unstorable(item, f"{path}[{index}]")
            if bad:
                return bad
    return None


def _bad_text(text: str, path: str) -> tuple[str, str] | None:
    if "\x00" in text:
        return NUL_CHARACTER, path
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return LONE_SURROGATE, path
    return None
