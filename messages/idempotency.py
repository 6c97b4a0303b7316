"""The window of idempotency keys already taken for execution on this node.

Kept in the Django cache: Redis in production, so every worker and every console instance
shares it; the process's memory in the embedded console. The first transmission to claim a
key is the one that runs; a later transmission of the same work (another message id, same
key) inside the window is a duplicate. A redelivery of the claiming transmission itself (same
message id, e.g. after a crash before commit) still runs. Claims made by a batch that rolls
back are released.

Left as it is: if the claiming transmission is lost for good (a crash before commit *and* a
broker that loses the redelivery), later transmissions are answered as duplicates until the
window expires.
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.core.cache import cache

PREFIX = "idem:"


def _key(node_id: str, key: str) -> str:
    # Cache keys have a length and alphabet limit; idempotency keys are arbitrary text.
    return PREFIX + hashlib.sha256(f"{node_id}\x00{key}".encode()).hexdigest()


def idempotency_claim(*, node_id: str, key: str, message_id: str) -> bool:
    """True when `message_id` holds the key (claimed now, or earlier by itself)."""
    cache_key = _key(node_id, key)
    if cache.add(cache_key, message_id, timeout=settings.REACH_IDEMPOTENCY_TTL_S):
        return True
    holder = cache.get(cache_key)
    if holder is None:  # expired between the two calls
        return cache.add(cache_key, message_id, timeout=settings.REACH_IDEMPOTENCY_TTL_S)
    return holder == message_id


def idempotency_release(*, node_id: str, claims: list[tuple[str, str]]) -> None:
    """Give back keys claimed by a batch that did not commit."""
    for key, message_id in claims:
        cache_key = _key(node_id, key)
        if cache.get(cache_key) == message_id:
            cache.delete(cache_key)
