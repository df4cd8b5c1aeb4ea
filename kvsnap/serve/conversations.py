"""The chat conversations a namespace ran, by message content, with the token ids the model saw.

A client sends the whole conversation with every request, the earlier answers as text. Rendered again,
an answer's text may tokenize otherwise than the tokens the model sampled, which would end reuse
there. So an incoming ``messages`` list is first matched by content against the conversations this
server ran: where one shares the first messages up to the end of one of its answers, its token ids
stand for those messages and only the rest is rendered, after them (``kvsnap.conversation``). No torch.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsnap import conversation

KEEP = 16  # conversations remembered per namespace (a few hundred bytes to a few hundred KB each)


def _key(message: dict[str, Any]) -> str:
    return json.dumps(message, sort_keys=True, default=str)


@dataclass(frozen=True, slots=True)
class Ran:
    """A conversation as run: its messages (the answer last) and ``token_ids`` (prompt + answer)."""

    keys: tuple[str, ...]
    token_ids: tuple[int, ...]
    turn_ends: tuple[tuple[int, int], ...]  # (messages, tokens) after each answer


@dataclass(frozen=True, slots=True)
class Match:
    """The longest run shared with a request: its first ``messages`` are the request's, as ``token_ids``."""

    messages: int
    token_ids: list[int]
    turn_ends: conversation.TurnEnds


class Conversations:
    """The last ``keep`` conversations one namespace ran, newest first."""

    def __init__(self, keep: int = KEEP):
        self._ran: collections.deque[Ran] = collections.deque(maxlen=keep)

    def match(self, messages: Sequence[dict[str, Any]]) -> Match | None:
        """The conversation that shares the most leading messages with ``messages``, up to the end of
        one of its answers (a user message must follow); None when none does."""
        keys = [_key(m) for m in messages]
        best: Match | None = None
        for ran in self._ran:
            common = 0
            while common < min(len(keys), len(ran.keys)) and keys[common] == ran.keys[common]:
                common += 1
            ends = [(m, t) for m, t in ran.turn_ends if m <= common and m < len(keys)]
            if ends and (best is None or ends[-1][0] > best.messages):
                m, t = ends[-1]
                best = Match(m, list(ran.token_ids[:t]), ends)
        return best

    def ran(
        self, messages: Sequence[dict[str, Any]], answer: str, token_ids: Sequence[int], earlier: conversation.TurnEnds
    ) -> None:
        """Remember ``messages`` answered by ``answer``, whose prompt and answer ran as ``token_ids``;
        ``earlier``: the turn ends its prompt kept from a match."""
        keys = (*(_key(m) for m in messages), _key({"role": "assistant", "content": answer}))
        ends = (*earlier, (len(keys), len(token_ids)))
        self._ran = collections.deque((r for r in self._ran if r.keys != keys[: len(r.keys)]), self._ran.maxlen)
        self._ran.appendleft(Ran(keys, tuple(token_ids), ends))
