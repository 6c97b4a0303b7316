"""The A2A-over-MQTT profile's Agent Cards on the roster (roster/profile.py): a retained card
registers or updates an agent, its presence follows `a2a-status`, an empty card removes it,
and a card that cannot be read is refused whole, with a reason. The bridge's part (the
subscription, the user properties) is tried against real SDK agents in
tests/test_profile_sdk.py."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from directory.coverage import capability_coverage
from directory.resolver import candidate_for, resolve
from roster.errors import ConsoleAgent, InvalidField
from roster.models import Agent, ClusterNode, Namespace, RosterEvent
from roster.profile import (
    DIALECT,
    PROFILE_NODE_ID,
    CardFrame,
    CardRefused,
    card_apply,
    cards_apply,
)
from roster.services import (
    agent_drain,
    lease_deadlines_repair,
    leases_expire,
    node_drain,
    node_retire,
    nodes_sweep,
)
from tests.conftest import bus_heard, register

pytestmark = pytest.mark.django_db
TOPIC = "$a2a/v1/discovery/acme/ops/echo"


def card(**changes) -> dict:
    """A card as the SDK's build_card makes it."""
    out = {"name": "Echo", "description": "Echoes", "version": "1.0.0",
           "supportedInterfaces": [{"url": "mqtt://broker:1883",
                                    "protocolBinding": "MQTTv5+JSONRPCv2",
                                    "protocolVersion": "1.0.0"}],
           "capabilities": {"streaming": True, "pushNotifications": False},
           "defaultInputModes": ["text/plain"], "defaultOutputModes": ["text/plain"],
           "skills": [{"id": "echo", "name": "Echo", "description": "echo", "tags": ["e"]},
                      {"id": "shout", "name": "Shout", "description": "loud", "tags": ["s"]}]}
    out.update(changes)
    return out


def frame(body=None, *, topic: str = TOPIC, status: str = "online", source: str = "agent",
          raw: bytes | None = None, heard_at=None) -> CardFrame:
    payload = raw if raw is not None else json.dumps(body or card()).encode()
    return CardFrame(topic, payload, status, source, heard_at)


def history(agent_id: str = "acme/ops/echo") -> list[tuple[str, str]]:
    return [(e.kind, e.detail) for e in
            RosterEvent.objects.filter(agent_id=agent_id).order_by("at", "id")]


def test_a_card_registers_its_agent_with_the_card_verbatim(now):
    sent = frame()
    assert card_apply(sent, now=now) == "registered"
    agent = Agent.objects.select_related("namespace", "node").get(agent_id="acme/ops/echo")
    assert agent.dialect == DIALECT and agent.namespace.name == "acme"
    assert agent.capabilities == ["echo", "shout"]
    assert agent.card == sent.payload.decode()  # the text itself, not a re-encoding
    assert agent.status == Agent.Status.ONLINE
    assert (agent.presence_source, agent.presence_since) == ("agent", now)
    assert agent.node.node_id == PROFILE_NODE_ID
    assert agent.endpoint == "$a2a/v1/request/acme/ops/echo"
    assert history() == [("REGISTERED", "Agent Card 'Echo' v1.0.0, online")]


def test_the_same_card_again_writes_nothing(now):
    card_apply(frame(), now=now)
    before = Agent.objects.get(agent_id="acme/ops/echo").updated_at
    # Every bridge hears every card, and again on each reconnect.
    assert card_apply(frame(), now=now + timedelta(seconds=5)) == "unchanged"
    assert Agent.objects.get(agent_id="acme/ops/echo").updated_at == before
    assert len(history()) == 1


def test_a_changed_card_updates_the_agent_and_says_so_in_its_history(now):
    card_apply(frame(), now=now)
    agent = Agent.objects.get(agent_id="acme/ops/echo")
    Agent.objects.filter(pk=agent.pk).update(inflight=2)
    skills = [{"id": "echo", "name": "Echo", "description": "echo", "tags": []},
              {"id": "whisper", "name": "Whisper", "description": "soft", "tags": []}]
    assert card_apply(frame(card(version="1.1.0", skills=skills)),
                      now=now + timedelta(minutes=1)) == "updated"
    agent.refresh_from_db()
    assert agent.capabilities == ["echo", "whisper"] and agent.version == "1.1.0"
    assert history()[-1] == ("CARD", "card changed (v1.0.0 → v1.1.0; skills added: whisper; "
                                     "skills gone: shout); it held 2 tasks")


