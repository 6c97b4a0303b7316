"""The Celery app: the same tasks run in the embedded process and in production workers."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "reachconsole.settings")

app = Celery("reachconsole")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

