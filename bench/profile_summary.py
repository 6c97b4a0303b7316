"""Where the console's ingest time goes: a py-spy raw profile, folded by phase.

bench/ingest.py --profile records the bench process with
`py-spy record --format raw --threads --gil`: only samples of the thread holding the GIL,
so the samples add up to the Python CPU time of the process, which is what a GIL-bound
bridge runs out of. Each stack is put in the phase of its deepest known frame; the paho
network thread and the event-publishing thread are phases of their own.

    .venv/bin/python bench/profile_summary.py bench/results/profile-burst-<run>.txt [rows]
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

# Deepest match wins: a frame name (function as py-spy prints it) → the phase it stands for.
PHASES: dict[str, str] = {
    "Handoff.take": "bridge owner: taking work off the queue",
    "Bridge._ingest": "ingest: other",
    "messages_ingest": "ingest: other",
    "parse_topic": "ingest: topic parse",
    "decode": "ingest: envelope decode (protocol.decode)",
    "_row": "ingest: Message(...) per row (inbound._row)",
    "_split_duplicates": "ingest: idempotency lookup",
    "messages_insert_new": "insert: other Python in messages_insert_new",
    "Field.get_db_prep_save": "insert: per-value get_db_prep_save/pre_save",
    "Field.pre_save": "insert: per-value get_db_prep_save/pre_save",
    "DateTimeField.pre_save": "insert: per-value get_db_prep_save/pre_save",
    "BaseCursor._convert_query": "insert: psycopg query parse + dump (multi-row VALUES, uncached)",
    "Connection.wait": "insert: waiting on PostgreSQL",
    "message_events": "ingest: message_events per row",
    "changes_apply": "ingest: changes_apply",
    "Atomic.__enter__": "transaction begin",
    "Atomic.__exit__": "transaction commit",
    "EventPublisher.publish": "events: grouping + hand-off (on_commit)",
    "close_old_connections": "close_old_connections",
    "DatabaseWrapper.close_if_health_check_failed": "health-check SELECT 1 on every batch",
    "MqttSession.ack": "PUBACKs (client.ack)",
    "Bridge._heartbeat": "heartbeat",
    "LocalCounter.flush": "metric counters flush (Redis)",
    "Bridge._confirm": "confirm PUBACKs of our publishes",
    "Bridge._publish": "publish",
}
# Below these, a frame of another phase is part of this one (a commit's wait is the commit's).
OWNING = (
    "DatabaseWrapper.close_if_health_check_failed", "Atomic.__exit__", "Atomic.__enter__",
    "close_old_connections", "MqttSession.ack", "Bridge._heartbeat", "LocalCounter.flush",
    "EventPublisher.publish",
)


# py-spy's --rate for bench/ingest.py and bench/ingest_cpu.py: samples a second, which turn
# the counts into seconds. BENCH_PROFILE_RATE=1000 for a finer look at a short run.
SAMPLE_HZ = int(os.environ.get("BENCH_PROFILE_RATE", "200"))
THREAD_PHASES = {
    "paho-mqtt-client": "paho network thread: read, parse, PUBACK, on_message",
    "a2a-events": "a2a-events thread: channel-layer group_send to Redis",
    "baseline-flusher": "baseline flusher: JSON -> row tuples -> batched INSERT",
}


def _name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def phase_of(thread: str, frames: list[str], owner: str = "mqtt-bridge") -> str:
    for prefix, phase in THREAD_PHASES.items():
        if thread.startswith(prefix):
            return phase
    if thread != owner:
        return "bench harness threads"
    names = [_name(f) for f in frames]
    for owner in OWNING:
        if owner in names:
            return PHASES[owner]
    for name in reversed(names):
        if name in PHASES:
            return PHASES[name]
    return "bridge owner: other"


def summarize(path: Path, owner: str = "mqtt-bridge") -> Counter:
    phases: Counter = Counter()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(";")
        if not count.isdigit() or ": " not in head:
            continue
        thread = head.split(": ", 1)[1]
        phases[phase_of(thread, rest.split(";"), owner)] += int(count)
    return phases


def report(path: Path, rows: int | None = None, owner: str = "mqtt-bridge") -> str:
    """`owner`: the thread that runs messages_ingest (the bridge's, or a bench's own)."""
    phases = summarize(path, owner)
    total = sum(phases.values())
    if not total:
        return f"no samples in {path}"
    lines = [f"GIL held: {total} samples = {total / SAMPLE_HZ:.2f} s of Python CPU"
             + (f", {total / SAMPLE_HZ / rows * 1e6:.0f} us per stored row" if rows else ""),
             f"{'phase':66} {'samples':>7} {'share':>6}" + (f" {'us/row':>7}" if rows else "")]
    for phase, n in phases.most_common():
        per_row = f" {n / SAMPLE_HZ / rows * 1e6:7.0f}" if rows else ""
        lines.append(f"{phase:66} {n:7d} {n / total:6.1%}{per_row}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(report(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))
