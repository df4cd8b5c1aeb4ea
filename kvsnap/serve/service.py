"""What ``kvsnap serve`` does for one request, without HTTP: render, reuse, prefill, stream, store.

A ``Service`` owns the loaded model, the block store and one ``Session`` per namespace (one per
API key, or just one). A session is never reset between requests: ``Session.run`` reuses the
prefix it shares with what the session last held (the previous turn of a chat stays hot) or, if
the store holds more, restores that (a restart, another conversation), prefills only the rest in
chunks, and adds the new full blocks to the store. ``complete`` is blocking and not reentrant:
the caller runs one request at a time (``kvsnap.serve.turns``) in a worker thread.

No torch at import: ``Session`` is imported when the first session is made.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsnap import limits
from kvsnap.config import CHAT_SAMPLING, SamplingParams, SessionConfig
from kvsnap.errors import ConfigError, ContextFullError, KvsnapError
from kvsnap.models.plain_tokenizer import longest_token_bytes
from kvsnap.serve.conversations import Conversations, Match
from kvsnap.serve.protocol import CHAT, FINISH_REASONS, CompletionRequest, ServeError, bad
from kvsnap.serve.tools import ToolCall, ToolStream, forced_text, template_style

if TYPE_CHECKING:
    from kvsnap.engine.session import Session
    from kvsnap.models.load import LoadedModel
    from kvsnap.store import BlockStore

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat answers default to CHAT_SAMPLING's
HOT_SESSIONS = 4  # namespaces whose last conversation stays in memory; older ones come back from the store


class Cancelled(Exception):
    """The client went away: raised from the streaming callback to stop the generation."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One answered request: the text and the reuse ledger of its prompt."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (hot session or store), not computed
    prefill_tokens: int  # prompt tokens the model's forward really saw
    restored_from: str | None  # "store" when the prefix came from the block store
    ttft_s: float | None
    total_s: float
    store_error: str | None
    tool_calls: tuple[ToolCall, ...] = ()  # the calls read from the answer; ``text`` is what lies outside them


@dataclass
class Ledger:
    """Totals since the server started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    completion_tokens: int = 0
    cancelled: int = 0
    failed: int = 0

    def add(self, c: Completion) -> None:
        self.requests += 1
        self.prompt_tokens += c.prompt_tokens
        self.cached_tokens += c.cached_tokens
        self.prefill_tokens += c.prefill_tokens
        self.completion_tokens += c.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        out["reuse_ratio"] = round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0
        return out


def model_id_of(spec: str) -> str:
    """The name a client uses for the model: a folder's or a .gguf file's name, else the spec itself."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return spec


