"""The layer every HTTP request passes: API key, graceful shutdown, counting and the request log.

``Gate`` is the app's outermost middleware that counts, so it is also where an exception nothing
else handled becomes its error response (``errors.fault``): the status a client receives is
the status ``/metrics`` counts and the request log records. (Starlette's own catch-all runs in
``ServerErrorMiddleware``, outside every user middleware: a 500 made there was counted as 0.)

``Shutdown`` is the drain: once begun (SIGTERM/SIGINT), new requests get 503 with
``Retry-After`` (the grace period); the jobs in flight may finish within the grace period, and
those still running then are cut: each handler gets a ``Cut`` event and ends its answer saying
why (a stream: an error event, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, Protocol

from starlette.exceptions import HTTPException

from deimos.server.errors import APIError, fault, retry_after
from deimos.server.metrics import Metrics
from deimos.server.worker import Cut, Job

request_log = logging.getLogger("deimos.requests")  # one JSON line per request

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
MAX_BODY_BYTES = 16 * 2**20  # a 100,000-property schema is 3 MB; nothing real needs more
SHUTTING_DOWN = "the server is shutting down; retry on another instance or later"


class Shutdown:
    """The drain state of one server. Its methods run on the event loop."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.draining = False
        self._jobs: dict[str, Job] = {}  # in flight: submitted and not yet answered

    def track(self, job: Job) -> None:
        self._jobs[job.id] = job

    def untrack(self, job: Job) -> None:
        self._jobs.pop(job.id, None)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def begin(self) -> None:
        """Refuse new requests from now on; cut what is still running after the grace period."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(self.grace_s, self.cut_all)

    def cut_all(self) -> None:
        for job in list(self._jobs.values()):
            job.cancelled.set()  # the engine drops it at its next token
            job.events.put_nowait(Cut(SHUTTING_DOWN))
        self._jobs.clear()


def shutting_down(retry_s: float) -> APIError:
    """The 503 of a draining server; ``Retry-After``: its grace period (by then this
    instance is gone, and a restarted one or another is taking requests)."""
    return APIError(503, SHUTTING_DOWN, code="server_shutting_down", headers=retry_after(retry_s))


def too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                    code="request_too_large")


def _limited(receive: Any) -> Any:
    """``receive`` that refuses a body growing past the limit (a chunked body has no length
    to check up front); FastAPI passes the HTTPException through as our 413."""
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > MAX_BODY_BYTES:
            raise HTTPException(413, too_large().message)
        return message

    return wrapped


class _GateServer(Protocol):
    api_key: str | None
    metrics: Metrics
    shutdown: Shutdown


class Gate:
    """ASGI middleware: the API key check, 503 while draining, request counts by route and
    status, and the per-request JSON log line (generation details come from the handler via
    scope state)."""

    def __init__(self, app: Any, server: _GateServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        t0 = time.monotonic()
        status = 0

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            key = self.server.api_key
            if key is not None and path != "/health":
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(auth.encode(), f"Bearer {key}".encode()):
                    err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                        "<key>'", code="invalid_api_key")
                    return await err.response()(scope, receive, send_status)
            if self.server.shutdown.draining:
                refusal = shutting_down(self.server.shutdown.grace_s)
                return await refusal.response()(scope, receive, send_status)
            length = dict(scope["headers"]).get(b"content-length", b"0")
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                return await too_large().response()(scope, receive, send_status)
            await self.app(scope, _limited(receive), send_status)
        except Exception as exc:  # noqa: BLE001 - the one place unhandled errors are answered
            err = fault(exc, f"{scope['method']} {path}")
            if status == 0:  # nothing sent yet: the client gets the error (else it is logged)
                await err.response()(scope, receive, send_status)
        finally:
            self.server.metrics.count_request(route, status)
            if route not in ("/health", "/metrics"):
                gen = scope.get("state", {}).get("deimos", {})
                request_log.info(json.dumps({
                    "ts": round(time.time(), 3), "method": scope["method"], "path": path,
                    "status": status, "duration_ms": round((time.monotonic() - t0) * 1000, 1),
                    **gen}))
