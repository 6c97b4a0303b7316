"""WebSocket routes. The message timeline's consumers join here as they are built."""

websocket_urlpatterns: list = []
