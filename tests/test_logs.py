"""Logs: one JSON object a line in production, plain text on embedded defaults (`make run`);
every line about a message carries its message_id, task_id, agent and node."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from logging.config import DictConfigurator
from pathlib import Path

import pytest
from django.conf import settings

from messages.models import Status
from messages.outbound import SendRequest, message_send

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import logging, django
django.setup()
from reachconsole.core.logs import log_fields
logging.getLogger("messages.outbound").warning(
    "undeliverable to %s: %s", "fin.tax", "no node — try later",
    extra=log_fields(message_id="m-1", task_id="t-1", agent="fin.tax", node="node-b"))
"""


def _log_lines(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in {"REDIS_URL", "REACH_LOG_FORMAT", "DATABASE_URL", "MQTT_URL"}}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                          encoding="utf-8", timeout=60, check=True,
                          env={**clean, "PYTHONIOENCODING": "utf-8", **env})
    return done.stderr.strip().splitlines()


def test_production_logs_one_json_object_a_line(tmp_path):
    # REDIS_URL makes it production shape (settings.EMBEDDED is False): JSON by default.
    lines = _log_lines(REDIS_URL="redis://127.0.0.1:1/0", REACH_RUN_DIR=str(tmp_path))
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["level"] == "WARNING" and line["logger"] == "messages.outbound"
    assert line["message"] == "undeliverable to fin.tax: no node — try later"
    assert (line["message_id"], line["task_id"], line["agent"], line["node"]) == (
        "m-1", "t-1", "fin.tax", "node-b")
    assert line["time"]


def test_make_run_logs_plain_text_and_either_can_be_chosen(tmp_path):
    lines = _log_lines(REACH_RUN_DIR=str(tmp_path))
    assert lines == [lines[0]] and lines[0].endswith(
        "WARNING messages.outbound: undeliverable to fin.tax: no node — try later")
    chosen = _log_lines(REACH_RUN_DIR=str(tmp_path), REACH_LOG_FORMAT="json")
    assert json.loads(chosen[0])["node"] == "node-b"
    text = _log_lines(REACH_RUN_DIR=str(tmp_path), REACH_LOG_FORMAT="text",
                      REDIS_URL="redis://127.0.0.1:1/0")
    assert text[0].endswith("no node — try later")


@pytest.mark.django_db
def test_the_log_line_of_a_message_event_carries_its_fields(caplog):
    """A send that no node can take: the console's warning names the message and its task."""
    agent = f"fin.gone-{uuid.uuid4().hex[:6]}"
    with caplog.at_level(logging.WARNING, logger="messages.outbound"):
        row = message_send(request=SendRequest(to=agent, payload={}))
    assert row.status == Status.UNDELIVERABLE
    record = next(r for r in caplog.records if r.getMessage().startswith("undeliverable"))
    # Formatted as production formats it (settings.LOGGING's JSON formatter).
    formatter = DictConfigurator({}).configure_formatter(
        dict(settings.LOGGING["formatters"]["json"]))
    line = json.loads(formatter.format(record))
    assert (line["message_id"], line["task_id"], line["agent"], line["node"]) == (
        row.message_id, row.task_id, agent, row.target_node_id)
    assert line["message"].startswith(f"undeliverable to {agent}")
