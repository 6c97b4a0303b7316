"""What the roster refuses, in words an operator or a node's author can act on.

Each error carries a stable code (the API's `error` field) and a status the API maps it to
(reachconsole/core/errors.py).
"""

from __future__ import annotations

from reachconsole.core.errors import ConsoleError


class RosterError(ConsoleError):
    code = "roster_error"
    status = 400


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


class NotOwner(RosterError):
    code = "not_owner"
    status = 403


class ConsoleAgent(RosterError):
    code = "console_agent"
    status = 403


class LeaseLapsed(RosterError):
    code = "lease_lapsed"
    status = 409


class NoLease(RosterError):
    code = "no_lease"
    status = 409


AGENT_ID_HELP = (
    "an agent id is `{namespace}.{name}` (or `namespace/name`): a lowercase namespace of "
    "letters, digits, '-' or '_', then a name of such segments joined by '.'; 265 characters "
    "at most"
)

# The words of each refusal, filled in with str.format where it is raised. Callers and tests
# decide on the error's class or code; these constants are what tests compare the words to.
AGENT_ID_MISSING = "agentId is missing; {help}"
AGENT_ID_INVALID = "`{raw}` is not a valid agent id; {help}"
NODE_ID_INVALID = (
    "{field} `{raw}` is not a node id: 1-128 letters, digits, '-', '_', '.', "
    "':' starting with a letter or digit (no '/', '+' or '#': it becomes an MQTT topic)"
)
LABELS_NOT_A_LIST = "{field} must be a list of at most {limit} names"
LABEL_INVALID = "{field}: `{raw}` is not a name (letters, digits, '-', '_', '.')"
METADATA_NOT_AN_OBJECT = "metadata must be a JSON object"
METADATA_TOO_LARGE = (
    "metadata is {size} bytes as JSON; the limit is {limit} bytes "
    "(REACH_MAX_METADATA_BYTES). Keep large documents elsewhere and link to them."
)
MAX_INFLIGHT_OUT_OF_RANGE = "maxInflight must be between 1 and 100000"
AGENT_HELD_ELSEWHERE = (
    "{agent_id} is registered on node {holder} and its lease runs until {until}; drain or "
    "deregister it there first, or wait for the lease to lapse"
)
AGENT_NOT_FOUND = "{agent_id} is not on the roster"
AGENT_NOT_FOUND_ON_HEARTBEAT = (
    "{agent_id} is not on the roster; register it with POST /api/roster/agents before "
    "sending heartbeats"
)
WRONG_NODE = (
    "{agent_id} is registered on node {holder}, not {node_id}; register it on the new node "
    "once the old lease lapses"
)
NODE_NOT_FOUND = "node {node_id} is not known to the console"
NOT_OWNER = (
    "{agent_id} is owned by `{owner}`; X-OODER-Actor `{actor}` may not {action} it. Ask its "
    "owner, or an operator (a service token request without X-OODER-Actor)"
)
CONSOLE_AGENT = (
    "{agent_id} is the console's own agent on its node {node_id}; only the console registers, "
    "renews, drains or removes it, not the API"
)
CONSOLE_NODE = (
    "node {node_id} is the console's own node; agents are registered there by the console "
    "only. Register the agent on the node that runs it"
)
PROFILE_NO_LEASE = (
    "{agent_id} is an agent of the A2A-over-MQTT profile: it has no lease to renew; its "
    "presence is what its retained Agent Card says (the broker's word)"
)
PROFILE_NODE = (
    "node {node_id} stands for the A2A-over-MQTT profile's agents, whom the broker serves; it "
    "is not {action}: drain an agent of it one at a time, and its presence is its card's"
)
PROFILE_NODE_REGISTER = (
    "nodeId {node_id} is the console's name for the A2A-over-MQTT profile's agents; a node of "
    "the cluster registers under a name of its own"
)
CONSOLE_NODE_DRAIN = (
    "node {node_id} is the console's own node: its agents are the console's, and they stop "
    "with it, not by a drain"
)
LEASE_LAPSED_UNDRAIN = (
    "{agent_id}'s lease lapsed at {at} while it was draining: it is leaving the roster "
    "(phase 2) and cannot be undrained. Register it again from the node that runs it"
)
CONSISTENCY_NEEDS_ALL_NAMESPACES = (
    "the roster-wide consistency report needs a token not bound to namespaces"
)


class InvalidNamespace(RosterError):
    code = "invalid_namespace"
    status = 422


class NamespaceTaken(RosterError):
    code = "namespace_taken"
    status = 409


class NamespaceNotFound(RosterError):
    code = "namespace_not_found"
    status = 404


NAMESPACE_HELP = (
    "a namespace is 1-64 lowercase letters, digits, '-' or '_', starting with a letter or digit"
)
NAMESPACE_INVALID = "`{raw}` is not a namespace name; " + NAMESPACE_HELP
NAMESPACE_TAKEN = "namespace {name} exists already"
NAMESPACE_NOT_FOUND = "namespace {name} does not exist (removed meanwhile?)"
