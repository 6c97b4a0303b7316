"""Agent ids in pages' addresses: a native id (`fin.tax`, no slash) or an A2A-over-MQTT
profile id (`acme/ops/echo`: exactly three segments, roster/profile.py), so that
`agents/acme/ops/echo/drain` names the agent `acme/ops/echo` and its drain."""

from __future__ import annotations


class AgentIdConverter:
    regex = r"[^/]+(?:/[^/]+/[^/]+)?"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value
