"""One chat turn over a ``Session``: messages in, the answer out, and nothing half kept.

The answer joins the messages as soon as decoding ends; an error or Ctrl-C before that leaves the
conversation (messages and KV) as it was before the turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvsnap import prefix
from kvsnap.config import SamplingParams
from kvsnap.engine.results import TurnResult
from kvsnap.engine.runner import Generation
from kvsnap.errors import StoreError

if TYPE_CHECKING:
    from kvsnap.store import BlockStore


class ChatHost(Protocol):
    """What a chat turn uses of its session (``kvsnap.engine.session.Session``)."""

    messages: list[dict[str, str]] | None
    tokens: list[int]
    pending: list[int]
    store: BlockStore | None

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def run(self, prompt_ids: Sequence[int], params: SamplingParams, **kw: Any) -> TurnResult: ...

    def truncate(self, length: int) -> None: ...

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
    before_tokens, before_messages = list(session.tokens), session.messages

    def keep(gen: Generation | None) -> None:
        # The answer joins the conversation as soon as it exists: an interrupt after this point (the
        # store write) cannot leave the KV holding an answer the messages lack.
        session.messages = [*messages, {"role": "assistant", "content": gen.text if gen is not None else ""}]

    try:
        ids = session.render_chat(messages)
        kw = dict(on_text=on_text, on_progress=on_progress, on_generated=keep, prompt_messages=messages)
        result = session.run(ids, params, **kw)
    except BaseException:
        if session.messages is before_messages:
            # No answer was kept (an error, or Ctrl-C before it): the conversation stays as it was
            # before this turn, and the KV holds nothing the messages do not.
            session.pending = []
            session.truncate(prefix.common_prefix_len(before_tokens, session.tokens))
        raise
    if session.store is not None and store_session is not None:
        try:
            session.store_session(store_session)
        except StoreError as exc:
            result = dataclasses.replace(result, store_error=result.store_error or f"block store not updated: {exc}")
    return result
