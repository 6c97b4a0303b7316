"""The window of idempotency keys already taken for execution on this node.

Kept in the Django cache: Redis in production, so every worker and every console instance
shares it; the process's memory in the embedded console. The first transmission to claim a
key is the one that runs; a later transmission of the same work (another message id, same
key) inside the window is a duplicate. A redelivery of the claiming transmission itself (same
message id, e.g. after a crash before commit) still runs. Claims made by a batch that rolls
back are released.

It also holds the marks stand-in copies leave (`copies_stood_in`): a publish to the console's
own inbox reaches a bridge through the shared group and, as a stand-in, through each bridge's
plain subscription (messages/subscriptions.py). When a stand-in is stored first, the group's copy
that follows must not be taken for a repeat of it; the mark says so, once.

Left as it is: if the claiming transmission is lost for good (a crash before commit *and* a
broker that loses the redelivery), later transmissions are answered as duplicates until the
window expires.
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.core.cache import cache

PREFIX = "idem:"
TWIN_PREFIX = "twin:"
# How long the group's copy may trail its stand-in: milliseconds normally; a share queued
# for a stopped bridge comes when that bridge is back, and one later than this is answered
# as the repeat it then looks like.
TWIN_TTL_S = 600


def _key(node_id: str, key: str) -> str:
    # Cache keys have a length and alphabet limit; idempotency keys are arbitrary text.
    return PREFIX + hashlib.sha256(f"{node_id}\x00{key}".encode()).hexdigest()


def idempotency_claim(*, node_id: str, key: str, message_id: str) -> str:
    """Whether `message_id` holds the key: "added" (claimed now), "held" (claimed earlier by
    itself: a redelivery), or "" (another transmission holds it). Only an "added" claim is
    the caller's to give back."""
    cache_key = _key(node_id, key)
    if cache.add(cache_key, message_id, timeout=settings.REACH_IDEMPOTENCY_TTL_S):
        return "added"
    holder = cache.get(cache_key)
    if holder is None:  # expired between the two calls
        added = cache.add(cache_key, message_id, timeout=settings.REACH_IDEMPOTENCY_TTL_S)
        return "added" if added else ""
    return "held" if holder == message_id else ""


def idempotency_release(*, node_id: str, claims: list[tuple[str, str]]) -> None:
    """Give back keys claimed by a batch that did not commit."""
    for key, message_id in claims:
        cache_key = _key(node_id, key)
        if cache.get(cache_key) == message_id:
            cache.delete(cache_key)


def _twin_key(node_id: str, message_id: str) -> str:
    return TWIN_PREFIX + hashlib.sha256(f"{node_id}\x00{message_id}".encode()).hexdigest()


def copies_stood_in(*, node_id: str, message_ids: list[str]) -> None:
    """Stand-in copies of these messages were stored first: mark each for its group copy.
    Called inside the storing transaction, so a group copy waiting on the same row sees
    the mark once the row is there."""
    cache.set_many({_twin_key(node_id, mid): 1 for mid in message_ids}, timeout=TWIN_TTL_S)


def copies_twin_take(*, node_id: str, message_ids: list[str]) -> set[str]:
    """Which of these messages are the group copy of a stored stand-in; each mark counts
    once, so a real repeat later is answered as one. Two round trips a batch."""
    if not message_ids:
        return set()
    keys = {_twin_key(node_id, mid): mid for mid in message_ids}
    found = cache.get_many(list(keys))
    if found:
        cache.delete_many(list(found))
    return {keys[key] for key in found}