class Service:
    """One model, its block store (or none) and a hot session per namespace."""

    def __init__(
        self,
        lm: LoadedModel,
        config: SessionConfig,
        store: BlockStore | None = None,
        *,
        model_id: str | None = None,
        aliases: tuple[str, ...] = (),
        hot_sessions: int = HOT_SESSIONS,
    ):
        self.lm = lm
        self.config = config.check(with_store=store is not None)
        self.store = store
        self.model_id = model_id or model_id_of(lm.name)
        # What a client may name the model: its id, the --model spec, "default", and any alias.
        self.names = {self.model_id, lm.name, "default", *aliases}
        self.hot_sessions = max(1, hot_sessions)
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._ledgers: dict[str, Ledger] = collections.defaultdict(Ledger)
        self._conversations: dict[str, Conversations] = collections.defaultdict(Conversations)
        self.started = time.time()
        # Tokenizing is the one step whose work grows with what a client sends before anything is
        # checked: a text longer than the context times the longest token cannot fit, so it is
        # refused by its length alone (None: the tokenizer gives no bound).
        self.context, self.context_what = limits.token_limit(lm.max_positions, lm.context_source)
        per_token = longest_token_bytes(lm.tokenizer)
        self.text_limit = self.context * per_token if per_token else None

    # -- checks a request passes before it waits for its turn -------------------------------------

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (no model named: the served one)."""
        if name is not None and name not in self.names:
            raise ServeError(
                404,
                f"the model {name!r} is not served here (this server serves {self.model_id!r})",
                param="model",
                code="model_not_found",
            )

    def sampling(self, req: CompletionRequest, prompt_tokens: int) -> SamplingParams:
        """The request's sampling settings; an unset one takes the model's recommendation (its
        generation_config.json), else ``CHAT_SAMPLING``'s. ``max_tokens`` is capped at the context left."""
        base, recommended = CHAT_SAMPLING, self.lm.sampling_defaults
        chosen: dict[str, Any] = {}
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(req, key)
            chosen[key] = value if value is not None else recommended.get(key, getattr(base, key))
        wanted = req.max_tokens
        if wanted is None:
            wanted = base.max_new_tokens if req.kind == CHAT else COMPLETION_MAX_TOKENS
        # Generation stops at the context anyway ("length"); the cap keeps a huge max_tokens valid.
        wanted = min(wanted, max(0, self.context - prompt_tokens))
        try:
            return SamplingParams(max_new_tokens=wanted, seed=req.seed, stop=req.stop, **chosen)
        except ConfigError as exc:
            raise bad(str(exc)) from None

    def check_size(self, req: CompletionRequest) -> None:
        """400 (``context_length_exceeded``) for a prompt whose text alone cannot fit the context;
        costs a pass over the text's characters, nothing that grows with the tokenizer's work."""
        if self.text_limit is None:
            return
        texts = [m["content"] for m in req.messages or ()] if req.kind == CHAT else [req.prompt or ""]
        # Tool schemas and past calls are rendered too; their JSON is at least as long as their text.
        calls = [m["tool_calls"] for m in req.messages or () if m.get("tool_calls")]
        texts += [json.dumps(part, ensure_ascii=False) for part in (req.tools, *calls) if part]
        chars = sum(map(len, texts))
        if chars * 4 <= self.text_limit:  # UTF-8 spends at most 4 bytes on a character
            return
        size = chars if chars > self.text_limit else sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > self.text_limit:
            raise bad(
                f"the prompt is {size:,} bytes of text, more than {self.context_what} ({self.context:,} tokens) "
                f"can hold ({self.text_limit:,} bytes at most)",
                req.param,
                code="context_length_exceeded",
            )

    # -- one request ------------------------------------------------------------------------------

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        """The prompt's token ids: chat messages through the model's chat template, a completion
        prompt the tokenizer's own way; 400 when they cannot be rendered or do not fit the context."""
        from kvsnap.engine.chat_template import render_chat

        self.check_size(req)
        style = self.tool_style(req)
        try:
            if req.kind == CHAT:
                ids = render_chat(self.lm, list(req.messages or ()), tools=req.tools or None, fit_chars=self.text_limit)
                if (
                    style is not None
                    and req.tool_choice is not None
                    and (forced := forced_text(style, req.tool_choice))
                ):
                    ids += self.lm.tokenizer(forced, add_special_tokens=False)["input_ids"]
            else:
                ids = list(self.lm.tokenizer(req.prompt)["input_ids"])
        except ContextFullError as exc:
            raise bad(str(exc), req.param, code="context_length_exceeded") from None
        except KvsnapError as exc:
            raise bad(str(exc), req.param) from None
        except Exception as exc:  # a chat template is a program: it may refuse a conversation in any way
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise bad(f"the model's chat template cannot render these messages: {first}", req.param) from None
        if not ids:
            raise bad("the prompt is empty", req.param)
        limit, what = self.context, self.context_what
        if len(ids) > limit:
            raise bad(
                f"the prompt is {len(ids):,} tokens, more than {what} ({limit:,})",
                req.param,
                code="context_length_exceeded",
            )
        return ids

    def tool_style(self, req: CompletionRequest) -> str | None:
        """How the model writes tool calls (``kvsnap.serve.tools.STYLES``), None for a request
        without tools; a 400 when the model's chat template shows a model no tools."""
        if not req.tools:
            return None
        style = template_style(getattr(self.lm.tokenizer, "chat_template", None))
        if style is None:
            raise bad(
                f"the chat template of {self.model_id} does not support tools (it never reads them): "
                "send the request without tools, or serve a model whose template takes tools",
                "tools",
                code="tools_not_supported",
            )
        return style

    def complete(
        self,
        req: CompletionRequest,
        namespace: str = "",
        *,
        on_ready: Callable[[], None] | None = None,
        on_text: Callable[[str], None] | None = None,
        on_tool_call: Callable[[int, ToolCall], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Completion:
        """Answer ``req`` in ``namespace``'s session. ``on_ready`` is called once the prompt is accepted
        (rendered, within the context), before any model work; ``on_text`` with each piece of the answer,
        and, for a request with tools, ``on_tool_call`` with each call read from it (its index, the call).
        When ``cancelled()`` turns true the work stops before the model's next forward (a prefill chunk
        or a decode step) and ``Cancelled`` is raised; the session keeps the KV of the tokens it holds."""
        self.check_model(req.model)
        ledger = self._ledgers[namespace]
        try:
            ids = self.prompt_ids(req)
            params = self.sampling(req, len(ids))
            style = self.tool_style(req)
        except ServeError:
            ledger.failed += 1
            raise
        match = self._conversations[namespace].match(req.messages) if req.kind == CHAT and req.messages else None
        ids = self._continued(match, req, ids) if match is not None else ids
        session = self.session(namespace)
        if cancelled is not None and cancelled():
            # Stopped while it waited (the client left, the server shuts down): nothing was answered yet.
            ledger.cancelled += 1
            raise Cancelled()
        if on_ready is not None:
            on_ready()

        def check() -> None:
            if cancelled is not None and cancelled():
                raise Cancelled()

        calls: list[ToolCall] = []
        content: list[str] = []

        def give(pieces: list[str | ToolCall]) -> None:
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    calls.append(piece)
                    if on_tool_call is not None:
                        on_tool_call(len(calls) - 1, piece)
                else:
                    content.append(piece)
                    if on_text is not None:
                        on_text(piece)

        reader = None
        if style is not None and req.tool_choice is not None and req.tool_choice.parses:
            reader = ToolStream(style, [t["function"]["name"] for t in req.tools])
            reader.prime(forced_text(style, req.tool_choice))  # the answer's start, written into the prompt

        def text(piece: str) -> None:
            check()
            give(reader.push(piece) if reader is not None else [piece])

        # Every prefill chunk and decode step passes through the model's forward: checked there, a
        # cancel takes effect within one step even while the answer's text is held back (a partial
        # character, a possible stop string). Raised before the forward runs, so no KV is half written.
        hook = self.lm.model.register_forward_pre_hook(lambda module, args: check())
        try:
            result = session.run(ids, params, on_text=text)
        except Cancelled:
            ledger.cancelled += 1
            self._keep_prompt(session)
            raise
        except BaseException:
            ledger.failed += 1
            raise
        finally:
            hook.remove()
        if reader is not None:
            give(reader.finish())
        completion = Completion(
            text="".join(content) if reader is not None else result.text,
            finish_reason="tool_calls" if calls else FINISH_REASONS.get(result.stop_reason, "stop"),
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.new_tokens,
            cached_tokens=result.hit_tokens,
            prefill_tokens=result.prefill_tokens,
            restored_from=result.restored_from,
            ttft_s=result.ttft_s,
            total_s=result.total_s,
            store_error=result.store_error,
            tool_calls=tuple(calls),
        )
        ledger.add(completion)
        if req.kind == CHAT and req.messages:
            earlier = match.turn_ends if match is not None and ids[: len(match.token_ids)] == match.token_ids else []
            self._conversations[namespace].ran(req.messages, result.text, session.all_tokens, earlier)
        return completion

    def _continued(self, match: Match, req: CompletionRequest, rendered: list[int]) -> list[int]:
        """The prompt as the ids a matching conversation ran for its first messages, the rest rendered
        after them; ``rendered`` (the whole conversation rendered) when that cannot be done or fit."""
        from kvsnap.engine.chat_template import continue_ids

        messages = list(req.messages or ())
        try:
            ids = continue_ids(self.lm, match.token_ids, messages[: match.messages], messages[match.messages :])
        except Exception:  # a chat template is a program; the whole rendering above already succeeded
            return rendered
        return ids if ids is not None and len(ids) <= self.context else rendered

    def session(self, namespace: str) -> Session:
        """``namespace``'s session, made on first use; past ``hot_sessions`` the least recently used
        one is dropped (its blocks are in the store, so it comes back at a restore's cost)."""
        session = self._sessions.get(namespace)
        if session is None:
            from kvsnap.engine.session import Session

            cfg = dataclasses.replace(self.config, namespace=namespace)
            session = Session(self.lm, cfg, store=self.store)
            self._sessions[namespace] = session
            while len(self._sessions) > self.hot_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(namespace)
        return session

    def _keep_prompt(self, session: Session) -> None:
        """After a cancelled request, its prompt's full blocks go to the store as a finished one's
        would (best effort: the client is gone, a store problem is not worth an error)."""
        if self.store is None:
            return
        with contextlib.suppress(KvsnapError):
            session.store_blocks()

    # -- reporting --------------------------------------------------------------------------------

    def ledger(self, namespace: str | None = None) -> dict[str, Any]:
        """Totals since start: ``namespace``'s own, or (None) every namespace's together."""
        if namespace is not None:
            return self._ledgers[namespace].as_dict() if namespace in self._ledgers else Ledger().as_dict()
        total = Ledger()
        for one in list(self._ledgers.values()):
            for f in dataclasses.fields(Ledger):
                setattr(total, f.name, getattr(total, f.name) + getattr(one, f.name))
        return total.as_dict()

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """What one namespace may see (``namespace``): the model, the settings and its own ledger.
        None: the whole server's view, for its operator: every namespace's ledger together, the hot
        sessions and the block store's stats and path (file reads: call off the event loop).

        A namespace sees nothing of the others: their totals, how many sessions are hot, the store's
        lookups and hits would tell one user what another asked, or that they asked at all."""
        view = {
            "model": self.model_id,
            "uptime_s": round(time.time() - self.started, 3),
            "block_size": self.config.block_size,
            "chunk_size": self.config.chunk_size,
            "ledger": self.ledger(namespace),
        }
        if namespace is not None:
            return view
        store: dict[str, Any] | None = None
        if self.store is not None:
            try:
                store = self.store.stats()
            except KvsnapError as exc:
                store = {"path": str(self.store.path), "error": str(exc)}
        return {**view, "hot_sessions": len(self._sessions), "store": store}
