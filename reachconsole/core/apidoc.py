"""The pieces every app's API schemas share, so that /api/openapi.json says what the API
really accepts and answers: the error body and the statuses any call can get
(reachconsole/api.py), request bodies that are validated as JSON Schema reads them, and the
JSON values the console can store.

An operation lists the statuses it really gives (`refusals(404, 409)`); the ones every
call can get are added here, so no operation's document forgets them.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from ninja import Schema
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from typing_extensions import TypeAliasType


class ErrorOut(Schema):
    """Every refusal: a stable machine code and words a person can act on."""

    error: str
    detail: str


# Any call: no or a wrong token (401), an untrusted X-OODER-Source or a token bound to other
# namespaces (403), a query or body the console refuses (422: a NUL character, a value out of
# its range), the database or Redis down (503, with Retry-After).
EVERY_CALL = (401, 403, 422, 503)
# A call with a JSON body: not JSON (400), over DATA_UPLOAD_MAX_MEMORY_SIZE (413).
WITH_BODY = (400, 413)


def refusals(*statuses: int, body: bool = False) -> dict[int, type[ErrorOut]]:
    """The error answers of one operation: `statuses` of its own, and those of every call."""
    every = (*EVERY_CALL, *(WITH_BODY if body else ()), *statuses)
    return dict.fromkeys(sorted(set(every)), ErrorOut)


# A JSON value the console can store and send on (reachconsole/core/jsonsafe.py): integers
# within 64 bits. The parser refuses the rest before any schema is applied (422); this type
# says so in the document, for free-form fields (a payload, metadata).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
JsonValue = TypeAliasType(
    "JsonValue",
    Union[None, bool, Int64, float, str, list["JsonValue"], dict[str, "JsonValue"]],  # noqa: UP007
)
JsonObject = dict[str, JsonValue]


def _integral(value: Any) -> Any:
    # JSON has one number type: 5.0 is the integer 5 to JSON Schema, and so to the console.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_int(*, ge: int, le: int) -> Any:
    """An integer field of a body within [ge, le]: 5 and 5.0, never "5" or true (BodyIn is
    strict). The bounds come before the validator: after one, pydantic leaves them out of
    the schema's minimum and maximum."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


class BodyIn(BaseModel):
    """A JSON request body as its document says: an object (a pydantic model, not a ninja
    Schema, which reads any value's attributes: a list became an empty body),
    types not coerced (`"5"` is not 5, `0` is not false), and fields the console does not
    know ignored, as long as they are JSON the console could store (the parser refuses the
    rest)."""

    model_config = ConfigDict(strict=True, extra="allow")
    __pydantic_extra__: dict[str, JsonValue]
