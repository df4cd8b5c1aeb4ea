"""What the chat reads: one message per line, slash commands, escapes, and multi-line blocks.

- A line starting with ``/`` is a command; ``//text`` sends ``/text`` as a message, and ``/say TEXT``
  sends TEXT as it is (for messages that start with a slash).
- In a terminal, a line holding only ``\"\"\"`` starts a multi-line message that ends at the next such
  line (a pasted block is one message). When stdin is not a terminal every line is one message,
  so scripts stay simple.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

FENCE = '"""'


@dataclass(frozen=True, slots=True)
class Message:
    text: str


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # "/save", "/save!", ...
    arg: str


def parse(line: str) -> Message | Command | None:
    """One input line as a message, a command, or nothing (blank)."""
    text = line.strip()
    if not text:
        return None
    if text.startswith("//"):
        return Message(text[1:])
    if text.startswith("/"):
        name, _, arg = text.partition(" ")
        if name == "/say":
            return Message(arg.strip()) if arg.strip() else None
        return Command(name, arg.strip())
    return Message(text)


def read_entry(read_line: Callable[[str], str], interactive: bool) -> Message | Command | None:
    """The next message or command (None for a blank line); EOFError at the end of input.

    A fenced block (terminal only) is read whole and sent as one message, even if it starts with ``/``.
    """
    line = read_line(">>> " if interactive else "")
    if interactive and line.strip() == FENCE:
        lines = []
        while True:
            more = read_line("... ")
            if more.strip() == FENCE:
                break
            lines.append(more)
        text = "\n".join(lines).strip("\n")
        return Message(text) if text.strip() else None
    return parse(line)


class InterruptGate:
    """Ctrl-C during a turn stops the answer once; a second Ctrl-C is held until the turn is recorded
    and its autosave started, and Ctrl-C during a wait for that save (``holding``) is held until it is done.

    Without it a second Ctrl-C, pressed while the interrupted answer is being recorded and autosaved,
    ended the chat (exit 130) with the turn on screen but not saved.
    """

    def __init__(self) -> None:
        self.armed = False
        self.held = False

    def _handler(self, signum: int, frame: object) -> None:
        if self.armed:
            self.armed = False  # the first Ctrl-C stops the answer; later ones wait for the save
            raise KeyboardInterrupt
        self.held = True

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Around a turn and its autosave: the first Ctrl-C interrupts, later ones are held."""
        with self._installed(armed=True):
            yield

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Around a wait for a save in flight: every Ctrl-C is held (``held`` says whether one came)."""
        with self._installed(armed=False):
            yield

    @contextmanager
    def _installed(self, armed: bool) -> Iterator[None]:
        self.armed, self.held = armed, False
        try:
            previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: signals cannot be handled here
            yield
            return
        try:
            yield
        finally:
            self.armed = False
            signal.signal(signal.SIGINT, previous)

    def stop_interrupting(self) -> None:
        """From now on in this turn, Ctrl-C is held (the answer is done; only saving is left)."""
        self.armed = False
