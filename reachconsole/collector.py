"""What `/metrics` shows: the whole console's numbers, whichever process is scraped.

A prometheus-client collector over shared state, not one registry per process: Daphnes and
workers run on many machines, so nothing is summed across processes at scrape time. Gauges
are read from the database (cheap, indexed reads: the roster's counts, the kept in-flight and
held totals, the open rows), counters and the publish → ACK histogram from the shared
counters every process adds to (reachconsole.core.metrics). Each source that cannot be read
is left out and said so in `reach_scrape_source_ok`, so the rest is still scraped.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterator

from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from alarms.selectors import active_by_kind
from messages.partitions import history_partitioned, partitions_list
from messages.selectors import load_totals, open_counts, retention_behind_s
from messages.tally import LATENCY
from reachconsole.core.metrics import HIST_PREFIX, counters_snapshot, histogram_read
from roster.hearing import bridges_hearing
from roster.models import Agent, ClusterNode, Consistency
from roster.selectors import roster_counts

log = logging.getLogger(__name__)

# Shared counter `name:label…` → (family, help, label names). Anything else counted is
# shown as `reach_<name>_total`, its label (if any) as `reason`.
COUNTER_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "messages": ("reach_messages", "Message rows that entered each status (new rows included), "
                 "by status and message type", ("status", "type")),
    "ingested": ("reach_bridge_ingested", "Messages stored from the bus, by the bridge instance "
                 "that stored them", ("instance",)),
    "reconnects": ("reach_bridge_reconnects", "Reconnections to the MQTT broker, by bridge "
                   "instance", ("instance",)),
    "rejected": ("reach_rejected", "Payloads dropped as not an A2A envelope, by reason",
                 ("reason",)),
    "cards": ("reach_profile_cards", "A2A-over-MQTT Agent Cards heard, by what they did to "
              "the roster (registered, updated, offline, online, removed, unchanged, absent)",
              ("outcome",)),
    "profile_cards_rejected": ("reach_profile_cards_rejected", "A2A-over-MQTT Agent Cards "
                               "refused whole, by reason", ("reason",)),
    "profile_violations": ("reach_profile_violations", "A2A-over-MQTT traffic that breaks the "
                           "profile, by rule (flagged on its row too)", ("rule",)),
    "retries": ("reach_retries", "New attempts of a task (attempt 2 and later: no ACK in "
                "time, a retryable NACK, or BUSY)", ()),
}
DUPLICATES = {"duplicate_message_id": "message_id",
              "duplicate_idempotency_key": "idempotency_key"}
GAUGES = frozenset({"reach_agents", "reach_agents_stale", "reach_nodes",
                    "reach_roster_consistency", "reach_inflight", "reach_held",
                    "reach_messages_open", "reach_bridge_connected", "reach_scrape_source_ok",
                    "reach_alarms_active", "reach_retention_behind_seconds"})
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_warned_at: dict[str, float] = {}


def _warn(source: str, exc: Exception) -> None:
    now = time.monotonic()
    if now - _warned_at.get(source, -60.0) >= 60:
        _warned_at[source] = now
        log.warning("/metrics could not read the %s (%s: %s); scraped without it", source,
                    type(exc).__name__, exc)


def counter_families(snapshot: dict[str, int]) -> list[Metric]:
    """The shared counters as Prometheus families; the named ones are always present."""
    families: dict[str, CounterMetricFamily] = {}
    unlabeled_seen: set[str] = set()
    for metric, doc, labels in COUNTER_FAMILIES.values():
        families[metric] = CounterMetricFamily(metric, doc, labels=list(labels))
    duplicates = dict.fromkeys(DUPLICATES.values(), 0)
    generic: dict[str, list[tuple[str | None, int]]] = defaultdict(list)
    for name, value in snapshot.items():
        if name.startswith(HIST_PREFIX):
            continue
        if name in DUPLICATES:
            duplicates[DUPLICATES[name]] += value
            continue
        base, _, label = name.partition(":")
        if base in COUNTER_FAMILIES:
            metric, _, labels = COUNTER_FAMILIES[base]
            values = label.split(":", len(labels) - 1) if labels else []
            if labels and (len(values) != len(labels) or not all(values)):
                continue  # not in this family's shape: nothing to show it as
            if not labels:
                unlabeled_seen.add(metric)
            families[metric].add_metric(values, value)
        elif _NAME.match(base) and f"reach_{base}" not in GAUGES:
            generic[base].append((label or None, value))
    for metric, _, labels in COUNTER_FAMILIES.values():
        if not labels and metric not in unlabeled_seen:
            families[metric].add_metric([], 0)
    dup = CounterMetricFamily("reach_duplicates", "Messages received again and not executed "
                              "again, by what repeated", labels=["kind"])
    for kind, value in duplicates.items():
        dup.add_metric([kind], value)
    out: list[Metric] = [*families.values(), dup]
    for base, samples in sorted(generic.items()):
        labeled = any(label is not None for label, _ in samples)
        family = CounterMetricFamily(f"reach_{base}", f"Counted by the console: {base}",
                                     labels=["reason"] if labeled else [])
        for label, value in samples:
            family.add_metric([label or ""] if labeled else [], value)
        out.append(family)
    hist = histogram_read(snapshot, LATENCY)
    out.append(HistogramMetricFamily(
        "reach_delivery_latency_seconds", "From the broker taking a task request (PUBACK) to "
        "its receiver's ACK", buckets=hist.buckets, sum_value=hist.sum_s))
    return out


def database_families() -> list[Metric]:
    now = timezone.now()
    counts = roster_counts(now=now)
    agents = GaugeMetricFamily("reach_agents", "Agents in the roster, by status",
                               labels=["status"])
    for status, value in ((Agent.Status.ONLINE, counts.online),
                          (Agent.Status.DRAINING, counts.draining),
                          (Agent.Status.OFFLINE, counts.offline)):
        agents.add_metric([status], value)
    stale = GaugeMetricFamily("reach_agents_stale", "Agents not OFFLINE that missed two "
                              "heartbeats in a row (also counted in reach_agents)",
                              value=counts.stale)
    by_node_status = dict.fromkeys(ClusterNode.Status.values, 0)
    by_node_status.update(ClusterNode.objects.order_by().values_list("status")
                          .annotate(n=Count("id")))
    nodes = GaugeMetricFamily("reach_nodes", "Cluster nodes, by status", labels=["status"])
    for status, value in by_node_status.items():
        nodes.add_metric([status], value)
    # The class the last reconciliation stored on each agent's node (roster/reconcile.py).
    by_class = dict.fromkeys(Consistency.values, 0)
    by_class.update(Agent.objects.order_by().values_list("node__consistency")
                    .annotate(n=Count("id")))
    consistency = GaugeMetricFamily("reach_roster_consistency", "Agents by what the last "
                                    "reconciliation said of their node: OK, STALE or UNKNOWN",
                                    labels=["class"])
    for cls, value in by_class.items():
        consistency.add_metric([cls], value)
    inflight, held = load_totals()
    open_rows = GaugeMetricFamily("reach_messages_open", "Message rows not ended yet (within "
                                  "their deadline), by status", labels=["status"])
    for status, value in open_counts().items():
        open_rows.add_metric([status], value)
    connected = GaugeMetricFamily("reach_bridge_connected", "1 for each MQTT bridge that hears "
                                  "the bus; absent for one that does not", labels=["instance"])
    for row in bridges_hearing(now=now):
        connected.add_metric([row.instance], 1)
    alarms = GaugeMetricFamily("reach_alarms_active", "Alarms whose condition holds now "
                               "(acknowledged or not), by kind", labels=["kind"])
    for kind, value in active_by_kind().items():
        alarms.add_metric([kind], value)
    return [agents, stale, nodes, consistency, alarms,
            GaugeMetricFamily("reach_inflight", "Task requests sent and not yet answered, "
                              "over all agents", value=inflight),
            GaugeMetricFamily("reach_held", "Task requests held back behind their agent's "
                              "maxInflight, over all agents", value=held),
            open_rows, connected,
            GaugeMetricFamily("reach_retention_behind_seconds", "How far the oldest message is "
                              "past REACH_RETENTION_DAYS: under a minute while the prune "
                              "(each minute) keeps up",
                              value=retention_behind_s(now=now)),
            GaugeMetricFamily("reach_history_partitions", "Partitions of the message history "
                              "(messages/partitions.py); 0 where it is one table pruned by "
                              "batched deletes (SQLite, REACH_PARTITIONS=off)",
                              value=len(partitions_list()) if history_partitioned() else 0)]


class ConsoleCollector:
    """Read at every scrape; nothing is kept in the process between scrapes."""

    def collect(self) -> Iterator[Metric]:
        ok = {}
        try:
            families = counter_families(counters_snapshot())
            ok["cache"] = True
        except Exception as exc:  # Redis down: the database's numbers still help
            _warn("shared counters", exc)
            families, ok["cache"] = [], False
        try:
            families += database_families()
            ok["database"] = True
        except Exception as exc:  # the database down: the counters still help
            _warn("database", exc)
            ok["database"] = False
        yield from families
        sources = GaugeMetricFamily("reach_scrape_source_ok", "1 when this scrape could read "
                                    "the source, 0 when it is left out", labels=["source"])
        for source, good in ok.items():
            sources.add_metric([source], int(good))
        yield sources


registry = CollectorRegistry(auto_describe=False)
registry.register(ConsoleCollector())
