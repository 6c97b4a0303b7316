"""Fault runs: the console in production shape (PostgreSQL, Redis, Mosquitto, Daphne, a stock
Celery worker and beat, all private: tests/stack.py) under a steady stream of tasks to a
simulated node (tests/fakenode.py), with one fault injected in the middle of the stream: a
restart (the worker killed with -9, Redis, PostgreSQL, the broker) or a stall (the console's
broker connection held open and still for 10 s, tests/stallproxy.py; the node keeps
heartbeating to the broker directly throughout).

Every task sent is counted as completed, failed, stuck or executed twice (RELIABILITY.md:
lost must be 0, duplicates on the bus must never become two executions). Slow (about a minute
per fault), so it runs only with REACH_FAULT_RUNS=1 or in CI's second run
(REACH_EXPECT_REAL_SERVICES=1).

Definitions used in the table:
- a task's outcome is its latest attempt: the last `a2a_message` row (by id) with its task id,
  direction SEND and type TASK_REQUEST. completed = COMPLETED; failed = UNDELIVERABLE, FAILED,
  EXPIRED, NACKED, TASK_ERROR, BUSY, or the console never took it (an HTTP answer other than
  2xx, or 503 / no answer until the client's retry budget ran out); stuck = any other status
  (or no row) when the wait ended; twice = the fake node executed its task more than once.
- deadlocks: "deadlock detected" in the private PostgreSQL log plus in the console's process
  logs during the test.
- recovery s: from the start of the fault to the completion of the first task that was sent
  after the fault started and completed. backlog s: from the start of the fault until every
  task sent before the service was back was final (n/a if one never was).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass

import pytest

from tests.conftest import expect_real_services
from tests.fakenode import FakeNode
from tests.stack import HOST, Stack, stack_or_skip

ENABLED = os.environ.get("REACH_FAULT_RUNS") == "1" or expect_real_services()
pytestmark = [
    pytest.mark.skipif(not ENABLED, reason="fault runs start a private PostgreSQL, Redis, "
                       "Mosquitto and the console's processes and take minutes: set "
                       "REACH_FAULT_RUNS=1 (CI's second run sets REACH_EXPECT_REAL_SERVICES=1)"),
    pytest.mark.timeout(600),
]

TASKS = int(os.environ.get("REACH_FAULT_TASKS", "300"))
RATE = float(os.environ.get("REACH_FAULT_RATE", "15"))  # tasks per second
DOWN_S = float(os.environ.get("REACH_FAULT_DOWN_S", "2"))
FINAL_WAIT_S = float(os.environ.get("REACH_FAULT_WAIT_S", "45"))  # after the last send
STALL_S = float(os.environ.get("REACH_FAULT_STALL_S", "15"))  # nothing moved: stop waiting
TASK_TIMEOUT_MS = 120_000
CLIENT_RETRY_BUDGET_S = 30  # how long the client keeps retrying one task on 503 / no answer
NODE_ID = "node-f"
AGENT_NAMES = ("alpha", "beta", "gamma")

COMPLETED = "COMPLETED"
FAILED = frozenset({"UNDELIVERABLE", "FAILED", "EXPIRED", "NACKED", "TASK_ERROR", "BUSY"})
FINAL = FAILED | {COMPLETED}

# The tightest settings the README allows (RELIABILITY.md): heartbeats every second and a
# 3 s lease, a node beating every second. An outage the console fails to excuse shows here
# first, as healthy agents called stale or lapsed.
HEARTBEAT_MS = int(os.environ.get("REACH_FAULT_HEARTBEAT_MS", "1000"))
LEASE_TTL_MS = int(os.environ.get("REACH_FAULT_LEASE_TTL_MS", "3000"))
# The worker's REACH_BRIDGE_INGEST (README, "Sharing the inbound load between bridges").
INGEST = os.environ.get("REACH_FAULT_INGEST", "auto")
BROKER_STALL_S = float(os.environ.get("REACH_FAULT_BROKER_STALL_S", "10"))
DB_STALL_S = float(os.environ.get("REACH_FAULT_DB_STALL_S", "5"))
SNAPSHOT_S = float(os.environ.get("REACH_FAULT_SNAPSHOT_S", "90"))
STALL_SECONDS = {"mosquitto": BROKER_STALL_S, "postgres": DB_STALL_S}
# A web request's query is cut off after this (REACH_DB_QUERY_BOUND_S, 5 s by default):
# shorter than the database stall, so the stall run goes through it.
QUERY_BOUND_S = 2
# How long an API read may take while a fault lasts: a request that finds no connection free
# waits for one at most the pool's timeout (10 s), then is answered 503; the pool's check of
# the connection it gets, and a query on it, are each cut off at QUERY_BOUND_S (a 503). All
# with Retry-After.
READ_BOUND_S = 10 + 2 * QUERY_BOUND_S + 2
# The console's keepalive in the runs: shorter than the stall, so that the stall run also
# goes through the bridge calling its open connection dead and reconnecting.
KEEPALIVE_S = 5

# fault id → (the service the fault hits, namespace of this fault's agents, how: "restart"
# takes it down and back, "supervised" kills it and leaves the restart to supervisord,
# "stall" holds the console's connections to it open and still, "snapshot" holds a
# REPEATABLE READ transaction open on its database)
FAULTS = {
    "worker-kill": ("worker", "fworker", "restart"),
    # The worker under supervisord as deploy/ runs it: its main process killed with -9, and
    # supervisord, not the test, starts the next one.
    "worker-kill-supervised": ("worker", "fsuper", "supervised"),
    "redis-restart": ("redis", "fredis", "restart"),
    "postgres-restart": ("postgres", "fpostgres", "restart"),
    "broker-restart": ("mosquitto", "fbroker", "restart"),
    "broker-stall": ("mosquitto", "fstall", "stall"),
    "postgres-stall": ("postgres", "fpgstall", "stall"),
    "snapshot-held": ("postgres", "fsnap", "snapshot"),
}


def tasks_for(how: str) -> int:
    """TASKS, with the fault after the first half; a held snapshot goes on for SNAPSHOT_S,
    and tasks go on being sent all through it (and as long again as the halves)."""
    if how == "snapshot":
        return TASKS + int(RATE * SNAPSHOT_S)
    return TASKS
RESULTS: list[dict] = []


# --- the client ---------------------------------------------------------------------------------
@dataclass
class Sent:
    index: int
    task_id: str
    to: str
    started_at: float = 0.0  # wall clock, first try
    answered_at: float = 0.0
    http_status: int | None = None
    api_status: str | None = None
    outcome: str = "pending"  # taken | refused | error5xx | not_taken
    detail: str = ""
    retries_503: int = 0
    transport_errors: int = 0


def _post(stack: Stack, path: str, body: dict, timeout: float = 15) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        f"{stack.base_url}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {stack.token}", "X-OODER-Source": "studio",
                 "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as exc:
        raw = exc.read()[:1000].decode(errors="replace")
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw


def send_task(stack: Stack, sent: Sent, payload: dict) -> None:
    """POST /api/a2a/send until the console takes it or refuses it. 503 ("not taken") and no
    answer at all are retried with the same task id after a short pause; any other 5xx is a
    failure of the console and is not retried."""
    sent.started_at = time.time()
    body = {"to": sent.to, "payload": payload, "taskId": sent.task_id,
            "timeoutMs": TASK_TIMEOUT_MS}
    give_up = time.monotonic() + CLIENT_RETRY_BUDGET_S
    while True:
        try:
            status, answer = _post(stack, "/api/a2a/send", body)
        except OSError as exc:  # refused, reset, timed out: unknown whether it was taken
            sent.transport_errors += 1
            sent.detail = f"no answer: {exc}"
            status, answer = None, None
        sent.http_status = status
        if status is not None and status < 500:
            sent.answered_at = time.time()
            if 200 <= status < 300:
                sent.outcome = "taken"
                sent.api_status = answer.get("status") if isinstance(answer, dict) else None
            else:
                sent.outcome = "refused"
                sent.detail = f"{status} {str(answer)[:300]}"
            return
        if status is not None and status != 503:
            sent.answered_at = time.time()
            sent.outcome = "error5xx"
            sent.detail = f"{status} {str(answer)[:300]}"
            return
        if status == 503:
            sent.retries_503 += 1
            sent.detail = f"503 {str(answer)[:300]}"
        if time.monotonic() > give_up:
            sent.answered_at = time.time()
            sent.outcome = "not_taken"
            return
        time.sleep(0.5)


class Sender(threading.Thread):
    """Sends the tasks at RATE per second, one after the other, like one busy client."""

    def __init__(self, stack: Stack, tasks: list[Sent], fault: str):
        super().__init__(name="fault-run-sender", daemon=True)
        self.stack, self.tasks, self.fault = stack, tasks, fault
        self.progress = 0
        self.reached: dict[int, threading.Event] = {}
        self.error: BaseException | None = None
        self.stop = threading.Event()  # set: no task after the one under way

    def when_sent(self, count: int) -> threading.Event:
        return self.reached.setdefault(count, threading.Event())

    def run(self) -> None:
        try:
            next_at = time.monotonic()
            for sent in self.tasks:
                pause = next_at - time.monotonic()
                if self.stop.wait(max(pause, 0)):
                    break
                next_at = max(next_at + 1 / RATE, time.monotonic() - 1 / RATE)
                send_task(self.stack, sent, {"n": sent.index, "fault": self.fault})
                self.progress += 1
                if self.progress in self.reached:
                    self.reached[self.progress].set()
        except BaseException as exc:
            self.error = exc
        finally:
            for event in self.reached.values():
                event.set()


class Reader(threading.Thread):
    """Reads the API as an operator's page would (`GET /api/roster/agents`, 4 a second)
    all through a run: how each read was answered and how long it took."""

    def __init__(self, stack: Stack):
        super().__init__(name="fault-run-reader", daemon=True)
        self.stack = stack
        self.reads: list[tuple[float, float, int | None, str]] = []  # at, seconds, status, note
        self.done = threading.Event()

    def run(self) -> None:
        request = urllib.request.Request(
            f"{self.stack.base_url}/api/roster/agents?limit=5",
            headers={"Authorization": f"Bearer {self.stack.token}",
                     "X-OODER-Source": "studio"})
        while not self.done.is_set():
            at = time.time()
            try:
                with urllib.request.urlopen(request, timeout=READ_BOUND_S + 10) as response:
                    response.read()
                    status, note = response.status, ""
            except urllib.error.HTTPError as exc:
                status = exc.code
                note = "" if exc.headers.get("Retry-After") else "no Retry-After"
                exc.read()
            except OSError as exc:
                status, note = None, f"no answer: {exc}"
            self.reads.append((at, time.time() - at, status, note))
            self.done.wait(0.25)

    def summary(self, down_at: float, up_at: float) -> dict:
        during = [r for r in self.reads if down_at - 1 <= r[0] <= up_at + 1]
        return {
            "reads": len(self.reads),
            "statuses": dict(Counter(r[2] for r in self.reads)),
            "bad": [r for r in self.reads if r[2] is None or (r[2] >= 500 and r[2] != 503)
                    or (r[2] == 503 and r[3])],
            "slowest": max((r[1] for r in self.reads), default=0.0),
            "slowest during": max((r[1] for r in during), default=0.0),
        }


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


RESPONSE_ROWS_SQL = """
SELECT task_id, extract(epoch FROM min(created_at))
FROM a2a_message
WHERE task_id = ANY(%s) AND direction = 'RECV' AND message_type = 'TASK_RESPONSE'
GROUP BY task_id
"""


def pace(stack: Stack, tasks: list[Sent], rows: dict[str, dict], node: FakeNode,
         fault: dict) -> dict:
    """p99 of send → COMPLETED and of the node's publish of its answer → the answer's row,
    for tasks sent before the fault and while it lasted."""
    with stack.connect_db() as conn:
        stored = dict(conn.execute(RESPONSE_ROWS_SQL, ([t.task_id for t in tasks],)))
    phases = {"before": lambda t: t.started_at < fault["down_at"],
              "during": lambda t: fault["down_at"] <= t.started_at < fault["start_at"]}
    figures = {}
    for phase, chosen in phases.items():
        picked = [t for t in tasks if chosen(t)]
        figures[f"send→completed {phase}"] = p99([
            rows[t.task_id]["done_at"] - t.started_at for t in picked
            if t.task_id in rows and rows[t.task_id]["status"] == COMPLETED
            and rows[t.task_id]["done_at"]])
        figures[f"publish→row {phase}"] = p99([
            float(stored[t.task_id]) - node.responded_at[t.task_id] for t in picked
            if t.task_id in stored and t.task_id in node.responded_at])
    return figures


def dead_tuples_vacuumed(stack: Stack) -> tuple[int, int]:
    """a2a_message's dead row versions, and what a VACUUM left of them: once no snapshot
    holds them, none should be left."""
    with stack.connect_db() as conn:
        def dead() -> int:
            return conn.execute("SELECT n_dead_tup FROM pg_stat_user_tables "
                                "WHERE relname = 'a2a_message'").fetchone()[0]
        before = dead()
        conn.execute("VACUUM a2a_message")
        return before, dead()


# --- reading the outcome -------------------------------------------------------------------------
LATEST_SQL = """
SELECT DISTINCT ON (task_id) task_id, status, error,
       extract(epoch FROM COALESCE(finished_at, updated_at)) AS done_at, attempt,
       published_at IS NOT NULL
