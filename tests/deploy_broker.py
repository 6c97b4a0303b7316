"""A PRIVATE Mosquitto run from deploy/mosquitto.conf and deploy/mosquitto.acl as they are in
the repository, with only what must move changed: the listener (a free loopback port), the
persistence directory, the log, and the paths of the password file (made here with
mosquitto_passwd for the accounts a test asks for) and of the ACL (copied as it is)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import stop_process
from tests.mqtt import free_port
from tests.processes import HOST, ROOT

CONF = ROOT / "deploy" / "mosquitto.conf"
ACL = ROOT / "deploy" / "mosquitto.acl"
MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")
MOSQUITTO_PASSWD = (shutil.which("mosquitto_passwd")
                    or shutil.which("mosquitto_passwd", path="/usr/sbin:/usr/bin"))
# The console's account, as deploy/README.md makes it.
CONSOLE_USER, CONSOLE_PASSWORD = "console", "console-password-for-tests"


@dataclass(frozen=True)
class Broker:
    port: int
    log_path: Path
    passwords: dict[str, str]

    def url(self, user: str = CONSOLE_USER) -> str:
        return f"mqtt://{user}:{self.passwords[user]}@{HOST}:{self.port}"


def broker_config(*, port: int, work: Path, skip: tuple[str, ...] = ()) -> str:
    """deploy/mosquitto.conf with only the listener, the persistence directory and the
    account files moved (and any `skip` settings left out)."""
    out, moved = [], []
    for line in CONF.read_text(encoding="utf-8").splitlines():
        words = line.split()
        key = words[0] if words and not line.startswith("#") else ""
        if key == "listener":
            line = f"listener {port} {HOST}"
        elif key == "persistence_location":
            line = f"persistence_location {work}/"
        elif key == "password_file":
            line = f"password_file {work}/passwd"
        elif key == "acl_file":
            line = f"acl_file {work}/acl"
        elif key in skip:
            continue
        else:
            key = ""
        if key:
            moved.append(key)
        out.append(line)
    # The file must keep the shape the tests rely on: each of these once.
    assert sorted(moved) == sorted(["listener", "persistence_location", "password_file",
                                    "acl_file"]), moved
    return "\n".join(out) + "\n"


@contextmanager
def private_mosquitto(*, users: dict[str, str] | None = None, skip: tuple[str, ...] = ()
                      ) -> Iterator[Broker]:
    """`mosquitto -c` on the deployment's files; the console's account always, and `users`
    (name → password) beside it. Stopped by its own pid at the end."""
    assert MOSQUITTO and MOSQUITTO_PASSWD, "mosquitto and mosquitto_passwd are not installed"
    # Started as root, Mosquitto drops to its own user, which must write the directory.
    work = Path(tempfile.mkdtemp(prefix="reach-deploy-broker-"))
    work.chmod(0o777)
    port = free_port()
    passwords = {CONSOLE_USER: CONSOLE_PASSWORD, **(users or {})}
    passwd = work / "passwd"
    for index, (user, password) in enumerate(passwords.items()):
        subprocess.run([MOSQUITTO_PASSWD, *(["-c"] if index == 0 else []), "-b", str(passwd),
                        user, password], check=True, capture_output=True)
    shutil.copy(ACL, work / "acl")
    for path in (passwd, work / "acl"):
        path.chmod(0o644)  # read by Mosquitto after it drops to its own user
    conf = work / "mosquitto.conf"
    conf.write_text(broker_config(port=port, work=work, skip=skip), encoding="utf-8")
    conf.chmod(0o644)
    log_path = work / "mosquitto.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 15
            while not _port_open(port):
                assert proc.poll() is None, f"mosquitto exited: {log_path.read_text()}"
                assert time.monotonic() < deadline, "mosquitto did not listen within 15 s"
                time.sleep(0.1)
            yield Broker(port=port, log_path=log_path, passwords=passwords)
        finally:
            stop_process(proc, 15)  # SIGINT: Mosquitto saves its persistence and exits
            shutil.rmtree(work, ignore_errors=True)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((HOST, port)) == 0
