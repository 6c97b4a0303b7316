"""What the OpenAPI document promises about single values, each pinned where schemathesis
found the API and its document disagreeing (tests/test_openapi_fuzz.py runs them all)."""

from __future__ import annotations

import pytest

from roster.models import Agent
from tests.conftest import register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

REGISTER = {"agentId": "fin.tax", "nodeId": "node-a"}


def test_it_registers_the_longest_name_an_agent_id_may_have(api):
    # The name column once held 200 characters: PostgreSQL refused this with a 500.
    name = ".".join(["n" * 64, "a" * 64, "m" * 64, "e" * 64, "xyz"])  # 263 characters
    r = api.post("/api/roster/agents", {**REGISTER, "agentId": f"f.{name}"})
    assert r.status_code == 201, r.content
    assert Agent.objects.get().name == name
    too_long = api.post("/api/roster/agents", {**REGISTER, "agentId": f"fi.{name}"})
    assert too_long.status_code == 422
    assert too_long.json()["error"] == "invalid_agent_id"  # over maxLength, as documented


@pytest.mark.parametrize("raw", ["[null, null]", "5", '"x"'])
def test_a_body_that_is_not_an_object_is_422(api, raw):
    register("fin.tax")
    r = api.post("/api/roster/agents/fin.tax/heartbeat", raw=raw)
    assert r.status_code == 422
    assert r.json()["error"] == "invalid_request"


@pytest.mark.parametrize(("patch", "status"), [
    ({"maxInflight": "5"}, 422),    # a string is not a number
    ({"maxInflight": True}, 422),   # nor is a boolean
    ({"maxInflight": 5.0}, 201),    # JSON has one number type: 5.0 is 5
    ({"maxInflight": 5.5}, 422),
    ({"unknown": {"kept": [1]}}, 201),  # fields it does not know are ignored
])
def test_numbers_are_json_numbers(api, patch, status):
    r = api.post("/api/roster/agents", {**REGISTER, **patch})
    assert r.status_code == status, r.content
    if status == 201:
        assert Agent.objects.get().max_inflight == patch.get("maxInflight", 8)


@pytest.mark.parametrize(("patch", "code"), [
    ({"agentId": " fin.tax"}, "invalid_request"),   # the document's pattern has no spaces
    ({"nodeId": "node-a\n"}, "invalid_field"),      # a node id is one whole topic level
    ({"groups": ["#ok", "not ok"]}, "invalid_field"),
])
def test_ids_are_held_to_their_documented_patterns(api, patch, code):
    r = api.post("/api/roster/agents", {**REGISTER, **patch})
    assert r.status_code == 422, r.content
    assert r.json()["error"] == code
    assert not Agent.objects.exists()


def test_a_path_agent_id_is_checked_with_the_rosters_words(api):
    r = api.get("/api/roster/agents/no-namespace")
    assert r.status_code == 422
    assert r.json()["error"] == "invalid_agent_id"


@pytest.mark.parametrize(("body", "code"), [
    ({"to": "#finance", "wait": True}, "invalid_request"),
    ({"to": "fin.tax", "wait": 0}, "invalid_request"),
    ({"to": "#not a group"}, "send_refused"),
    ({"to": "capability:web search"}, "send_refused"),
])
def test_a_send_the_document_calls_invalid_is_422(api, body, code):
    r = api.post("/api/a2a/send", body)
    assert r.status_code == 422, r.content
    assert r.json()["error"] == code
