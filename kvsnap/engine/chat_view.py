"""What a chat shows the model once its conversation outgrows the context.

The conversation keeps every message; the oldest turns (a user message and what follows it, up to the
next user message) leave the model's view, and the leading system messages never do, as in Ollama.
What stays in view is rendered again by the chat template and prefilled: the kept turns now sit at
other positions, so their KV is computed again, exactly, and only the system prompt's KV is reused
(as far as its tokens match). Re-rotating the kept keys instead (llama.cpp's context shift) would
skip that prefill, but the kept keys and values also carry what the dropped turns contributed
through attention: the KV would stand for tokens it was not computed from, and a save or the block
store would hand it to every later reuse of those tokens' chained hashes (benchmarks/context_shift.py
measures both ways).

A drop leaves the view at most half the context, as llama.cpp's context shift discards half: the next
turns append to the KV instead of paying for a prefill of the kept turns on every turn. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvsnap import limits, prefix
from kvsnap.errors import ContextFullError
from kvsnap.types import chat_view, leading_system

Render = Callable[[Sequence[dict[str, str]]], list[int]]


class ViewHost(Protocol):
    """What fitting a view uses of its session (``kvsnap.engine.session.Session``)."""

    lm: Any  # kvsnap.models.load.LoadedModel
    config: Any  # kvsnap.config.SessionConfig
    messages: list[dict[str, str]] | None
    dropped_messages: int
    tokens: list[int]
    pending: list[int]

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...

    def truncate(self, length: int) -> None: ...


def context_of(lm) -> tuple[int, str]:
    """The most tokens a session of ``lm`` holds, and what sets it (the model, or ``--ctx-size``)."""
    return limits.token_limit(lm.max_positions, lm.context_source)


def answer_room(context: int, max_new_tokens: int) -> int:
    """Positions a turn keeps free for its answer: the whole answer when it is short, else a quarter of the
    context (an answer longer than that stops at the context, ``stop_reason`` "context")."""
    return max(1, min(max_new_tokens, context // 4))


@dataclass(frozen=True, slots=True)
class Fit:
    """A view of the conversation that fits the context."""

    dropped: int  # messages out of view, after the leading system messages
    ids: list[int]  # the view, rendered
    dropped_turns: int = 0  # turns this fit took out of view


def fit(
    render: Render,
    messages: Sequence[dict[str, str]],
    dropped: int,
    context: int,
    room: int,
    *,
    keep_last: bool = True,
) -> Fit:
    """The view of ``messages`` (``dropped`` of them out of view already) to show the model: as it is when
    its rendering and ``room`` fit ``context``, else with the fewest more turns dropped that bring it to
    half the context. ``keep_last``: the last turn stays in view (it holds the message being answered).
    Where even that is too long, the view keeps only it; the caller decides whether that fits."""
    lead = leading_system(messages)
    start = lead + dropped
    # Where the view may start: where it starts now, then at each later turn.
    cuts = [start, *(i for i in range(start + 1, len(messages)) if messages[i]["role"] == "user")]
    if not keep_last:
        cuts.append(len(messages))
    rendered: dict[int, list[int]] = {}

    def ids(k: int) -> list[int]:
        if k not in rendered:
            view = [*messages[:lead], *messages[cuts[k] :]]
            rendered[k] = render(view) if view else []  # every turn out of view and no system message
        return rendered[k]

    if len(ids(0)) + room <= context or len(cuts) == 1:
        return Fit(dropped, ids(0))
    target = min(context // 2, context - room)
    lo, hi = 1, len(cuts) - 1  # the first cut whose view is within the target (views shrink as cuts move on)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(ids(mid)) <= target:
            hi = mid
        else:
            lo = mid + 1
    turns = sum(1 for m in messages[start : cuts[lo]] if m["role"] == "user")
    return Fit(cuts[lo] - lead, ids(lo), turns)


def fit_turn(session: ViewHost, messages: Sequence[dict[str, str]], max_new_tokens: int) -> Fit:
    """The view for a chat turn whose last message is the new user message, by ``on_context_full``;
    ``ContextFullError`` (nothing changed) when the turn cannot be answered within the context."""
    context, what = context_of(session.lm)
    room = answer_room(context, max_new_tokens)
    if session.config.on_context_full == "drop_oldest":
        view = fit(session.render_chat, messages, session.dropped_messages, context, room)
    else:
        view = Fit(session.dropped_messages, session.render_chat(chat_view(messages, session.dropped_messages)))
        if len(view.ids) + room > context:
            raise ContextFullError(
                f"the conversation is {len(view.ids):,} tokens: with room for a {room:,}-token answer it is more "
                f"than {what} ({context:,}); on_context_full='drop_oldest' drops its oldest turns from view"
            )
    if len(view.ids) >= context:
        raise ContextFullError(
            f"the prompt is {len(view.ids):,} tokens with only this message in view, more than {what} "
            f"({context:,}) holds with room for an answer"
        )
    return view


@dataclass(frozen=True, slots=True)
class Refit:
    """What fitting a restored session into the context did."""

    held_tokens: int  # tokens the session held before
    kept_tokens: int  # of them, the KV kept (the rest is computed again by the next turn, if it needs it)
    dropped_turns: int  # turns that left the model's view


def fit_held(session: ViewHost, max_new_tokens: int) -> Refit | None:
    """Fit what a session just restored into its context, as a chat turn would: the oldest turns leave the
    view (the messages keep them) and the KV past what the new view shares with it goes; without chat
    messages, only the tokens that fit are kept. None when it fits as it is."""
    context, _ = context_of(session.lm)
    room = answer_room(context, max_new_tokens)
    held = len(session.tokens)
    dropped_turns = 0
    if session.messages:

        def render(messages: Sequence[dict[str, str]]) -> list[int]:
            return session.render_chat(messages, add_generation_prompt=False)

        view = fit(render, session.messages, session.dropped_messages, context, room, keep_last=False)
        if not view.dropped_turns:
            return None
        keep = prefix.common_prefix_len(session.tokens, view.ids)
        session.dropped_messages, dropped_turns = view.dropped, view.dropped_turns
    elif held + room > context:
        keep = max(0, context - room)
    else:
        return None
    session.pending = []
    session.truncate(keep)
    return Refit(held, len(session.tokens), dropped_turns)
