"""The deployment files run the README's production commands, and say what they promise:
deploy/compose.yaml (N Daphne behind a WebSocket-passing proxy, workers with one bridge id
each, exactly one beat, /readyz healthchecks), deploy/nginx.conf (plain round robin, the
Upgrade headers, the client's address replaced) and the Procfile.

Docker is not usable on the test machine, so the compose file is read as YAML (with its
anchors and merge keys, as Compose reads them); `nginx -t` checks the proxy's file where nginx
is installed.
"""

from __future__ import annotations

import base64
import http.client
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.conftest import stop_process
from tests.mqtt import free_port
from tests.processes import ROOT, daphne_serving

DEPLOY = ROOT / "deploy"


def readme_commands() -> dict[str, list[str]]:
    """The production commands from the README's "Two ways to run" block, by program."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("**Production**"):]
    block = block[block.index("```sh"):]
    block = block[:block.index("```", 5)]
    commands = {}
    for line in block.splitlines():
        if not line.startswith(("daphne ", "celery ")):
            continue  # the `export … \` lines are not commands of a process
        words = shlex.split(line.split("#")[0])
        if words[0] == "daphne":
            commands["web"] = words
        elif words[:1] == ["celery"]:
            commands[words[3]] = words  # celery -A reachconsole worker|beat
    assert set(commands) == {"web", "worker", "beat"}, commands
    return commands


def runs(command: list[str], readme: list[str]) -> bool:
    """`command` is the README's command with options added (a path before the program, a
    log level, --proxy-headers): the README's words appear in it in the same order."""
    words = [Path(command[0]).name, *command[1:]]
    position = 0
    for word in words:
        if position < len(readme) and word == readme[position]:
            position += 1
    return position == len(readme)


def which_program(command: list[str]) -> str | None:
    for name, readme in readme_commands().items():
        if runs(command, readme):
            return name
    return None


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))


def console_services(compose: dict) -> dict[str, str]:
    """Service name → which production program it runs (web, worker, beat)."""
    found = {}
    for name, service in compose["services"].items():
        command = service.get("command")
        if isinstance(command, list) and (program := which_program(command)):
            found[name] = program
    return found


