"""200 concurrent readers against a stock Daphne: every answer is an answer, none is a 5xx.

In production shape this once gave 55 % HTTP 500 "too many clients": every request thread
kept a PostgreSQL connection. Speed is bench/readers.py's business; this test checks only
that the console stays correct under the load.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter

import pytest
from django.conf import settings
from django.test import Client

from tests.conftest import TOKEN, reader, register
from tests.processes import HOST, daphne_serving

READERS = 200
SECONDS = 15.0


@pytest.fixture
def daphne(tmp_path):
    # A request waits in the pool's queue; on a busy box that wait is what grows, and its
    # 10 s default is a speed goal (bench/readers.py), not what this test checks.
    with daphne_serving(tmp_path, REACH_DB_POOL_TIMEOUT_S="60") as served:
        yield served


def read_for(port: int, headers: dict[str, dict[str, str]], seconds: float) -> tuple:
    statuses: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = [0.0]
    start = threading.Barrier(READERS, action=lambda: deadline.__setitem__(
        0, time.monotonic() + seconds))

    def reader(index: int) -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=120)
        start.wait()
        paths = list(headers)
        turn = index
        while time.monotonic() < deadline[0]:
            path = paths[turn % len(paths)]
            turn += 1
            try:
                conn.request("GET", path, headers=headers[path])
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                with lock:
                    failures[f"{path}: {type(exc).__name__}: {exc}"[:200]] += 1
                conn.close()
                conn = http.client.HTTPConnection(HOST, port, timeout=120)
                continue
            with lock:
                statuses[f"{path} {response.status}"] += 1
                if response.status >= 500:
                    failures[f"{path} {response.status}: {body[:200]!r}"] += 1
        conn.close()

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(READERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 150)
    assert not any(thread.is_alive() for thread in threads), "a reader hung"
    return statuses, failures


@pytest.mark.django_db(transaction=True)
def test_200_concurrent_readers_get_no_5xx(daphne):
    port, log_path = daphne
    for i in range(20):
        register(f"readers.a{i}", f"node-{i % 4}")
    client = Client()
    client.force_login(reader("reader", password="pw-123456"))
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    headers = {
        "/": {"Cookie": f"{settings.SESSION_COOKIE_NAME}={session}"},
        "/api/roster/agents": {"Authorization": f"Bearer {TOKEN}", "X-OODER-Source": "studio"},
    }

    statuses, failures = read_for(port, headers, SECONDS)

    total = sum(statuses.values())
    ok = sum(n for key, n in statuses.items() if key.endswith(" 200"))
    detail = f"statuses {dict(statuses)}; failures {dict(failures.most_common(5))}"
    assert not failures, detail
    assert total >= READERS, detail  # every reader got at least one answer
    assert ok >= 0.95 * total, detail
    assert {key.rsplit(" ", 1)[0] for key in statuses} == set(headers), detail
    assert "too many clients" not in log_path.read_text()
