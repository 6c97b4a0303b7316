"""`make run` for real: the one-process console with its worker, beat, broker and simulator."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import stop_process
from tests.mqtt import free_port

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "embedded-run-token-0123456789"


def embedded_env() -> dict[str, str]:
    """This process's environment less the variables that select real services."""
    return {k: v for k, v in os.environ.items()
            if k not in {"DATABASE_URL", "REDIS_URL", "MQTT_URL"}}


def get_json(url: str):
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {TOKEN}", "X-OODER-Source": "studio"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {TOKEN}", "X-OODER-Source": "studio",
                 "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s; last: {last!r}")


@pytest.fixture
def console(tmp_path):
    port, mqtt_port = free_port(), free_port()
    env = embedded_env()
    env.update(
        REACH_RUN_DIR=str(tmp_path), REACH_EMBEDDED_MQTT_PORT=str(mqtt_port),
        REACH_SERVICE_TOKENS=TOKEN, REACH_ADMIN_PASSWORD="admin-pw-123",
        REACH_LEASE_TTL_MS="1500", REACH_HEARTBEAT_MS="400", REACH_LEASE_SWEEP_S="0.3",
        PYTHONUNBUFFERED="1",
    )
    log = open(tmp_path / "console.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "runconsole", "--port", str(port),
         "--simulate-nodes", "2", "--simulate-agents", "4"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get_json(f"{base}/healthz"), 60, "the console did not answer")
        proc.mqtt_port = mqtt_port  # for a second simulated cluster on its broker
        yield base, proc, tmp_path / "console.log"
    finally:
        stop_process(proc)
        log.close()


def test_it_runs_the_whole_console_in_one_process(console):
    base, proc, log_path = console

    def simulated_online():
        agents = [a for a in get_json(f"{base}/api/roster/agents")
                  if a["nodeId"].startswith("sim-") and a["status"] == "ONLINE"]
        return agents if len(agents) == 4 else None

    agents = wait_for(simulated_online, 30, "the simulated cluster did not register 4 agents")
    assert {a["nodeId"] for a in agents} == {"sim-node-a", "sim-node-b"}
    # The console hosts its own probe agent and heartbeats for it.
    probe = [a for a in get_json(f"{base}/api/roster/agents") if a["agentId"] == "ops.probe"]
    assert probe and probe[0]["nodeId"] == "console"
    def sim_nodes_ok():
        ok = {n["nodeId"] for n in get_json(f"{base}/api/cluster/nodes")
              if n["consistency"] == "OK"}
        return ok >= {"sim-node-a", "sim-node-b", "console"}

    wait_for(sim_nodes_ok, 30, "the simulated nodes and the console did not heartbeat")

    # An agent that never heartbeats goes OFFLINE: the beat → worker → sweep path is live.
    post_json(f"{base}/api/roster/agents", {"agentId": "ops.silent", "nodeId": "quiet-node"})
    wait_for(
        lambda: any(a["agentId"] == "ops.silent" and a["status"] == "OFFLINE"
                    for a in get_json(f"{base}/api/roster/agents")),
        20, "the lease sweep did not run in the embedded worker",
    )
    # The simulated agents keep theirs by heartbeating.
    live = [a for a in get_json(f"{base}/api/roster/agents") if a["nodeId"].startswith("sim-")]
    assert all(a["status"] == "ONLINE" for a in live)

    login = urllib.request.urlopen(f"{base}/accounts/login/", timeout=5)
    assert login.status == 200
    output = log_path.read_text()
    assert "MQTT broker (embedded): mqtt://127.0.0.1:" in output
    assert "Admin account created: admin" in output
    # Every run says how to sign in (tests/test_run_ports_and_sign_in.py has the cases).
    assert (f"Sign in at {base}/accounts/login/ as admin with the password in "
            "REACH_ADMIN_PASSWORD.") in output

    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # runconsole prints every thread's stack
        time.sleep(1)
        raise AssertionError("runconsole did not stop within 20 s of Ctrl-C; its threads:\n"
                             + log_path.read_text()[-12000:]) from None
    assert code == 0, log_path.read_text()[-3000:]


