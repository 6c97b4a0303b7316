"""WebSocket routes (behind AllowedHostsOriginValidator and the session auth, see asgi.py)."""

from django.urls import path, re_path

from messages.consumers import EventStreamConsumer, ScopedStreamConsumer, SkillProgressConsumer

websocket_urlpatterns = [
    path("ws/timeline/", EventStreamConsumer.as_asgi()),
    path("ws/skill_progress/", SkillProgressConsumer.as_asgi()),
    re_path(r"^ws/(?P<kind>conversation|scene|session)/(?P<key>[^/]{1,200})/$",
            ScopedStreamConsumer.as_asgi()),
]
