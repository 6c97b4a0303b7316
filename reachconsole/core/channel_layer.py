"""The Redis channel layer under the console's own prefix (reachconsole/core/identity.py).

The prefix is the console's name, which is read from its database: not known when settings
load, so it is taken when the layer is made (at a process's first event or socket).
`REACH_CHANNEL_PREFIX` names one outright.
"""

from __future__ import annotations

from typing import Any

from channels_redis.pubsub import RedisPubSubChannelLayer

from reachconsole.core.identity import console_id


class ConsoleChannelLayer(RedisPubSubChannelLayer):
    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(*args, prefix=prefix or console_id(), **kwargs)
