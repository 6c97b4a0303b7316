"""The roster's identifiers, parsed and checked: pure functions, no database and no write.

Everything that names an agent or a node (the APIs, the bridge's DRAIN, aliases, sends) reads
it through these, so one rule (roster/models.py's expressions) decides what a valid id is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from roster import errors
from roster.errors import AGENT_ID_HELP, InvalidAgentId, InvalidField
from roster.models import NAME_RE, NAMESPACE_RE, NODE_ID_RE, Agent

MAX_LABELS = 64
# The A2A-over-MQTT profile's identifiers (org, unit, agent, pool): "MUST match
# ^[A-Za-z0-9_.-]+$"; its agents' ids on the roster are `{org}/{unit}/{agent}`.
PROFILE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_PART = PROFILE_ID_RE.pattern.removeprefix("^").removesuffix("$")
# The same, for schemas: an agent `{org}/{unit}/{agent}`, and a pool `{org}/{unit}/pool/{p}`.
PROFILE_AGENT_PATTERN = f"{_PART}/{_PART}/{_PART}"
PROFILE_POOL_PATTERN = f"{_PART}/{_PART}/pool/{_PART}"
MAX_INFLIGHT_RANGE = (1, 100_000)
AGENT_ID_MAX_LENGTH = Agent._meta.get_field("agent_id").max_length


@dataclass(frozen=True, slots=True)
class AgentRef:
    namespace: str
    name: str

    @property
    def agent_id(self) -> str:
        return f"{self.namespace}.{self.name}"


def agent_id_split(text: str) -> tuple[str, str]:
    """`fin.tax` or `fin/tax` → ("fin", "tax"), unchecked; ("", text) without a separator.
    A `/` wins over dots, which a name may hold (`fin/tax.v2`)."""
    namespace, separator, name = text.partition("/" if "/" in text else ".")
    return (namespace, name) if separator else ("", text)


def agent_id_parse(raw: Any) -> AgentRef:
    """`fin.tax` or `fin/tax` → AgentRef; anything else raises InvalidAgentId."""
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidAgentId(errors.AGENT_ID_MISSING.format(help=AGENT_ID_HELP))
    text = raw.strip()
    namespace, name = agent_id_split(text)
    if (not NAMESPACE_RE.fullmatch(namespace) or not name or not NAME_RE.fullmatch(name)
            or len(text) > AGENT_ID_MAX_LENGTH):
        raise InvalidAgentId(errors.AGENT_ID_INVALID.format(raw=raw[:100], help=AGENT_ID_HELP))
    return AgentRef(namespace=namespace, name=name)


def profile_agent_id(raw: Any) -> str | None:
    """`acme/ops/echo` (an A2A-over-MQTT profile agent's id, roster/profile.py) as it is
    stored, or None when `raw` is not one."""
    if not isinstance(raw, str) or len(raw) > AGENT_ID_MAX_LENGTH:
        return None
    parts = raw.split("/")
    if len(parts) == 3 and all(PROFILE_ID_RE.fullmatch(p) for p in parts):
        return raw
    return None


def profile_pool_id(raw: Any) -> str | None:
    """`acme/ops/pool/sum` (a pool of the A2A-over-MQTT profile: its members share the
    request topic, and the broker hands each request to one), or None when `raw` is not
    one."""
    if not isinstance(raw, str) or len(raw) > AGENT_ID_MAX_LENGTH:
        return None
    parts = raw.split("/")
    if len(parts) == 4 and parts[2] == "pool" and all(PROFILE_ID_RE.fullmatch(p)
                                                      for p in parts):
        return raw
    return None


def stored_agent_id(raw: Any) -> str:
    """The roster's id for what a caller typed: a profile agent's id as it is, a native one
    parsed (`fin/tax` → `fin.tax`); InvalidAgentId for neither."""
    return profile_agent_id(raw) or agent_id_parse(raw).agent_id


def agent_namespace(raw: Any) -> str:
    """The namespace of what a caller typed as an agent id: a profile agent's org, a native
    agent's namespace; InvalidAgentId for neither."""
    profile = profile_agent_id(raw) or profile_pool_id(raw)
    return profile.split("/", 1)[0] if profile else agent_id_parse(raw).namespace


def node_id_check(raw: Any, *, field: str = "nodeId") -> str:
    if not isinstance(raw, str) or not NODE_ID_RE.fullmatch(raw):
        raise InvalidField(errors.NODE_ID_INVALID.format(field=field, raw=str(raw)[:100]))
    return raw
