"""How much request body the HTTP API reads: a bound per request and one for all requests at once (ASGI middleware).

A JSON body is read whole and parsed while the interpreter lock is held (about 2 ms per MiB here), and lives as
long as its request, so without a bound a few clients sending large bodies stall every stream of the gateway and
grow its memory without limit. Here:

- a body larger than `max_bytes()` is refused with 413 before it is read: by its Content-Length, or as soon as a
  chunked body passes it. `OpenAIApi` sets the limit from the served model: the most a useful request can need,
  a prompt of `gateway.requests.prompt_bytes_limit` bytes written as JSON escapes (6 bytes per byte at most)
  plus room for the other fields. A larger body carries text that could not fit the context anyway;
- the bodies read or held at once count against `budget_bytes` together (a chunked body counts as the limit
  itself); a request that would pass it is refused with 429 before its body is read, and may be sent again.

A refused body is still received, up to `MAX_BODY_BYTES`, and dropped as it comes (no memory is spent on it): a
client that is still sending when the answer comes and the connection closes would see the connection reset
instead of the answer. A longer one is cut off. Refused bodies are read at `DRAIN_BYTES_PER_S` at most, all of them
together: receiving a body costs the interpreter lock about 2 ms per MiB, so a flood of oversized requests read at
the network's pace would take that lock from every stream of the gateway (a stream's longest pause up to 3x its
usual one under 50 bodies of 16 MiB); read at this pace, it takes a few percent of a core, and the flood's senders
wait for their answers instead of the streams.

The gateway's memory for request bodies is therefore at most `budget_bytes`, about twice that while they are
parsed, whatever the number of connections.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.openai_errors import error_body
from gateway.requests import ModelContext, prompt_bytes_limit
from shardmesh.core.errors import InvalidArgument, ResourceExhausted

MAX_BODY_BYTES = 64 * 1024 * 1024  # without a served model to size it from: the gRPC API's default message limit
BODY_BUDGET_BYTES = 256 * 1024 * 1024
DRAIN_BYTES_PER_S = 64 * 1024 * 1024  # refused bodies, read and dropped, all requests together
JSON_ESCAPE_BYTES = 6  # the longest JSON escape of one byte of text: a control character as \u00XX
PER_TOKEN_ID_BYTES = 32  # a prompt of token ids as JSON: up to 6 digits, a comma, and any whitespace a client adds
OTHER_FIELDS_BYTES = 1024 * 1024  # messages' roles and framing, stop strings, sampling fields, ...

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    def __init__(self, app: Any, max_bytes: Callable[[], int] = lambda: MAX_BODY_BYTES,
                 budget_bytes: int = BODY_BUDGET_BYTES, logger: Any = None,
                 drain_bytes_per_s: float = DRAIN_BYTES_PER_S) -> None:  # fmt: skip
        self.app = app
        self._max_bytes = max_bytes
        self.budget_bytes = budget_bytes
        self._log = logger
        self._lock = threading.Lock()
        self._held = 0
        self._drain = Pace(drain_bytes_per_s)

    @property
    def held(self) -> int:
        """Bytes of request bodies reserved now."""
        with self._lock:
            return self._held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self._max_bytes()
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(receive, send, 413, _too_large(f"{declared} bytes", limit), declared)
            return
        reserved = declared if declared is not None else limit
        if not self._reserve(reserved):
            error = ResourceExhausted(f"the gateway holds {self.held} bytes of request bodies, its limit for all "
                                      f"requests at once is {self.budget_bytes}: send it again later")  # fmt: skip
            await self._refuse(receive, send, *error_body(error), reserved)
            return
        try:
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    del chunks
                    await self._refuse(receive, send, 413, _too_large(f"more than {limit} bytes", limit), None,
                                       message.get("more_body", False))  # fmt: skip
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            del chunks
            await self.app(scope, _replay(body, receive), send)
        finally:
            self._release(reserved)

    def _reserve(self, size: int) -> bool:
        with self._lock:
            if self._held and self._held + size > self.budget_bytes:  # one request alone may use it all
                return False
            self._held += size
            return True

    def _release(self, size: int) -> None:
        with self._lock:
            self._held -= size

    async def _refuse(self, receive: Receive, send: Send, status: int, body: dict[str, Any], size: int | None,
                      more_body: bool = True) -> None:  # fmt: skip
        """Answer `status` with `body`, after dropping what the client still sends of a body of `size` bytes (None:
        unknown), up to MAX_BODY_BYTES."""
        if self._log is not None:
            self._log.warning("request_failed", api="openai", code=status, error=body["error"]["message"])
        dropped = 0
        while more_body and (size is None or size <= MAX_BODY_BYTES) and dropped <= MAX_BODY_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = len(message.get("body", b""))
            dropped += chunk
            more_body = message.get("more_body", False)
            if more_body:  # not reading stops the client at its socket's buffer: its send waits, not the streams
                await asyncio.sleep(self._drain.wait(chunk))
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class Pace:
    """A rate shared by whoever asks: `wait(n)` is how long to wait before taking `n` more bytes, after those taken
    before it (a virtual clock: no thread, no timer)."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._free_at = 0.0
        self._lock = threading.Lock()

    def wait(self, n: int) -> float:
        with self._lock:
            now = self._clock()
            start = max(now, self._free_at)
            self._free_at = start + n / self.bytes_per_s
            return start - now


def max_body_bytes(model: ModelContext) -> int:
    """The largest body a request to `model` can usefully have (see the module's docstring), at most MAX_BODY_BYTES."""
    text = prompt_bytes_limit(model) if model.tokenizer is not None else 0
    return min(MAX_BODY_BYTES, JSON_ESCAPE_BYTES * text + PER_TOKEN_ID_BYTES * model.max_context + OTHER_FIELDS_BYTES)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed one before the app sees it
    return None


def _too_large(size: str, limit: int) -> dict[str, Any]:
    message = (f"the request body is {size}, more than the {limit} this gateway reads: a prompt that long could not "
               "fit the served model's context")  # fmt: skip
    body = error_body(InvalidArgument("body", message))[1]
    body["error"]["code"] = "request_too_large"
    return body


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the connection's own messages (the client going away)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
