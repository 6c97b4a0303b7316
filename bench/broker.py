"""A private Mosquitto with raised limits, for `bench/ingest.py --raised-broker`.

The machine's Mosquitto keeps its stock limits (20 QoS 1 messages in flight and 1,000
queued per client), under which a subscriber that falls behind loses messages
(RELIABILITY.md). This starts a second, throw-away broker on a free loopback port with the
limits docs/performance.md tells deployments to set, so the same bench can show the
difference. It is stopped (by its own pid) when the bench ends.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# What docs/performance.md recommends for the bridge's broker.
RAISED_LIMITS = {
    "max_inflight_messages": 1000,  # ≥ the bridge's batch (500): it acks after each commit
    "max_queued_messages": 200000,  # a burst the console has not written yet waits here
    "max_queued_bytes": 0,  # no byte limit on top (0 = none, Mosquitto's default)
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RaisedBroker:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-mosquitto-"))
        # Started as root, mosquitto drops to its own user, which must write the log here.
        self.dir.chmod(0o777)
        self.port = free_port()
        self.log = self.dir / "mosquitto.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RaisedBroker:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        conf = self.dir / "mosquitto.conf"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true",
                 "persistence false", f"log_dest file {self.log}",
                 *(f"{k} {v}" for k, v in RAISED_LIMITS.items())]
        conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self._wait_listening()
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"private mosquitto exited: {self.proc.stderr.read()!r}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"private mosquitto did not listen on {self.port} within 10 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