FROM a2a_message
WHERE task_id = ANY(%s) AND direction = 'SEND' AND message_type = 'TASK_REQUEST'
ORDER BY task_id, id DESC
"""
ROWS_SQL = """
SELECT task_id, count(*), bool_or(status = 'COMPLETED')
FROM a2a_message
WHERE task_id = ANY(%s) AND direction = 'SEND' AND message_type = 'TASK_REQUEST'
GROUP BY task_id
"""


def latest_rows(stack: Stack, task_ids: list[str]) -> dict[str, dict] | None:
    try:
        with stack.connect_db() as conn:
            latest = {r[0]: {"status": r[1], "error": r[2],
                             "done_at": float(r[3]) if r[3] is not None else None,
                             "attempt": r[4], "published": r[5]}
                      for r in conn.execute(LATEST_SQL, (task_ids,))}
            for task_id, rows, any_completed in conn.execute(ROWS_SQL, (task_ids,)):
                latest[task_id].update(rows=rows, any_completed=any_completed)
        return latest
    except Exception as exc:  # the database may be the thing that is down
        print(f"  (reading a2a_message failed: {type(exc).__name__}: {exc})")
        return None


def wait_final(stack: Stack, task_ids: list[str]) -> dict[str, dict]:
    """Poll until every task's latest attempt is final, nothing moved for STALL_S, or
    FINAL_WAIT_S passed."""
    deadline = time.monotonic() + FINAL_WAIT_S
    last_signature, last_change = None, time.monotonic()
    rows: dict[str, dict] = {}
    while True:
        got = latest_rows(stack, task_ids)
        if got is not None:
            rows = got
            if all(r["status"] in FINAL for r in rows.values()) and len(rows) == len(task_ids):
                return rows
            signature = tuple(sorted((t, r["status"], r["rows"]) for t, r in rows.items()))
            if signature != last_signature:
                last_signature, last_change = signature, time.monotonic()
        now = time.monotonic()
        if now > deadline or now - last_change > STALL_S:
            return rows
        time.sleep(1.0)


# --- the table ---------------------------------------------------------------------------------
COLUMNS = ("fault", "sent", "completed", "failed", "stuck", "twice", "lost b/c", "unknown",
           "deadlocks", "recovery s", "backlog s", "503/5xx/noans", "read max s", "run s")


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def table(results: list[dict]) -> str:
    rows = [[_fmt(r[c]) for c in COLUMNS] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) if i else v.ljust(w)
                        for i, (v, w) in enumerate(zip(row, widths, strict=True)))
              for row in rows]
    return "\n".join(lines)


def classify(tasks: list[Sent], rows: dict[str, dict], node: FakeNode) -> dict:
    completed, failed, stuck = [], [], []
    for sent in tasks:
        row = rows.get(sent.task_id)
        if row is None:
            (failed if sent.outcome in ("refused", "error5xx", "not_taken") else stuck).append(
                sent)
        elif row["status"] == COMPLETED:
            completed.append(sent)
        elif row["status"] in FAILED:
            failed.append(sent)
        else:
            stuck.append(sent)
    twice = node.executed_twice()
    return {"completed": completed, "failed": failed, "stuck": stuck,
            "twice": [t for t in tasks if t.task_id in twice]}


# Every task sent, accounted for as Jepsen scores a queue (docs/faults.md, "Every task
# accounted for"):
OUTCOME_CLASSES = ("ok", "failed", "lost by the broker", "lost by the console", "unknown")


def outcome_class(sent: Sent, row: dict | None, *, observed: frozenset[str],
                  executed: set[str], answered: set[str]) -> tuple[str, str]:
    """(class, why) of one task. `observed`: the agents whose node this run watches (the
    fake node's); `executed`/`answered`: the task ids that node ran / answered.

    - ok: its latest attempt COMPLETED;
    - failed: final without completing, or refused by the API; with its reason;
    - lost by the broker: the broker acknowledged it to the console (PUBACK) and the
      subscriber, a node that is there and subscribed, never got it;
    - lost by the console: the console took it and never had the broker take it, or the
      node answered and the console did not act on the answer;
    - unknown: anything else (no final outcome and nothing that says who lost it)."""
    if row is not None and row["status"] == COMPLETED:
        return "ok", ""
    if row is not None and row["status"] in FAILED:
        return "failed", f"{row['status']}: {row.get('error') or ''}"
    if row is None and sent.outcome in ("refused", "error5xx", "not_taken"):
        return "failed", f"not taken: {sent.detail}"
    if sent.task_id in answered:
        return "lost by the console", "the node answered; the task did not complete"
    if sent.to in observed and sent.task_id not in executed:
        if row is not None and row.get("published"):
            return "lost by the broker", "acknowledged to the console, never delivered"
        if sent.outcome == "taken":
            return "lost by the console", "taken by the API, never taken by the broker"
    return "unknown", f"latest attempt {row and row['status']}"


def outcome_classes(tasks: list[Sent], rows: dict[str, dict], node: FakeNode
                    ) -> dict[str, list[tuple[Sent, str]]]:
    observed = frozenset(node.agents)
    executed = set(node.executions_by_task)
    answered = set(node.responded_at)
    classes: dict[str, list[tuple[Sent, str]]] = {name: [] for name in OUTCOME_CLASSES}
    for sent in tasks:
        kind, why = outcome_class(sent, rows.get(sent.task_id), observed=observed,
                                  executed=executed, answered=answered)
        classes[kind].append((sent, why))
    return classes


def plot_write(fault: str, tasks: list[Sent], rows: dict[str, dict],
               classes: dict[str, list[tuple[Sent, str]]], fault_times: dict) -> None:
    """With REACH_FAULT_PLOTS=DIR, the run's picture as DIR/{fault}.svg (docs/faults/)."""
    folder = os.environ.get("REACH_FAULT_PLOTS")
    if not folder:
        return
    from pathlib import Path

    from tests.fault_plot import outcomes_svg

    zero = fault_times["down_at"]
    kind_of = {sent.task_id: kind for kind, items in classes.items() for sent, _ in items}
    points = []
    for sent in tasks:
        row = rows.get(sent.task_id) or {}
        final = row.get("status") in FINAL and row.get("done_at")
        points.append((sent.started_at - zero,
                       row["done_at"] - sent.started_at if final else None,
                       kind_of[sent.task_id]))
    path = Path(folder) / f"{fault}.svg"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(outcomes_svg(
        title=f"{fault}: {len(tasks)} tasks at {RATE:g}/s, outcome against time",
        points=points, fault=(0.0, fault_times["start_at"] - zero)))


def recovery_times(tasks: list[Sent], rows: dict[str, dict], fault: dict) -> tuple:
    down_at, up_at = fault["down_at"], fault["up_at"]
    after = [rows[t.task_id]["done_at"] for t in tasks
             if t.started_at >= down_at and t.task_id in rows
             and rows[t.task_id]["status"] == COMPLETED and rows[t.task_id]["done_at"]]
    recovery = (min(after) - down_at) if after else None
    before = [t for t in tasks if t.started_at < up_at]
    done = [rows.get(t.task_id) for t in before]
    if before and all(r and r["status"] in FINAL and r["done_at"] for r in done):
        backlog = max(max(r["done_at"] for r in done) - down_at, 0.0)
    else:
        backlog = None
    return recovery, backlog


# --- the test ----------------------------------------------------------------------------------
def warm_up(stack: Stack, agent: str, tag: str) -> str:
    """One task end to end before the run, so the run measures faults, not start-up."""
    task_id = f"{tag}-warmup"
    status, answer = _post(stack, "/api/a2a/send", {"to": agent, "payload": {"warm": True},
                                                     "taskId": task_id,
                                                     "timeoutMs": TASK_TIMEOUT_MS})
    if not 200 <= status < 300:
        return f"warm-up send answered {status} {str(answer)[:300]}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = latest_rows(stack, [task_id]) or {}
        if rows.get(task_id, {}).get("status") == COMPLETED:
            return ""
        time.sleep(0.3)
    return f"warm-up task did not complete in 30 s (latest: {rows.get(task_id)})"


def _wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s")


def test_the_harness_counts_what_it_should(stack: Stack):
    """The yardstick before the measurements: the fake node executes a key once, answers a
    repeat as a duplicate (with the response again), and reports a task run under two keys;
    the classification tells completed, failed and stuck apart; the recovery arithmetic."""
    import paho.mqtt.client as mqtt

    from messages import protocol

    prefix = stack.clean_run()
    node = FakeNode(base_url=stack.base_url, token=stack.token, mqtt_host=HOST,
                    mqtt_port=stack.mqtt_port, prefix=prefix, node_id=NODE_ID,
                    agents=["fself.alpha"], heartbeat_s=HEARTBEAT_MS / 1000)
    peer = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"selfcheck-{prefix}",
                       protocol=mqtt.MQTTv5)
    answers: list[protocol.Envelope] = []
    subscribed = threading.Event()
    peer.on_message = lambda c, u, m: answers.append(protocol.decode(m.payload))
    peer.on_subscribe = lambda c, u, mid, rcs, p: subscribed.set()
    try:
        node.start()
        peer.connect(HOST, stack.mqtt_port)
        peer.subscribe(protocol.inbox_topic(prefix, "selfcheck"), qos=1)
        peer.loop_start()
        assert subscribed.wait(10)

        def request(task_id: str, key: str) -> protocol.Envelope:
            env = protocol.new_envelope(
                message_type="TASK_REQUEST", from_agent_id="selfcheck.peer",
                to_agent_id="fself.alpha", target_node_id=NODE_ID, task_id=task_id,
                headers={"replyNodeId": "selfcheck", "originNodeId": "selfcheck",
                         "idempotencyKey": key}, payload={"x": 1})
            peer.publish(protocol.inbox_topic(prefix, NODE_ID), protocol.encode(env), qos=1)
            return env

        first = request("self-t1", "self-k1")
        _wait_for(lambda: node.executions["self-k1"] and not node.stats()["pending"], 10,
                  "the fake node did not execute self-k1")
        again = request("self-t1", "self-k1")  # a retry: same key, new message id

        def answered(env, kind):
            return [a for a in answers if a.message_type == kind
                    and env.message_id in (a.ack_for, a.in_reply_to)]

        _wait_for(lambda: answered(again, "TASK_RESPONSE"), 10, "no response to the repeat")
        assert node.executions["self-k1"] == 1
        assert answered(first, "ACK")[0].payload == {}
        assert answered(again, "ACK")[0].payload == {"duplicate": True}
        assert answered(first, "TASK_RESPONSE")[0].origin_node_id == NODE_ID
        assert node.executed_twice() == {}
        request("self-t1", "self-k2")  # the same task under another key runs again
        _wait_for(lambda: node.executed_twice(), 10, "a second execution was not reported")
        assert node.executed_twice() == {"self-t1": 2}

        # Through the console: one completes, one cannot be delivered, one is never answered.
        ghost = "fself.ghost"
        status, body = _post(stack, "/api/roster/agents", {"agentId": ghost,
                                                            "nodeId": "ghost-node"})
        assert status in (200, 201), body
        tasks = [Sent(0, f"self-{prefix}-ok", "fself.alpha"),
                 Sent(1, f"self-{prefix}-nobody", "fself.nobody"),
                 Sent(2, f"self-{prefix}-ghost", ghost)]
        for sent in tasks:
            send_task(stack, sent, {"n": sent.index})
        ids = [t.task_id for t in tasks]
        _wait_for(lambda: (latest_rows(stack, ids) or {}).get(ids[0], {}).get("status")
                  == COMPLETED, 30, "the console did not complete a task")
        rows = latest_rows(stack, ids) or {}
        outcome = classify(tasks, rows, node)
        assert [t.index for t in outcome["completed"]] == [0], rows
        assert [t.index for t in outcome["failed"]] == [1], (rows, tasks[1])
        assert [t.index for t in outcome["stuck"]] == [2], rows
        assert outcome["twice"] == []
        classes = outcome_classes(tasks, rows, node)
        assert {k: [s.index for s, _ in v] for k, v in classes.items()} == {
            "ok": [0], "failed": [1], "lost by the broker": [], "lost by the console": [],
            "unknown": [2]}, classes  # the ghost's node is not one this run watches

        # Who lost it, from what the console's row and the node say.
        def kind(row, *, executed=(), answered=(), outcome="taken") -> str:
            sent = Sent(9, "t9", "fself.alpha", outcome=outcome)
            return outcome_class(sent, row, observed=frozenset({"fself.alpha"}),
                                 executed=set(executed), answered=set(answered))[0]

        published = {"status": "PUBLISHED", "published": True}
        assert kind(published) == "lost by the broker"
        assert kind({"status": "SENT", "published": False}) == "lost by the console"
        assert kind(None) == "lost by the console"  # taken (202), no row: never stored
        assert kind(published, executed={"t9"}, answered={"t9"}) == "lost by the console"
        assert kind(published, executed={"t9"}) == "unknown"  # running, not answered yet
        assert kind(None, outcome="not_taken") == "failed"
        assert kind({"status": "EXPIRED", "error": "no answer"}) == "failed"

        # recovery: the first task sent after the fault that completed; backlog: until all
        # sent before the service was back were final.
        synthetic = [Sent(0, "a", "x", started_at=10), Sent(1, "b", "x", started_at=21),
                     Sent(2, "c", "x", started_at=22), Sent(3, "d", "x", started_at=40)]
        done = {"a": {"status": COMPLETED, "done_at": 30.0},
                "b": {"status": "EXPIRED", "done_at": 26.0},
                "c": {"status": COMPLETED, "done_at": 25.0},
                "d": {"status": COMPLETED, "done_at": 41.0}}
        fault = {"down_at": 20.0, "up_at": 23.0}
        assert recovery_times(synthetic, done, fault) == (5.0, 10.0)
        done["b"] = {"status": "PUBLISHED", "done_at": 26.0}
        assert recovery_times(synthetic, done, fault) == (5.0, None)
    finally:
        peer.loop_stop()
        peer.disconnect()
        node.stop()


