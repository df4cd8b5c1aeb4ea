"""Why a prompt reused less than it could: where reuse stopped, the text on both sides, and a likely cause.

No torch here: an explanation needs token ids, a tokenizer's ``decode`` and what a snapshot or the
store records. Causes, as ``Miss.cause`` names them:

- ``model``: the KV was made with another model; ``differs`` says which fingerprint part (config,
  tokenizer, weights, kv_dtype), when the source recorded its parts;
- ``block_size``: the store holds the prefix under another block size (a ``.kv`` file is read in
  its own block size, so this is the store's alone);
- ``namespace``: same model and block size, another namespace;
- ``system``: the system message changed (or was added or removed);
- ``template``: the chat template renders an earlier turn differently: an earlier answer, rendered
  again, tokenizes differently (same text, different tokens), or the same messages render to other text;
- ``tokenization``: a tokenization boundary shifted: the same text, split into different tokens
  (a snapshot that ends mid-word: its last token merges with what follows);
- ``text``: the text differs (with chat messages: which one);
- ``reuse``: the tokens matched, but the load-or-recompute decision (``--reuse``) recomputed them;
- ``none``: nothing was missed: the prompt continues all the source holds, or ends inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvsnap import hashing, prefix, quantization
from kvsnap.config import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    pass

Decode = Callable[[list[int]], str]
Messages = Sequence[dict[str, str]]

CONTEXT_CHARS = 40  # text shown on each side of where reuse stopped
_WINDOW = 32  # tokens decoded past it to compare the texts
PARTS = ("config", "tokenizer", "weights", "kv_dtype")
_PART_NAMES = {"config": "config (architecture, RoPE, ...)", "kv_dtype": "KV dtype"}


@dataclass(frozen=True, slots=True)
class Running:
    """The chain a run keys its KV under: its model's fingerprint parts, namespace and block size."""

    parts: dict[str, str]  # config, tokenizer, weights and, when known, kv_dtype
    namespace: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    model: str = ""

    def fingerprint(self, kv_dtype: str, quantization: str = "none") -> str:
        from kvsnap.models.fingerprint import fingerprint_of

        return fingerprint_of(self.as_run(kv_dtype, quantization))

    def as_run(self, kv_dtype: str, quantization: str = "none") -> dict[str, str]:
        """The parts; a model known by its files alone (``running_model``) takes the source's KV dtype and
        weight quantization, which only a run's flags set."""
        if "kv_dtype" in self.parts:
            return dict(self.parts)
        return {**self.parts, "kv_dtype": kv_dtype, "quantization": quantization}


@dataclass(frozen=True, slots=True)
class Miss:
    """Where a prompt stopped matching what a source (snapshot, store, session) holds, and why."""

    cause: str
    why: str  # one line
    source: str  # "snapshot" | "store" | "session"
    position: int | None  # first token where the prompt and the source differ; None where they agree
    block: int | None  # the block holding that token
    block_size: int
    reused_tokens: int
    source_tokens: int
    prompt_tokens: int
    before: str = ""  # the text just before ``position`` (the same on both sides)
    source_after: str = ""  # the source's text from ``position`` on
    prompt_after: str = ""  # the prompt's
    source_next: tuple[str, ...] = ()  # the source's next tokens, one text each
    prompt_next: tuple[str, ...] = ()
    differs: tuple[str, ...] = ()  # fingerprint parts that differ (cause "model")
    message: int | None = None  # index of the prompt's chat message where it diverged
    where: str = ""  # which store chain, for the store

    @property
    def missed(self) -> bool:
        return self.cause != "none"

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# -- the chain a source was made under --------------------------------------------------------------


def running_model(model: str, namespace: str = "", block_size: int = DEFAULT_BLOCK_SIZE) -> Running | None:
    """The chain ``model`` would key its KV under, from its folder on this machine (None when it is not here).

    The KV dtype depends on the device a run picks, so it is left out: it is taken to be the source's.
    """
    from kvsnap.models.fingerprint import config_digest, config_file, tokenizer_digest, weights_digest
    from kvsnap.models.locate import model_folder

    folder = model_folder(model)
    if folder is None:
        return None
    parts = {
        "config": config_digest(config_file(folder)),
        "tokenizer": tokenizer_digest(folder),
        "weights": weights_digest(folder),
    }
    return Running(parts, namespace, block_size, model)


