"""The Celery app: the same tasks run in the embedded process and in production workers."""

from __future__ import annotations

import os

from celery import Celery, bootsteps

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "reachconsole.settings")

app = Celery("reachconsole")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()



class BridgeStep(bootsteps.StartStopStep):
    """The MQTT bridge lives as long as the worker: a bootstep, not a task, because a task
    running for hours is redelivered after the broker's visibility timeout and a second
    bridge would appear."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.bridge = None

    def start(self, parent) -> None:
        from django.conf import settings

        if not settings.REACH_BRIDGE or not settings.MQTT_URL:
            return
        from messages.bridge import Bridge

        self.bridge = Bridge.from_settings()
        self.bridge.start()

    def stop(self, parent) -> None:
        if self.bridge is not None:
            self.bridge.stop()
            self.bridge = None


app.steps["worker"].add(BridgeStep)
