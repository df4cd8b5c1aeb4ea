"""A session's ``.kv`` save in a background thread, so a chat's prompt comes back before the file is written.

How it stays consistent: **while a save is in flight, nothing changes the session.** The thread runs
the ordinary ``Session.save`` on the session as it is: the blocks not yet encoded are read from the
cache and compressed, and the file is written to a temp file and renamed over the old one (a failed
save leaves the previous file as it was). Whoever owns the session calls ``wait`` before anything that
changes it: the next turn (it may crop the cache and write over positions the save is still reading,
and it replaces the tokens, the messages and the encoded-block memo the save updates), a reset, another
save, a store write, and before exiting. That is the simple choice: copying the state out first would
let the next turn overlap the save too, but needs a second save path and care with the memo of encoded
blocks; in a chat the save runs while the user reads the answer and types, so the wait almost never shows.

The thread never runs the model, and neither does ``start``: tokens sampled but not yet run through it
(``Session.pending``, the answer's last token) stay out of the file. Running them first would put a
forward pass over the whole history back in front of the prompt,
and the next turn runs them anyway, as does a resumed chat (it re-renders the messages, which hold the
whole answer, and prefills what the file lacks). The thread does not take Ctrl-C either (SIGINT is
blocked in it, so the signal goes to the caller's thread). No printing here.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvsnap.format.save_target import FileStamp, Held

if TYPE_CHECKING:
    from kvsnap.engine.results import SaveStats
    from kvsnap.engine.session import Session

# How often a waiting caller wakes up: a signal (Ctrl-C) handled by another thread only runs the
# caller's Python handler when the caller's thread next runs Python code.
_WAKE_S = 0.05


@dataclass(frozen=True)
class Saved:
    """What a finished save wrote: its stats, what the file holds, and the file's identity right after the
    rename (taken in the thread, so a program that writes the file later is not mistaken for this save)."""

    stats: SaveStats
    held: Held
    stamp: FileStamp | None
    seconds: float  # the thread's time, start to end


class BackgroundSave:
    """One save running in its own thread; ``wait`` returns what it wrote or raises its error."""

    def __init__(self, session: Session, path: str | Path):
        self.path = Path(path)
        self._session = session
        self._held = Held.of(session.tokens, session.messages)  # what the file will hold (no pending tokens)
        self._result: Saved | None = None
        self._error: BaseException | None = None
        self._started = time.perf_counter()
        # Not a daemon: an interpreter that exits (even on an error) first lets the file be written whole.
        self._thread = threading.Thread(target=self._run, name=f"kvsnap-save {self.path.name}")
        self._thread.start()

    def _run(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # Ctrl-C belongs to the caller's thread
        try:
            stats = self._session.save(self.path, flush=False)
            stamp = FileStamp.of(self.path)
            self._result = Saved(stats, self._held, stamp, time.perf_counter() - self._started)
        except BaseException as exc:  # handed to the caller by wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the file to be written; returns whether it is done."""
        self._thread.join(timeout)
        return self.done()

    def wait(self) -> Saved:
        """Block until the file is written; returns what was saved, or raises the save's error."""
        while self._thread.is_alive():
            self._thread.join(_WAKE_S)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class BackgroundSaver:
    """At most one background save of ``session`` at a time.

    ``start`` begins a save; until ``wait`` has returned (or raised), the session must not change (see
    the module docstring). ``wait`` hands each save's result or error over exactly once.
    """

    def __init__(self, session: Session):
        self.session = session
        self._current: BackgroundSave | None = None

    @property
    def in_flight(self) -> bool:
        """A save was started and its result not yet collected (it may have finished)."""
        return self._current is not None

    def done(self) -> bool:
        """A save was started, has finished, and waits to be collected: ``wait`` will not block."""
        return self._current is not None and self._current.done()

    def finished_within(self, timeout: float) -> bool:
        """Whether the save in flight is done, waiting at most ``timeout`` seconds for it (False: none)."""
        return self._current is not None and self._current.join(timeout)

    def start(self, path: str | Path) -> BackgroundSave:
        if self._current is not None:
            raise RuntimeError("a save is in flight: wait() for it first")
        self._current = BackgroundSave(self.session, path)
        return self._current

    def wait(self) -> Saved | None:
        """Wait for the save in flight (None when there is none); raises its error. Either way it is
        collected: the next ``wait`` returns None until another save starts."""
        current, self._current = self._current, None
        if current is None:
            return None
        try:
            return current.wait()
        except BaseException:
            if not current.done():  # interrupted while waiting: the save is still ours to collect
                self._current = current
            raise