def test_offline_from_the_last_will_then_online_again(now):
    card_apply(frame(), now=now)
    assert card_apply(frame(status="offline", source="lwt"),
                      now=now + timedelta(seconds=1)) == "offline"
    agent = Agent.objects.get(agent_id="acme/ops/echo")
    assert agent.status == Agent.Status.OFFLINE
    assert (agent.presence_source, agent.presence_since) == ("lwt",
                                                             now + timedelta(seconds=1))
    # A fresh card without the property brings it back.
    assert card_apply(frame(status=""), now=now + timedelta(seconds=9)) == "online"
    agent.refresh_from_db()
    assert (agent.status, agent.presence_source) == (Agent.Status.ONLINE, "agent")
    assert [k for k, _ in history()] == ["REGISTERED", "OFFLINE", "REVIVED"]
    assert history()[1][1] == "a2a-status=offline, source lwt"


def test_a_card_saying_online_does_not_undo_an_operators_drain(now):
    card_apply(frame(), now=now)
    Agent.objects.filter(agent_id="acme/ops/echo").update(status=Agent.Status.DRAINING)
    card_apply(frame(card(version="2.0.0")), now=now + timedelta(seconds=1))
    assert Agent.objects.get(agent_id="acme/ops/echo").status == Agent.Status.DRAINING


def test_an_empty_retained_card_removes_the_agent(now):
    card_apply(frame(), now=now)
    assert card_apply(frame(raw=b""), now=now + timedelta(seconds=1)) == "removed"
    assert not Agent.objects.filter(agent_id="acme/ops/echo").exists()
    assert history()[-1] == ("DEREGISTERED", "its retained Agent Card was cleared")
    assert card_apply(frame(raw=b""), now=now) == "absent"


@pytest.mark.parametrize(("raw", "reason", "words"), [
    (b"{not json", "bad_json", "the card is not JSON"),
    (b"[1, 2]", "bad_card", "not an object"),
    (json.dumps({"name": "x"}).encode(), "missing_fields",
     "lacks what an A2A Agent Card requires: description, version, defaultInputModes"),
    (json.dumps(card(skills=[{"name": "no id"}])).encode(), "bad_card", "skill 0 has no id"),
    (json.dumps(card(description="x" * 70_000)).encode(), "too_large",
     "the console takes cards of at most 65,536"),
    (b"[" * 5000 + b"]" * 5000, "bad_json", "nests deeper than a JSON reader goes"),
])
def test_a_card_that_cannot_be_read_is_refused_whole_with_a_reason(now, raw, reason, words):
    with pytest.raises(CardRefused) as refused:
        card_apply(frame(raw=raw), now=now)
    assert refused.value.reason == reason and words in str(refused.value)
    assert not Agent.objects.filter(agent_id="acme/ops/echo").exists()
    assert not Namespace.objects.filter(name="acme").exists()


def test_a_refusal_about_a_known_agent_is_kept_on_it_until_a_good_card(now):
    card_apply(frame(), now=now)
    counts = cards_apply([frame(raw=b"{oops")], now=now + timedelta(seconds=1))
    assert counts == {"profile_cards_rejected:bad_json": 1}
    agent = Agent.objects.get(agent_id="acme/ops/echo")
    assert agent.card_refused.startswith("the card is not JSON")
    assert agent.card_refused_at == now + timedelta(seconds=1)
    assert agent.capabilities == ["echo", "shout"]  # the last good card still stands
    assert cards_apply([frame()], now=now + timedelta(seconds=2)) == {"cards:unchanged": 1}
    agent.refresh_from_db()
    assert agent.card_refused == "" and agent.card_refused_at is None


@pytest.mark.parametrize(("topic", "words"), [
    ("$a2a/v1/discovery/acme/ops", "is not a discovery topic"),
    ("$a2a/v1/discovery/acme/ops/echo/extra", "is not a discovery topic"),
    ("$a2a/v1/discovery/ac me/ops/echo", "the org id 'ac me' is not of the profile's"),
    ("$a2a/v1/discovery/acme/../echo", "the unit id '..' is not of the profile's"),
])
def test_a_topic_outside_the_profile_is_refused(now, topic, words):
    with pytest.raises(CardRefused) as refused:
        card_apply(frame(topic=topic), now=now)
    assert words in str(refused.value)


def test_profile_agents_are_left_alone_by_the_lease_sweep_and_the_node_sweep(now):
    register("fin.tax", "node-a", now=now - timedelta(hours=1))
    card_apply(frame(), now=now - timedelta(hours=1))
    card_apply(frame(topic="$a2a/v1/discovery/acme/ops/gone", status="offline", source="lwt"),
               now=now - timedelta(hours=1))
    bus_heard(since=now - timedelta(hours=2), until=now)
    # The repair gives a deadline to every live agent without one: not to these.
    lease_deadlines_repair()
    # An operator drains both: a drained native agent whose lease lapsed is removed by the
    # sweep; a profile agent has no lease to lapse.
    agent_drain(agent_id="acme/ops/echo")
    agent_drain(agent_id="acme/ops/gone")
    leases_expire(now=now)
    nodes_sweep(now=now)
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.OFFLINE
    assert Agent.objects.get(agent_id="acme/ops/echo").status == Agent.Status.DRAINING
    assert Agent.objects.get(agent_id="acme/ops/gone").status == Agent.Status.DRAINING
    assert not RosterEvent.objects.filter(agent_id__startswith="acme/",
                                          kind__in=["EXPIRED", "REMOVED"]).exists()
    assert ClusterNode.objects.get(node_id=PROFILE_NODE_ID).status == ClusterNode.Status.ONLINE


