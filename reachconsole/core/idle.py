"""Database work from a request that then waits a long time (an API call with `wait: true`):
give back what the work took before waiting.

Under ASGI, Django runs a request's synchronous code on a thread of that request's own
(asgiref's ThreadSensitiveContext) and keeps it, with the database connection that thread
took from the pool, until the request ends. A request that waits a minute for an agent held
both for that minute: nine such requests took the process's eight pooled connections and
every other call answered 503; two hundred added two hundred threads.
"""

from __future__ import annotations

from asgiref.sync import SyncToAsync, sync_to_async
from django.db import connections


def connections_release() -> None:
    """Give this thread's database connections back (to the pool when there is one), unless
    inside a transaction (a test's, which must keep its connection)."""
    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block:
            conn.close()


def request_thread_release() -> None:
    """Let this request's worker thread end now: a later synchronous call of the request
    (Django's request_finished) gets a new one. Only after connections_release() ran on that
    thread, or its connection would stay checked out by a thread that no longer runs.

    This reaches into asgiref (SyncToAsync's per-context executors), which has no public
    way to do it; without those names it does nothing and the thread waits, idle, as before
    (tests/test_api_wait.py counts the threads)."""
    context_var = getattr(SyncToAsync, "thread_sensitive_context", None)
    executors = getattr(SyncToAsync, "context_to_thread_executor", None)
    if context_var is None or executors is None:
        return
    context = context_var.get(None)
    if context is None or getattr(context, "_executor", None) is not None:
        return  # not a request's context, or one whose executor its owner supplied
    executor = executors.pop(context, None)
    if executor is not None:
        executor.shutdown(wait=False)


async def db_then_idle(fn, *args, **kwargs):
    """`fn` (synchronous, using the database) on the request's thread, then the connection
    and the thread given back, so that what follows can wait holding neither."""

    def run():
        try:
            return fn(*args, **kwargs)
        finally:
            connections_release()

    try:
        return await sync_to_async(run)()
    finally:
        request_thread_release()
