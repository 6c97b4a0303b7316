"""The Celery app: the same tasks run in the embedded process and in production workers."""

from __future__ import annotations

import logging
import os
import threading

from celery import Celery, bootsteps

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "reachconsole.settings")

app = Celery("reachconsole")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
log = logging.getLogger(__name__)



def _reconcile_at_start() -> None:
    """Classify the cluster's nodes once before this worker's bridge routes work, bounded by
    REACH_RECONCILE_TIMEOUT_S for the authority (then UNKNOWN). A failure here never keeps
    the worker from starting: the periodic run tries again."""
    from roster.models import Reconciliation
    from roster.reconcile import cluster_reconcile

    try:
        run = cluster_reconcile(trigger=Reconciliation.Trigger.STARTUP)
        log.info("reconciliation at start against %s: %s in %d ms", run.authority, run.counts,
                 run.duration_ms)
    except Exception:
        log.exception("reconciliation at start failed; the periodic run will try again")


class BridgeStep(bootsteps.StartStopStep):
    """The MQTT bridge lives as long as the worker: a bootstep, not a task, because a task
    running for hours is redelivered after the broker's visibility timeout and a second
    bridge would appear.

    Its client id and share group carry the console's name, read from the database
    (reachconsole/core/identity.py): a worker started while the database is down starts
    its bridge once the database answers, from a thread of its own, instead of failing to
    start (a supervisor would only restart it into the same state)."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.bridge = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None

    def start(self, parent) -> None:
        from django.conf import settings

        from reachconsole.core.identity import console_id_warm

        _reconcile_at_start()
        if not settings.REACH_BRIDGE or not settings.MQTT_URL:
            return
        self._stopping.clear()
        if console_id_warm():
            self._bridge_start()
            return
        self._waiter = threading.Thread(target=self._bridge_start_when_known,
                                        name="bridge-waits-for-database", daemon=True)
        self._waiter.start()

    def _bridge_start_when_known(self) -> None:
        from reachconsole.core.identity import console_id_wait

        if console_id_wait(self._stopping) is not None:
            log.info("the database answers: the MQTT bridge starts")
            self._bridge_start()

    def _bridge_start(self) -> None:
        from messages.bridge import Bridge

        with self._lock:
            if self._stopping.is_set():
                return
            self.bridge = Bridge.from_settings()
            self.bridge.start()

    def stop(self, parent) -> None:
        self._stopping.set()
        if self._waiter is not None:
            self._waiter.join(15)
            self._waiter = None
        with self._lock:
            if self.bridge is not None:
                self.bridge.stop()
                self.bridge = None


app.steps["worker"].add(BridgeStep)
