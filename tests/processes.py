"""Starting the console's own processes from a test, as production runs them: the test
database's URL for them, and a stock `daphne` serving the console until the test ends."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.db import connection

from tests.conftest import TOKEN, stop_process
from tests.mqtt import free_port

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


def database_url() -> str:
    """The test database pytest-django made (data a test commits there is what they see)."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    return f"postgres://{auth}@{db['HOST'] or HOST}:{db['PORT'] or 5432}/{db['NAME']}"


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "daphne exited before it answered"
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"daphne did not answer on {port} within {timeout} s")


@contextmanager
def daphne_serving(run_dir: Path, **env: str) -> Iterator[tuple[int, Path]]:
    """A stock daphne on a free port, on the test database, with the test's service token;
    `env` adds or overrides settings. Yields the port and its log file."""
    with daphne_process(run_dir, **env) as (port, log_path, _proc):
        yield port, log_path


@contextmanager
def daphne_process(run_dir: Path, **env: str) -> Iterator[tuple[int, Path, subprocess.Popen]]:
    """daphne_serving, with the process too."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SECRET_KEY": settings.SECRET_KEY,
           "REACH_SERVICE_TOKENS": TOKEN, "REACH_RUN_DIR": str(run_dir),
           "REACH_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", **env}
    log_path = run_dir / "daphne.log"
    log = open(log_path, "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "daphne"), "-b", HOST, "-p", str(port),
         "reachconsole.asgi:application"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(port, proc)
        yield port, log_path, proc
    finally:
        stop_process(proc)
        log.close()


@contextmanager
def console_serving(port: int, run_dir: Path) -> Iterator[subprocess.Popen]:
    """The console as people run it, on the test database: a stock daphne in production
    shape; `manage.py runconsole` on embedded defaults (its one process binds the in-memory
    channel layer to Daphne's loop, which a bare daphne without Redis cannot)."""
    env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SECRET_KEY": settings.SECRET_KEY,
           "REACH_SERVICE_TOKENS": TOKEN, "REACH_RUN_DIR": str(run_dir),
           "REACH_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    if settings.EMBEDDED:
        env["REACH_EMBEDDED_MQTT_PORT"] = str(free_port())
        argv = [sys.executable, "manage.py", "runconsole", "--host", HOST, "--port", str(port),
                "--no-worker", "--simulate-nodes", "0"]
    else:
        argv = [str(Path(sys.executable).parent / "daphne"), "-b", HOST, "-p", str(port),
                "reachconsole.asgi:application"]
    with open(run_dir / f"console-{port}.log", "a") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, proc)
            yield proc
        finally:
            stop_process(proc)


def api_send(port: int, to: str) -> str:
    """A send through the console's own API; returns the message id."""
    request = urllib.request.Request(
        f"http://{HOST}:{port}/api/a2a/send", data=json.dumps({"to": to}).encode(),
        method="POST", headers={"Authorization": f"Bearer {TOKEN}", "X-OODER-Source": "studio",
                                "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["messageId"]
