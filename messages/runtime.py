"""The bridge running in this process, if any: the one owner of the MQTT client."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from messages.bridge import Bridge

_lock = threading.Lock()
_bridge: Bridge | None = None


def current_bridge() -> Bridge | None:
    return _bridge


def set_bridge(bridge: Bridge | None) -> None:
    global _bridge
    with _lock:
        _bridge = bridge
