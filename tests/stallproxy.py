"""A TCP proxy that can stall: forwarding stops in both directions, and no socket closes.

The common production fault is not a restart but a connection that stops moving: a NAT or a
load balancer that dropped its state, a paused VM, a broker with a full disk, a database
stuck on I/O. Neither end sees a close; each only sees nothing arrive. `stall()` does that
to every connection through the proxy, new ones included (they are accepted and held, as a
black-holed route would hold them); `resume()` lets everything flow again, in order, as a
path that comes back does.

It runs its own asyncio loop in a daemon thread, so a test drives it from plain code.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from tests.mqtt import free_port

CHUNK = 64 * 1024


class StallProxy:
    def __init__(self, *, target_host: str, target_port: int, host: str = "127.0.0.1",
                 port: int | None = None):
        self.target = (target_host, target_port)
        self.host = host
        self.port = port or free_port()
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"stall-proxy-{self.port}", daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()

    # --- driving it -------------------------------------------------------------------------
    def start(self) -> StallProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def stall(self) -> None:
        self._call(lambda: self._flowing.clear())

    def resume(self) -> None:
        self._call(lambda: self._flowing.set())

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        self.stall()
        try:
            yield
        finally:
            self.resume()

    @property
    def is_stalled(self) -> bool:
        return self._flowing is not None and not self._flowing.is_set()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, fn) -> None:
        done = threading.Event()

        def run() -> None:
            fn()
            done.set()

        self._loop.call_soon_threadsafe(run)
        if not done.wait(10):
            raise RuntimeError("the stall proxy's loop did not answer")

    # --- the loop ---------------------------------------------------------------------------
    async def _serve(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, self.host, self.port)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        self._flowing.set()  # let the pumps see their sockets close

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
                      ) -> None:
        self.connections += 1
        self._writers.add(client_w)
        await self._flowing.wait()  # a stalled route holds a new connection too
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            self._writers.discard(client_w)
            return
        self._writers.add(server_w)
        await asyncio.gather(self._pump(client_r, server_w), self._pump(server_r, client_w),
                             return_exceptions=True)
        for writer in (client_w, server_w):
            writer.close()
            self._writers.discard(writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                # Read before a stall began: held here until it ends, never dropped.
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()
