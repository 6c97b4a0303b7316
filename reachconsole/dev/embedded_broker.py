"""In-process MQTT broker (amqtt) for the console's embedded mode. Dev-only: production code
never imports it (pyproject.toml, [tool.importlinter]).

Production talks to Mosquitto; embedded mode runs this broker on loopback so a developer's laptop
needs no extra service. Everything here is stdlib + amqtt so it can start before Django is set up.

amqtt 0.12 speaks MQTT 3.1.1 only, so clients of this broker must use MQTTv311 (clean_session=False
plus a fixed client id for a persistent session). An MQTT 5 CONNECT with no properties is refused
with CONNACK return code 1 ("unacceptable protocol version"); one with properties (such as a session
expiry interval) is misparsed and never answered, so the client hangs until its keepalive expires.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
import threading
from types import TracebackType

import amqtt.broker
from amqtt.broker import Broker
from amqtt.contexts import BrokerConfig, ListenerConfig, ListenerType
from amqtt.mqtt.constants import QOS_1
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.protocol.handler import OUTGOING
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import OutgoingApplicationMessage, Session

logger = logging.getLogger(__name__)

# amqtt logs every connection, listener and plugin load at INFO; "transitions" (its state-machine
# dependency) is just as chatty.
_NOISY_LOGGERS = ("amqtt", "transitions")

_PROBE_TIMEOUT = 0.5

class BrokerPortInUse(RuntimeError):
    """The embedded broker's port is already taken by another process."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        super().__init__(
            f"Cannot start the embedded MQTT broker: {host}:{port} is already in use. "
            f"Set MQTT_URL to the broker already listening there (e.g. mqtt://127.0.0.1:{port}) "
            f"to use it instead, or free the port."
        )


class AllowAllAuthPlugin(BaseAuthPlugin):
    """Accept every client without marking its session anonymous.

    amqtt's own AnonymousAuthPlugin(allow_anonymous=True) flags every session it admits as
    anonymous, and the broker then neither queues QoS 1/2 messages for an offline anonymous
    session nor keeps the session after disconnect - persistent sessions would silently not work.
    """

    async def authenticate(self, *, session: Session) -> bool:
        return True


PUBACK_WAIT_S = 10  # how long a delivery task waits; an unanswered message stays queued either way


