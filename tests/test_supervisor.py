"""deploy/: every production process runs under a supervisor that restarts it when it dies.

The supervisord test runs the shipped deploy/supervisord.conf itself: the file is read and only
the install path, the virtualenv, the runtime directory and Daphne's address are substituted,
so the program commands and restart policy are exactly what production gets. It kills the
worker's main process with SIGKILL and expects supervisord to start a new one that works.
"""

from __future__ import annotations

import configparser
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import expect_real_services
from tests.mqtt import free_port
from tests.stack import supervisord_conf_text
from tests.test_worker_survives_redis import (  # noqa: F401 - private_redis is a fixture
    BIN,
    ROOT,
    app_env,
    assert_sweeps_run,
    private_redis,
    wait_for,
)

DEPLOY = ROOT / "deploy"
STOCK = {
    "daphne": "daphne -b 0.0.0.0 -p 8000 reachconsole.asgi:application",
    "worker": "celery -A reachconsole worker -l info",
    "beat": "celery -A reachconsole beat -l info",
}
UNITS = {"web": "daphne", "worker": "worker", "beat": "beat"}


def read_ini(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(inline_comment_prefixes=(";", "#"),
                                          comment_prefixes=(";", "#"), strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


def test_the_shipped_supervisord_config_runs_the_stock_commands_and_restarts_them():
    conf = read_ini(DEPLOY / "supervisord.conf")
    programs = {s.removeprefix("program:") for s in conf.sections() if s.startswith("program:")}
    assert programs == set(STOCK)
    for name, stock in STOCK.items():
        section = conf[f"program:{name}"]
        assert section["command"] == f"/srv/reachconsole/.venv/bin/{stock}"
        assert "--pool" not in section["command"] and " -P " not in section["command"]
        assert section["autorestart"] == "true"
        assert section["stdout_logfile"] == "/dev/stdout"
        assert section["stdout_logfile_maxbytes"] == "0"
        assert section["redirect_stderr"] == "true"
    worker = conf["program:worker"]
    # Warm shutdown: TERM to the main process alone, time to finish, then kill the group.
    assert worker["stopsignal"] == "TERM"
    assert worker["stopasgroup"] == "false" and worker["killasgroup"] == "true"
    assert int(worker["stopwaitsecs"]) >= 60


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_the_systemd_units_run_the_stock_commands_and_always_restart(unit):
    conf = read_ini(DEPLOY / "systemd" / f"reachconsole-{unit}.service")
    service = conf["Service"]
    assert service["ExecStart"] == f"/srv/reachconsole/.venv/bin/{STOCK[UNITS[unit]]}"
    assert service["Restart"] == "always"
    assert service["EnvironmentFile"] == "/etc/reachconsole.env"
    assert conf["Unit"]["StartLimitIntervalSec"] == "0"
    if unit == "worker":
        assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"


def supervisord_or_skip() -> Path:
    binary = BIN / "supervisord"
    if binary.exists():
        return binary
    reason = f"supervisor is not installed in {BIN.parent} (pip install -e '.[dev]')"
    if expect_real_services():
        pytest.fail(f"{reason}, and REACH_EXPECT_REAL_SERVICES=1")
    pytest.skip(reason)


def config_for_test(run_dir: Path, web_port: int) -> Path:
    """deploy/supervisord.conf with this checkout, this virtualenv, a private runtime
    directory and a free loopback port for Daphne; nothing else changes."""
    text = supervisord_conf_text(run_dir, more=(("-b 0.0.0.0 -p 8000",
                                                 f"-b 127.0.0.1 -p {web_port}"),))
    path = run_dir / "supervisord.conf"
    path.write_text(text)
    return path


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            return r.status == 200
    except OSError:  # not listening yet (URLError is an OSError)
        return False


class Supervisorctl:
    def __init__(self, conf: Path, env: dict[str, str]):
        self.conf, self.env = conf, env

    def __call__(self, *args: str) -> str:
        done = subprocess.run([str(BIN / "supervisorctl"), "-c", str(self.conf), *args],
                              env=self.env, capture_output=True, text=True, timeout=30)
        return done.stdout

    def states(self) -> dict[str, tuple[str, int]]:
        """program → (state, pid); pid 0 when not running."""
        found = {}
        for line in self("status").splitlines():
            parts = line.split()
            if len(parts) >= 2:
                pid = int(parts[3].rstrip(",")) if len(parts) > 3 and parts[2] == "pid" else 0
                found[parts[0]] = (parts[1], pid)
        return found

    def all_running(self) -> dict[str, tuple[str, int]] | None:
        states = self.states()
        if set(states) >= set(STOCK) and all(states[p][0] == "RUNNING" for p in STOCK):
            return states
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.django_db(transaction=True)
def test_supervisord_restarts_a_killed_worker(private_redis):  # noqa: F811 - the fixture
    supervisord = supervisord_or_skip()
    # A short directory: the control socket's path must stay under the 108-byte limit.
    run_dir = Path(tempfile.mkdtemp(prefix="reach-sv-"))
    env = app_env(run_dir, private_redis.url)
    web_port = free_port()
    conf = config_for_test(run_dir, web_port)
    ctl = Supervisorctl(conf, env)
    log_path = run_dir / "supervisord.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(supervisord), "-c", str(conf)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    started: set[int] = set()
    try:
        def running():
            if proc.poll() is not None:
                raise AssertionError(f"supervisord exited:\n{log_path.read_text()[-3000:]}")
            return ctl.all_running()

        states = wait_for(running, 60, "supervisord did not get every program RUNNING", 0.5)
        started.update(pid for _, pid in states.values())
        # RUNNING says a program outlived its startsecs, not that Daphne listens yet (on a
        # busy box its start takes longer than that).
        wait_for(lambda: _healthz(web_port), 60, "Daphne under supervisord answering /healthz")
        old_pid = states["worker"][1]
        pool = children_of(old_pid)

        os.kill(old_pid, signal.SIGKILL)

        def restarted():
            state, pid = ctl.states().get("worker", ("", 0))
            return pid if state == "RUNNING" and pid not in (0, old_pid) else None

        new_pid = wait_for(restarted, 60, "supervisord did not restart the killed worker", 0.5)
        started.add(new_pid)
        assert alive(new_pid) and not alive(old_pid)
        assert "exited: worker (terminated by SIGKILL" in log_path.read_text()
        # The new worker does the work, and the killed one left no pool process behind.
        assert_sweeps_run()
        wait_for(lambda: not any(alive(p) for p in pool), 30,
                 "the killed worker's pool processes did not exit")
        assert ctl.all_running(), ctl("status")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # supervisord stops its programs, then itself
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pid in started:  # anything supervisord could not stop
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(run_dir, ignore_errors=True)
