"""Fields of log lines. Every line about one message carries the same four (`extra=`), so a
search for any of them in the JSON logs finds every line about that message and its task."""

from __future__ import annotations

import logging

from django.core.exceptions import PermissionDenied


def log_fields(*, message_id: str, task_id: str, agent: str, node: str) -> dict[str, str]:
    """`agent` does the work (toAgentId), `node` receives it (targetNodeId)."""
    return {"message_id": message_id, "task_id": task_id, "agent": agent, "node": node}


class RefusalsInOneLine(logging.Filter):
    """A refused permission is a correct 403, not an error: Django logs it with the
    PermissionDenied traceback attached, about 40 lines for one person clicking a button
    they may not use. Keep the line ("Forbidden (Permission denied): /path"), drop the
    traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, PermissionDenied):
            record.exc_info = None
            record.exc_text = None
        return True
