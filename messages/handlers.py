"""Agents the console hosts itself. `ops.probe` answers health probes with its node and time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.utils import timezone


def probe(payload: Any) -> dict[str, Any]:
    return {"nodeId": settings.REACH_NODE_ID, "time": timezone.now().isoformat()}


LOCAL_HANDLERS: dict[str, Callable[[Any], dict[str, Any]]] = {"ops.probe": probe}
