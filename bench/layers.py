"""Channels layers for the console's event stream, against Redis: events/s delivered to one
subscriber of a group.

Cases (each bounded by --events events or --seconds s of sending):
  core/pubsub per event     one `group_send` per event (channels_redis.core / .pubsub)
  core/pubsub batch B       what messages.events.EventPublisher does: events coalesced into
                            frames of B (100, 500), one `group_send` per frame, from one
                            long-lived event loop
  core/pubsub async_to_sync one `async_to_sync(group_send)` per event from a plain thread:
                            what code must NOT do (a new event loop and Redis connection
                            per call)
  EventPublisher            messages.events.publisher itself with the settings' layer
                            (pub/sub): 500 events per publish() call, each fanned out to
                            the timeline group and to its conversation's group (100
                            conversations here), so one call is ~101 group_sends

The subscriber is another process (as a Daphne consumer would be): it joins the group and
counts the events it receives. The events are real `message_events()` dicts.

    .venv/bin/python bench/layers.py [--events 10000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import common

GROUP = "a2a.timeline"
LAYERS = {
    "core": "channels_redis.core.RedisChannelLayer",
    "pubsub": "channels_redis.pubsub.RedisPubSubChannelLayer",
}
IDLE_S = 2.0  # the subscriber stops this long after the last event (lost ones never come)


def make_layer(kind: str, prefix: str):
    """As settings would configure it: hosts and prefix, every other option at default
    (the core layer drops past 100 messages waiting per channel)."""
    from channels_redis.core import RedisChannelLayer
    from channels_redis.pubsub import RedisPubSubChannelLayer

    cls = RedisChannelLayer if kind == "core" else RedisPubSubChannelLayer
    return cls(hosts=[common.REDIS_URL], prefix=prefix)


# --- the subscriber (its own process) ------------------------------------------------------------
def subscriber_main(kind: str, prefix: str, ready: Any, out: Any, deadline_s: float) -> None:
    out.put(asyncio.run(_subscribe(kind, prefix, ready, deadline_s)))


async def _subscribe(kind: str, prefix: str, ready: Any, deadline_s: float) -> dict:
    layer = make_layer(kind, prefix)
    channel = await layer.new_channel()
    await layer.group_add(GROUP, channel)
    state = {"events": 0, "frames": 0, "first": 0.0, "last": 0.0, "ended": False}
    reader = asyncio.create_task(_read(layer, channel, state))
    ready.put("ready")
    deadline = time.monotonic() + deadline_s
    # Never time a receive() out: the pub/sub layer unsubscribes a channel whose receive is
    # cancelled. Watch from outside and cancel once, at the end.
    while not state["ended"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if state["last"] and time.time() - state["last"] > IDLE_S:
            break
    reader.cancel()
    return {k: state[k] for k in ("events", "frames", "first", "last", "ended")}


async def _read(layer, channel: str, state: dict) -> None:
    while True:
        message = await layer.receive(channel)
        if message["type"] == "bench.end":
            state["ended"] = True
            return
        count = len(message["events"]) if "events" in message else 1
        state["events"] += count
        state["frames"] += 1
        state["last"] = time.time()
        state["first"] = state["first"] or state["last"]


# --- the senders ------------------------------------------------------------------------------
async def send_per_event(layer, events: list[dict], seconds: float) -> int:
    deadline = time.monotonic() + seconds
    sent = 0
    for event in events:
        if time.monotonic() > deadline:
            break
        await layer.group_send(GROUP, {"type": "a2a.event", "event": event})
        sent += 1
    return sent


async def send_batched(layer, events: list[dict], seconds: float, size: int) -> int:
    """EventPublisher's way: one frame (`a2a.events`) per `size` events."""
    deadline = time.monotonic() + seconds
    sent = 0
    for start in range(0, len(events), size):
        if time.monotonic() > deadline:
            break
        chunk = events[start : start + size]
        await layer.group_send(GROUP, {"type": "a2a.events", "events": chunk})
        sent += len(chunk)
    return sent


def send_async_to_sync(layer, events: list[dict], seconds: float) -> int:
    """From a plain thread, one async_to_sync call per event (the anti-pattern)."""
    from asgiref.sync import async_to_sync

    deadline = time.monotonic() + seconds
    result = {"sent": 0}

    def body() -> None:
        for event in events:
            if time.monotonic() > deadline:
                break
            async_to_sync(layer.group_send)(GROUP, {"type": "a2a.event", "event": event})
            result["sent"] += 1

    worker = threading.Thread(target=body, name="bench-async-to-sync")
    worker.start()
    worker.join()
    return result["sent"]


def publisher_frames(events: list[dict], size: int) -> int:
    """How many group_sends EventPublisher.publish makes for these events, `size` a call."""
    from messages.events import event_groups

    return sum(len({g for e in events[i : i + size] for g in event_groups(e)})
               for i in range(0, len(events), size))


def send_with_publisher(events: list[dict], seconds: float, size: int) -> int:
    """The real messages.events.publisher: the settings' layer (pub/sub, our prefix), and
    each batch fanned out to the timeline and to every conversation's group in it."""
    from messages.events import publisher

    deadline = time.monotonic() + seconds
    pending, sent = [], 0
    for start in range(0, len(events), size):
        if time.monotonic() > deadline:
            break
        chunk = events[start : start + size]
        pending.append(publisher.publish(chunk))
        sent += len(chunk)
    for future in pending:
        future.result(timeout=60)
    return sent


