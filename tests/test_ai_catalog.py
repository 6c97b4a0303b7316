"""`GET /.well-known/ai-catalog.json` (roster/catalog.py): the roster's agents of both
dialects as an AI Catalog (v0.9), for signed-in users and service tokens, a bound token
seeing its namespaces only."""

from __future__ import annotations

import json

import pytest

from roster import catalog
from roster.profile import card_apply, card_read
from tests.conftest import FIN_TOKEN, ApiClient, logged_in, reader, register
from tests.test_profile_cards import card, frame

pytestmark = pytest.mark.django_db
URL = "/.well-known/ai-catalog.json"


def read(response) -> dict:
    assert response.status_code == 200, response.content[:300]
    assert response["Content-Type"] == "application/ai-catalog+json"
    return json.loads(b"".join(response.streaming_content))


def by_agent(doc: dict) -> dict[str, dict]:
    return {e["extensions"]["io.reachconsole.roster"]["agentId"]: e for e in doc["entries"]}


def test_both_dialects_are_listed_with_their_cards(now):
    register("fin.tax", "node-a", now=now, capabilities=["tax", "vat"], version="2.1",
             metadata={"description": "Files the taxes"})
    published = card(name="Echo", description="Echoes")
    card_apply(frame(published), now=now)
    doc = read(logged_in(reader("victor", password="pw-victor-123")).get(URL))
    assert doc["specVersion"] == "0.9"
    assert doc["host"]["identifier"] and doc["host"]["displayName"].startswith("reachconsole")
    entries = by_agent(doc)
    assert set(entries) == {"fin.tax", "acme/ops/echo"}
    # The profile agent's card is the one it published.
    echo = entries["acme/ops/echo"]
    assert echo["type"] == "application/a2a-agent-card+json"
    assert echo["data"] == published
    assert echo["displayName"] == "Echo" and echo["tags"] == ["echo", "shout"]
    assert echo["extensions"]["io.reachconsole.roster"] == {
        "agentId": "acme/ops/echo", "dialect": "a2a-mqtt", "status": "ONLINE",
        "nodeId": "a2a-mqtt", "presenceSource": "agent"}
    assert echo["identifier"].endswith(":acme:ops/echo")
    # The native agent's is made from its registration, and is a card the console would
    # itself take from the profile's discovery tree.
    tax = entries["fin.tax"]["data"]
    assert card_read(json.dumps(tax).encode())[1] == tax
    assert [s["id"] for s in tax["skills"]] == ["tax", "vat"]
    assert tax["description"] == "Files the taxes" and tax["version"] == "2.1"
    assert tax["supportedInterfaces"][0]["url"] == "http://testserver/api/a2a/send"
    assert entries["fin.tax"]["extensions"]["io.reachconsole.roster"]["dialect"] == "native"


def test_a_service_token_reads_it_and_a_bound_one_sees_its_namespaces_only(now):
    register("fin.tax", "node-a", now=now)
    register("ops.watch", "node-a", now=now)
    card_apply(frame(topic="$a2a/v1/discovery/fin/ops/echo"), now=now)
    everyone = by_agent(read(ApiClient().client.get(URL, headers=ApiClient().headers)))
    assert set(everyone) == {"fin.tax", "ops.watch", "fin/ops/echo"}
    fin = ApiClient(token=FIN_TOKEN)
    bound = by_agent(read(fin.client.get(URL, headers=fin.headers)))
    assert set(bound) == {"fin.tax", "fin/ops/echo"}


def test_no_caller_no_catalog_in_words(client):
    answer = client.get(URL)
    assert answer.status_code == 401 and answer["WWW-Authenticate"] == "Bearer"
    assert "Authorization: Bearer" in answer.json()["detail"]
    wrong = client.get(URL, headers={"Authorization": "Bearer not-a-token-of-this-console",
                                      "X-OODER-Source": "studio"})
    assert wrong.status_code == 401 and "not valid" in wrong.json()["detail"]


def test_a_large_roster_comes_a_page_at_a_time(now, monkeypatch):
    monkeypatch.setattr(catalog, "PAGE", 3)
    for n in range(7):
        register(f"fin.a{n}", "node-a", now=now)
    response = logged_in(reader("victor", password="pw-victor-123")).get(URL)
    chunks = list(response.streaming_content)
    assert len(chunks) == 2 + 3  # the head, three pages, the end
    doc = json.loads(b"".join(chunks))
    assert [e["extensions"]["io.reachconsole.roster"]["agentId"] for e in doc["entries"]] == [
        f"fin.a{n}" for n in range(7)]