@pytest.fixture(scope="module", name="stack")
def stack_fixture():
    running = stack_or_skip(extra_env={"REACH_HEARTBEAT_MS": str(HEARTBEAT_MS),
                                       "REACH_LEASE_TTL_MS": str(LEASE_TTL_MS),
                                       "MQTT_KEEPALIVE_S": str(KEEPALIVE_S),
                                       "REACH_DB_QUERY_BOUND_S": str(QUERY_BOUND_S),
                                       "REACH_BRIDGE_INGEST": INGEST})
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_run(stack: Stack, fault: str):
    service, namespace, how = FAULTS[fault]
    started = time.monotonic()
    prefix = stack.clean_run()
    if how == "supervised":
        stack.supervise(service)
    offsets = stack.log_offsets()
    agents = [f"{namespace}.{name}" for name in AGENT_NAMES]
    node = FakeNode(base_url=stack.base_url, token=stack.token, mqtt_host=HOST,
                    mqtt_port=stack.mqtt_port, prefix=prefix, node_id=NODE_ID, agents=agents,
                    heartbeat_s=HEARTBEAT_MS / 1000)
    tasks = [Sent(index=i, task_id=f"{fault}-{prefix}-{i:04d}", to=agents[i % len(agents)])
             for i in range(tasks_for(how))]
    sender = Sender(stack, tasks, fault)
    reader = Reader(stack)
    result: dict = {}
    try:
        node.start()
        warm_note = warm_up(stack, agents[0], f"{fault}-{prefix}")
        if warm_note:
            print(f"\n[{fault}] {warm_note}")

        fault_point = sender.when_sent(TASKS // 2)
        reader.start()
        sender.start()
        assert fault_point.wait(TASKS / RATE + 120), "the sender did not reach the fault point"
        if how == "stall":
            fault_times = stack.stall_service(service, stall_s=STALL_SECONDS[service])
        elif how == "snapshot":
            fault_times = stack.hold_snapshot(SNAPSHOT_S)
        elif how == "supervised":
            fault_times = stack.kill_supervised(service)
        else:
            fault_times = stack.restart_service(service, down_s=DOWN_S)
        sender.join(timeout=len(tasks) * 2)
        assert not sender.is_alive(), "the sender did not finish"
        if sender.error:
            raise sender.error
        sent_done = time.time()

        rows = wait_final(stack, [t.task_id for t in tasks])
        reader.done.set()
        reader.join(READ_BOUND_S + 15)
        reads = reader.summary(fault_times["down_at"], fault_times["up_at"])
        outcome = classify(tasks, rows, node)
        classes = outcome_classes(tasks, rows, node)
        plot_write(fault, tasks, rows, classes, fault_times)
        pg = stack.count_in_logs("deadlock detected", offsets)
        pg_deadlocks = pg.pop("postgres", 0)
        proc_deadlocks = sum(pg.values())
        recovery, backlog = recovery_times(tasks, rows, fault_times)
        http = Counter(t.outcome for t in tasks)
        result = {
            "fault": fault, "sent": len(tasks),
            "completed": len(outcome["completed"]), "failed": len(outcome["failed"]),
            "stuck": len(outcome["stuck"]), "twice": len(outcome["twice"]),
            "lost b/c": (f"{len(classes['lost by the broker'])}/"
                         f"{len(classes['lost by the console'])}"),
            "unknown": len(classes["unknown"]),
            "deadlocks": pg_deadlocks + proc_deadlocks, "recovery s": recovery,
            "backlog s": backlog,
            "503/5xx/noans": (f"{sum(t.retries_503 for t in tasks)}/{http['error5xx']}/"
                              f"{sum(t.transport_errors for t in tasks)}"),
            "read max s": reads["slowest"],
            "run s": time.monotonic() - started,
        }
        RESULTS.append(result)

        statuses = Counter(r["status"] for r in rows.values())
        statuses["(no row)"] = len(tasks) - len(rows)
        down = fault_times["stopped_at"] - fault_times["down_at"]
        back = fault_times["up_at"] - fault_times["down_at"]
        print(f"\n[{fault}] prefix {prefix}; {service} stopping took {down:.1f} s, back after "
              f"{back:.1f} s; sending ended {sent_done - fault_times['down_at']:.1f} s after "
              "the fault")
        print(f"[{fault}] latest-attempt statuses: {dict(statuses)}")
        print(f"[{fault}] HTTP outcomes: {dict(http)}; API statuses: "
              f"{dict(Counter(t.api_status for t in tasks))}")
        latency = sorted(t.answered_at - t.started_at for t in tasks if t.answered_at)
        if latency:
            slowest = max(tasks, key=lambda t: t.answered_at - t.started_at)
            print(f"[{fault}] send answered in p50 {latency[len(latency) // 2] * 1000:.0f} ms, "
                  f"max {latency[-1] * 1000:.0f} ms (task {slowest.index}, sent "
                  f"{slowest.started_at - fault_times['down_at']:+.1f} s from the fault)")
        most = max((r["rows"] for r in rows.values()), default=0)
        early = sum(1 for r in rows.values() if r["any_completed"] and r["status"] != COMPLETED)
        print(f"[{fault}] attempts per task: max {most}; tasks whose earlier attempt completed "
              f"but whose latest did not: {early}")
        print(f"[{fault}] deadlocks: {pg_deadlocks} in the PostgreSQL log, "
              f"{proc_deadlocks} in process logs {pg}")
        print(f"[{fault}] tracebacks in process logs: "
              f"{ {n: c for n, c in stack.count_in_logs('Traceback', offsets).items() if c} }")
        print(f"[{fault}] fake node: {node.stats()}")
        print(f"[{fault}] every task accounted for: "
              + ", ".join(f"{name} {len(items)}" for name, items in classes.items()))
        for name in OUTCOME_CLASSES[1:]:
            for sent, why in classes[name][:3]:
                print(f"[{fault}]   e.g. {name}: {sent.task_id}: {why[:200]}")
        for label in ("failed", "stuck", "twice"):
            examples = outcome[label][:3]
            for sent in examples:
                row = rows.get(sent.task_id) or {}
                print(f"[{fault}]   e.g. {label}: {sent.task_id} http={sent.http_status} "
                      f"{sent.outcome} {sent.detail[:160]!r} row={row.get('status')} "
                      f"attempts={row.get('rows')} error={(row.get('error') or '')[:200]!r} "
                      f"executions={node.executions_by_task.get(sent.task_id, 0)}")
        print(f"[{fault}] API reads: {reads['reads']}, answered {reads['statuses']}; slowest "
              f"{reads['slowest']:.1f} s, {reads['slowest during']:.1f} s while the fault lasted")
        for at, took, status, note in reads["bad"][:3]:
            print(f"[{fault}]   e.g. a read {at - fault_times['down_at']:+.1f} s from the fault: "
                  f"{status} {note} after {took:.1f} s")
        figures, dead = {}, (0, 0)
        if how == "snapshot":
            figures = pace(stack, tasks, rows, node, fault_times)
            dead = dead_tuples_vacuumed(stack)
            print(f"[{fault}] p99 s: " + ", ".join(
                f"{k} {_fmt(v and round(v, 3))}" for k, v in figures.items()))
            print(f"[{fault}] a2a_message dead row versions after the hold: {dead[0]}; left by "
                  f"a VACUUM: {dead[1]}")
        print("\n" + table(RESULTS))

        summary = (f"{fault}: completed {result['completed']}/{len(tasks)}, failed "
                   f"{result['failed']}, stuck {result['stuck']}, twice {result['twice']}, "
                   f"deadlocks {result['deadlocks']}, recovery {_fmt(recovery)} s, "
                   f"backlog {_fmt(backlog)} s")
        # Who lost what first (every task ok), then the rest of the run's counts.
        assert len(classes["ok"]) == len(tasks), (
            summary + f"\n{ {k: len(v) for k, v in classes.items()} }\n" + table(RESULTS))
        assert (result["completed"], result["failed"], result["stuck"], result["twice"],
                result["deadlocks"]) == (len(tasks), 0, 0, 0, 0), summary + "\n" + table(RESULTS)
        # Never a 500, a 503 always says when to come back, and no read hangs past its bound.
        assert not reads["bad"], f"{fault}: API reads answered badly: {reads['bad'][:5]}"
        assert reads["slowest"] <= READ_BOUND_S, f"{fault}: an API read took {reads['slowest']}"
        if how == "snapshot":
            # The pace within 2x of before (a floor of 100 ms: these are tens of milliseconds,
            # and one scheduling hiccup on a two-core box is as long).
            for name in ("send→completed", "publish→row"):
                before, during = figures[f"{name} before"], figures[f"{name} during"]
                assert before is not None and during is not None, figures
                assert during <= max(2 * before, before + 0.1), f"{fault}: {name} {figures}"
            assert dead[1] <= 10 + dead[0] // 100, f"{fault}: vacuum left {dead} dead rows"
    except BaseException:
        print(f"\n[{fault}] logs of this run (stack dir {stack.tmp}):")
        print(stack.tails(30, offsets))
        raise
    finally:
        if sender.is_alive():
            sender.join(5)
        node.stop()
