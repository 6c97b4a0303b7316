"""Where an operator acts on an alarm: the page of its subject, for the alarms page and the
overview's strip alike."""

from __future__ import annotations

from django import template
from django.conf import settings
from django.urls import NoReverseMatch, reverse
from django.utils.http import urlencode

from alarms.models import Alarm

register = template.Library()

HEADLINES = {
    Alarm.Kind.BUS_NOT_HEARD: "The console does not hear the bus",
    Alarm.Kind.NODE_DOWN: "Node {subject} is down",
    Alarm.Kind.CAPABILITY_UNCOVERED: "No agent can take capability:{subject}",
    Alarm.Kind.DELIVERY_FAILING: "Deliveries are failing",
    Alarm.Kind.BROKER_DROPS: "The MQTT broker dropped messages",
    Alarm.Kind.TASKS_EXPIRING: "Tasks to {subject} are expiring",
    Alarm.Kind.AGENT_FAILING: "{subject} is failing its tasks",
    Alarm.Kind.RETENTION_BEHIND: "The message history outgrows its retention",
}


@register.filter
def alarm_headline(alarm: Alarm) -> str:
    return HEADLINES.get(alarm.kind, "{kind}: {subject}").format(kind=alarm.kind,
                                                                 subject=alarm.subject)


def _agent_page(agent_id: str) -> list[tuple[str, str]]:
    try:
        return [("the agent", reverse("roster:agent", args=[agent_id]))]
    except NoReverseMatch:  # seen on the bus under an id no roster page can have
        return []


@register.filter
def alarm_links(alarm: Alarm) -> list[tuple[str, str]]:
    """(words, address) of the pages to act from, the first being the subject's own."""
    kind, subject = alarm.kind, alarm.subject
    messages = reverse("a2a:list")
    if kind == Alarm.Kind.NODE_DOWN:
        return [("cluster nodes", f"{reverse('roster:nodes')}#node-{subject}"),
                ("its agents", f"{reverse('roster:health')}?{urlencode({'node': subject})}")]
    if kind == Alarm.Kind.CAPABILITY_UNCOVERED:
        return [("agents offering it",
                 f"{reverse('roster:health')}?{urlencode({'capability': subject})}")]
    if kind == Alarm.Kind.TASKS_EXPIRING:
        return [("the expired tasks",
                 f"{messages}?{urlencode({'status': 'EXPIRED', 'agent': subject})}"),
                *_agent_page(subject)]
    if kind == Alarm.Kind.AGENT_FAILING:
        return [*_agent_page(subject),
                ("its task errors",
                 f"{messages}?{urlencode({'status': 'TASK_ERROR', 'agent': subject})}")]
    if kind == Alarm.Kind.DELIVERY_FAILING:
        return [("the broker and deliveries", f"{reverse('overview')}#ov-broker"),
                ("expired tasks", f"{messages}?status=EXPIRED")]
    if kind == Alarm.Kind.RETENTION_BEHIND:
        # The timeline's `until` is minutes ago: the rows older than the retention.
        minutes = max(1, int(settings.REACH_RETENTION_DAYS * 1440))
        return [("the messages past the retention",
                 f"{messages}?{urlencode({'until': str(minutes)})}")]
    return [("the broker", f"{reverse('overview')}#ov-broker")]
