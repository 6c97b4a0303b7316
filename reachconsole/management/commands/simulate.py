"""`manage.py simulate`: a small cluster of simulated nodes against a running console."""

from __future__ import annotations

import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from messages import signing
from messages.mqtt_client import url_redacted
from reachconsole.dev.simulator import Knobs, SimulatedCluster


class Command(BaseCommand):
    help = "Run simulated nodes that register, heartbeat and trade tasks over MQTT."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--nodes", type=int, default=3, help="simulated nodes (default 3)")
        parser.add_argument("--agents", type=int, default=12,
                            help="agents, spread over the nodes (default 12)")
        parser.add_argument("--rate", type=float, default=20.0, help="tasks per second in all")
        parser.add_argument("--fail-rate", type=float, default=0.0,
                            help="share of tasks, 0 to 1, answered with ok=false "
                                 "(TASK_ERROR; default 0)")
        parser.add_argument("--busy-rate", type=float, default=0.0,
                            help="share of requests, 0 to 1, answered BUSY (default 0)")
        parser.add_argument("--nack-rate", type=float, default=0.0,
                            help="share of requests, 0 to 1, refused with a NACK (default 0)")
        parser.add_argument("--slow-ms", type=int, default=50,
                            help="milliseconds each task takes before its answer (default 50)")
        parser.add_argument("--kill-node-after", type=float, default=None,
                            help="seconds after which the last node goes silent (default: "
                                 "never)")
        parser.add_argument("--seed", type=int, default=7,
                            help="random seed: the same seed, the same traffic (default 7)")
        parser.add_argument("--url", default="http://127.0.0.1:8000",
                            help="the console's base URL")
        parser.add_argument("--token", default=None,
                            help="a service token (default: the first of REACH_SERVICE_TOKENS)")
        parser.add_argument("--mqtt-url", default=None, help="default: MQTT_URL")

    def handle(self, *args, **o) -> None:
        token = o["token"] or (settings.REACH_SERVICE_TOKENS[0].secret
                               if settings.REACH_SERVICE_TOKENS else None)
        mqtt_url = o["mqtt_url"] or settings.MQTT_URL
        if not token:
            raise CommandError("no service token: pass --token or set REACH_SERVICE_TOKENS")
        if not mqtt_url:
            raise CommandError("no broker: pass --mqtt-url or set MQTT_URL")
        cluster = SimulatedCluster(
            base_url=o["url"], token=token, mqtt_url=mqtt_url, nodes=o["nodes"],
            agents=o["agents"], seed=o["seed"], prefix=settings.MQTT_TOPIC_PREFIX,
            mqtt_protocol=settings.MQTT_PROTOCOL,
            keyring=signing.keyring_for(settings.REACH_SIGNING_KEYS),
            knobs=Knobs(rate=o["rate"], fail_rate=o["fail_rate"], busy_rate=o["busy_rate"],
                        nack_rate=o["nack_rate"], slow_ms=o["slow_ms"],
                        kill_node_after=o["kill_node_after"]),
        )
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        cluster.start()
        self.stdout.write(f"{o['nodes']} nodes, {o['agents']} agents → {o['url']} and "
                          f"{url_redacted(mqtt_url)}; Ctrl-C stops")
        while not stop.wait(10):
            self.stdout.write(f"sent {cluster.sent_requests} tasks, executed "
                              f"{sum(cluster.executions().values())}")
        cluster.stop()
