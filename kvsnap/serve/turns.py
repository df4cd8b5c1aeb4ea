"""Requests take turns at the one model, in arrival order, with a bounded wait. No torch, no HTTP.

``Turns.reserve`` is synchronous, so the place in line is taken (or a 503 raised) the moment a
request is accepted, before the server answers anything; ``Ticket.wait`` then waits for that place
and ``Ticket.release`` gives the turn to the next ticket, whether the request finished, failed, or
its client went away while it waited. Everything runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from typing import Any

from kvsnap.serve.protocol import ServeError

RETRY_AFTER_MAX_S = 60


class Ticket:
    """One request's place in line."""

    def __init__(self, turns: Turns):
        self._turns = turns
        self._granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._done = False
        self.started: float | None = None

    async def wait(self) -> None:
        """Until it is this ticket's turn (cancellable: a cancelled wait still needs ``release``)."""
        await asyncio.shield(self._granted)

    def release(self) -> None:
        """Leave the line, or end the turn; idempotent."""
        if not self._done:
            self._done = True
            self._turns._leave(self)

    def _grant(self) -> None:
        self.started = time.monotonic()
        if not self._granted.done():
            self._granted.set_result(None)


class Turns:
    """One running request and at most ``max_waiting`` waiting ones, served first come, first served."""

    def __init__(self, max_waiting: int):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: Ticket | None = None
        self._average_s = 1.0  # recent seconds per request, for Retry-After

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def reserve(self) -> Ticket:
        """A place in line, or a 503 (with ``Retry-After``) when the line is full."""
        if self._running is not None and len(self._waiting) >= self.max_waiting:
            raise ServeError(
                503,
                f"the server is busy ({len(self._waiting)} request(s) waiting behind the running one); retry later",
                code="server_busy",
                headers={"Retry-After": str(self.retry_after())},
            )
        ticket = Ticket(self)
        if self._running is None:
            self._running = ticket
            ticket._grant()
        else:
            self._waiting.append(ticket)
        return ticket

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the recent time per request times the line ahead."""
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(self._average_s * (len(self._waiting) + 1))))

    def snapshot(self) -> dict[str, Any]:
        return {"running": self.busy, "waiting": self.waiting, "max_waiting": self.max_waiting}

    def _leave(self, ticket: Ticket) -> None:
        if ticket is self._running:
            if ticket.started is not None:
                self._average_s = 0.7 * self._average_s + 0.3 * (time.monotonic() - ticket.started)
            self._running = None
            if self._waiting:
                self._running = self._waiting.popleft()
                self._running._grant()
        else:
            with contextlib.suppress(ValueError):  # released twice, or never queued
                self._waiting.remove(ticket)