def test_it_names_mqtt_url_when_the_broker_port_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = embedded_env()
        env.update(REACH_RUN_DIR=str(tmp_path),
                   REACH_EMBEDDED_MQTT_PORT=str(taken.getsockname()[1]))
        result = subprocess.run(
            [sys.executable, "manage.py", "runconsole", "--port", str(free_port())],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode != 0
    assert "MQTT_URL" in result.stderr
    assert "REACH_EMBEDDED_MQTT_PORT" in result.stderr


def test_every_option_of_simulate_says_what_it_does():
    """`manage.py simulate --help` is how a newcomer learns its fault knobs and their units."""
    from reachconsole.management.commands.simulate import Command

    parser = Command().create_parser("manage.py", "simulate")
    own = [a for a in parser._actions
           if a.option_strings and a.dest not in {"help", "version", "verbosity", "settings",
                                                  "pythonpath", "traceback", "no_color",
                                                  "force_color", "skip_checks"}]
    assert len(own) >= 12
    assert [a.dest for a in own if not a.help] == []
    rates = {a.dest: a.help for a in own if a.dest.endswith("_rate") and a.dest != "rate"}
    assert rates and all("0 to 1" in text for text in rates.values())


def test_simulate_runs_beside_make_run_on_its_embedded_broker(console, tmp_path):
    """`manage.py simulate` against `make run`: it speaks MQTT 5 by default, which the
    embedded broker refuses; it used to print "sent 36 tasks, executed 0" while its agents
    went OFFLINE. It finds the broker's version itself, its names do not clash with make run's
    own simulated cluster, and what it says it sent is what the broker confirmed."""
    base, proc, _ = console
    env = embedded_env()
    env.update(REACH_RUN_DIR=str(tmp_path), REACH_EMBEDDED_MQTT_PORT=str(proc.mqtt_port),
               PYTHONUNBUFFERED="1")
    env.pop("MQTT_PROTOCOL", None)
    log_path = tmp_path / "simulate.log"
    with open(log_path, "w+") as log:
        sim = subprocess.Popen(
            [sys.executable, "manage.py", "simulate", "--url", base, "--token", TOKEN,
             "--nodes", "2", "--agents", "4", "--rate", "10", "--slow-ms", "10",
             "--tag", "two", "--report-every", "1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            def theirs_and_ours_online():
                online = {a["agentId"] for a in get_json(f"{base}/api/roster/agents")
                          if a["status"] == "ONLINE" and a["nodeId"].startswith("sim-")}
                tagged = {a for a in online if a.endswith("-two")}
                return len(tagged) == 4 and len(online - tagged) == 4

            wait_for(theirs_and_ours_online, 40,
                     "both simulated clusters did not come ONLINE side by side")

            def executed():
                counts = re.findall(r"^sent \d+ tasks, executed (\d+)", log_path.read_text(),
                                    re.MULTILINE)
                return counts and int(counts[-1]) >= 5

            wait_for(executed, 40, "the second cluster did not execute tasks")
        finally:
            sim.send_signal(signal.SIGINT)
            code = sim.wait(30)
    output = log_path.read_text()
    assert code == 0, output[-3000:]
    assert "speaks MQTT 3.1.1 only" in output, output[-3000:]
    assert "sim-node-a-two, sim-node-b-two" in output
    last = re.match(r"sent (\d+) tasks, executed (\d+)", output.splitlines()[-1])
    assert last and int(last[1]) > 0 and int(last[2]) > 0, output[-3000:]


def test_simulate_says_at_once_when_no_broker_answers(tmp_path):
    env = embedded_env()
    env.update(REACH_RUN_DIR=str(tmp_path), REACH_EMBEDDED_MQTT_PORT=str(free_port()))
    result = subprocess.run(
        [sys.executable, "manage.py", "simulate", "--url", "http://127.0.0.1:9", "--token",
         TOKEN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "no MQTT broker answers at mqtt://127.0.0.1:" in result.stderr, result.stderr
    assert "--mqtt-url" in result.stderr
