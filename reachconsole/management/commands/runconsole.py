"""`make run`: the whole console in one process on embedded defaults.

Checks its ports first (nothing is created by a run that cannot serve), migrates, makes sure
a local admin account exists and says how to sign in to it, starts the embedded MQTT broker
(unless MQTT_URL names one), a Celery worker and beat as threads, a small simulated cluster,
and serves HTTP and WebSockets with Daphne. Production runs the same code as separate
processes.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import secrets
import signal
import socket
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from messages import signing
from reachconsole.core.tokens import tokens_parse

log = logging.getLogger(__name__)

# The generated admin password, kept in the run directory (mode 0600) so every run can say
# how to sign in, not only the run that created the account.
ADMIN_PASSWORD_FILE = "admin-password"  # noqa: S105 - a file name, not a password
HTTP_PORT_TAKEN = (
    "Cannot serve the console on {host}:{port}: that port is already in use ({why}). "
    "Choose another one: make run PORT={free} (or manage.py runconsole --port {free})."
)
MQTT_PORT_TAKEN = (
    "Cannot start the embedded MQTT broker on 127.0.0.1:{port}: that port is already in use "
    "({why}), by a local Mosquitto perhaps. Use that broker instead with "
    "MQTT_URL=mqtt://127.0.0.1:{port}, or give the embedded one another port: "
    "make run MQTT_PORT={free} (REACH_EMBEDDED_MQTT_PORT={free})."
)
RESET_HINT = "Forgot it? Set a new one: .venv/bin/python manage.py changepassword {user}{env}"


def port_in_use(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on at `host`, or None when it can (checked by binding it
    for a moment, as the server will)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    with socket.socket(family, kind, proto) as probe:
        # Servers set SO_REUSEADDR too: a closed connection lingering in TIME_WAIT does not
        # make the port taken, a listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def port_free_after(host: str, port: int, *, tries: int = 20) -> int:
    """The first port after `port` that is free, to suggest (or port + 1 if none is)."""
    for candidate in range(port + 1, min(port + 1 + tries, 65536)):
        if port_in_use(host, candidate) is None:
            return candidate
    return port + 1


def ports_check(*, host: str, port: int, mqtt_port: int | None) -> None:
    """Refuse to start, with words, when the console's port or the embedded broker's is taken:
    before the database, the admin account or anything else is created."""
    problems = []
    why = port_in_use(host, port)
    if why:
        problems.append(HTTP_PORT_TAKEN.format(host=host, port=port, why=why,
                                               free=port_free_after(host, port)))
    if mqtt_port is not None:
        why = port_in_use("127.0.0.1", mqtt_port)
        if why:
            problems.append(MQTT_PORT_TAKEN.format(port=mqtt_port, why=why,
                                                   free=port_free_after("127.0.0.1", mqtt_port)))
    if problems:
        raise CommandError("\n".join(problems))


def password_keep(path: Path, password: str) -> None:
    """Write the password readable by its owner only (0600), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, password.encode())
    finally:
        os.close(fd)


def sign_in_words(user, *, kept: Path, login_url: str) -> list[str]:
    """How to sign in to the admin account, said on every run."""
    name = user.get_username()
    env_password = settings.REACH_ADMIN_PASSWORD
    lines = []
    kept_password = kept.read_text(encoding="utf-8").strip() if kept.exists() else ""
    if env_password and user.check_password(env_password):
        lines.append(f"Sign in at {login_url} as {name} with the password in "
                     "REACH_ADMIN_PASSWORD.")
    elif kept_password and user.check_password(kept_password):
        lines.append(f"Sign in at {login_url} as {name} / {kept_password}  (the password is "
                     f"kept in {kept}, readable by you only)")
    else:
        changed = f" ({kept} holds an older one)" if kept_password else ""
        lines.append(f"Sign in at {login_url} as {name} with the password you set for it"
                     f"{changed}.")
    # changepassword needs the same database as this run.
    same = [var for var in ("REACH_RUN_DIR", "DATABASE_URL") if os.environ.get(var)]
    env = f"  (with this run's {' and '.join(same)} set)" if same else ""
    lines.append(RESET_HINT.format(user=name, env=env))
    return lines


