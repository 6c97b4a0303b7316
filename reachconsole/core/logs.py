"""Fields of log lines. Every line about one message carries the same four (`extra=`), so a
search for any of them in the JSON logs finds every line about that message and its task."""

from __future__ import annotations


def log_fields(*, message_id: str, task_id: str, agent: str, node: str) -> dict[str, str]:
    """`agent` does the work (toAgentId), `node` receives it (targetNodeId)."""
    return {"message_id": message_id, "task_id": task_id, "agent": agent, "node": node}
