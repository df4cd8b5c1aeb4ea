"""Connections of ``kvsnap serve`` that cannot outstay their welcome: uvicorn's h11 protocol with a
deadline for each request to arrive, a deadline for a client to take its answer, and a cap on open
connections.

uvicorn closes an idle keep-alive connection, but a connection that sends a header byte now and
then is never idle and never done: thousands of them hold a file descriptor each until the
process runs out, and then nobody, ``/health`` included, gets in. Here a client owes the server a
whole request from the moment it connects (or its last answer ends): the headers within
``HEADER_TIMEOUT_S``, then the body within ``BODY_TIMEOUT_S``, or the connection is closed. Once a
request is in, its answer is the server's business (the line of requests is bounded elsewhere),
but the client must keep taking it: once the answer's bytes fill the socket and the transport's
buffer, writing pauses, and a client that takes nothing for ``WRITE_TIMEOUT_S`` is disconnected
(aborted: a plain close would wait for the buffer to drain, which is what it never does). Its
request then stops as if it had left. The model's turn never waits on this: generation writes into
the request's own queue, and the turn passes on when generation ends.

At ``max_connections`` open connections, a new one closes the oldest connection that still owes
its request (a slow client, or an idle keep-alive one) to make room, so a client that asks at
once, as a health check does, always gets in. uvicorn's own ``limit_concurrency`` would answer
every request with a 503 at that point instead, ``/health`` included.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0  # an idle connection between requests (uvicorn's timer; the header deadline bounds it too)
BODY_TIMEOUT_S = 60.0  # a request body of 32 MiB at half a megabyte a second
WRITE_TIMEOUT_S = 30.0  # a client that takes none of its answer for this long is disconnected
# File descriptors kept for everything but client connections: the listening socket, the store's
# files and lock, the model's files, stdio.
RESERVED_FDS = 64
_OWING = (h11.IDLE, h11.SEND_BODY)  # the client's side of a request that has not fully arrived


def connection_cap(wanted: int) -> int:
    """``wanted`` open connections, raising the process's file limit to hold them where the hard
    limit allows; otherwise as many as the limit leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - RESERVED_FDS))


def guarded_protocol(
    max_connections: int,
    header_timeout: float = HEADER_TIMEOUT_S,
    body_timeout: float = BODY_TIMEOUT_S,
    write_timeout: float = WRITE_TIMEOUT_S,
    log: Callable[[str], None] | None = None,
) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with these bounds (pass it as ``uvicorn.Config(http=...)``);
    ``log`` hears of each client disconnected for not reading."""

    class GuardedProtocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.owed_since = time.monotonic()
            self.deadline: asyncio.TimerHandle | None = None
            self.deadline_phase: Any = None
            self.write_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.owed_since = time.monotonic()
            self.watch()
            # Connections being closed still count until the loop reports them lost: not here.
            if sum(not c.transport.is_closing() for c in self.connections) > max_connections:
                self.make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_watch()
            self.stop_write_watch()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.write_deadline is None:
                self.write_deadline = self.loop.call_later(write_timeout, self.write_expired)

        def resume_writing(self) -> None:
            super().resume_writing()
            self.stop_write_watch()

        def stop_write_watch(self) -> None:
            if self.write_deadline is not None:
                self.write_deadline.cancel()
                self.write_deadline = None

        def write_expired(self) -> None:
            self.write_deadline = None
            if self.flow.write_paused:  # closing or not: a close waits for the buffer to drain
                if log is not None:
                    who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                    log(f"{who} took none of its answer for {write_timeout:g} s: disconnected")
                self.transport.abort()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.owed_since = time.monotonic()
            self.stop_watch()
            self.watch()

        def owing(self) -> bool:
            return self.conn.their_state in _OWING and not self.transport.is_closing()

        def watch(self) -> None:
            """Arm the deadline of the request part the client owes now; none once it is all in."""
            if not self.owing():
                self.stop_watch()
                return
            phase = self.conn.their_state
            if self.deadline is not None and phase is self.deadline_phase:
                return
            self.stop_watch()
            timeout = header_timeout if phase is h11.IDLE else body_timeout
            self.deadline_phase = phase
            self.deadline = self.loop.call_later(timeout, self.expire)

        def stop_watch(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            self.deadline = None
            if self.owing():
                self.transport.close()  # the app, if it was reading a body, hears a disconnect

        def make_room(self) -> None:
            """Close the connection that has owed its request longest (this one, if no other owes)."""
            owing = [c for c in self.connections if isinstance(c, GuardedProtocol) and c is not self and c.owing()]
            victim = min(owing, key=lambda c: c.owed_since) if owing else self
            victim.transport.close()

    return GuardedProtocol
