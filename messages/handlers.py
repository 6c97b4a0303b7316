"""The console's own agents: what they do, and the one way each request to them is run.

`ops.probe` answers health probes with its node and time. A request to a console agent is run
in-process, whether it was sent through the console (messages/outbound.py) or arrived on the
console's inbox (messages/inbound.py): both call `console_agent_run`. The console's node keeps
its agents on the roster itself (`console_agents_register`, `console_agents_heartbeat`); the
bridge only publishes the heartbeat it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.utils import timezone

from directory.resolver import LOCAL_AGENTS
from messages import protocol, signing
from messages.rows import row_log_fields
from roster.services import agent_register, heartbeat_record

log = logging.getLogger(__name__)


def probe(payload: Any) -> dict[str, Any]:
    return {"nodeId": settings.REACH_NODE_ID, "time": timezone.now().isoformat()}


LOCAL_HANDLERS: dict[str, Callable[[Any], dict[str, Any]]] = {"ops.probe": probe}
# What the console's node says of its agents in every heartbeat: they answer at once.
_HEARTBEAT_LOAD = {"inflight": 0, "queueDepth": 0, "maxInflight": 64}


@dataclass(frozen=True, slots=True)
class ConsoleAnswer:
    payload: dict[str, Any]  # the TASK_RESPONSE's payload: {"ok": True, "result": …} or the error
    error: str  # the request's own words when the agent failed (its task ends TASK_ERROR)


def console_agent_run(*, agent_id: str, payload: Any, request: Any) -> ConsoleAnswer:
    """Run one request to a console agent. A failure of the agent is the task's answer
    (TASK_ERROR with the words), never the caller's exception. `request`: the request's row,
    whose ids the log line of a failure carries (built only then: this is the hot path of
    every request to the console)."""
    try:
        return ConsoleAnswer(payload={"ok": True, "result": LOCAL_HANDLERS[agent_id](payload)},
                             error="")
    except Exception as exc:
        log.exception("local handler %s failed", agent_id, extra=row_log_fields(request))
        words = f"{type(exc).__name__}: {exc}"
        return ConsoleAnswer(payload={"ok": False, "error": words},
                             error=f"the task failed: {words}"[:2000])


def console_agents_register(*, node_id: str, actor: str = "bridge") -> None:
    for agent_id in LOCAL_AGENTS:
        agent_register(agent_id=agent_id, node_id=node_id, version="console", actor=actor,
                       metadata={"local": True})


def console_agents_heartbeat(*, node_id: str, heartbeat_ms: int) -> bytes:
    """The console node's heartbeat for its agents, encoded (and signed when the console has
    signing keys), for the bridge to publish."""
    env = protocol.new_envelope(
        message_type=protocol.MessageType.HEARTBEAT, from_agent_id=node_id,
        headers={"originNodeId": node_id},
        payload={"heartbeatMs": heartbeat_ms, "agents": _heartbeat_agents()},
    )
    keyring = signing.keyring_for(settings.REACH_SIGNING_KEYS)
    return protocol.encode(env, key=keyring.signing_key(node_id) if keyring else None)


def console_agents_renew(*, node_id: str, heartbeat_ms: int) -> None:
    """Renew the console's own agents directly: its heartbeat comes back as an echo, which
    ingest drops."""
    heartbeat_record(node_id=node_id, agents=_heartbeat_agents(), heartbeat_ms=heartbeat_ms)


def _heartbeat_agents() -> list[dict[str, Any]]:
    return [{"agentId": agent_id, **_HEARTBEAT_LOAD} for agent_id in LOCAL_AGENTS]
