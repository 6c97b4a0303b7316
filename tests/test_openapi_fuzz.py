"""The OpenAPI document tells the truth: schemathesis, with every check it has, against a
stock Daphne serving the real console on the test's database.

What the document calls valid is accepted, what it calls invalid is refused, every answer
has a documented status and matches its schema, and nothing is a 500. Bounded in examples
per operation, so it takes a minute or two; `REACH_FUZZ_EXAMPLES` and `REACH_FUZZ_SEED`
run it longer or elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from roster import services
from tests.conftest import TOKEN, register
from tests.processes import HOST, daphne_serving

EXAMPLES = int(os.environ.get("REACH_FUZZ_EXAMPLES", "25"))
# A fixed seed: CI runs the same cases every time, so a failure is the code's, not luck's.
SEED = os.environ.get("REACH_FUZZ_SEED", "20261130")


@pytest.fixture
def daphne(tmp_path):
    # Nodes' agents are judged on the clock: no bridge runs in this test.
    with daphne_serving(tmp_path, REACH_JUDGE_BY_CLOCK="1") as served:
        yield served


@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_the_api_does_what_its_openapi_document_says(daphne, tmp_path):
    port, log_path = daphne
    # Something to find: agents on two nodes, a drained one, an alias-free capability.
    register("fin.tax", "node-a", capabilities=["tax"], owner="alice")
    register("fin.vat", "node-b", capabilities=["vat"], groups=["#finance"])
    register("llm.chat", "node-b", capabilities=["chat"])
    services.agent_drain(agent_id="llm.chat")
    services.node_seen(node_id="node-a")

    command = [
        str(Path(sys.executable).parent / "st"), "run",
        f"http://{HOST}:{port}/api/openapi.json",
        "--header", f"Authorization: Bearer {TOKEN}",
        "--header", "X-OODER-Source: studio",
        "--checks", "all",
        "--max-examples", str(EXAMPLES),
        "--seed", SEED,
        "--workers", "1",
        "--request-timeout", "30",
        # Examples it finds stay out of the working tree (and out of the next run).
        "--generation-database", "none",
        # The console refuses a NUL character in any string of any body or query, free-form
        # payloads included (reachconsole/api.py StrictParser; tests/test_hostile_input.py);
        # JSON Schema cannot say "no NUL in any string of an arbitrary JSON value", so the
        # document cannot, and strings with one are not generated as valid data.
        "--generation-allow-x00", "false",
        "--no-color",
    ]
    result = subprocess.run(  # noqa: S603 - our own command line
        command, cwd=tmp_path, capture_output=True, text=True, timeout=840, check=False,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        server_log = log_path.read_text()[-6000:]
        pytest.fail(f"schemathesis found failures (exit {result.returncode}):\n{output[-30000:]}"
                    f"\n--- daphne log (end) ---\n{server_log}", pytrace=False)
    assert "No issues found" in output or " passed" in output, output[-3000:]
