"""ASGI entry point: Django views over HTTP, Channels consumers over WebSocket."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "reachconsole.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from reachconsole.core.identity import console_id_warm  # noqa: E402
from reachconsole.core.query_bound import query_bound_install  # noqa: E402
from reachconsole.routing import websocket_urlpatterns  # noqa: E402

# Now, not on the first event: Daphne's loop would wait on that read (a database that is not
# up yet is read on first use instead).
console_id_warm()
# A web process's queries are bounded: a stalled database answers 503, never hangs.
query_bound_install()

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
