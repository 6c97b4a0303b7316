"""A token that changes whenever an agent joins or leaves the roster.

Readers that keep a copy of the set of agent ids (the directory's substring index) compare it
instead of counting rows; roster/services.py changes it on every join and leave.
"""

from __future__ import annotations

import uuid

from django.core.cache import cache
from django.db import transaction

ROSTER_GENERATION_KEY = "roster-generation"


def roster_generation() -> str:
    """Changes whenever an agent joins or leaves the roster: readers that keep a copy of the
    set of agent ids (the directory's substring index) compare it instead of counting rows."""
    generation = cache.get(ROSTER_GENERATION_KEY)
    if generation is None:
        generation = uuid.uuid4().hex
        if not cache.add(ROSTER_GENERATION_KEY, generation, timeout=None):
            generation = cache.get(ROSTER_GENERATION_KEY) or generation
    return generation


def roster_changed() -> None:
    # Now, for readers in this transaction, and again after commit, for everyone else: a
    # reader that copied the set between the two copies it again.
    def bump() -> None:
        cache.set(ROSTER_GENERATION_KEY, uuid.uuid4().hex, timeout=None)

    bump()
    transaction.on_commit(bump)
