"""The HTTP face of ``kvsnap serve``: Starlette routes over ``kvsnap.serve`` (which holds the logic).

A completion request is checked (key, JSON, model) and given its place in line (or a 503) before
anything is answered; ``JobResponse`` then waits for its turn, runs the request in the one worker
thread and answers it as JSON or as server-sent events. It also listens for the client leaving:
then the worker stops before the model's next step (one token), and the turn passes on only once
the worker is done, so two requests never touch the model at once. The worker never waits for the
client: its events go into the request's own queue (as long as the answer, which the context
bounds), and the turn passes on the moment the worker returns, however far behind the client's
reading is (``serve_conn`` disconnects a client that stops reading). Every error is OpenAI's error JSON; a
traceback goes to the server's stderr, never into a response.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvsnap import limits
from kvsnap.errors import ConfigError, KvsnapError
from kvsnap.serve import protocol as p
from kvsnap.serve.keys import ApiKeys
from kvsnap.serve.service import Cancelled, Completion, Service
from kvsnap.serve.turns import Ticket, Turns

MAX_BODY_BYTES = 32 << 20
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a proxy in front must not hold the stream back
]


class ServerState:
    """What the routes share: the service, the keys, the line, the worker thread, running requests."""

    def __init__(self, service: Service, keys: ApiKeys, turns: Turns, log: Callable[[str], None]):
        self.service = service
        self.keys = keys
        self.turns = turns
        self.log = log
        # One thread: even a request whose client left keeps the model until its worker returns.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsnap-serve")
        self.active: set[threading.Event] = set()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once a request came
        self.stopping = asyncio.Event()  # set on the loop when closing: wakes the requests in line

    def cancel_all(self) -> None:
        """Stop every accepted request before its next model step, and answer those still in line
        with a 503 (the server is shutting down). Safe from a signal handler."""
        self.closing = True
        for event in list(self.active):
            event.set()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)


def error_response(exc: p.ServeError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def as_serve_error(exc: BaseException, log: Callable[[str], None]) -> p.ServeError:
    """Any failure as the error a client is shown; what is not the client's doing is logged in full."""
    if isinstance(exc, p.ServeError):
        return exc
    if isinstance(exc, ConfigError):
        return p.bad(str(exc))
    if isinstance(exc, KvsnapError):
        log(f"error: {exc}")
        return p.ServeError(500, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    log("".join(traceback.format_exception(exc)).rstrip())
    return p.ServeError(500, "internal error while answering (the server's log has the details)")


class JobResponse:
    """An ASGI response that runs one accepted request when its turn comes."""

    def __init__(self, state: ServerState, req: p.CompletionRequest, namespace: str, ticket: Ticket):
        self.state, self.req, self.namespace, self.ticket = state, req, namespace, ticket
        self.rid = ("chatcmpl-" if req.kind == p.CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.scope: Any = None
        self._future: asyncio.Future[None] | None = None
        self._finished = False  # the worker's last event was handled

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scope = scope
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(kind: str, value: Any = None) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: nobody listens any more
                cancel.set()

        def work() -> None:
            try:
                done = self.state.service.complete(
                    self.req,
                    self.namespace,
                    on_ready=lambda: post("ready"),
                    on_text=lambda text: post("text", text),
                    on_tool_call=lambda index, call: post("tool_call", (index, call)),
                    cancelled=cancel.is_set,
                )
                post("done", done)
            except BaseException as exc:
                post("error", exc)

        self.state.loop = loop
        self.state.active.add(cancel)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, cancel, tg.cancel_scope)
                if not await self._turn():
                    # Still in line when the server stops: refused before any header goes out.
                    await error_response(_shutting_down())(self.scope, _no_receive, send)
                    tg.cancel_scope.cancel()
                    return
                self._future = loop.run_in_executor(self.state.executor, work)
                self._future.add_done_callback(lambda _: self.ticket.release())
                try:
                    await self._answer(events, send)
                except OSError:  # the client left while we wrote to it
                    cancel.set()
                finally:
                    tg.cancel_scope.cancel()
        finally:
            left = cancel.is_set() and not self._finished and not self.state.closing
            cancel.set()
            await self._settle()
            self.state.active.discard(cancel)
            if left:
                self.state.log(f"{self.req.kind}: stopped, the client left")

    async def _turn(self) -> bool:
        """Wait for this request's turn; False when the server began shutting down first."""
        if not self.state.closing:
            turn = asyncio.ensure_future(self.ticket.wait())
            stop = asyncio.ensure_future(self.state.stopping.wait())
            try:
                await asyncio.wait({turn, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                turn.cancel()
                stop.cancel()
        return not self.state.closing

    async def _settle(self) -> None:
        """Wait for the worker to return, then pass the turn on: called as soon as the worker's last
        event is in (so the next request starts while this one's last bytes go out) and at the end."""
        if self._future is not None:
            with anyio.CancelScope(shield=True):
                await asyncio.wait([self._future])
            self._finished = True
        self.ticket.release()

    async def _answer(self, events: asyncio.Queue[tuple[str, Any]], send: Any) -> None:
        req, kind = self.req, self.req.kind
        event, value = await events.get()
        if event == "ready" and not req.stream:
            while event not in ("done", "error"):
                event, value = await events.get()
        if event in ("done", "error"):
            await self._settle()
        if event == "error":  # before any byte went out: a plain error answer
            await self._fail(value, send)
            return
        if event == "done":
            await self._whole(value, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        usage = req.include_usage
        if kind == p.CHAT:
            await self._event(
                send, p.chunk(kind, self.rid, self.created, self._model, "", first=True, with_usage=usage)
            )
        while True:
            event, value = await events.get()
            if event == "text":
                await self._event(send, p.chunk(kind, self.rid, self.created, self._model, value, with_usage=usage))
            elif event == "tool_call":
                piece = p.chunk(kind, self.rid, self.created, self._model, None, with_usage=usage, tool_call=value)
                await self._event(send, piece)
            elif event == "done":
                await self._settle()
                c: Completion = value
                last = p.chunk(
                    kind, self.rid, self.created, self._model, None, finish=c.finish_reason, with_usage=usage
                )
                await self._event(send, last)
                if usage:
                    use = _usage(c)
                    await self._event(send, p.usage_chunk(kind, self.rid, self.created, self._model, use))
                self._log_done(c)
                break
            elif event == "error":
                await self._settle()
                err = self._stopped(value) if isinstance(value, Cancelled) else as_serve_error(value, self.state.log)
                if err is not None:
                    if not isinstance(value, Cancelled):
                        self.state.log(f"{kind} stream failed: {err.message}")
                    await self._event(send, err.body())  # headers are out: the error travels as an event
                break
        await send({"type": "http.response.body", "body": p.DONE, "more_body": False})

    @property
    def _model(self) -> str:
        return self.state.service.model_id

    async def _event(self, send: Any, data: dict[str, Any]) -> None:
        await send({"type": "http.response.body", "body": p.sse(data), "more_body": True})

    async def _whole(self, c: Completion, send: Any) -> None:
        body = p.response(
            self.req.kind, self.rid, self.created, self._model, c.text, c.finish_reason, _usage(c), c.tool_calls
        )
        body["kvsnap"] = {"prefill_tokens": c.prefill_tokens, "restored_from": c.restored_from, "ttft_s": c.ttft_s}
        self._log_done(c)
        await JSONResponse(body)(self.scope, _no_receive, send)

    async def _fail(self, exc: BaseException, send: Any) -> None:
        err = self._stopped(exc) if isinstance(exc, Cancelled) else as_serve_error(exc, self.state.log)
        if err is None:
            return
        if not isinstance(exc, Cancelled):
            self.state.log(f"{self.req.kind} {err.status}: {err.message}")
        await error_response(err)(self.scope, _no_receive, send)

    def _stopped(self, exc: Cancelled) -> p.ServeError | None:
        """Why a request was stopped: the server shuts down (the client hears it), or the client left."""
        return _shutting_down() if self.state.closing else None

    def _log_done(self, c: Completion) -> None:
        line = (
            f"{self.req.kind}: {c.prompt_tokens:,} prompt tokens ({c.cached_tokens:,} cached, "
            f"{c.prefill_tokens:,} prefilled), {c.completion_tokens:,} new ({c.finish_reason})"
        )
        if c.tool_calls:
            line += f", {len(c.tool_calls)} tool call(s)"
        if c.ttft_s is not None:
            line += f", ttft {c.ttft_s:.3f} s"
        self.state.log(line)
        if c.store_error:
            self.state.log(f"warning: {c.store_error}")


def _shutting_down() -> p.ServeError:
    return p.ServeError(503, "the server is shutting down", code="server_shutting_down")


def _usage(c: Completion) -> dict[str, Any]:
    return p.usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def _watch_disconnect(receive: Any, cancel: threading.Event, scope: anyio.CancelScope) -> None:
    """The body is read already: the next message is the client leaving (or the response ending)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except OSError:
        pass  # the connection is gone either way
    cancel.set()
    scope.cancel()


def body_limit(service: Service) -> int:
    """The largest body worth reading: ``MAX_BODY_BYTES``, or less where the context is small. JSON
    spends at most 6 bytes (``\\u0001``) on a byte of text, so no prompt that could fit is refused."""
    if service.text_limit is None:
        return MAX_BODY_BYTES
    return min(MAX_BODY_BYTES, 6 * service.text_limit + (1 << 20))


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused past ``limit`` bytes without reading the rest into memory."""
    too_big = p.ServeError(413, f"the request body is larger than {limits.size_text(limit)}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_big
            parts.append(part)
    except ClientDisconnect:
        raise p.ServeError(400, "the client left before its request body was read") from None
    return b"".join(parts)


def build_app(state: ServerState) -> Starlette:
    service, keys, turns = state.service, state.keys, state.turns

    max_body = body_limit(service)

    def namespace(request: Request) -> str:
        return keys.namespace_for(request.headers.get("authorization"))

    def accept(body: bytes, kind: str) -> p.CompletionRequest:
        req = p.parse_request(body, kind)
        service.check_model(req.model)
        service.check_size(req)
        return req

    async def completions(request: Request, kind: str) -> Any:
        ns = namespace(request)
        body = await read_body(request, max_body)
        # Off the event loop: the checks' work grows with the body (bounded, and mostly without the
        # GIL, but never while /health waits).
        req = await anyio.to_thread.run_sync(accept, body, kind)
        return JobResponse(state, req, ns, turns.reserve())

    async def chat(request: Request) -> Any:
        return await completions(request, p.CHAT)

    async def complete(request: Request) -> Any:
        return await completions(request, p.COMPLETION)

    async def models(request: Request) -> JSONResponse:
        namespace(request)
        return JSONResponse(p.model_list([service.model_id], int(service.started)))

    async def model(request: Request) -> JSONResponse:
        namespace(request)
        service.check_model(request.path_params["name"])
        return JSONResponse(p.model_card(service.model_id, int(service.started)))

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization")
        if keys.is_admin(auth, request.client.host if request.client else None):
            info = await anyio.to_thread.run_sync(service.stats, None)
            return JSONResponse({**info, "queue": turns.snapshot(), "view": "admin"})
        # A key's own figures only (Service.stats says why); the line is everyone's, so it is not shown.
        return JSONResponse({**service.stats(namespace(request)), "view": "key"})

    async def on_serve_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, p.ServeError)
        if exc.status >= 500 or exc.status == 413:
            state.log(f"{request.method} {request.url.path} {exc.status}: {exc.message}")
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        err = p.ServeError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_serve_error(exc, state.log))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/kvsnap/stats", stats, methods=["GET"]),
    ]
    handlers = {p.ServeError: on_serve_error, HTTPException: on_http_error, Exception: on_crash}
    return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
