"""One chat turn over a ``Session``: messages in, the answer out, and nothing half kept.

The answer joins the messages as soon as decoding ends; an error or Ctrl-C before that leaves the
conversation (messages, what is in view, and KV) as it was before the turn. A conversation that
outgrows the context drops its oldest turns from the model's view first (``chat_view``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvsnap import prefix
from kvsnap.config import SamplingParams
from kvsnap.engine.chat_view import ViewHost, fit_turn
from kvsnap.engine.results import TurnResult
from kvsnap.engine.runner import Generation
from kvsnap.errors import StoreError
from kvsnap.types import chat_view

if TYPE_CHECKING:
    from kvsnap.store import BlockStore


class ChatHost(ViewHost, Protocol):
    """What a chat turn uses of its session (``kvsnap.engine.session.Session``)."""

    store: BlockStore | None

    def run(self, prompt_ids: Sequence[int], params: SamplingParams, **kw: Any) -> TurnResult: ...

    def store_session(self, name: str) -> int: ...


def chat_turn(
    session: ChatHost,
    user_text: str,
    params: SamplingParams,
    *,
    system: str | None = None,
    on_text: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    store_session: str | None = None,
) -> TurnResult:
    """Append the user message, render it with the chat template, reuse what matches, answer."""
    messages = list(session.messages or [])
    if not messages and system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_text})
    before_tokens, before_messages, before_dropped = list(session.tokens), session.messages, session.dropped_messages
    view = fit_turn(session, messages, params.max_new_tokens)  # changes nothing: it only renders
    shown = chat_view(messages, view.dropped)

    def keep(gen: Generation | None) -> None:
        # The answer joins the conversation as soon as it exists: an interrupt after this point (the
        # store write) cannot leave the KV holding an answer the messages lack.
        session.dropped_messages = view.dropped
        session.messages = [*messages, {"role": "assistant", "content": gen.text if gen is not None else ""}]

    try:
        kw = dict(on_text=on_text, on_progress=on_progress, on_generated=keep, prompt_messages=shown)
        result = session.run(view.ids, params, **kw)
    except BaseException:
        if session.messages is before_messages:
            # No answer was kept (an error, or Ctrl-C before it): the conversation stays as it was
            # before this turn, and the KV holds nothing the messages do not.
            session.dropped_messages = before_dropped
            session.pending = []
            session.truncate(prefix.common_prefix_len(before_tokens, session.tokens))
        raise
    if view.dropped_turns:
        result = dataclasses.replace(result, dropped_turns=view.dropped_turns)
    if session.store is not None and store_session is not None:
        try:
            session.store_session(store_session)
        except StoreError as exc:
            result = dataclasses.replace(result, store_error=result.store_error or f"block store not updated: {exc}")
    return result
