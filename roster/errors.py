"""What the roster refuses, in words an operator or a node's author can act on.

Each error carries a stable code (the API's `error` field) and a status the API maps it to.
"""

from __future__ import annotations


class RosterError(Exception):
    code = "roster_error"
    status = 400

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class InvalidAgentId(RosterError):
    code = "invalid_agent_id"
    status = 422


class InvalidField(RosterError):
    code = "invalid_field"
    status = 422


class AgentNotFound(RosterError):
    code = "agent_not_found"
    status = 404


class NodeNotFound(RosterError):
    code = "node_not_found"
    status = 404


class AgentHeldElsewhere(RosterError):
    code = "agent_held_elsewhere"
    status = 409


class WrongNode(RosterError):
    code = "wrong_node"
    status = 409


class NamespaceForbidden(RosterError):
    code = "namespace_forbidden"
    status = 403


class ActorMismatch(RosterError):
    code = "actor_mismatch"
    status = 403


AGENT_ID_HELP = (
    "an agent id is `{namespace}.{name}` (or `namespace/name`): a lowercase namespace of "
    "letters, digits, '-' or '_', then a name of such segments joined by '.'"
)
