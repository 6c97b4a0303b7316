"""A small simulated cluster that speaks the console's public contract for real.

Each simulated node registers its agents over the HTTP API and renews their leases with
heartbeats, with a load that moves, so a newcomer running `make run` sees a live roster.
It uses only the public API (no ORM), exactly as another team's node would.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

NAMESPACES = {
    "fin": ["tax", "vat-report", "bank-statement", "invoice"],
    "llm": ["chat", "summarize", "translate", "bank-statement"],
    "web": ["web_search", "crawl", "scrape"],
    "ops": ["probe", "backup", "notify"],
}


@dataclass
class SimulatedAgent:
    agent_id: str
    capabilities: list[str]
    groups: list[str]
    max_inflight: int
    inflight: int = 0


@dataclass
class SimulatedNode:
    node_id: str
    agents: list[SimulatedAgent] = field(default_factory=list)
    heartbeat_ms: int = 5000
    alive: bool = True


def cluster_plan(*, nodes: int, agents: int, seed: int = 7) -> list[SimulatedNode]:
    """Spread `agents` over `nodes` deterministically for a given seed."""
    rng = random.Random(seed)
    pool = [(ns, name) for ns, names in NAMESPACES.items() for name in names]
    plan = [SimulatedNode(node_id=f"sim-node-{chr(ord('a') + i)}") for i in range(nodes)]
    for i in range(agents):
        ns, name = pool[i % len(pool)]
        suffix = "" if i < len(pool) else f"-{i // len(pool) + 1}"
        plan[i % nodes].agents.append(SimulatedAgent(
            agent_id=f"{ns}.{name}{suffix}", capabilities=[name],
            groups=[f"#{ns}-team"], max_inflight=rng.choice([4, 8, 16]),
        ))
    return plan


class SimulatedCluster:
    def __init__(self, *, base_url: str, token: str, nodes: int = 3, agents: int = 12,
                 rate: float = 2.0, seed: int = 7, source: str = "studio",
                 kill_node_after: float | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"the console URL must be http(s)://…, not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.source = source
        self.rate = rate
        self.kill_node_after = kill_node_after
        self.nodes = cluster_plan(nodes=nodes, agents=agents, seed=seed)
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors = 0

    # --- HTTP -----------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(  # noqa: S310 - the scheme is checked in __init__
            f"{self.base_url}{path}", data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}", "X-OODER-Source": self.source,
                     "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            self.errors += 1
            log.warning("simulator: %s %s → %s %s", method, path, exc.code,
                        exc.read()[:200].decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.errors += 1
            log.warning("simulator: %s %s failed: %s", method, path, exc)
        return None

    def register(self, node: SimulatedNode) -> None:
        for agent in node.agents:
            lease = self._call("POST", "/api/roster/agents", {
                "agentId": agent.agent_id, "nodeId": node.node_id, "version": "sim-1",
                "capabilities": agent.capabilities, "groups": agent.groups,
                "maxInflight": agent.max_inflight, "metadata": {"simulated": True},
            })
            if lease:
                node.heartbeat_ms = lease["heartbeatMs"]

    def heartbeat(self, node: SimulatedNode) -> None:
        for agent in node.agents:
            agent.inflight = max(0, min(agent.max_inflight,
                                        agent.inflight + self.rng.choice([-1, 0, 1])))
            self._call("POST", f"/api/roster/agents/{agent.agent_id}/heartbeat", {
                "nodeId": node.node_id, "inflight": agent.inflight,
                "queueDepth": self.rng.choice([0, 0, 0, 1, 2]),
            })

    # --- lifecycle --------------------------------------------------------------------------
    def _run_node(self, node: SimulatedNode) -> None:
        started = time.monotonic()
        self.register(node)
        while not self._stop.wait(node.heartbeat_ms / 1000):
            if (self.kill_node_after is not None and node is self.nodes[-1]
                    and time.monotonic() - started > self.kill_node_after):
                node.alive = False
                log.warning("simulator: %s stops heartbeating (--kill-node-after)", node.node_id)
                return
            self.heartbeat(node)

    def start(self) -> None:
        for node in self.nodes:
            thread = threading.Thread(target=self._run_node, args=(node,),
                                      name=f"sim-{node.node_id}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
