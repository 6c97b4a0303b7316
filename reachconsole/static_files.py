"""WhiteNoise, able to run in an async middleware chain.

WhiteNoise's middleware is synchronous only. Under ASGI Django then runs it, and every
middleware and view below it, on a thread for the whole request: a request that waits (an
API call with `wait: true`) held a thread for as long as it waited
(reachconsole/core/idle.py). Here a request for anything but a static file goes on without
a thread hop; a static file is found and opened on a thread, as WhiteNoise does it.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None, **kwargs) -> None:
        super().__init__(get_response, **kwargs)
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        if self.autorefresh:
            # Looks on disk (DEBUG): on a thread, and only for what may be a file.
            static_file = (await sync_to_async(self.find_file, thread_sensitive=False)(
                request.path_info) if self._maybe_static(request.path_info) else None)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve, thread_sensitive=False)(static_file, request)
        return await self.get_response(request)

    def _maybe_static(self, path: str) -> bool:
        # WHITENOISE_ROOT's files are served from the site's root: then any path may be one.
        return path.startswith(self.static_prefix) or any(
            prefix == "/" for _root, prefix in self.directories)