def test_it_runs_the_readme_commands_for_every_console_process(compose):
    programs = console_services(compose)
    assert sorted(programs.values()) == ["beat", "web", "worker", "worker"], programs
    assert compose["services"]["migrate"]["command"] == ["python", "manage.py", "migrate",
                                                         "--noinput"]
    for name in [*programs, "migrate"]:
        env = compose["services"][name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://") and "@postgres:5432/" in \
            env["DATABASE_URL"], name
        assert env["REDIS_URL"] == "redis://redis:6379/0", name
        # The console's own broker account: the shipped broker lets no anonymous client in.
        assert env["MQTT_URL"] == ("mqtt://console:${MQTT_CONSOLE_PASSWORD:?set "
                                   "MQTT_CONSOLE_PASSWORD}@mosquitto:1883"), name
        assert env["REACH_REQUIRE_SECRET_KEY"] == "1", name
        assert "REACH_BRIDGE_INSTANCE" not in env or programs.get(name) == "worker", name


def test_it_has_one_beat_and_workers_with_a_bridge_id_each(compose):
    services, programs = compose["services"], console_services(compose)
    beats = [name for name, program in programs.items() if program == "beat"]
    assert len(beats) == 1 and services[beats[0]].get("deploy", {}).get("replicas", 1) == 1
    workers = [name for name, program in programs.items() if program == "worker"]
    instances = [services[name]["environment"]["REACH_BRIDGE_INSTANCE"] for name in workers]
    # Copies of one service would share one MQTT client id and throw each other off.
    assert len(set(instances)) == len(workers) >= 2, instances
    assert all(services[name].get("deploy", {}).get("replicas", 1) == 1 for name in workers)
    assert all(services[name]["stop_grace_period"] == "120s" for name in workers)


def test_the_daphnes_are_replicas_behind_the_proxy_and_checked_with_readyz(compose):
    services = compose["services"]
    webs = [name for name, program in console_services(compose).items() if program == "web"]
    assert webs == ["daphne"]
    daphne = services["daphne"]
    assert daphne["deploy"]["replicas"] >= 2
    assert "--proxy-headers" in daphne["command"]  # the client's address, from the proxy
    assert "ports" not in daphne  # reachable only through the proxy (docs/deployment.md)
    assert "/readyz" in " ".join(daphne["healthcheck"]["test"])
    proxy = services["proxy"]
    assert "./nginx.conf:/etc/nginx/nginx.conf:ro" in proxy["volumes"]
    assert proxy["depends_on"]["daphne"]["condition"] == "service_healthy"


def test_the_broker_runs_the_recommended_configuration(compose):
    mosquitto = compose["services"]["mosquitto"]
    assert "./mosquitto.conf:/mosquitto/config/mosquitto.conf:ro" in mosquitto["volumes"]
    assert "mosquitto -c /mosquitto/config/mosquitto.conf" in mosquitto["command"][-1]
    # deploy/mosquitto.conf keeps its persistence there: it must be the volume.
    conf = (DEPLOY / "mosquitto.conf").read_text(encoding="utf-8")
    location = re.search(r"^persistence_location (\S+)$", conf, re.MULTILINE).group(1)
    assert f"mosquitto-data:{location.rstrip('/')}" in mosquitto["volumes"]
    for service in ("postgres", "redis", "mosquitto"):
        assert compose["services"][service]["healthcheck"]["test"], service


def test_every_mosquitto_setting_has_its_reason_above_it():
    lines = (DEPLOY / "mosquitto.conf").read_text(encoding="utf-8").splitlines()
    settings = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    assert settings
    for i in settings:
        # A comment right above it, or it continues a group of one kind (log_type lines).
        above = lines[i - 1]
        same_kind = above.split(" ")[0] == lines[i].split(" ")[0]
        assert above.startswith("#") or same_kind, f"no reason above: {lines[i]!r}"
        # Mosquitto would take a trailing comment as part of the value.
        assert "#" not in lines[i], f"inline comment: {lines[i]!r}"


def test_the_procfile_runs_the_readme_commands():
    entries = {}
    for line in (ROOT / "Procfile").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, command = line.split(":", 1)
            entries[name] = shlex.split(command.replace("${PORT:-8000}", "8000"))
    assert set(entries) == {"web", "worker", "beat"}
    for name, command in entries.items():
        assert which_program(command) == name, (name, command)


def test_the_proxy_passes_websockets_round_robin_and_replaces_the_client_address():
    conf = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    code = "\n".join(line.split("#")[0] for line in conf.splitlines())
    upstream = re.search(r"upstream reachconsole \{(.*?)\}", code, re.DOTALL).group(1)
    assert re.search(r"server daphne:8000\b", upstream)
    # Any Daphne serves any client: no stickiness of any kind.
    assert not re.search(r"\b(ip_hash|hash|sticky|least_conn|random)\b", upstream)
    assert "proxy_set_header Upgrade $http_upgrade;" in code
    assert "proxy_set_header Connection $connection_upgrade;" in code
    assert "proxy_http_version 1.1;" in code
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in code
    assert "$proxy_add_x_forwarded_for" not in code
    assert code.count("proxy_pass http://reachconsole;") == 2


@pytest.mark.skipif(not shutil.which("nginx"), reason="nginx is not installed")
def test_nginx_accepts_the_proxy_configuration(tmp_path):
    # Outside compose there is no host `daphne` to resolve.
    conf = tmp_path / "nginx.conf"
    conf.write_text((DEPLOY / "nginx.conf").read_text(encoding="utf-8")
                    .replace("server daphne:8000", "server 127.0.0.1:8000"), encoding="utf-8")
    result = subprocess.run(["nginx", "-t", "-c", str(conf), "-g", f"pid {tmp_path}/nginx.pid;"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr



def _websocket_handshake(port: int, path: str) -> tuple[str, int | None]:
    """A raw WebSocket handshake through `port`: the status line, and the close code of the
    first frame when the server closed the socket."""
    key = base64.b64encode(os.urandom(16)).decode()
    request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
               f"Sec-WebSocket-Version: 13\r\nOrigin: http://127.0.0.1\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 4:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    head, _, frame = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n")[0].decode()
    # The server's frames are unmasked: opcode 8 is a close, its first 2 bytes the code.
    code = int.from_bytes(frame[2:4], "big") if len(frame) >= 4 and frame[0] & 0x0F == 8 \
        else None
    return status, code


@contextmanager
def nginx_in_front_of(tmp_path: Path, upstreams: list[int]) -> Iterator[int]:
    """deploy/nginx.conf as it is, on a free port, with the compose service name `daphne`
    replaced by these loopback ports; yields nginx's port."""
    port = free_port()
    text = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    assert "listen 80;" in text and "server daphne:8000 " in text
    servers = "; ".join(f"server 127.0.0.1:{p}" for p in upstreams)
    conf = tmp_path / "nginx.conf"
    conf.write_text(text.replace("listen 80;", f"listen 127.0.0.1:{port};")
                    .replace("server daphne:8000 ", f"{servers} "), encoding="utf-8")
    errors = tmp_path / "nginx.err"
    with open(errors, "w") as err:
        proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(tmp_path),
                                 "-g", f"daemon off; pid {tmp_path}/nginx.pid;"],
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 15
            while not _listening(port):
                assert proc.poll() is None, errors.read_text()
                assert time.monotonic() < deadline, "nginx did not listen within 15 s"
                time.sleep(0.1)
            yield port
        finally:
            stop_process(proc, 10)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not shutil.which("nginx"), reason="nginx is not installed")