def chain_mismatch(
    running: Running | None,
    *,
    model: str,
    fingerprint: str,
    parts: dict[str, str],
    kv_dtype: str,
    root: bytes,
    block_size: int,
    check_block_size: bool,
) -> tuple[str, str, tuple[str, ...]] | None:
    """``(cause, why, differing parts)`` when a source's chain is not the one ``running`` keys under."""
    if running is None:
        return None
    ours = running.as_run(kv_dtype, parts.get("quantization", "none"))
    fp = running.fingerprint(kv_dtype, parts.get("quantization", "none"))
    if fp != fingerprint:
        known = {**parts, "kv_dtype": parts.get("kv_dtype", kv_dtype)}
        differs = tuple(k for k in PARTS if k in known and k in ours and known[k] != ours[k])
        what = [_PART_NAMES.get(k, k) for k in differs if k != "kv_dtype"]
        if "engine" in known and "engine" not in ours:  # a serving engine's chain (kvsnap/integrations)
            what.append(f"engine: computed by {known['engine']}")
        if "kv_dtype" in differs:
            what.append(f"KV dtype: {known['kv_dtype']}, not {ours['kv_dtype']}")
        # A float model records no quantization part: absent is "none".
        theirs_q, ours_q = known.get("quantization", "none"), ours.get("quantization", "none")
        if theirs_q != ours_q:
            differs += ("quantization",)
            what.append(quantization.refusal(theirs_q, ours_q))
        detail = f"different {', '.join(what)}" if what else f"fingerprint {fingerprint[:12]}, this run {fp[:12]}"
        names = f": {model}, this run {running.model}" if running.model and running.model != model else ""
        return "model", f"made with another model ({detail}){names}", differs
    if check_block_size and block_size != running.block_size:
        why = f"stored under block size {block_size}; this run uses {running.block_size} (--block-size)"
        return "block_size", why, ()
    if hashing.chain_root(fp, running.namespace, block_size) != root:
        if running.namespace and hashing.chain_root(fp, "", block_size) == root:
            return "namespace", f"made without a namespace; this run uses namespace {running.namespace!r}", ()
        return "namespace", "made under another namespace (same model and block size)", ()
    return None


# -- where the tokens part, and why -------------------------------------------------------------------


def explain(
    prompt_ids: Sequence[int],
    source_ids: Sequence[int],
    decode: Decode,
    *,
    block_size: int,
    reused: int,
    source: str = "snapshot",
    prompt_messages: Messages | None = None,
    source_messages: Messages | None = None,
    mismatch: tuple[str, str, tuple[str, ...]] | None = None,
    where: str = "",
) -> Miss:
    """Where ``prompt_ids`` stop matching ``source_ids`` and the likely cause (see the module's list)."""
    prompt_ids, source_ids = list(prompt_ids), list(source_ids)
    pos = prefix.common_prefix_len(prompt_ids, source_ids)
    diverged = pos < len(prompt_ids) and pos < len(source_ids)
    base = dict(
        source=source,
        position=pos if diverged else None,
        block=pos // block_size if diverged else None,
        block_size=block_size,
        reused_tokens=reused,
        source_tokens=len(source_ids),
        prompt_tokens=len(prompt_ids),
        where=where,
    )
    if diverged:
        base.update(_context(prompt_ids, source_ids, pos, decode))
    if mismatch is not None:
        cause, why, differs = mismatch
        return Miss(cause, why, differs=differs, **base)
    if not diverged:
        ends = pos == len(prompt_ids) < len(source_ids)
        if source == "store":  # a run reuses whole blocks only: the prompt's last partial block is computed
            why = "the store holds " + ("the whole prompt" if ends else "nothing more of this prompt")
            why += f" ({reused:,} tokens in whole blocks)"
        else:
            held = f"all {len(source_ids):,} tokens the {source} holds"
            why = f"the prompt ends inside {held}" if ends else f"the prompt continues {held}"
            if reused < pos:
                why += f" ({reused:,} reused)"
        return Miss("none", why, **base)
    index = _message_at(prompt_messages, prompt_ids, pos, decode) if prompt_messages else None
    cause, why = _cause(prompt_ids, source_ids, pos, decode, index, prompt_messages, source_messages, source)
    return Miss(cause, why, message=index, **base)


