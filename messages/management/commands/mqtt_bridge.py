"""Run the MQTT bridge in the foreground, for debugging (production runs it in the worker)."""

from __future__ import annotations

import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from messages.bridge import Bridge
from reachconsole.core.identity import console_id_wait


class Command(BaseCommand):
    help = "Run the MQTT bridge in the foreground until Ctrl-C."

    def handle(self, *args, **options) -> None:
        if not settings.MQTT_URL:
            raise CommandError("MQTT_URL is not set: name the broker, e.g. mqtt://127.0.0.1:1883")
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if console_id_wait(stop) is None:  # its client id carries the console's name
            return
        bridge = Bridge.from_settings()
        bridge.start()
        self.stdout.write(f"bridge {bridge.client_id} on {bridge.url}; Ctrl-C stops it")
        while not stop.wait(5):
            self.stdout.write(str(bridge.stats()))
        bridge.stop()
