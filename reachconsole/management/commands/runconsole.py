"""`make run`: the whole console in one process on embedded defaults.

Migrates, makes sure a local admin account exists, starts the embedded MQTT broker (unless
MQTT_URL names one), a Celery worker and beat as threads, a small simulated cluster, and
serves HTTP and WebSockets with Daphne. Production runs the same code as separate processes.
"""

from __future__ import annotations

import logging
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from reachconsole.core.tokens import tokens_parse

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Run the console, its worker, beat, an embedded broker and a simulated cluster."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-worker", action="store_true",
                            help="do not run a Celery worker and beat in this process")
        parser.add_argument("--simulate-nodes", type=int, default=3,
                            help="simulated nodes (0: none)")
        parser.add_argument("--simulate-agents", type=int, default=12)
        parser.add_argument("--simulate-rate", type=float, default=2.0,
                            help="tasks per second the simulated cluster sends")
        parser.add_argument("--simulate-heartbeat-ms", type=int, default=None,
                            help="simulated nodes' heartbeat (default: what the lease says)")

    def handle(self, *args, **options) -> None:
        # Events go out on Daphne's loop: the in-memory channel layer only works from the
        # loop its consumers run on.
        from daphne.server import twisted_loop

        from messages.events import publisher

        publisher.bind_loop(twisted_loop)
        call_command("migrate", interactive=False, verbosity=0)
        self._ensure_admin()
        token = self._ensure_service_token()
        broker = self._start_broker()
        worker = None
        if not options["no_worker"]:
            from reachconsole.celery import app
            from reachconsole.embedded import EmbeddedWorker

            worker = EmbeddedWorker(app)
            worker.start()
            self.stdout.write("Celery worker and beat: running in this process")
        base_url = f"http://{options['host']}:{options['port']}"
        simulator = None
        if options["simulate_nodes"] > 0:
            from reachconsole.dev.simulator import Knobs, SimulatedCluster

            simulator = SimulatedCluster(
                base_url=base_url, token=token, mqtt_url=settings.MQTT_URL,
                nodes=options["simulate_nodes"], agents=options["simulate_agents"],
                knobs=Knobs(rate=options["simulate_rate"]), prefix=settings.MQTT_TOPIC_PREFIX,
                mqtt_protocol=settings.MQTT_PROTOCOL,
                heartbeat_ms=options["simulate_heartbeat_ms"],
            )
        self.stdout.write(self.style.SUCCESS(f"Console: {base_url}/  (Ctrl-C stops everything)"))
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

    def _ensure_admin(self) -> None:
        User = get_user_model()
        username = settings.REACH_ADMIN_USER
        if User.objects.filter(username=username).exists():
            self.stdout.write(f"Admin account: {username} (password as set before)")
            return
        password = settings.REACH_ADMIN_PASSWORD or secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email="", password=password)
        shown = "from REACH_ADMIN_PASSWORD" if settings.REACH_ADMIN_PASSWORD else password
        self.stdout.write(self.style.WARNING(
            f"Admin account created: {username} / {shown}  (shown once; "
            "change it in the admin or set REACH_ADMIN_PASSWORD before the first run)"
        ))

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
        self.stdout.write(f"MQTT broker (embedded): {broker.url}")
        return broker

    def _serve(self, host: str, port: int, on_ready=None) -> None:
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server

        from reachconsole.asgi import application

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
