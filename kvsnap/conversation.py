"""A chat's token ids as the model ran them, and where each exchange ends in them.

A chat keeps the ids it ran (the prompt it rendered, then the answer it sampled) and appends the next
message to them, instead of rendering the whole conversation again: a template renders an earlier
answer as text, and that text may tokenize otherwise than the tokens sampled, which would end reuse
there. Two records make this survive a save: ``TURN_ENDS`` (after each exchange, how many messages and
how many tokens the conversation held) and ``PENDING_IDS`` (the answer's sampled tokens the model has
not run yet, which a save leaves out of the KV). Both sit in a file's or store session's ``extra``. A
value that does not fit is ignored: the chat then renders the conversation again, as a chat without
them does. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TURN_ENDS = "turn_ends"
PENDING_IDS = "pending_ids"

TurnEnds = list[tuple[int, int]]  # (messages, tokens) after each exchange, in order


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def read(extra: dict[str, Any], num_messages: int, num_tokens: int) -> tuple[TurnEnds, list[int]]:
    """The turn ends and pending ids ``extra`` records for a conversation of ``num_messages`` messages
    whose KV holds ``num_tokens`` tokens; empty when absent or when they do not fit."""
    raw_ends, raw_pending = extra.get(TURN_ENDS, []), extra.get(PENDING_IDS, [])
    if not isinstance(raw_ends, list) or not isinstance(raw_pending, list):
        return [], []
    if not all(_is_count(t) for t in raw_pending):
        return [], []
    ends: TurnEnds = []
    for item in raw_ends:
        if not (isinstance(item, list) and len(item) == 2 and all(_is_count(x) for x in item)):
            return [], []
        m, t = item
        if ends and (m <= ends[-1][0] or t <= ends[-1][1]):
            return [], []
        ends.append((m, t))
    if ends and (ends[-1][0] > num_messages or ends[-1][1] > num_tokens + len(raw_pending)):
        return [], []
    return ends, list(raw_pending)


def record(turn_ends: TurnEnds, pending: Sequence[int]) -> dict[str, Any]:
    """What a file or store session records of them (nothing when there is nothing to record)."""
    out: dict[str, Any] = {}
    if turn_ends:
        out[TURN_ENDS] = [[m, t] for m, t in turn_ends]
    if pending:
        out[PENDING_IDS] = list(pending)
    return out


def ends_within(turn_ends: TurnEnds, num_tokens: int) -> TurnEnds:
    """The turn ends that still hold once only the first ``num_tokens`` tokens are kept."""
    return [(m, t) for m, t in turn_ends if t <= num_tokens]


def continues(turn_ends: TurnEnds, num_messages: int, num_tokens: int) -> bool:
    """Whether the ids held (``num_tokens``, pending included) are the conversation as run up to its last
    answer (``num_messages`` messages): then the next message is appended to them."""
    return bool(turn_ends) and turn_ends[-1] == (num_messages, num_tokens)


def last_user(messages: Sequence[dict[str, str]]) -> int | None:
    """Index of the last user message; None when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


def exchanges(messages: Sequence[dict[str, str]]) -> list[tuple[int, str, str]]:
    """Each exchange as (number from 1, the user message, the answer): for ``/history``."""
    out: list[tuple[int, str, str]] = []
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            follows = messages[i + 1] if i + 1 < len(messages) else None
            answer = follows["content"] if follows is not None and follows["role"] == "assistant" else ""
            out.append((len(out) + 1, m["content"], answer))
    return out
