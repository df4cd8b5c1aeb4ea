"""One chat turn over a ``Session``: messages in, the answer out, and nothing half kept.

The prompt is the ids the chat already ran (its earlier prompts and the answers as sampled) with the
new message appended as the template writes it after them (``kvsnap.conversation``): everything
computed is reused, however the template would render the earlier answers again. Where that rendering
would differ, ``explain`` says so (``TurnResult.rerender``) and the model still sees what it saw.

The answer joins the messages as soon as decoding ends; an error or Ctrl-C before that leaves the
conversation (messages, what is in view, and KV) as it was before the turn. A conversation that
outgrows the context drops its oldest turns from the model's view first (``chat_view``): the view is
then rendered again, and its turn ends start over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvsnap import conversation, prefix
from kvsnap.config import SamplingParams
from kvsnap.engine import explain
from kvsnap.engine.chat_template import continue_ids
from kvsnap.engine.chat_view import Fit, ViewHost, fit_turn
from kvsnap.engine.results import TurnResult
from kvsnap.engine.runner import Generation
from kvsnap.errors import StoreError
from kvsnap.types import chat_view, leading_system

if TYPE_CHECKING:
    from kvsnap.store import BlockStore


class ChatHost(ViewHost, Protocol):
    """What a chat turn uses of its session (``kvsnap.engine.session.Session``)."""

    store: BlockStore | None
    turn_ends: conversation.TurnEnds

    @property
    def all_tokens(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

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
    """Append the user message to the ids the chat ran (or render the view, after a drop), answer."""
    messages = list(session.messages or [])
    if not messages and system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_text})
    before_tokens, before_messages, before_dropped = list(session.tokens), session.messages, session.dropped_messages
    before_ends, before_pending = list(session.turn_ends), list(session.pending)
    view = fit_turn(session, messages, params.max_new_tokens)  # changes nothing: it only renders
    shown = chat_view(messages, view.dropped)
    ids = _appended(session, messages, view) or view.ids
    rerender = None
    if session.config.explain and ids != view.ids:
        decode = session.lm.tokenizer.decode
        kw = dict(
            block_size=session.config.block_size, reused=len(session.tokens), source="session", prompt_messages=shown
        )
        rerender = explain.explain(view.ids, ids, decode, **kw).as_dict()

    def keep(gen: Generation | None) -> None:
        # The answer joins the conversation as soon as it exists: an interrupt after this point (the
        # store write) cannot leave the KV holding an answer the messages lack.
        session.dropped_messages = view.dropped
        session.messages = [*messages, {"role": "assistant", "content": gen.text if gen is not None else ""}]
        session.turn_ends = [*session.turn_ends, (len(session.messages), session.num_tokens)]

    try:
        kw = dict(on_text=on_text, on_progress=on_progress, on_generated=keep, prompt_messages=shown)
        result = session.run(ids, params, **kw)
    except BaseException:
        if session.messages is before_messages:
            # No answer was kept (an error, or Ctrl-C before it): the conversation stays as it was
            # before this turn, and the KV holds nothing the messages do not.
            session.dropped_messages = before_dropped
            session.pending = []
            session.truncate(prefix.common_prefix_len(before_tokens, session.tokens))
            if session.tokens == before_tokens:  # the answer's last sampled token is still to be run
                session.pending = before_pending
            session.turn_ends = conversation.ends_within(before_ends, session.num_tokens)
        raise
    if view.dropped_turns or rerender is not None:
        result = dataclasses.replace(result, dropped_turns=view.dropped_turns, rerender=rerender)
    if session.store is not None and store_session is not None:
        try:
            session.store_session(store_session)
        except StoreError as exc:
            result = dataclasses.replace(result, store_error=result.store_error or f"block store not updated: {exc}")
    return result


def _appended(session: ChatHost, messages: list[dict[str, str]], view: Fit) -> list[int] | None:
    """The ids already run with the new message appended, when they are the conversation up to its last
    answer and the view keeps every turn they hold; None when the view must be rendered again."""
    history = messages[:-1]
    if view.dropped != session.dropped_messages or not history:
        return None
    if not conversation.continues(session.turn_ends, len(history), session.num_tokens):
        return None
    return continue_ids(session.lm, session.all_tokens, chat_view(history, view.dropped), messages[-1:])


def undo(session: ChatHost) -> bool:
    """Drop the last exchange (the last user message and what follows it); the KV is kept up to the end
    of the exchange before it, where the turn ends record it, without running the model. False when
    there is no exchange to drop."""
    messages = list(session.messages or [])
    cut = conversation.last_user(messages)
    if cut is None:
        return False
    kept = messages[:cut]
    dropped = min(session.dropped_messages, len(kept) - leading_system(kept))
    ends = [t for m, t in session.turn_ends if m == len(kept)]
    if ends:
        keep = ends[0]
    else:
        # No recorded end there (the conversation was rendered again since): keep what the rendering of
        # the remaining view shares with the tokens.
        view = chat_view(kept, dropped)
        keep = prefix.common_prefix_len(session.all_tokens, session.render_chat(view, False) if view else [])
    held = session.all_tokens
    session.truncate(min(keep, len(session.tokens)))
    session.pending = held[len(session.tokens) : keep]
    session.turn_ends = conversation.ends_within(session.turn_ends, keep)
    session.messages = kept or None
    session.dropped_messages = dropped
    return True
