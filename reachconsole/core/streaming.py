"""Streaming a response whose chunks come from the database, under ASGI (Daphne) and WSGI."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest

_END = object()


async def streamed(chunks: Iterator[str]) -> AsyncIterator[str]:
    # Under ASGI Django reads a synchronous iterator to its end before sending a byte; read
    # each chunk (one keyset page, one query) in the thread that serves sync code instead.
    read = sync_to_async(next, thread_sensitive=True)
    while (chunk := await read(chunks, _END)) is not _END:
        yield chunk


def streamed_for(request: HttpRequest, chunks: Iterator[str]) -> Iterator[str] | AsyncIterator[str]:
    """`chunks` as the server that serves `request` streams them."""
    return streamed(chunks) if isinstance(request, ASGIRequest) else chunks
