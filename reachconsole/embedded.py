"""The embedded single-process mode: a Celery worker and beat as threads of this process.

They are the real Celery worker and beat, consuming from the in-memory transport (or Redis
when REDIS_URL is set), so the tasks, schedules and claims are the ones production runs.
"""

from __future__ import annotations

import logging
import threading

from celery import Celery
from celery.beat import EmbeddedService
from celery.worker import WorkController

log = logging.getLogger(__name__)


class _ReadyWorker(WorkController):
    """A WorkController that says when its consumer is ready (it runs in a thread)."""

    def __init__(self, *args, **kwargs):
        self.ready = threading.Event()
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer) -> None:
        self.ready.set()


class EmbeddedWorker:
    def __init__(self, app: Celery, *, concurrency: int = 2, beat: bool = True):
        self.app = app
        self.concurrency = concurrency
        self.with_beat = beat
        self._worker: _ReadyWorker | None = None
        self._thread: threading.Thread | None = None
        self._beat = None

    def start(self, timeout: float = 30.0) -> None:
        self.app.loader.import_default_modules()
        self._worker = _ReadyWorker(
            app=self.app, concurrency=self.concurrency, pool="threads",
            hostname="embedded@reachconsole", loglevel="WARNING",
            without_heartbeat=True, without_mingle=True, without_gossip=True,
        )
        self._thread = threading.Thread(
            target=self._worker.start, name="celery-worker", daemon=True
        )
        self._thread.start()
        if not self._worker.ready.wait(timeout):
            raise RuntimeError(f"the embedded Celery worker did not start within {timeout} s")
        if self.with_beat:
            # The base Scheduler keeps nothing on disk: an embedded console starts afresh.
            self._beat = EmbeddedService(
                self.app, thread=True, max_interval=1, scheduler_cls="celery.beat:Scheduler"
            )
            self._beat.start()

    def stop(self) -> None:
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        if self._worker is not None:
            self._worker.stop(in_sighandler=False)
            self._worker = None
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
