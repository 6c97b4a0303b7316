"""The console in production shape, on private services, for fault runs.

`Stack` starts its OWN PostgreSQL, Redis and Mosquitto on free loopback ports (never the
shared ones on 5432/6379/1883), migrates a private database, and runs the README's production
commands as subprocesses: `daphne … reachconsole.asgi:application`, `celery -A reachconsole
worker -l info` (stock: the default pool) and `celery -A reachconsole beat -l info`. Every
process logs to a file in the stack's temporary directory; `tail()` shows the end of each.

Faults: `kill(name, sig)`, `start(name)` and `restart_service(name, down_s)` for `postgres`
(pg_ctl stop -m fast / start), `redis`, `mosquitto` (SIGTERM: it saves its persistence) and
`worker` (kill -9 of its whole process group, as a container kill does, then a fresh start).
`supervise("worker")` runs the worker under supervisord with deploy/supervisord.conf's own
`[program:worker]`, and `kill_supervised("worker")` kills its main process with -9 and lets
supervisord start the next one, as a deployment does.
`stall_service("mosquitto" | "postgres", stall_s)` stops the console's connections to the
broker or the database from moving without closing them: the console's processes reach
Mosquitto and PostgreSQL through stall proxies (tests/stallproxy.py), while tests and
simulated nodes connect to them directly. `hold_snapshot(seconds)` keeps a REPEATABLE READ
transaction open on the console's database, as a long report would.

`new_run()` gives the next test a clean console on the same services: the app processes are
stopped, the database is recreated from the migrated template, Redis is flushed, and the
topic prefix and run directory (beat's schedule file) are new. `stop()` ends everything
we started; it runs from the fixture's `finally` and from `atexit`.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import expect_real_services
from tests.mqtt import free_ports
from tests.stallproxy import StallProxy

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
DB_NAME = "reach"
TEMPLATE_DB = "reach_template"
APP_PROCESSES = ("daphne", "worker", "beat")
SERVICES = ("postgres", "redis", "mosquitto")
# The stack's console identity, fixed so that its bridges' client ids are known here.
STACK_CONSOLE_ID = "reach-stack"


def bridge_client_id(instance: str = "1") -> str:
    """A bridge's MQTT client id in the stack (messages.client_ids.client_id_for)."""
    return f"{STACK_CONSOLE_ID}-console-{instance}"


# The console's bridge client ids with the default REACH_BRIDGE_INSTANCE (and those of the
# version before the console's identity was in them), whose sessions a new run ends.
BRIDGE_CLIENT_IDS = (bridge_client_id("1"), "reach-console-1")
# Variables of the test process that must not leak into the stack's processes (CI's second
# run points these at the shared services).
_STRIPPED_ENV = re.compile(r"^(REACH_|DJANGO_|MQTT_|DATABASE_URL$|REDIS_URL$|CELERY_)")


class StackError(RuntimeError):
    """The stack could not be started or driven; the message says which process and why."""


# --- binaries -------------------------------------------------------------------------------
def supervisord_conf_text(run_dir: Path, *, more: tuple[tuple[str, str], ...] = ()) -> str:
    """deploy/supervisord.conf with this checkout, this virtualenv and `run_dir` for its
    runtime directory (and `more` replacements); nothing else changes. Refuses a file that
    no longer has what it replaces, so a test never runs something else than deploy/ has."""
    text = (ROOT / "deploy" / "supervisord.conf").read_text()
    for old, new in (("/srv/reachconsole/.venv/bin/", f"{Path(sys.executable).parent}/"),
                     ("/srv/reachconsole", str(ROOT)), ("/run/reachconsole", str(run_dir)),
                     *more):
        if old not in text:
            raise StackError(f"deploy/supervisord.conf no longer contains {old!r}")
        text = text.replace(old, new)
    return text