async def end_marker(layer) -> None:
    # Sent a few times: a full core-layer channel drops what arrives while it is full.
    for _ in range(5):
        await layer.group_send(GROUP, {"type": "bench.end"})
        await asyncio.sleep(0.2)


# --- one case ---------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    layer: str
    how: str  # per-event | batch | async_to_sync
    batch: int = 1
    sent: int = 0
    delivered: int = 0
    send_s: float = 0.0
    events_per_s: float | None = None
    send_calls_per_s: float | None = None
    lost: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


def run_case(case: Case, events: list[dict], seconds: float, tag: str) -> Case:
    # Fresh keys and channels per case; the real publisher uses the settings' prefix.
    prefix = tag if case.how == "publisher" else f"{tag}{case.layer}{case.how[:3]}{case.batch}"
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    sub = ctx.Process(target=subscriber_main, args=(case.layer, prefix, ready, out,
                                                    seconds + 15), daemon=True)
    sub.start()
    try:
        ready.get(timeout=20)
        start = time.time()
        case.sent, case.send_s = _send(case, events, seconds, prefix)
        got = out.get(timeout=seconds + 25)
    finally:
        sub.join(5)
        if sub.is_alive():
            sub.terminate()
    return _score(case, got, start, events)


def _send(case: Case, events: list[dict], seconds: float, prefix: str) -> tuple[int, float]:
    """Events sent and the seconds spent sending them (the end marker not included)."""
    layer = make_layer(case.layer, prefix)
    if case.how == "publisher":
        began = time.monotonic()
        sent = send_with_publisher(events, seconds, case.batch)
        took = time.monotonic() - began
        asyncio.run(end_marker(layer))
        return sent, took
    if case.how == "async_to_sync":
        began = time.monotonic()
        sent = send_async_to_sync(layer, events, seconds)
        took = time.monotonic() - began
        asyncio.run(end_marker(make_layer(case.layer, prefix)))
        return sent, took

    async def go() -> tuple[int, float]:
        began = time.monotonic()
        if case.how == "batch":
            sent = await send_batched(layer, events, seconds, case.batch)
        else:
            sent = await send_per_event(layer, events, seconds)
        took = time.monotonic() - began
        await end_marker(layer)
        return sent, took

    return asyncio.run(go())


def _score(case: Case, got: dict, start: float, events: list[dict]) -> Case:
    case.delivered = got["events"]
    case.lost = case.sent - case.delivered
    span = (got["last"] - start) if got["last"] else 0.0
    case.events_per_s = case.delivered / span if span > 0 else None
    calls = case.sent / case.batch if case.how == "batch" else case.sent
    if case.how == "publisher":
        calls = publisher_frames(events[: case.sent], case.batch)
    case.send_calls_per_s = calls / case.send_s if case.send_s > 0 else None
    case.notes = {"frames_received": got["frames"], "end_marker_seen": got["ended"]}
    return case


# --- events and cases ---------------------------------------------------------------------------
def sample_events(n: int) -> list[dict]:
    """Real event dicts, from the console's own message_events()."""
    from django.utils import timezone

    from messages.events import message_events
    from messages.models import Message

    now = timezone.now()
    out = []
    for i in range(n):
        row = Message(pk=i + 1, message_id=f"m-{i}", task_id=f"task-{i}",
                      message_type="TASK_REQUEST", direction="OBSERVED", status="OBSERVED",
                      from_agent_id="bench.sender", to_agent_id="bench.worker",
                      target_node_id=f"node-{i % 8}", conversation_id=f"conv-{i % 100}",
                      created_at=now, updated_at=now)
        out.extend(message_events(row, previous=""))
    return out


def cases() -> list[Case]:
    out = []
    for layer in LAYERS:
        out.append(Case(f"{layer}: group_send per event", layer, "per-event"))
        for size in (100, 500):
            out.append(Case(f"{layer}: batch of {size} per group_send", layer, "batch", size))
        out.append(Case(f"{layer}: async_to_sync per event (thread)", layer, "async_to_sync"))
    # The console's own code path, conversation fan-out included (settings use pub/sub).
    out.append(Case("pubsub: EventPublisher.publish, 500/call", "pubsub", "publisher", 500))
    return out


def print_table(results: list[Case]) -> None:
    headers = ["case", "sent", "delivered", "lost", "events/s", "group_send/s", "send s"]
    rows = [[c.name, f"{c.sent:,}", f"{c.delivered:,}", f"{c.lost:,}",
             common.fmt(c.events_per_s, 0), common.fmt(c.send_calls_per_s, 0),
             common.fmt(c.send_s, 2)] for c in results]
    print()
    print(common.table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=10.0, help="sending cap per case")
    args = ap.parse_args(argv)
    try:
        common.services_check()
    except common.ServiceDown as exc:
        print(f"BENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    tag = common.run_tag("l")
    common.django_setup(channel_prefix=tag)
    events = sample_events(args.events)
    results = []
    for case in cases():
        print(f"... {case.name}", flush=True)
        results.append(run_case(case, events, args.seconds, tag))
    common.redis_cleanup(tag)
    print_table(results)
    path = common.write_result("layers", {
        "bench": "layers", "machine": common.machine(), "code": common.git_state(),
        "config": vars(args) | {
            "redis": common.REDIS_URL, "group": GROUP, "layers": LAYERS},
        "command": " ".join([".venv/bin/python", "bench/layers.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "results": [asdict(c) for c in results]})
    print(f"\nresults: {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