def _cause(
    prompt_ids: list[int],
    source_ids: list[int],
    pos: int,
    decode: Decode,
    index: int | None,
    prompt_messages: Messages | None,
    source_messages: Messages | None,
    source: str,
) -> tuple[str, str]:
    role = prompt_messages[index].get("role") if prompt_messages is not None and index is not None else None
    if prompt_messages is not None and source_messages is not None:
        theirs, ours = _system(source_messages), _system(prompt_messages)
        if theirs != ours:
            change = "was added" if theirs is None else "was removed" if ours is None else "changed"
            return "system", f"the system message {change}"
    if index == 0 and role != "system" and _before_content(prompt_messages[0], prompt_ids, pos, decode):
        # No system message was given, so the template wrote its own default one where the source has another.
        return "system", (
            f"this prompt has no system message, so the chat template put in its default one; the {source} "
            "was made with another (give the same system message)"
        )
    if _same_text(prompt_ids, source_ids, pos, decode):
        a, b = decode(source_ids[pos : pos + 1]), decode(prompt_ids[pos : pos + 1])
        if role == "assistant":
            return "template", (
                f"the chat template renders an earlier answer again and it tokenizes differently "
                f"(same text, different tokens: {a!r} vs {b!r})"
            )
        return "tokenization", f"a tokenization boundary shifted: the same text, other tokens ({a!r} vs {b!r})"
    if role == "system":
        return "system", "the system message changed"
    if source_messages and prompt_messages and _continues(prompt_messages, source_messages):
        return "template", "the chat template renders earlier turns differently (same messages, different text)"
    if role is not None:
        return "text", f"the prompt's {role} message {index + 1} differs from the {source}'s text"
    return "text", f"the prompt's text differs from the {source}'s"


def _context(prompt_ids: list[int], source_ids: list[int], pos: int, decode: Decode) -> dict[str, Any]:
    return {
        "before": decode(prompt_ids[max(0, pos - _WINDOW) : pos])[-CONTEXT_CHARS:],
        "source_after": decode(source_ids[pos : pos + _WINDOW])[:CONTEXT_CHARS],
        "prompt_after": decode(prompt_ids[pos : pos + _WINDOW])[:CONTEXT_CHARS],
        "source_next": tuple(decode([t]) for t in source_ids[pos : pos + 3]),
        "prompt_next": tuple(decode([t]) for t in prompt_ids[pos : pos + 3]),
    }


def _same_text(prompt_ids: list[int], source_ids: list[int], pos: int, decode: Decode) -> bool:
    """Whether the texts agree across the first differing tokens (or until one side ends): then only
    the split into tokens differs."""
    a, b = decode(source_ids[pos : pos + _WINDOW]), decode(prompt_ids[pos : pos + _WINDOW])
    common = prefix.common_prefix_len(a, b)
    first = max(len(decode(source_ids[pos : pos + 1])), len(decode(prompt_ids[pos : pos + 1])))
    return common > 0 and (common >= first or common == len(a) or common == len(b))


def _message_at(messages: Messages, prompt_ids: list[int], pos: int, decode: Decode) -> int | None:
    """Index of the message whose rendering holds token ``pos`` (the template's text before a message's
    content counts as that message's); None past the last one (the generation prompt)."""
    text = decode(prompt_ids)
    offset = len(decode(prompt_ids[:pos]))
    cursor = 0
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        at = text.find(content, cursor) if content else -1
        if at < 0:
            continue
        end = at + len(content)
        if offset <= end:
            return i
        cursor = end
    return None


def _before_content(message: dict[str, str], prompt_ids: list[int], pos: int, decode: Decode) -> bool:
    """Whether token ``pos`` comes before the text of ``message``, the prompt's first message."""
    content = message.get("content") or ""
    at = decode(prompt_ids).find(content) if content else -1
    return at > 0 and len(decode(prompt_ids[:pos])) < at


def _system(messages: Messages) -> str | None:
    return messages[0].get("content") if messages and messages[0].get("role") == "system" else None


def _continues(prompt_messages: Messages, source_messages: Messages) -> bool:
    n = len(source_messages)
    return n <= len(prompt_messages) and [dict(m) for m in prompt_messages[:n]] == [dict(m) for m in source_messages]
