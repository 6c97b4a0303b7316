"""The chain of probes by which one bridge proves up to when it has heard the bus
(roster/hearing.py), and notices a connection that stopped moving without closing.

A bridge publishes a small probe to its own topic every PROBE_EVERY_S. One that comes back
was published after everything the broker handed over before it, so once those are stored
the console has heard the bus up to the probe's send time. The send times are this record's
own, never read from the payload (anyone allowed on the topic could write one), and only
probes sent since the broker last granted the bridge's subscriptions count (`renew`). No
paho and no database here: the bridge's session (messages/mqtt_session.py) sends what this
says, and its owner loop (messages/bridge.py) reports what it holds.
"""

from __future__ import annotations

import collections
import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

PROBES_KEPT = 200  # probes awaited at most (100 s of them): older ones are given up


@dataclass(frozen=True, slots=True)
class Probe:
    """One of our probes, back through the broker: once everything received before it is
    stored, the console has heard the bus up to when probe `seq` was sent."""
    nonce: str
    seq: int


def probe_decode(payload: bytes) -> Probe | None:
    try:
        data = json.loads(payload)
        return Probe(str(data["nonce"]), int(data["seq"]))
    except (ValueError, TypeError, KeyError):
        return None


class ProbeChain:
    """`renew` (paho's thread, on the SUBACK of what the bridge must hear) starts a chain;
    `send` gives the next probe's payload; `back` (owner thread, after the ingest of what
    came before) extends the chain; `heard` is hearing without a gap, or None."""

    def __init__(self) -> None:
        self.nonce = ""  # "" : nothing proves anything until the next SUBACK
        self._seq = 0
        self._out: collections.OrderedDict[int, tuple[str, datetime]] = (
            collections.OrderedDict())  # seq → (nonce, send time), until it comes back
        # (since, through, the last seq in it, its nonce): hearing without a gap.
        self._heard: tuple[datetime, datetime, int, str] | None = None
        self._back_at = 0.0  # monotonic, when paho last took one back (any thread)
        self._waiting_since = 0.0  # monotonic, the first probe sent since one came back

    def renew(self) -> None:
        self.nonce = secrets.token_hex(8)

    def forget(self) -> None:
        """The connection ended: nothing of it proves anything any more (until `renew`)."""
        self.nonce = ""

    def restart(self) -> None:
        """What the bridge hears changes: no proof until the broker has granted the new
        subscriptions (their SUBACK renews the nonce), or the time before would count as
        heard. Probes go on meanwhile: they still tell a dead connection."""
        self._heard = None

    def noted_back(self) -> None:
        """paho's thread: one of ours arrived (counted before it is queued behind others)."""
        self._back_at = time.monotonic()

    def unanswered_for(self, now: float, *, connected_at: float) -> float:
        """Seconds the oldest probe still out has waited (none before `connected_at`)."""
        if self._back_at >= self._waiting_since:
            self._waiting_since = now  # everything before this one came back
        return now - max(self._waiting_since, connected_at)

    def broken(self, now: float) -> None:
        """The connection was called dead: one reconnect per wait, and a new chain."""
        self._waiting_since = now
        self.nonce = ""

    def send(self) -> bytes:
        self._seq += 1
        self._out[self._seq] = (self.nonce, timezone.now())
        while len(self._out) > PROBES_KEPT:
            self._out.popitem(last=False)
        return json.dumps({"nonce": self.nonce, "seq": self._seq}).encode()

    def back(self, probes: list[Probe]) -> None:
        """Extend the chain, or start a new one. One missing (QoS 0 dropped: so may
        heartbeats have been) breaks it, as does a new connection (what was published in
        between may be gone)."""
        for probe in probes:
            sent = self._out.get(probe.seq)
            if sent is None or sent[0] != probe.nonce or probe.nonce != self.nonce:
                continue  # not ours, or from before the subscriptions it proves
            del self._out[probe.seq]
            heard = self._heard
            if heard is None or heard[3] != probe.nonce or probe.seq != heard[2] + 1:
                self._heard = (sent[1], sent[1], probe.seq, probe.nonce)
            else:
                self._heard = (heard[0], sent[1], probe.seq, probe.nonce)

    @property
    def heard(self) -> tuple[datetime, datetime] | None:
        """(since, through) of hearing without a gap on the current chain, or None."""
        heard = self._heard
        if heard is None or not self.nonce or heard[3] != self.nonce:
            return None
        return heard[0], heard[1]
