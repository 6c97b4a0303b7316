"""`GET /.well-known/ai-catalog.json`: the roster's agents as an AI Catalog, so that a
discovery service can index a bus it cannot see.

The format is the AI Catalog's (github.com/Agent-Card/ai-catalog, ai-catalog.io) first
release, v0.9 (`specVersion: "0.9"`, media type `application/ai-catalog+json`): `host`, and
one entry a roster agent, of type `application/a2a-agent-card+json` with its A2A Agent Card
inline (`data`). A profile agent's card is the one it published (roster/profile.py), as it
was published but for whitespace (the entry embeds it as JSON); a native agent's is made
from its registration (`native_card`): its capabilities as skills, and as its interface the
console's send API, which is how anyone outside the bus reaches it.

Who may read it: a signed-in user, or a caller with a service token (the API's rules:
`Authorization: Bearer`, `X-OODER-Source`); a token bound to namespaces sees their agents
only. The document is streamed a page of agents at a time, so a roster of 100,000 agents
costs memory for one page.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET

from reachconsole.core.auth import ServiceAuth
from reachconsole.core.errors import ApiError
from reachconsole.core.identity import console_id
from reachconsole.core.streaming import streamed_for
from roster.models import Agent, Dialect

SPEC_VERSION = "0.9"
MEDIA_TYPE = "application/ai-catalog+json"
CARD_TYPE = "application/a2a-agent-card+json"
EXTENSION = "io.reachconsole.roster"
PAGE = 500
FIELDS = ("agent_id", "name", "version", "capabilities", "metadata", "status", "dialect",
          "card", "updated_at", "presence_source", "namespace__name", "node__node_id")


def native_card(agent: Agent, *, send_url: str) -> dict[str, Any]:
    """An A2A Agent Card for a native agent, made from its registration."""
    description = agent.metadata.get("description") if isinstance(agent.metadata, dict) else None
    return {
        "name": agent.agent_id,
        "description": description if isinstance(description, str) and description else
        f"{agent.agent_id}, an agent of namespace {agent.namespace.name} on node "
        f"{agent.node.node_id}, reached through the console",
        "version": agent.version or "unversioned",
        # Not an A2A binding: the console's own send API (docs/protocol.md), with
        # {"to": "<agentId>", "payload": …}.
        "supportedInterfaces": [{"url": send_url, "protocolBinding": "reachconsole-send+HTTP",
                                 "protocolVersion": "1"}],
        "capabilities": {"streaming": False, "pushNotifications": False},
        "defaultInputModes": ["application/json"],
        "defaultOutputModes": ["application/json"],
        "skills": [{"id": c, "name": c, "description": f"the capability {c}", "tags": [c]}
                   for c in agent.capabilities or []],
    }


def _entry(agent: Agent, *, publisher: str, send_url: str) -> dict[str, Any]:
    card = None
    if agent.dialect == Dialect.A2A_MQTT and agent.card:
        try:
            card = json.loads(agent.card)
        except ValueError:
            card = None  # cannot happen for a stored card (roster/profile.py read it)
    if not isinstance(card, dict):
        card = native_card(agent, send_url=send_url)
    entry = {
        "identifier": f"urn:air:{publisher}:{agent.namespace.name}:{agent.name}",
        "type": CARD_TYPE,
        "displayName": str(card.get("name") or agent.agent_id),
        "version": str(card.get("version") or agent.version or ""),
        "tags": list(agent.capabilities or []),
        "updatedAt": agent.updated_at.isoformat(),
        "data": card,
        "extensions": {EXTENSION: {"agentId": agent.agent_id, "dialect": agent.dialect,
                                   "status": agent.status, "nodeId": agent.node.node_id,
                                   **({"presenceSource": agent.presence_source}
                                      if agent.dialect == Dialect.A2A_MQTT else {})}},
    }
    if isinstance(card.get("description"), str):
        entry["description"] = card["description"]
    return entry


def _pages(namespaces: frozenset[str] | None) -> Iterator[list[Agent]]:
    """Every agent, by id, a page a query (keyset: each page costs the same)."""
    after = ""
    while True:
        qs = Agent.objects.select_related("namespace", "node").only(*FIELDS).order_by(
            "agent_id")
        if namespaces is not None:
            qs = qs.filter(namespace__name__in=namespaces)
        page = list(qs.filter(agent_id__gt=after)[:PAGE])
        if page:
            yield page
        if len(page) < PAGE:
            return
        after = page[-1].agent_id


def catalog_chunks(*, namespaces: frozenset[str] | None, host: dict[str, str],
                   send_url: str) -> Iterator[str]:
    """The document, a chunk a page of agents."""
    publisher = host["identifier"]
    yield (f'{{"specVersion": {json.dumps(SPEC_VERSION)}, "host": {json.dumps(host)}, '
           '"entries": [')
    first = True
    for page in _pages(namespaces):
        entries = ", ".join(json.dumps(_entry(a, publisher=publisher, send_url=send_url),
                                       ensure_ascii=False) for a in page)
        yield ("" if first else ", ") + entries
        first = False
    yield "]}"


def _caller_namespaces(request: HttpRequest) -> frozenset[str] | None:
    """None: every namespace (a signed-in user, an unbound token); else the token's."""
    if request.user.is_authenticated and "Authorization" not in request.headers:
        return None
    return ServiceAuth()(request).token.namespaces


@require_GET
def ai_catalog(request: HttpRequest) -> HttpResponse:
    try:
        namespaces = _caller_namespaces(request)
    except ApiError as exc:
        answer = JsonResponse({"error": exc.code, "detail": exc.detail}, status=exc.status)
        if exc.status == 401:
            answer["WWW-Authenticate"] = "Bearer"
        return answer
    name = console_id()
    host = {"displayName": f"reachconsole {name}", "identifier": name}
    chunks = catalog_chunks(namespaces=namespaces, host=host,
                            send_url=request.build_absolute_uri("/api/a2a/send"))
    response = StreamingHttpResponse(streamed_for(request, chunks), content_type=MEDIA_TYPE)
    response["Cache-Control"] = "private, no-store"
    return response
