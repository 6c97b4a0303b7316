"""The hand-over from paho's thread to the bridge's owner thread (messages/mqtt_session.py):
what comes is taken in order, a batch at most, paho waits at the limit (so the broker keeps
the rest), and a wake (a PUBACK, due outbox rows) starts the owner's turn."""

from __future__ import annotations

import threading

from messages.mqtt_session import Confirmed, Handoff, Received
from messages.probes import Probe


def received(n: int) -> Received:
    return Received(topic="p/node/a/inbox", payload=b"{}", mid=n, qos=1, generation=1)


def test_what_comes_is_taken_in_order_a_batch_at_a_time():
    handoff = Handoff(limit=100)
    items = [received(1), Probe("nonce", 1), received(2), received(3)]
    for item in items:
        handoff.put(item)
    assert handoff.queued() == 4
    assert handoff.take(0, 3) == items[:3]
    assert handoff.take(0, 3) == items[3:]
    assert handoff.take(0, 3) == []


def test_paho_waits_at_the_limit_until_the_owner_takes():
    handoff = Handoff(limit=2)
    handoff.put(received(1))
    handoff.put(received(2))
    third = threading.Thread(target=handoff.put, args=(received(3),), daemon=True)
    third.start()
    third.join(0.3)
    assert third.is_alive() and handoff.queued() == 2  # held: paho reads no further
    assert [r.mid for r in handoff.take(0, 1)] == [1]
    third.join(10)
    assert not third.is_alive()
    assert [r.mid for r in handoff.take(0, 10)] == [2, 3]


def test_a_waiting_owner_is_woken_by_a_message_a_confirm_or_a_wake():
    handoff = Handoff(limit=10)
    for wake, brings in ((lambda: handoff.put(received(7)), [received(7)]),
                         (lambda: handoff.confirm(Confirmed(mid=1, failure="", at=None)), []),
                         (handoff.wake, [])):
        taken: list = []
        owner = threading.Thread(target=lambda out=taken: out.append(handoff.take(60, 10)),
                                 daemon=True)
        owner.start()
        owner.join(0.2)
        assert owner.is_alive()  # nothing to do: it waits
        wake()
        owner.join(10)
        assert not owner.is_alive(), "the owner slept through its wake"
        assert taken[0] == brings
    assert [c.mid for c in handoff.confirms()] == [1]


def test_a_put_between_the_owners_take_and_its_next_wait_is_never_missed():
    handoff = Handoff(limit=100_000)
    total = 20_000
    got: list = []

    def owner() -> None:
        # A lost wake would leave it asleep for a minute with items queued.
        while len(got) < total:
            got.extend(handoff.take(60, 500))

    taker = threading.Thread(target=owner, daemon=True)
    taker.start()
    for n in range(total):
        handoff.put(received(n))
    taker.join(30)
    assert not taker.is_alive(), f"the owner sleeps with {handoff.queued()} items queued"
    assert [r.mid for r in got] == list(range(total))
