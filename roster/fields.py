"""The roster's identifiers as typed API fields: the pattern the OpenAPI document shows and
the check that refuses a value are one rule (roster/models.py's expressions).

Each field first runs the roster's own check, so a refusal carries the roster's code and
words (`invalid_agent_id`, `invalid_field`); pydantic then holds the value to the documented
pattern and length, so nothing the document calls invalid gets through (a value with
spaces around it, say, which the roster's parser would have trimmed).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from reachconsole.core.apidoc import json_int
from roster import errors
from roster.errors import InvalidField
from roster.ids import (
    AGENT_ID_MAX_LENGTH,
    MAX_INFLIGHT_RANGE,
    MAX_LABELS,
    PROFILE_AGENT_PATTERN,
    agent_id_parse,
    node_id_check,
    stored_agent_id,
)
from roster.models import NAME_RE, NAMESPACE_RE, NODE_ID_RE


def _inner(regex) -> str:
    return regex.pattern.removeprefix("^").removesuffix("$")


NAME = _inner(NAME_RE)
# `namespace.name` as the roster stores it; on input `namespace/name` too (PROTOCOL.md).
AGENT_ID_PATTERN = rf"^{_inner(NAMESPACE_RE)}\.{NAME}$"
AGENT_ID_INPUT_PATTERN = rf"^{_inner(NAMESPACE_RE)}[./]{NAME}$"
NODE_ID_PATTERN = NODE_ID_RE.pattern
CAPABILITY_PATTERN = NAME_RE.pattern
GROUP_PATTERN = rf"^#?{NAME}$"


def _checked(check):
    def validate(value: Any) -> Any:
        if isinstance(value, str):  # other types get pydantic's own words
            check(value)
        return value

    return BeforeValidator(validate)


def _max_inflight(value: Any) -> None:
    low, high = MAX_INFLIGHT_RANGE
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and not low <= value <= high:
        raise InvalidField(errors.MAX_INFLIGHT_OUT_OF_RANGE)


def _label(field: str, prefix: str = ""):
    def check(value: str) -> None:
        name = value.removeprefix(prefix) if prefix else value
        if not NAME_RE.fullmatch(name):
            raise InvalidField(errors.LABEL_INVALID.format(field=field, raw=value[:60]))

    return check


# The check comes after the Field: pydantic runs it first all the same (it wraps what is
# to its left), and a Field placed after a validator loses its pattern from the schema.
AgentId = Annotated[
    str,
    Field(pattern=AGENT_ID_PATTERN, max_length=AGENT_ID_MAX_LENGTH,
          description="`namespace.name`, e.g. `fin.tax`", examples=["fin.tax"]),
    _checked(agent_id_parse),
]
# An agent as the roster stores it: native `fin.tax`, or an A2A-over-MQTT profile agent
# `acme/ops/echo` (in a path, through the `agent` converter: roster/converters.py).
RosterAgentId = Annotated[
    str,
    Field(pattern=rf"^(?:{AGENT_ID_PATTERN.removeprefix('^').removesuffix('$')}|"
                  rf"{PROFILE_AGENT_PATTERN})$",
          max_length=AGENT_ID_MAX_LENGTH,
          description="`namespace.name`, or an A2A-over-MQTT agent's `org/unit/agent`",
          examples=["fin.tax", "acme/ops/echo"]),
    _checked(stored_agent_id),
]
AgentIdInput = Annotated[
    str,
    Field(pattern=AGENT_ID_INPUT_PATTERN, max_length=AGENT_ID_MAX_LENGTH,
          description="`namespace.name` (or `namespace/name`, normalized to the former)",
          examples=["fin.tax"]),
    _checked(agent_id_parse),
]
NodeId = Annotated[
    str,
    Field(pattern=NODE_ID_PATTERN, max_length=128,
          description="a node id: one MQTT topic level", examples=["node-a"]),
    _checked(node_id_check),
]
Capability = Annotated[str, Field(pattern=CAPABILITY_PATTERN), _checked(_label("capabilities"))]
Group = Annotated[str, Field(pattern=GROUP_PATTERN), _checked(_label("groups", "#"))]
Capabilities = Annotated[list[Capability], Field(max_length=MAX_LABELS)]
Groups = Annotated[list[Group], Field(max_length=MAX_LABELS)]
MaxInflight = Annotated[
    json_int(ge=MAX_INFLIGHT_RANGE[0], le=MAX_INFLIGHT_RANGE[1]),
    BeforeValidator(lambda value: _max_inflight(value) or value),
]