def test_the_profiles_node_is_no_cluster_node(now):
    card_apply(frame(), now=now)
    with pytest.raises(ConsoleAgent, match="stands for the A2A-over-MQTT profile's agents"):
        node_drain(node_id=PROFILE_NODE_ID, actor="olga")
    with pytest.raises(ConsoleAgent, match="is not retired"):
        node_retire(node_id=PROFILE_NODE_ID, actor="olga")
    with pytest.raises(InvalidField, match="a node of the cluster registers under a name"):
        register("fin.tax", PROFILE_NODE_ID)
    # Its skills are no capability left uncovered: no native send reaches them anyway.
    assert [c.capability for c in capability_coverage(now=now)] == []


def test_a_card_heard_before_the_one_applied_changes_nothing(now):
    early, late = now, now + timedelta(seconds=2)
    # Bridge A applies the agent's Last Will; bridge B, lagging, then its earlier card.
    assert card_apply(frame(status="offline", source="lwt", heard_at=late),
                      now=late) == "registered"
    assert card_apply(frame(card(version="0.9"), heard_at=early), now=late) == "stale"
    agent = Agent.objects.get(agent_id="acme/ops/echo")
    assert (agent.status, agent.version) == (Agent.Status.OFFLINE, "1.0.0")
    # A removal heard after a card: the lagging bridge's card does not bring it back.
    assert card_apply(frame(raw=b"", heard_at=late + timedelta(seconds=1)),
                      now=late) == "removed"
    assert card_apply(frame(heard_at=late), now=late + timedelta(seconds=5)) == "stale"
    assert not Agent.objects.filter(agent_id="acme/ops/echo").exists()
    # The agent back later: a card heard after the removal registers it again.
    assert card_apply(frame(heard_at=late + timedelta(seconds=9)),
                      now=late + timedelta(seconds=9)) == "registered"


def test_the_directory_routes_to_a_profile_agent_by_its_cards_word(now, settings):
    card_apply(frame(), now=now)
    # A console that does not speak the profile now would hear none of its replies.
    settings.REACH_A2A_PROFILE = False
    judged = candidate_for(Agent.objects.get(agent_id="acme/ops/echo"), now)
    assert not judged.routable and "REACH_A2A_PROFILE=0" in judged.why
    settings.REACH_A2A_PROFILE = True
    agent = Agent.objects.select_related("node", "namespace").get(agent_id="acme/ops/echo")
    judged = candidate_for(agent, now)
    assert judged.routable and judged.node_id == "a2a-mqtt"
    assert judged.why == "live: its Agent Card is on the bus (A2A-over-MQTT)"
    # By its capability segment (its agent id's last part), like any agent.
    found = resolve(mention="echo", now=now)
    assert (found.agent_id, found.node_id) == ("acme/ops/echo", "a2a-mqtt")
    # Offline by its Last Will: considered, named, not chosen; no lease makes it live again.
    card_apply(frame(status="offline", source="lwt"), now=now)
    found = resolve(mention="echo", now=now)
    assert found.agent_id is None
    assert [(c.agent_id, c.routable) for c in found.candidates] == [("acme/ops/echo", False)]
    assert found.candidates[0].why.startswith("offline: its Agent Card says a2a-status=offline")


