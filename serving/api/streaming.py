"""Server-sent events of a streamed images request (OpenAI's ``stream: true``).

The first event is awaited before the response starts, so a refusal (a bad LoRA, an overloaded engine) is a plain
JSON error with its status; a failure after it is an ``error`` event that ends the stream. The backend's iterator
is closed however the response ends (finished, failed, or the client gone), which cancels its request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from serving.api.protocol import (
    ErrorBody,
    ImageCompletedEvent,
    PartialImageEvent,
    StreamErrorEvent,
    StreamKind,
)
from serving.common.errors import APIError, internal_error
from serving.common.logging import get_logger
from serving.engine import GenerationEvent, PartialImage

logger = get_logger("api.streaming")


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` of ``frames``; when the response ends, however it ends, ``frames`` and the backend's
    ``events`` are closed."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], events: AsyncIterator[GenerationEvent]) -> None:
        super().__init__(frames, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.frames, self.events = frames, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.frames.aclose()
                await self.events.aclose()


async def stream_images(events: AsyncIterator[GenerationEvent], kind: StreamKind, size: str,
                        started: float) -> EventStreamResponse:
    """The response streaming ``events`` (previews, then the result) as ``kind`` events of images of ``size``,
    once the first event is in; what the backend raises before it propagates. ``started``: when the request came
    in (``time.perf_counter``), for the completed events' ``timings.total_s``."""
    try:
        first = await anext(events)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await events.aclose()
        raise
    return EventStreamResponse(_frames(first, events, kind, size, started), events)


async def _frames(first: GenerationEvent, rest: AsyncIterator[GenerationEvent], kind: StreamKind, size: str,
                  started: float) -> AsyncIterator[bytes]:
    """``first`` and then each of ``rest`` as SSE frames; a failure as an ``error`` event, last."""
    try:
        yield _encode(first, kind, size, started)
        async for event in rest:
            yield _encode(event, kind, size, started)
    except APIError as error:
        yield _frame(StreamErrorEvent(error=ErrorBody.of(error)))
    except Exception:
        logger.exception("images stream failed")
        yield _frame(StreamErrorEvent(error=ErrorBody.of(internal_error())))


def _encode(event: GenerationEvent, kind: StreamKind, size: str, started: float) -> bytes:
    """A preview as one ``partial_image`` event; the result as one ``completed`` event per image."""
    if isinstance(event, PartialImage):
        return _frame(PartialImageEvent.of(event, kind, size))
    completed = ImageCompletedEvent.of(event, kind, size, total_s=time.perf_counter() - started)
    return b"".join(_frame(image) for image in completed)


def _frame(event: PartialImageEvent | ImageCompletedEvent | StreamErrorEvent) -> bytes:
    """One SSE frame: ``event:`` the event's ``type``, ``data:`` its JSON (one line)."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n".encode()
