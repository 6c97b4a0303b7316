"""`make run`: it takes a port, refuses a taken one (its own or the embedded broker's) with
words before it creates anything, and every run says how to sign in to the admin account."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from io import StringIO

import pytest
from django.contrib.auth.models import User

from reachconsole.management.commands import runconsole
from tests.mqtt import free_port
from tests.test_embedded_run import ROOT, embedded_env

LOGIN = "http://127.0.0.1:8001/accounts/login/"


def run_console(tmp_path, port: int, **env) -> subprocess.CompletedProcess:
    environ = embedded_env()
    environ.update(REACH_RUN_DIR=str(tmp_path), **env)
    return subprocess.run(
        [sys.executable, "manage.py", "runconsole", "--port", str(port)],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60,
    )


def listening() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def test_make_run_passes_the_port_and_the_brokers_port():
    dry = subprocess.run(["make", "-n", "run", "PORT=8123", "MQTT_PORT=1999"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert "REACH_EMBEDDED_MQTT_PORT=1999 .venv/bin/python manage.py runconsole --port 8123" \
        in dry.stdout
    plain = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True,
                           timeout=30, env={k: v for k, v in os.environ.items()
                                            if k not in ("PORT", "MQTT_PORT")})
    assert ".venv/bin/python manage.py runconsole --port 8000" in plain.stdout
    assert "REACH_EMBEDDED_MQTT_PORT" not in plain.stdout


def test_a_taken_console_port_stops_it_before_anything_is_created(tmp_path):
    with listening() as taken:
        port = taken.getsockname()[1]
        result = run_console(tmp_path, port, REACH_EMBEDDED_MQTT_PORT=str(free_port()))
    assert result.returncode != 0
    assert f"Cannot serve the console on 127.0.0.1:{port}: that port is already in use" \
        in result.stderr
    assert "make run PORT=" in result.stderr and "runconsole --port" in result.stderr
    assert "Traceback" not in result.stderr
    # No database, no admin account, no password file: a later run starts clean.
    assert not (tmp_path / "reachconsole.sqlite3").exists()
    assert not (tmp_path / runconsole.ADMIN_PASSWORD_FILE).exists()
    assert "Admin account created" not in result.stdout


def test_a_taken_broker_port_names_both_ways_out_before_anything_is_created(tmp_path):
    with listening() as taken:
        mqtt_port = taken.getsockname()[1]
        result = run_console(tmp_path, free_port(), REACH_EMBEDDED_MQTT_PORT=str(mqtt_port))
    assert result.returncode != 0
    assert f"MQTT_URL=mqtt://127.0.0.1:{mqtt_port}" in result.stderr
    assert "make run MQTT_PORT=" in result.stderr and "REACH_EMBEDDED_MQTT_PORT=" in result.stderr
    assert not (tmp_path / "reachconsole.sqlite3").exists()


def test_both_ports_taken_are_named_at_once(tmp_path):
    with listening() as web, listening() as mqtt:
        result = run_console(tmp_path, web.getsockname()[1],
                             REACH_EMBEDDED_MQTT_PORT=str(mqtt.getsockname()[1]))
    assert result.returncode != 0
    assert "Cannot serve the console" in result.stderr
    assert "Cannot start the embedded MQTT broker" in result.stderr


def test_the_suggested_port_is_free():
    with listening() as taken:
        port = taken.getsockname()[1]
        assert runconsole.port_in_use("127.0.0.1", port)
        suggested = runconsole.port_free_after("127.0.0.1", port)
        assert suggested > port and runconsole.port_in_use("127.0.0.1", suggested) is None


# --- signing in ---------------------------------------------------------------------------------

def ensure_admin() -> str:
    command = runconsole.Command(stdout=StringIO(), no_color=True)
    command._ensure_admin(login_url=LOGIN)
    return command.stdout._out.getvalue()


@pytest.fixture
def run_dir(settings, tmp_path):
    settings.RUN_DIR = tmp_path
    settings.REACH_ADMIN_USER = "admin"
    settings.REACH_ADMIN_PASSWORD = None
    return tmp_path


@pytest.mark.django_db
def test_every_run_says_how_to_sign_in_with_the_kept_password(run_dir):
    first = ensure_admin()
    kept = run_dir / runconsole.ADMIN_PASSWORD_FILE
    password = kept.read_text()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert User.objects.get(username="admin").check_password(password)
    assert "Admin account created: admin" in first
    assert f"Sign in at {LOGIN} as admin / {password}" in first
    assert str(kept) in first

    again = ensure_admin()  # a later run: the account exists, the password is still said
    assert "Admin account created" not in again
    assert f"Sign in at {LOGIN} as admin / {password}" in again
    assert "manage.py changepassword admin" in again
    assert User.objects.filter(username="admin").count() == 1


@pytest.mark.django_db
def test_a_changed_password_is_not_shown_and_the_reset_command_is(run_dir):
    ensure_admin()
    old = (run_dir / runconsole.ADMIN_PASSWORD_FILE).read_text()
    admin = User.objects.get(username="admin")
    admin.set_password("a-new-one-456")
    admin.save()
    said = ensure_admin()
    assert old not in said and "a-new-one-456" not in said
    assert f"Sign in at {LOGIN} as admin with the password you set for it" in said
    assert "holds an older one" in said
    assert "Forgot it? Set a new one: .venv/bin/python manage.py changepassword admin" in said


@pytest.mark.django_db
def test_a_password_from_the_environment_is_named_not_printed_or_kept(run_dir, settings):
    settings.REACH_ADMIN_PASSWORD = "from-env-789"
    said = ensure_admin()
    assert User.objects.get(username="admin").check_password("from-env-789")
    assert "from-env-789" not in said
    assert f"Sign in at {LOGIN} as admin with the password in REACH_ADMIN_PASSWORD." in said
    assert not (run_dir / runconsole.ADMIN_PASSWORD_FILE).exists()