class KeepInflightHandler(BrokerProtocolHandler):
    """amqtt 0.12 forgets a QoS 1 message sent to a subscriber that does not PUBACK it within
    5 s, or that disconnects first: a console killed in the middle of a burst would lose
    what was in flight. MQTT 3.1.1 (4.4) wants such messages sent again when the session
    resumes, so this handler keeps them in the session until the PUBACK arrives; amqtt's own
    resume path (`_retry_deliveries`) then sends them again.
    """

    async def _handle_qos1_message_flow(self, app_message) -> None:  # type: ignore[override]
        outgoing = (app_message.direction == OUTGOING and app_message.qos == QOS_1
                    and self.session is not None and app_message.packet_id is not None
                    and app_message.puback_packet is None)
        if not outgoing:
            await super()._handle_qos1_message_flow(app_message)
            return
        if isinstance(app_message, OutgoingApplicationMessage):
            self.session.inflight_out[app_message.packet_id] = app_message
        dup = app_message.publish_packet is not None
        packet = app_message.build_publish_packet(dup=dup)
        waiter: asyncio.Future = asyncio.Future()
        self._puback_waiters[app_message.packet_id] = waiter
        try:
            await self._send_packet(packet)
            app_message.publish_packet = packet
            app_message.puback_packet = await asyncio.wait_for(waiter, timeout=PUBACK_WAIT_S)
            self.session.inflight_out.pop(app_message.packet_id, None)
        except (TimeoutError, asyncio.CancelledError, ConnectionError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the broker is shutting down, not just this client
            # Left in inflight_out: sent again (DUP) when the client's session resumes.
            logger.debug("QoS 1 message %s kept for redelivery", app_message.packet_id)
        finally:
            self._puback_waiters.pop(app_message.packet_id, None)


def _patch_amqtt() -> None:
    """Make amqtt's broker build KeepInflightHandler for its clients (it builds its handlers
    by this module-level name). Done when a broker starts, not at import: importing this
    module changes no library."""
    amqtt.broker.BrokerProtocolHandler = KeepInflightHandler  # type: ignore[misc]


def _quiet_amqtt_logging() -> None:
    for name in _NOISY_LOGGERS:
        noisy = logging.getLogger(name)
        # Respect a level someone configured deliberately (e.g. Django LOGGING for debugging).
        if noisy.level == logging.NOTSET:
            noisy.setLevel(logging.WARNING)


def _is_addr_in_use(exc: BaseException | None) -> bool:
    # amqtt wraps the OSError from asyncio.start_server in BrokerError("... can't be started").
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _bind_fails(host: str, port: int) -> bool:
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False  # unresolvable host: let amqtt report it
    for family, kind, proto, _canonical, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # Mirror asyncio's reuse_address=True so TIME_WAIT sockets left by a previous run are
            # not mistaken for a live listener. On Windows SO_REUSEADDR would let us share a live
            # port, so ask for exclusive use there instead.
            if sys.platform == "win32":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
            else:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if _is_addr_in_use(exc):
                    return True
                # Anything else (bad address, privileged port) is left for amqtt to report.
    return False


def _something_answers(host: str, port: int) -> bool:
    # Wildcard binds are reached through loopback.
    probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # noqa: S104
    try:
        with socket.create_connection((probe_host, port), timeout=_PROBE_TIMEOUT):
            return True
    except OSError:
        return False


def _port_is_taken(host: str, port: int) -> bool:
    # The bind check alone misses a broker on the wildcard address on BSD/macOS, which let us
    # shadow it by binding the specific loopback address. It goes first all the same: a bare TCP
    # connect makes an amqtt broker on that port log an ERROR ("No data from ...").
    return _bind_fails(host, port) or _something_answers(host, port)


class EmbeddedBroker:
    """amqtt broker running on its own event loop in a daemon thread."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 1883) -> None:
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _config(self) -> BrokerConfig:
        return BrokerConfig(
            # Only the "default" listener: BrokerConfig's default would bind 0.0.0.0, and a
            # websocket listener is never needed here.
            listeners={
                "default": ListenerConfig(type=ListenerType.TCP, bind=f"{self.host}:{self.port}"),
            },
            # An explicit plugin map replaces amqtt's defaults, which include the $SYS publisher
            # (every 20 s) and per-packet logging plugins. No topic plugin means no ACL.
            plugins={f"{AllowAllAuthPlugin.__module__}.{AllowAllAuthPlugin.__qualname__}": {}},
            # Persistent sessions are kept until the process exits, like Mosquitto's default.
            session_expiry_interval=None,
        )

    def start(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self.running:
                return
            _quiet_amqtt_logging()
            _patch_amqtt()
            if _port_is_taken(self.host, self.port):
                raise BrokerPortInUse(self.host, self.port)

            self._ready.clear()
            self._start_error = None
            self._thread = threading.Thread(
                target=self._run, name=f"embedded-mqtt-broker:{self.port}", daemon=True
            )
            self._thread.start()
            if not self._ready.wait(timeout):
                self._stop_locked(timeout)
                raise RuntimeError(f"embedded MQTT broker did not start within {timeout} s")

            error = self._start_error
            if error is not None:
                self._thread.join(timeout)
                self._thread = None
                if _is_addr_in_use(error):
                    # Lost a race with another process between the probe and amqtt's bind.
                    raise BrokerPortInUse(self.host, self.port) from error
                raise RuntimeError(f"embedded MQTT broker failed to start: {error}") from error
        logger.debug("embedded MQTT broker listening on %s", self.url)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop_locked(timeout)

    def _stop_locked(self, timeout: float) -> None:
        thread, loop, stop_requested = self._thread, self._loop, self._stop_requested
        if thread is None:
            return
        if loop is not None and stop_requested is not None:
            try:
                loop.call_soon_threadsafe(stop_requested.set)
            except RuntimeError:
                pass  # loop already closed: the thread is on its way out
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"embedded MQTT broker did not stop within {timeout} s")
        self._thread = None

    def _run(self) -> None:
        # asyncio.run also cancels leftover client tasks and closes the loop when serving ends.
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            # BaseException too: whatever ends the thread must reach the caller waiting in start().
            if not self._ready.is_set():
                self._start_error = exc
            else:
                logger.exception("embedded MQTT broker crashed")
        finally:
            self._loop = None
            self._stop_requested = None
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        # Broker() must be built inside the running loop: it captures it for its tasks.
        broker = Broker(self._config())
        # start() returns once asyncio.start_server() is listening, so the kernel accepts
        # connections from here on; no connect probe needed (amqtt would log it as an error).
        await broker.start()
        self._ready.set()
        try:
            await self._stop_requested.wait()
        finally:
            try:
                await broker.shutdown()
            except Exception:
                logger.warning("embedded MQTT broker did not shut down cleanly", exc_info=True)

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
