"""`manage.py simulate`: a small cluster of simulated nodes against a running console."""

from __future__ import annotations

import secrets
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from messages import signing
from messages.mqtt_client import url_redacted
from reachconsole.dev.simulator import (
    BrokerUnusable,
    SimulatedCluster,
    broker_protocol_detect,
    fault_arguments_add,
    knobs_from,
)


class Command(BaseCommand):
    help = "Run simulated nodes that register, heartbeat and trade tasks over MQTT."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--nodes", type=int, default=3, help="simulated nodes (default 3)")
        parser.add_argument("--agents", type=int, default=12,
                            help="agents, spread over the nodes (default 12)")
        parser.add_argument("--rate", type=float, default=20.0, help="tasks per second in all")
        fault_arguments_add(parser)
        parser.add_argument("--seed", type=int, default=7,
                            help="random seed: the same seed, the same traffic (default 7)")
        parser.add_argument("--url", default="http://127.0.0.1:8000",
                            help="the console's base URL")
        parser.add_argument("--token", default=None,
                            help="a service token (default: the first of REACH_SERVICE_TOKENS)")
        parser.add_argument("--mqtt-url", default=None,
                            help="the broker (default: MQTT_URL, else make run's embedded "
                                 "broker on 127.0.0.1:REACH_EMBEDDED_MQTT_PORT)")
        parser.add_argument("--mqtt-protocol", choices=["auto", "5", "3.1.1"], default="auto",
                            help="MQTT version (default auto: 5 where the broker takes it, "
                                 "else 3.1.1, which make run's embedded broker speaks)")
        parser.add_argument("--tag", default=None,
                            help="added to every node and agent name, so this cluster runs "
                                 "beside make run's own (default: 4 random letters; '' for "
                                 "the plain names)")
        parser.add_argument("--report-every", type=float, default=10.0,
                            help="seconds between progress lines (default 10)")

    def handle(self, *args, **o) -> None:
        token = o["token"] or (settings.REACH_SERVICE_TOKENS[0].secret
                               if settings.REACH_SERVICE_TOKENS else None)
        if not token:
            raise CommandError("no service token: pass --token (make run prints one at start) "
                               "or set REACH_SERVICE_TOKENS")
        mqtt_url = (o["mqtt_url"] or settings.MQTT_URL
                    or f"mqtt://127.0.0.1:{settings.REACH_EMBEDDED_MQTT_PORT}")
        mqtt_protocol = o["mqtt_protocol"]
        if mqtt_protocol == "auto":
            try:
                mqtt_protocol = broker_protocol_detect(mqtt_url)
            except (BrokerUnusable, ValueError) as exc:
                raise CommandError(str(exc)) from exc
            if mqtt_protocol == "3.1.1":
                self.stdout.write(f"{url_redacted(mqtt_url)} speaks MQTT 3.1.1 only (as make "
                                  "run's embedded broker does): the simulated nodes use it")
        tag = secrets.token_hex(2) if o["tag"] is None else o["tag"]
        cluster = SimulatedCluster(
            base_url=o["url"], token=token, mqtt_url=mqtt_url, nodes=o["nodes"],
            agents=o["agents"], seed=o["seed"], prefix=settings.MQTT_TOPIC_PREFIX,
            mqtt_protocol=mqtt_protocol, tag=tag,
            keyring=signing.keyring_for(settings.REACH_SIGNING_KEYS),
            knobs=knobs_from(o, rate=o["rate"]),
        )
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        cluster.start()
        names = ", ".join(n.node_id for n in cluster.nodes)
        self.stdout.write(f"{o['nodes']} nodes ({names}), {o['agents']} agents → {o['url']} "
                          f"and {url_redacted(mqtt_url)}; Ctrl-C stops")
        refused = cluster.connect_errors(timeout=10)
        if refused:
            cluster.stop()
            raise CommandError("the simulated nodes cannot use the broker: " + "; ".join(
                f"{node}: {why}" for node, why in refused.items()))
        while not stop.wait(o["report_every"]):
            self.stdout.write(self._progress(cluster))
        cluster.stop()
        self.stdout.write(self._progress(cluster))

    @staticmethod
    def _progress(cluster: SimulatedCluster) -> str:
        # "sent" is what the broker confirmed: a publish still queued in the client (the
        # broker away, or refusing us) has not left.
        waiting = cluster.sent_requests - cluster.published_requests
        line = (f"sent {cluster.published_requests} tasks, executed "
                f"{sum(cluster.executions().values())}")
        if waiting:
            line += f", {waiting} not confirmed by the broker yet"
        if cluster.http_errors:
            line += f", {cluster.http_errors} failed HTTP calls (see the log)"
        return line