def faults_parse(asked: list[str], *, agents: list[str]) -> list[tuple[str, str]]:
    """`--simulate-fault AGENT=FAULT`, each checked against the simulated cluster's agents
    and the faults it knows, before anything is started."""
    from reachconsole.dev.simulator import FAULTS

    faults = []
    for item in asked:
        agent_id, sep, fault = (part.strip() for part in item.partition("="))
        if not sep:
            raise CommandError(f"--simulate-fault {item!r}: write AGENT=FAULT, e.g. "
                               f"{agents[0] if agents else 'fin.tax'}=silent")
        if agent_id not in agents:
            raise CommandError(f"--simulate-fault {item!r}: no simulated agent {agent_id!r}; "
                               f"they are {', '.join(agents)}")
        if fault not in FAULTS or not fault:
            raise CommandError(f"--simulate-fault {item!r}: the faults are "
                               f"{', '.join(f for f in FAULTS if f)}")
        faults.append((agent_id, fault))
    return faults


class Command(BaseCommand):
    help = "Run the console, its worker, beat, an embedded broker and a simulated cluster."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-worker", action="store_true",
                            help="do not run a Celery worker and beat in this process")
        parser.add_argument("--simulate-nodes", type=int, default=3,
                            help="simulated nodes (0: none)")
        parser.add_argument("--simulate-agents", type=int, default=12,
                            help="simulated agents, spread over the nodes (default 12)")
        parser.add_argument("--simulate-rate", type=float, default=2.0,
                            help="tasks per second the simulated cluster sends")
        parser.add_argument("--simulate-heartbeat-ms", type=int, default=None,
                            help="simulated nodes' heartbeat (default: what the lease says)")
        # Faults on purpose (README "Make something go wrong"); /practice/ switches them
        # while it runs.
        from reachconsole.dev.simulator import fault_arguments_add

        fault_arguments_add(parser, prefix="simulate-")
        parser.add_argument("--simulate-fault", action="append", default=[],
                            metavar="AGENT=FAULT",
                            help="one agent slow, failing or silent from the start, e.g. "
                                 "fin.tax=silent (repeatable)")

    def handle(self, *args, **options) -> None:
        # `kill -USR1 <pid>` prints every thread's stack: what a console that will not stop
        # is waiting on (tests/test_embedded_run.py asks it when a stop takes too long).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        ports_check(host=options["host"], port=options["port"],
                    mqtt_port=None if settings.MQTT_URL else settings.REACH_EMBEDDED_MQTT_PORT)
        faults = []
        if options["simulate_nodes"] > 0:
            from reachconsole.dev.simulator import cluster_plan

            plan = cluster_plan(nodes=options["simulate_nodes"],
                                agents=options["simulate_agents"])
            faults = faults_parse(options["simulate_fault"],
                                  agents=[a.agent_id for n in plan for a in n.agents])
        # Events go out on Daphne's loop: the in-memory channel layer only works from the
        # loop its consumers run on.
        from daphne.server import twisted_loop

        from messages.events import publisher

        publisher.bind_loop(twisted_loop)
        call_command("migrate", interactive=False, verbosity=0)
        base_url = f"http://{options['host']}:{options['port']}"
        self._ensure_admin(login_url=f"{base_url}/accounts/login/")
        token = self._ensure_service_token()
        broker = self._start_broker()
        worker = None
        if not options["no_worker"]:
            from reachconsole.celery import app
            from reachconsole.embedded import EmbeddedWorker

            worker = EmbeddedWorker(app)
            worker.start()
            self.stdout.write("Celery worker and beat: running in this process")
        simulator = None
        if options["simulate_nodes"] > 0:
            from reachconsole.dev.practice import practice_offer
            from reachconsole.dev.simulator import SimulatedCluster, knobs_from

            simulator = SimulatedCluster(
                base_url=base_url, token=token, mqtt_url=settings.MQTT_URL,
                nodes=options["simulate_nodes"], agents=options["simulate_agents"],
                knobs=knobs_from(options, rate=options["simulate_rate"], prefix="simulate-"),
                prefix=settings.MQTT_TOPIC_PREFIX, mqtt_protocol=settings.MQTT_PROTOCOL,
                keyring=signing.keyring_for(settings.REACH_SIGNING_KEYS),
                heartbeat_ms=options["simulate_heartbeat_ms"],
            )
            for agent_id, fault in faults:
                simulator.agent_fault(agent_id, fault)
            practice_offer(simulator)
        # The console's URLs and /practice/ (reachconsole/dev/practice.py), which acts on
        # this process's simulated cluster and so exists only here.
        settings.ROOT_URLCONF = "reachconsole.dev.urls"
        self.stdout.write(self.style.SUCCESS(f"Console: {base_url}/  (Ctrl-C stops everything)"))
        if simulator:
            self.stdout.write(f"Make something go wrong: {base_url}/practice/  (stop a node, "
                              "make an agent slow, failing or silent)")
        try:
            self._serve(options["host"], options["port"], on_ready=simulator.start
                        if simulator else None)
        finally:
            if simulator:
                simulator.stop()
            if worker:
                worker.stop()
            if broker:
                broker.stop()

    def _ensure_admin(self, *, login_url: str) -> None:
        User = get_user_model()
        username = settings.REACH_ADMIN_USER
        kept = Path(settings.RUN_DIR) / ADMIN_PASSWORD_FILE
        user = User.objects.filter(username=username).first()
        if user is None:
            password = settings.REACH_ADMIN_PASSWORD or secrets.token_urlsafe(12)
            user = User.objects.create_superuser(username=username, email="", password=password)
            if not settings.REACH_ADMIN_PASSWORD:
                password_keep(kept, password)
            self.stdout.write(self.style.WARNING(f"Admin account created: {username}"))
        for line in sign_in_words(user, kept=kept, login_url=login_url):
            self.stdout.write(self.style.SUCCESS(line))

    def _ensure_service_token(self) -> str:
        if settings.REACH_SERVICE_TOKENS:
            return settings.REACH_SERVICE_TOKENS[0].secret
        # No token configured: one for this run only, so the simulated nodes can register.
        token = secrets.token_urlsafe(24)
        settings.REACH_SERVICE_TOKENS = tokens_parse([token])
        self.stdout.write(f"Service token for this run (REACH_SERVICE_TOKENS unset): {token}")
        return token

    def _start_broker(self):
        if settings.MQTT_URL:
            self.stdout.write(f"MQTT broker: {settings.MQTT_URL}")
            return None
        from reachconsole.dev.embedded_broker import BrokerPortInUse, EmbeddedBroker

        broker = EmbeddedBroker(host="127.0.0.1", port=settings.REACH_EMBEDDED_MQTT_PORT)
        try:
            broker.start()
        except BrokerPortInUse as exc:
            raise CommandError(
                f"{exc}\n(or choose another port for the embedded broker with "
                "REACH_EMBEDDED_MQTT_PORT)"
            ) from exc
        # This process is the only user of these settings: the bridge connects to it, and
        # the embedded broker speaks MQTT 3.1.1 only (persistent sessions via clean_session).
        settings.MQTT_URL = broker.url
        settings.MQTT_PROTOCOL = "3.1.1"
        settings.REACH_EMBEDDED_BROKER = True
        self.stdout.write(f"MQTT broker (embedded): {broker.url}")
        return broker

    def _serve(self, host: str, port: int, on_ready=None) -> None:
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server

        from reachconsole.asgi import application
        from reachconsole.core.query_bound import query_bound_uninstall

        # The in-process worker shares this process: its bridge waits a stalled database out
        # (acknowledging nothing it has not stored) rather than have its writes cut off.
        query_bound_uninstall()
        server = Server(
            application=application,
            endpoints=build_endpoint_description_strings(host=host, port=port),
            ready_callable=on_ready,
            verbosity=0,
        )
        try:
            server.run()
        except OSError as exc:
            raise CommandError(f"cannot serve on {host}:{port}: {exc}; use --port") from exc