def test_the_pages_show_a_profile_agent_beside_a_native_one(now):
    from tests.conftest import logged_in, reader, staff_user

    register("fin.tax", "node-a", now=now)
    published = card(provider={"organization": "Acme", "url": "https://acme.example"},
                     description='<img src=x onerror="1">')
    card_apply(frame(published), now=now)
    # Its Last Will: the same card, offline.
    card_apply(frame(published, status="offline", source="lwt"), now=now + timedelta(seconds=3))
    viewer = logged_in(reader("victor", password="pw-victor-123"))
    html = viewer.get("/").content.decode()
    assert 'data-agent="fin.tax"' in html and 'data-agent="acme/ops/echo"' in html
    assert 'href="/agents/acme/ops/echo/"' in html and 'data-dialect="a2a-mqtt"' in html
    assert 'data-presence="lwt"' in html

    page = viewer.get("/agents/acme/ops/echo/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "source lwt" in html and "its Last Will: the connection was lost" in html
    assert 'data-skill="echo"' in html and 'data-skill="shout"' in html
    assert "Acme https://acme.example" in html
    assert '&lt;img src=x onerror=&quot;1&quot;&gt;' in html and 'onerror="1"' not in html
    assert "$a2a/v1/request/acme/ops/echo" in html

    # A refused card is on its page, the good one still standing.
    cards_apply([frame(raw=b"{oops")], now=now + timedelta(seconds=5))
    html = viewer.get("/agents/acme/ops/echo/").content.decode()
    assert 'id="card-refused"' in html and "the card is not JSON" in html

    # An operator drains it through its address, slashes and all.
    operator = logged_in(staff_user("olga", "change_agent"))
    assert operator.post("/agents/acme/ops/echo/drain").status_code == 302
    assert Agent.objects.get(agent_id="acme/ops/echo").status == Agent.Status.DRAINING


def test_both_dialects_are_listed_and_filtered_and_a_profile_agent_is_never_stale(now, api):
    register("fin.tax", "node-a", now=now - timedelta(hours=1))
    card_apply(frame(), now=now - timedelta(hours=1))
    bus_heard(since=now - timedelta(hours=2), until=now + timedelta(minutes=1))
    listed = {a["agentId"]: a for a in api.get("/api/roster/agents").json()}
    assert listed["acme/ops/echo"]["dialect"] == "a2a-mqtt"
    assert listed["acme/ops/echo"]["presenceSource"] == "agent"
    assert listed["fin.tax"]["dialect"] == "native"
    # An hour without a heartbeat: the native agent is stale, the card's agent is not.
    assert (listed["fin.tax"]["stale"], listed["acme/ops/echo"]["stale"]) == (True, False)
    stale = [a["agentId"] for a in api.get("/api/roster/agents?stale=true").json()]
    assert stale == ["fin.tax"]
    only = [a["agentId"] for a in api.get("/api/roster/agents?dialect=a2a-mqtt").json()]
    assert only == ["acme/ops/echo"]
    from tests.conftest import logged_in, reader

    html = logged_in(reader("victor", password="pw-victor-123")).get(
        "/?dialect=a2a-mqtt").content.decode()
    assert 'data-agent="acme/ops/echo"' in html and 'data-agent="fin.tax"' not in html


def test_the_agent_pages_parts_answer_for_a_profile_agent(now):
    from tests.conftest import logged_in, staff_user

    card_apply(frame(), now=now)
    client = logged_in(staff_user("olga", "change_agent", "view_message"))
    for path in ("/messages/agents/acme/ops/echo/load/", "/messages/agents/acme/ops/echo/stats/",
                 "/directory/agents/acme/ops/echo/names/"):
        answer = client.get(path)
        assert answer.status_code == 200, (path, answer.status_code)


def test_the_api_reads_and_deregisters_a_profile_agent_by_its_slashed_id(now, api):
    card_apply(frame(), now=now)
    register("fin.tax", "node-a", now=now)
    one = api.get("/api/roster/agents/acme/ops/echo")
    assert one.status_code == 200, one.content
    assert (one.json()["agentId"], one.json()["dialect"]) == ("acme/ops/echo", "a2a-mqtt")
    # Native ids and their actions are where they were.
    assert api.get("/api/roster/agents/fin.tax").json()["agentId"] == "fin.tax"
    assert api.post("/api/roster/agents/fin.tax/drain").status_code == 200
    assert api.get("/api/roster/agents/acme/ops/nobody").status_code == 404
    assert api.get("/api/roster/agents/acme/ops").status_code == 404
    drained = api.post("/api/roster/agents/acme/ops/echo/drain")
    assert drained.status_code == 200 and drained.json()["status"] == "DRAINING"
    back = api.post("/api/roster/agents/acme/ops/echo/undrain")
    assert back.status_code == 200 and back.json()["status"] == "ONLINE"
    renew = api.post("/api/roster/agents/acme/ops/echo/heartbeat")
    assert renew.status_code == 409, renew.content
    assert renew.json()["error"] == "no_lease"
    assert "its presence is what its retained Agent Card says" in renew.json()["detail"]
    gone = api.delete("/api/roster/agents/acme/ops/echo")
    assert gone.status_code == 200, gone.content
    assert not Agent.objects.filter(agent_id="acme/ops/echo").exists()


def test_the_overview_counts_the_profiles_agents_beside_the_rest(now):
    from tests.conftest import logged_in, reader

    card_apply(frame(), now=now)
    card_apply(frame(topic="$a2a/v1/discovery/acme/ops/mute", status="offline", source="lwt"),
               now=now)
    register("fin.tax", "node-a", now=now)
    page = logged_in(reader("otto", password="pw-otto-1234567")).get("/overview/")
    html = page.content.decode()
    assert '<b data-agents="profile-online">1</b> online' in html
    assert '<b data-agents="profile-offline">1</b> offline' in html
    assert '<b data-agents="online">2</b> online' in html  # both dialects in the totals