def test_nginx_spreads_requests_over_two_daphnes_and_passes_websockets(tmp_path):
    """Two stock Daphnes behind deploy/nginx.conf: plain requests reach both, and a WebSocket
    handshake reaches the console's consumer, which accepts it and then closes an anonymous
    socket with 4401 (without the Upgrade headers passed on, Daphne answers 400)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with daphne_serving(tmp_path / "a") as (port_a, log_a), \
            daphne_serving(tmp_path / "b") as (port_b, log_b):
        before = {log_a: log_a.stat().st_size, log_b: log_b.stat().st_size}
        with nginx_in_front_of(tmp_path, [port_a, port_b]) as port:
            for _ in range(6):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/healthz")
                assert conn.getresponse().status == 200
                conn.close()
            status, code = _websocket_handshake(port, "/ws/timeline/")
        served = {log.parent.name: log.read_bytes()[start:].count(b"/healthz")
                  for log, start in before.items()}
    assert served["a"] >= 2 and served["b"] >= 2, served
    assert status.startswith("HTTP/1.1 101"), status
    assert code == 4401


@pytest.mark.skipif(not shutil.which("mosquitto_passwd"), reason="Mosquitto is not installed")
def test_the_brokers_start_command_makes_the_accounts_that_then_get_in(compose):
    """The mosquitto service's own command, run by sh with its three directories moved into a
    temporary one (and the listener onto a free loopback port): it makes the console's
    account and each node's from the environment, and the broker it then execs lets those in
    and nobody anonymous."""
    import tempfile

    import paho.mqtt.client as mqtt

    # Mosquitto drops to its own user, which must reach the files (pytest's tmp_path is 0700).
    tmp_path = Path(tempfile.mkdtemp(prefix="reach-compose-broker-"))
    tmp_path.chmod(0o755)
    service = compose["services"]["mosquitto"]
    moves = {"/etc/mosquitto/reach": tmp_path / "reach", "/mosquitto/config": tmp_path / "config",
             "/var/lib/mosquitto": tmp_path / "data"}

    def moved(text: str) -> str:
        for old, new in moves.items():
            text = text.replace(old, str(new))
        return text

    port = free_port()
    (tmp_path / "config").mkdir()
    conf = moved((DEPLOY / "mosquitto.conf").read_text(encoding="utf-8"))
    conf = re.sub(r"^listener .*$", f"listener {port} 127.0.0.1", conf, flags=re.MULTILINE)
    (tmp_path / "config" / "mosquitto.conf").write_text(conf, encoding="utf-8")
    shutil.copy(DEPLOY / "mosquitto.acl", tmp_path / "config" / "mosquitto.acl")
    for volume in service["volumes"]:  # every file the command reads is mounted
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            assert Path(moved(target)).exists(), volume
    script = moved(service["command"][-1]).replace("$$", "$")
    env = {**os.environ, "MQTT_CONSOLE_PASSWORD": "console-pw-1",
           "MQTT_NODE_ACCOUNTS": "node-a:node-a-pw,node-b:node-b-pw"}
    assert set(service["environment"]) == {"MQTT_CONSOLE_PASSWORD", "MQTT_NODE_ACCOUNTS"}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the broker did not listen"
            time.sleep(0.1)

        def connack(user: str | None, password: str | None) -> bool:
            client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
            if user:
                client.username_pw_set(user, password)
            try:
                client.connect("127.0.0.1", port)
                result = []
                client.on_connect = lambda c, u, f, rc, p: result.append(rc)
                deadline = time.monotonic() + 10
                while not result and time.monotonic() < deadline:
                    client.loop(0.1)
                return bool(result) and not result[0].is_failure
            finally:
                client.disconnect()

        assert connack("console", "console-pw-1")
        assert connack("node-b", "node-b-pw")
        assert not connack("node-a", "console-pw-1")
        assert not connack(None, None)
    finally:
        stop_process(proc, 15)
        shutil.rmtree(tmp_path, ignore_errors=True)