def _pg_bindir() -> Path | None:
    def version(path: str) -> tuple[int, ...]:
        match = re.search(r"/postgresql/([\d.]+)/", path)
        return tuple(int(p) for p in match.group(1).split(".")) if match else (0,)

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def find_binaries() -> tuple[dict[str, str], list[str]]:
    """(name → path, what is missing)."""
    found: dict[str, str] = {}
    missing: list[str] = []
    bindir = _pg_bindir()
    for name in ("initdb", "pg_ctl"):
        path = bindir / name if bindir else None
        if path and path.exists():
            found[name] = str(path)
        else:
            missing.append(f"{name} (looked under /usr/lib/postgresql/*/bin and PATH)")
    for name in ("redis-server", "mosquitto"):
        path = shutil.which(name) or next(
            (p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.path.exists(p)), None)
        if path:
            found[name] = path
        else:
            missing.append(name)
    venv_bin = Path(sys.executable).parent
    for name in ("daphne", "celery"):
        path = venv_bin / name if (venv_bin / name).exists() else shutil.which(name)
        if path:
            found[name] = str(path)
        else:
            missing.append(f"{name} (the project's virtualenv)")
    return found, missing


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _live_processes() -> Iterator[tuple[int, Path]]:
    """(pid, /proc entry) of every process that is not a zombie."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            yield int(entry.name), entry


def _session_members(sid: int) -> list[int]:
    members = []
    for pid, _ in _live_processes():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid:
                members.append(pid)
    return members


def _wait(check, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # the thing being waited for may raise until it is up
            last = exc
        time.sleep(interval)
    raise StackError(f"{what} within {timeout:.0f} s (last: {last!r})")


# --- the stack ------------------------------------------------------------------------------
class Stack:
    def __init__(self, *, extra_env: dict[str, str] | None = None, keep_dir: bool = False):
        self.bins, missing = find_binaries()
        if missing:
            raise StackError("missing binaries: " + ", ".join(missing))
        self.tmp = Path(tempfile.mkdtemp(prefix="reach-stack-"))
        # PostgreSQL and Mosquitto may run as other users: they must traverse the directory.
        self.tmp.chmod(0o755)
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.pg_dir = self.tmp / "pg"
        self.pg_data = self.pg_dir / "data"
        self.pg_log = self.pg_dir / "postgres.log"
        self.pg_sock = self.pg_dir / "sock"
        self.mqtt_dir = self.tmp / "mosquitto"
        self.redis_dir = self.tmp / "redis"
        # Chosen together, so no two are the same (each is only free until bound).
        (self.pg_port, self.redis_port, self.mqtt_port, self.http_port, mqtt_proxy_port,
         pg_proxy_port) = free_ports(6)
        self.token = f"fault-run-{secrets.token_hex(12)}"
        self.secret_key = secrets.token_urlsafe(50)
        self.extra_env = dict(extra_env or {})
        self.keep_dir = keep_dir or os.environ.get("REACH_KEEP_STACK") == "1"
        self.prefix = ""
        self.run_dir = self.tmp / "run-0"
        self.runs = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.supervised: set[str] = set()  # run under supervisord (supervise()) this run
        # The console's own ways to the broker and to PostgreSQL, which a stall fault holds
        # (see the docstring).
        self.mqtt_proxy = StallProxy(target_host=HOST, target_port=self.mqtt_port,
                                     port=mqtt_proxy_port)
        self.pg_proxy = StallProxy(target_host=HOST, target_port=self.pg_port,
                                   port=pg_proxy_port)
        self._log_files: dict[str, object] = {}
        self._lock = threading.RLock()
        self._stopped = False
        self._run_used = False
        self._is_root = os.geteuid() == 0
        atexit.register(self.stop)

    # --- addresses and environment ------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def mqtt_url(self) -> str:
        return f"mqtt://{HOST}:{self.mqtt_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/0"

    def database_url(self, name: str = DB_NAME) -> str:
        return f"postgres://postgres@{HOST}:{self.pg_port}/{name}"

    def console_database_url(self, name: str = DB_NAME) -> str:
        """The console's processes reach PostgreSQL through the stall proxy."""
        return f"postgres://postgres@{HOST}:{self.pg_proxy.port}/{name}"

    def env(self, database: str = DB_NAME) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not _STRIPPED_ENV.match(k)}
        env.update(
            DJANGO_SETTINGS_MODULE="reachconsole.settings",
            DATABASE_URL=self.console_database_url(database),
            REDIS_URL=self.redis_url,
            MQTT_URL=f"mqtt://{HOST}:{self.mqtt_proxy.port}",
            MQTT_TOPIC_PREFIX=self.prefix or "fr-migrate",
            REACH_NODE_ID="console",
            REACH_CONSOLE_ID=STACK_CONSOLE_ID,
            REACH_SERVICE_TOKENS=self.token,
            DJANGO_SECRET_KEY=self.secret_key,
            REACH_RUN_DIR=str(self.run_dir),
            DJANGO_ALLOWED_HOSTS="127.0.0.1,localhost",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def connect_db(self, database: str = DB_NAME, timeout: float = 3):
        """A psycopg connection (autocommit) to the stack's own database."""
        import psycopg

        return psycopg.connect(host=HOST, port=self.pg_port, user="postgres", dbname=database,
                               autocommit=True, connect_timeout=max(1, int(timeout)))

    # --- logs --------------------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.pg_log if name == "postgres" else self.logs / f"{name}.log"

    def log_paths(self) -> dict[str, Path]:
        names = ["postgres", "redis", "mosquitto", *APP_PROCESSES, "migrate"]
        return {n: self.log_path(n) for n in names if self.log_path(n).exists()}

    def log_offsets(self) -> dict[str, int]:
        return {n: p.stat().st_size for n, p in self.log_paths().items()}

    def log_text(self, name: str, since: dict[str, int] | None = None) -> str:
        path = self.log_path(name)
        if not path.exists():
            return ""
        with open(path, "rb") as fh:
            fh.seek((since or {}).get(name, 0))
            return fh.read().decode("utf-8", errors="replace")

    def count_in_logs(self, needle: str, since: dict[str, int] | None = None) -> dict[str, int]:
        """How often `needle` occurs in each log (after the offsets of `since`)."""
        return {n: self.log_text(n, since).count(needle) for n in self.log_paths()}

    def tail(self, name: str, lines: int = 40, since: dict[str, int] | None = None) -> str:
        text = self.log_text(name, since)
        return "\n".join(text.splitlines()[-lines:])

    def tails(self, lines: int = 40, since: dict[str, int] | None = None) -> str:
        out = []
        for name in self.log_paths():
            out.append(f"----- {name} ({self.log_path(name)}) last {lines} lines -----")
            out.append(self.tail(name, lines, since))
        return "\n".join(out)

    def _open_log(self, name: str):
        handle = open(self.log_path(name), "ab")  # noqa: SIM115 - closed in _close_log
        self._log_files[name] = handle
        return handle

    def _close_log(self, name: str) -> None:
        handle = self._log_files.pop(name, None)
        if handle is not None:
            handle.close()

    # --- the services ------------------------------------------------------------------------
    def _as_postgres(self) -> dict:
        if not self._is_root:
            return {}
        return {"user": "postgres", "group": "postgres", "extra_groups": []}

    def _chown(self, path: Path, user: str) -> None:
        if not self._is_root:
            return
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            return
        for item in [path, *path.rglob("*")]:
            os.chown(item, entry.pw_uid, entry.pw_gid)

    def _pg_ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.bins["pg_ctl"], "-D", str(self.pg_data), *args],
            cwd=self.pg_dir, capture_output=True, text=True, timeout=timeout,
            **self._as_postgres(),
        )

    def _pg_init(self) -> None:
        self.pg_dir.mkdir()
        self.pg_sock.mkdir()
        self._chown(self.pg_dir, "postgres")
        result = subprocess.run(
            [self.bins["initdb"], "-D", str(self.pg_data), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--locale=C", "--no-sync"],
            cwd=self.pg_dir, capture_output=True, text=True, timeout=120, **self._as_postgres(),
        )
        if result.returncode != 0:
            raise StackError(f"initdb failed:\n{result.stdout}\n{result.stderr}")
        with open(self.pg_data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(
                f"\n# reach fault-run stack\nport = {self.pg_port}\n"
                f"listen_addresses = '{HOST}'\nunix_socket_directories = '{self.pg_sock}'\n"
                "max_connections = 200\nlog_line_prefix = '%m [%p] '\n"
                "log_lock_waits = on\n"
            )

    def _pg_start(self) -> None:
        result = self._pg_ctl("start", "-w", "-t", "60", "-l", str(self.pg_log))
        if result.returncode != 0:
            raise StackError(f"pg_ctl start failed:\n{result.stdout}\n{result.stderr}\n"
                             f"{self.tail('postgres')}")
        _wait(lambda: self._pg_ping(), 30, "PostgreSQL did not accept connections")

    def _pg_ping(self) -> bool:
        with self.connect_db("postgres", timeout=2) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)

    def _pg_stop(self, mode: str = "fast") -> None:
        if not self.pg_data.exists():
            return
        result = self._pg_ctl("stop", "-m", mode, "-w", "-t", "60")
        if result.returncode != 0 and self._pg_postmaster_pid():
            raise StackError(f"pg_ctl stop -m {mode} failed:\n{result.stdout}\n{result.stderr}")

    def _pg_postmaster_pid(self) -> int | None:
        try:
            pid = int((self.pg_data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def _redis_start(self) -> None:
        self.redis_dir.mkdir(exist_ok=True)
        self._spawn("redis", [
            self.bins["redis-server"], "--port", str(self.redis_port), "--bind", HOST,
            "--save", "", "--appendonly", "no", "--dir", str(self.redis_dir),
        ])
        _wait(lambda: self._redis_ping(), 20, "Redis did not answer PING")

    def _redis_ping(self) -> bool:
        import redis

        client = redis.Redis(host=HOST, port=self.redis_port, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def _mosquitto_start(self) -> None:
        if not self.mqtt_dir.exists():
            self.mqtt_dir.mkdir()
            conf = self.mqtt_dir / "mosquitto.conf"
            conf.write_text(
                f"listener {self.mqtt_port} {HOST}\n"
                "allow_anonymous true\n"
                "persistence true\n"
                f"persistence_location {self.mqtt_dir}/\n"
                "max_queued_messages 100000\n"
                "max_inflight_messages 100\n"
                "sys_interval 1\n"
                "log_dest stdout\n"
                "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
                "connection_messages true\n"
                "log_timestamp_format %Y-%m-%dT%H:%M:%S\n",
                encoding="utf-8",
            )
            # As root, Mosquitto drops to its own user: that user writes the persistence.
            self._chown(self.mqtt_dir, "mosquitto")
        self._spawn("mosquitto", [self.bins["mosquitto"], "-c",
                                  str(self.mqtt_dir / "mosquitto.conf")])
        _wait(lambda: _port_open(self.mqtt_port), 20, "Mosquitto did not listen")

    # --- the console's processes ----------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with self._lock:
            old = self.procs.get(name)
            if old is not None and old.poll() is None:
                raise StackError(f"{name} is already running (pid {old.pid})")
            self._close_log(name)
            log = self._open_log(name)
            log.write(f"\n===== {time.strftime('%H:%M:%S')} start {name}: {' '.join(argv)}\n"
                      .encode())
            log.flush()
            # A session of its own: a kill reaches the whole process tree (Celery's pool).
            self.procs[name] = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def _app_argv(self, name: str) -> list[str]:
        if name in self.supervised:
            return [str(Path(sys.executable).parent / "supervisord"), "-c",
                    str(self._supervisord_conf(name))]
        if name == "daphne":
            return [self.bins["daphne"], "-b", HOST, "-p", str(self.http_port),
                    "reachconsole.asgi:application"]
        if name == "worker":
            return [self.bins["celery"], "-A", "reachconsole", "worker", "-l", "info"]
        if name == "beat":
            return [self.bins["celery"], "-A", "reachconsole", "beat", "-l", "info"]
        raise StackError(f"unknown process {name!r}")

    def _start_app(self, name: str, wait: bool = True) -> None:
        offset = self.log_path(name).stat().st_size if self.log_path(name).exists() else 0
        self._spawn(name, self._app_argv(name), env=self.env())
        if not wait:
            return
        proc = self.procs[name]

        def up() -> bool:
            if proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode}:\n"
                                 f"{self.tail(name, 60, {name: offset})}")
            if name == "daphne":
                return _port_open(self.http_port)
            if name == "worker":
                return " ready." in self.log_text(name, {name: offset})
            return "beat: Starting" in self.log_text(name, {name: offset}) or (
                time.monotonic() - started > 3)

        started = time.monotonic()
        try:
            _wait(up, 90, f"{name} did not come up")
        except StackError as exc:
            raise StackError(f"{exc}\n{self.tail(name, 60, {name: offset})}") from None

    def _terminate(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        """Signal the process group of `name`; SIGKILL it when it does not end in time."""
        proc = self.procs.get(name)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Whatever the leader left behind in its group (a pool child) goes too, and in its
        # session: supervisord puts each program in a process group of its own.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._close_log(name)

    # --- public: lifecycle ---------------------------------------------------------------------
    def start_services(self) -> None:
        self._pg_init()
        self._pg_start()
        self._redis_start()
        self._mosquitto_start()
        self.mqtt_proxy.start()
        self.pg_proxy.start()

    def migrate_template(self) -> None:
        with self.connect_db("postgres") as conn:
            conn.execute(f'CREATE DATABASE "{TEMPLATE_DB}"')
        log = self.logs / "migrate.log"
        with open(log, "ab") as fh:
            result = subprocess.run(
                [sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT,
                env=self.env(TEMPLATE_DB), stdout=fh, stderr=subprocess.STDOUT, timeout=300,
            )
        if result.returncode != 0:
            raise StackError(f"manage.py migrate failed ({result.returncode}):\n"
                             f"{self.tail('migrate', 60)}")

    def new_run(self) -> str:
        """A clean console on the running services; returns the new topic prefix."""
        for name in reversed(APP_PROCESSES):
            self._terminate(name)
        self.supervised.clear()
        self._forget_mqtt_sessions()
        import redis

        client = redis.Redis(host=HOST, port=self.redis_port, socket_timeout=5)
        client.flushall()
        client.close()
        with self.connect_db("postgres") as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{DB_NAME}" TEMPLATE "{TEMPLATE_DB}"')
        self.runs += 1
        self.prefix = f"fr{secrets.token_hex(4)}"
        self.run_dir = self.tmp / f"run-{self.runs}"
        self.run_dir.mkdir()
        for name in APP_PROCESSES:
            self._start_app(name)
        self.wait_ready()
        self._run_used = False
        return self.prefix

    def clean_run(self) -> str:
        """The console for the next test: the untouched one after start(), else a new run."""
        if self._run_used:
            self.new_run()
        self._run_used = True
        return self.prefix

    def _forget_mqtt_sessions(self) -> None:
        """End the persistent broker sessions a previous run's bridge left behind."""
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        for client_id in BRIDGE_CLIENT_IDS:
            client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                 protocol=mqtt.MQTTv5)
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 0
            try:
                client.connect(HOST, self.mqtt_port, keepalive=10, clean_start=True,
                               properties=props)
                client.loop(1)
                client.disconnect()
            except OSError:
                pass

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a service (the postmaster) or a console process (its whole process
        group). For SIGKILL, SIGTERM, SIGINT and SIGQUIT, wait until it is gone; any other
        signal (SIGSTOP, SIGCONT, SIGHUP…) is only sent."""
        ending = sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
        if name == "postgres":
            pid = self._pg_postmaster_pid()
            if pid:
                os.kill(pid, sig)
                if ending:
                    _wait(lambda: self._pg_postmaster_pid() is None, 60,
                          "PostgreSQL did not exit")
            return
        proc = self.procs.get(name)
        if proc is None:
            raise StackError(f"unknown process {name!r}")
        if ending:
            self._terminate(name, sig, timeout=30)
        elif proc.poll() is None:
            os.killpg(proc.pid, sig)

    def start(self, name: str | None = None) -> Stack:
        """`start()` brings the whole stack up; `start(name)` starts one piece again."""
        if name is None:
            self.start_services()
            self.migrate_template()
            self.new_run()
            return self
        if name == "postgres":
            self._pg_start()
        elif name == "redis":
            self._redis_start()
        elif name == "mosquitto":
            self._mosquitto_start()
        elif name in APP_PROCESSES:
            self._start_app(name)
        else:
            raise StackError(f"unknown process {name!r}")
        return self

    def restart_service(self, name: str, down_s: float = 2.0) -> dict[str, float]:
        """Take `name` down for `down_s` seconds and bring it back. Returns wall-clock times:
        `down_at` (the fault begins), `start_at` (starting again), `up_at` (it answers)."""
        down_at = time.time()
        if name == "postgres":
            self._pg_stop("fast")
        elif name in ("redis", "mosquitto"):
            self._terminate(name, signal.SIGTERM)
        elif name == "worker":
            self._terminate(name, signal.SIGKILL)
        else:
            raise StackError(f"restart_service does not know {name!r}")
        stopped_at = time.time()
        self._assert_down(name)
        time.sleep(down_s)
        start_at = time.time()
        self.start(name)
        return {"down_at": down_at, "stopped_at": stopped_at, "start_at": start_at,
                "up_at": time.time()}

    def stall_service(self, name: str, stall_s: float) -> dict[str, float]:
        """Hold every connection of the console to `name` for `stall_s` seconds, open but
        carrying nothing, then let it flow again. The same times as restart_service."""
        proxy = {"mosquitto": self.mqtt_proxy, "postgres": self.pg_proxy}.get(name)
        if proxy is None:
            raise StackError(f"stall_service does not know {name!r}")
        down_at = time.time()
        with proxy.stalled():
            time.sleep(stall_s)
            start_at = time.time()
        return {"down_at": down_at, "stopped_at": down_at, "start_at": start_at,
                "up_at": time.time()}

    def hold_snapshot(self, hold_s: float) -> dict[str, float]:
        """Keep a REPEATABLE READ transaction open on the console's database for `hold_s`
        seconds, its snapshot taken by a read of the message table: what a long export or a
        report left open does. Vacuum can reclaim no row version that snapshot might see
        until it ends. The same times as restart_service."""
        import psycopg

        down_at = time.time()
        with psycopg.connect(host=HOST, port=self.pg_port, user="postgres", dbname=DB_NAME,
                             connect_timeout=3) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.execute("SELECT count(*) FROM a2a_message").fetchone()
            time.sleep(hold_s)
            start_at = time.time()
            conn.rollback()
        return {"down_at": down_at, "stopped_at": down_at, "start_at": start_at,
                "up_at": time.time()}

    def _supervisord_conf(self, name: str) -> Path:
        """deploy/supervisord.conf with only `name`'s program, its paths made this
        checkout's and this stack's; the program's command and restart policy unchanged."""
        import configparser

        run = self.tmp / "sv"
        run.mkdir(exist_ok=True)
        text = supervisord_conf_text(run)
        conf = configparser.RawConfigParser(inline_comment_prefixes=(";", "#"),
                                            comment_prefixes=(";", "#"), strict=True)
        conf.optionxform = str
        conf.read_string(text)
        for section in conf.sections():
            if section.startswith("program:") and section != f"program:{name}":
                conf.remove_section(section)
        if not conf.has_section(f"program:{name}"):
            raise StackError(f"deploy/supervisord.conf has no [program:{name}]")
        path = run / f"{name}.conf"
        with path.open("w") as handle:
            conf.write(handle)
        return path

    def supervise(self, name: str = "worker") -> None:
        """From now until the next run, `name` runs under supervisord as deploy/ has it
        (its output still goes to `name`'s log)."""
        self._terminate(name)
        self.supervised.add(name)
        self._start_app(name)
        self.wait_ready()

    def supervised_pid(self, name: str) -> int | None:
        """The pid of the program supervisord runs as `name` (its direct child)."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return None
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            return None
        alive = {pid for pid, _ in _live_processes()}
        return next((int(p) for p in children if int(p) in alive), None)

    def kill_supervised(self, name: str = "worker") -> dict[str, float]:
        """kill -9 of the supervised program's main process (what the OOM killer does), and
        supervisord alone brings it back. The same times as restart_service; `up_at` is
        when the new process says it is ready."""
        if name not in self.supervised:
            raise StackError(f"{name} is not supervised: call supervise({name!r}) first")
        old = _wait(lambda: self.supervised_pid(name), 30, f"supervisord runs no {name}")
        offset = self.log_path(name).stat().st_size
        down_at = time.time()
        os.kill(old, signal.SIGKILL)
        _wait(lambda: old not in {pid for pid, _ in _live_processes()}, 10,
              f"{name} (pid {old}) did not die")
        stopped_at = time.time()
        new = _wait(lambda: (pid := self.supervised_pid(name)) not in (None, old) and pid,
                    60, f"supervisord did not start {name} again")
        start_at = time.time()
        ready = " ready." if name == "worker" else ""
        _wait(lambda: ready in self.log_text(name, {name: offset}), 90,
              f"{name} (pid {new}) did not say it is ready")
        return {"down_at": down_at, "stopped_at": stopped_at, "start_at": start_at,
                "up_at": time.time()}

    def _assert_down(self, name: str) -> None:
        """A fault that did not take the service down would make the run meaningless."""
        port = {"postgres": self.pg_port, "redis": self.redis_port,
                "mosquitto": self.mqtt_port}.get(name)
        if port is not None and _port_open(port):
            raise StackError(f"{name} still accepts connections on {port} after being stopped")
        proc = self.procs.get(name)
        if name == "worker" and proc is not None:
            _wait(lambda: not _session_members(proc.pid), 10,
                  f"the worker's processes (session {proc.pid}) did not all die")

    def wait_ready(self, timeout: float = 60) -> dict:
        """GET /readyz until it answers 200; raise with the last answer after `timeout`."""
        last: object = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=5) as response:
                    if response.status == 200:
                        import json

                        return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                last = f"{exc.code} {exc.read()[:500].decode(errors='replace')}"
            except OSError as exc:
                last = exc
            time.sleep(0.3)
        raise StackError(f"/readyz did not answer 200 within {timeout:.0f} s (last: {last})\n"
                         f"{self.tail('daphne', 40)}")

    def stop(self) -> None:
        """End everything this stack started. Safe to call twice and from atexit."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for name in (*APP_PROCESSES, "mosquitto", "redis"):
            try:
                self._terminate(name, signal.SIGTERM, timeout=20)
            except Exception as exc:  # go on: the rest must stop too
                print(f"stack: stopping {name} failed: {exc}", file=sys.stderr)
        self.mqtt_proxy.stop()
        self.pg_proxy.stop()
        try:
            if self._pg_postmaster_pid():
                self._pg_stop("fast")
        except Exception as exc:
            print(f"stack: pg_ctl stop failed ({exc}); killing the postmaster", file=sys.stderr)
            pid = self._pg_postmaster_pid()
            if pid:
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        left = self.leftovers()
        if left:
            print(f"stack: processes still running after stop: {left}", file=sys.stderr)
        if self.keep_dir:
            print(f"stack: kept {self.tmp} (logs under {self.logs}, {self.pg_log})",
                  file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Processes of ours still alive: the sessions we created, and the postmaster."""
        sids = {p.pid for p in self.procs.values()}
        found = []
        for pid, entry in _live_processes():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                in_session = os.getsid(pid) in sids
            except OSError:
                continue
            if in_session or str(self.tmp) in cmdline:
                found.append(f"{pid} {cmdline.strip()[:120]}")
        return found

    def pids(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {n: (p.pid if p.poll() is None else None)
                                      for n, p in self.procs.items()}
        out["postgres"] = self._pg_postmaster_pid()
        return out


# --- pytest ---------------------------------------------------------------------------------
def stack_or_skip(**kwargs) -> Stack:
    """A started Stack; skips (or, with REACH_EXPECT_REAL_SERVICES=1, fails) when the
    service binaries are missing."""
    _, missing = find_binaries()
    if missing:
        reason = ("the fault-run stack needs PostgreSQL, Redis and Mosquitto binaries; missing: "
                  + ", ".join(missing))
        if expect_real_services():
            pytest.fail(reason)
        pytest.skip(reason)
    stack = Stack(**kwargs)
    try:
        stack.start()
    except BaseException:
        print(stack.tails(60), file=sys.stderr)
        stack.keep_dir = True
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module", name="stack")
def stack_fixture() -> Iterator[Stack]:
    """`stack`: one private stack for a module (import `stack_fixture` into the module); call
    `stack.new_run()` for a clean console per test."""
    running = stack_or_skip()
    try:
        yield running
    finally:
        running.stop()
