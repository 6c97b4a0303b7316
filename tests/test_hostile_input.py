"""Bad input to the API is a 4xx with words a person can act on, never a 500, and writes
nothing (issue: hostile input). Each case was a 500 before."""

from __future__ import annotations

import json
import re

import pytest
from django.conf import settings

from messages.models import Message
from reachconsole.api import BODY_TOO_LARGE, NUL_CHARACTER
from reachconsole.api import api as ninja_api
from roster.models import Agent
from tests.conftest import logged_in, register, staff_user

pytestmark = pytest.mark.django_db
TWO_MB = 2 * 1024 * 1024


def _too_large() -> str:
    return BODY_TOO_LARGE.format(limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
                                 payload=settings.REACH_MAX_MESSAGE_BYTES)


@pytest.mark.parametrize("path, body", [
    ("/api/a2a/send", {"to": "fin.tax", "payload": {"text": "x" * TWO_MB}}),
    ("/api/roster/agents", {"agentId": "fin.tax", "nodeId": "node-b",
                            "metadata": {"notes": "y" * TWO_MB}}),
])
def test_a_body_over_the_limit_is_413_with_the_limit_named(api, path, body):
    answer = api.post(path, raw=json.dumps(body))
    assert answer.status_code == 413
    assert answer.json() == {"error": "body_too_large", "detail": _too_large()}
    assert not Message.objects.exists() and not Agent.objects.exists()


def test_a_nul_anywhere_in_a_body_is_422_and_nothing_is_written(api):
    register("fin.tax", "node-b")
    answer = api.post("/api/a2a/send", {"to": "fin.tax",
                                        "payload": {"rows": ["ok", {"note": "a\u0000b"}]}})
    assert answer.status_code == 422
    assert answer.json() == {"error": "nul_character", "detail": NUL_CHARACTER.format(
        where="body.payload.rows[1].note")}
    assert not Message.objects.exists()


def test_a_nul_in_a_key_is_422(api):
    answer = api.post("/api/roster/agents", {"agentId": "fin.tax", "nodeId": "node-b",
                                             "metadata": {"a\u0000": 1}})
    assert answer.status_code == 422
    assert answer.json()["detail"] == NUL_CHARACTER.format(where="body.metadata: a key")
    assert not Agent.objects.exists()


@pytest.mark.parametrize("path, params", [
    ("/api/directory/resolve", {"mention": "a\x00b"}),
    ("/api/roster/agents", {"namespace": "fin\x00"}),
])
def test_a_nul_in_a_query_string_is_422(api, path, params):
    answer = api.get(path, params)
    assert answer.status_code == 422
    name = next(iter(params))
    assert answer.json() == {"error": "nul_character", "detail": NUL_CHARACTER.format(
        where=f"the query parameter {name!r}")}


def _path_operations() -> list[tuple[str, str]]:
    """Every operation of the API with a parameter in its path, the parameter a NUL."""
    found = []
    for path, methods in ninja_api.get_openapi_schema()["paths"].items():
        if "{" in path:
            found += [(method, re.sub(r"\{[^}]+\}", "a%00b", path)) for method in methods]
    return found


def test_a_nul_in_any_api_path_is_422_with_words(api):
    operations = _path_operations()
    assert len(operations) >= 12  # the messages, tasks, roster, stats and alarms ones
    for method, path in operations:
        answer = (api.post(path, {}) if method == "post" else
                  api.client.generic(method.upper(), path, headers=api.headers))
        assert answer.status_code == 422, (method, path, answer.status_code)
        assert answer.json()["error"] == "nul_character", (method, path)
        assert "contains a NUL character" in answer.json()["detail"]


@pytest.mark.parametrize("path", ["/messages/a%00b/", "/agents/a%00b/", "/nodes/a%00b/",
                                  "/tasks/a%00b/", "/alarms/a%00b/", "/messages/a%00b/trace/"])
def test_a_nul_in_a_page_path_is_400_with_words(path):
    viewer = logged_in(staff_user("vic", "view_message", "view_agent"))
    answer = viewer.get(path)
    assert answer.status_code == 400, (path, answer.status_code)
    assert "NUL character" in answer.content.decode()


@pytest.mark.parametrize("params", [{"offset": "9223372036854775808"}, {"offset": "-1"},
                                    {"limit": "0"}, {"limit": "10001"}])
def test_paging_numbers_are_bounded(api, params):
    answer = api.get("/api/roster/agents", params)
    assert answer.status_code == 422
    assert answer.json()["error"] == "invalid_request"
    assert next(iter(params)) in answer.json()["detail"]


@pytest.mark.parametrize("raw, code, where", [
    ('{"to": "fin.tax", "payload": "\\ud800"}', "lone_surrogate", "body.payload"),
    ('{"to": "fin.tax", "payload": {"n": 100000000000000000000000000000}}',
     "number_out_of_range", "body.payload.n"),
])
def test_what_the_console_cannot_store_is_422_with_where(api, raw, code, where):
    register("fin.tax", "node-b")
    answer = api.post("/api/a2a/send", raw=raw)
    assert answer.status_code == 422
    assert answer.json()["error"] == code
    assert answer.json()["detail"].startswith(where)
    assert not Message.objects.exists()
